"""Background prefetch of a layer's prefetch list (prefetch_list.py) into the node's caches.

A list is checked against the layer's blob map, then fetched at PREFETCH priority, starting just before
mount(2) so that its first store reads overlap the mount: a small first group, then large ones
(PREFETCH_FIRST_GROUP_BYTES, PREFETCH_GROUP_BYTES), PREFETCH_GROUPS_IN_FLIGHT at once, each one
``fetcher.warm`` (planned in one go, so the chunks of a group that lie side by side in a pack share a GET
however far apart the list names them; no bytes held; queued in list order so the first-needed chunks
arrive first, within the fetcher's prefetch slots so on-demand reads go first). The first group is small,
so the chunks a workload needs first do not share the link (and the CPU that verifies them) with the rest
of the list; the others are large, because every group boundary splits runs of neighbours into more GETs
(with 16 MiB groups, the bench's 84 MB list took 223 GETs; in one group, 101). The group size bounds the
flights and queued store reads a prefetch makes at once. A job stops when the layer's last mount goes, or
when the mount it was started with fails (its cancel scope), or before a group that would not fit in
the room the disk cache has left (``room``: a prefetch never makes the cache evict what readers use).

Fill. ``fill_entries`` is the rest of the layer's chunks in blob order (the daemon's ``fill`` policy
``layer``), fetched after the list at FILL priority and kept in the cache as fetched (fetcher.py, "A
fill's chunks as fetched"): a fill read starts only while no on-demand read
waits, few at a time and small (fetcher.FILL_READS, FILL_READ_BYTES), so a miss beside them keeps a
fair share of the link. The list's chunks come first, then everything else streams
in behind them and behind every on-demand read, until the cache bound: one store read at a time per
fill turn, each planned as its turn comes, in the order fill_order.py gives (on from the readers' last
miss, the layer missed in last first; the job's ``fill_order``, which the daemon tells of misses). Each
chunk that lands is counted and, while the mount's trace is open, recorded in it (FLAG_PREFETCH); only
the list's are reported as prefetched (``landed``), since those are what a profile predicted.

Threads: the daemon's trio thread; the fetcher does its store reads in its own worker threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields

import trio

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.chunks import ChunkLocation
from dsec_fs.errors import DsecError
from dsec_fs.layer import utc_now

from .fetcher import FILL, FILL_READ_BYTES, FILL_READS, PREFETCH, ChunkFetcher, Priority
from .fill_order import FillOrder, FillTurns, plan_reads
from .memory_cache import MemoryChunkCache
from .prefetch_list import PrefetchEntry, PrefetchList
from .trace import FLAG_BLOB, FLAG_ERROR, FLAG_MISS, FLAG_PREFETCH, TraceWriter
from .traced_blob import StoreFetchLog

log = logging.getLogger(__name__)

PREFETCH_FIRST_GROUP_BYTES = 2 << 20
PREFETCH_GROUP_BYTES = 256 << 20
PREFETCH_GROUPS_IN_FLIGHT = 2
# Fill ``auto`` fills a layer with no profile only when its store's round trip is at least this: each
# miss then waits a round trip the fill can save it, and that outweighs what the fill costs the node
# (decompressing, verifying and caching the whole layer on the cores the sandbox starts on). Measured
# (bench_sandbox_coldstart, first-ever, docs/benchmarks.md): at 20 ms per request the fill took the
# start from 2.3-2.9x the pull to 1.2-1.3x; at 1 ms it made it slower (1.0x -> 2.3x); the daemon's own
# cost per miss is 2-6 ms under load (bench_miss_cost). 10 ms, not 5: a sample is only ever slowed, and
# the samples an up takes (its layers' small objects, read side by side while the daemon parses what came
# first) made a 1 ms store look like 5 ms and more on a busy node (fill8, docs/benchmarks.md); a 20 ms one
# never looks faster than it is. With a fill's chunks kept as fetched (no decompression nor sha256 of the
# layer: fetcher.py), a fill behind 1 ms still made first-ever starts slower, 1.04-1.22x (fillz, ibid.).
AUTO_FILL_MIN_ROUND_TRIP = 0.010
# It judges by the least of the first AUTO_FILL_SAMPLES small store calls (one may be slowed by a cold
# disk or a busy core: with one sample a 1 ms store was once taken for a slow one), or of those there are
# after AUTO_FILL_PATIENCE seconds.
AUTO_FILL_SAMPLES = 4
AUTO_FILL_PATIENCE = 1.0
FILL_DECISION_SECONDS = 30.0
# Bytes fetched and not yet in the cache (fetcher.unwritten_bytes) above which a fill waits before its next
# read: a few fill reads' worth, so the link keeps busy while the cache writer catches up.
FILL_UNWRITTEN_BYTES = 32 << 20
FILL_DECISION_POLL = 0.05
# Where to read a chunk (blob-map entry, digest) from: the layer's own packs first (LayerBlob.location),
# so a forged index in a shared store cannot make a prefetch read another writer's pack.
Locate = Callable[[int, bytes], ChunkLocation]


@dataclass
class PrefetchJob:
    layer: str
    list: str  # path of the prefetch list
    chunks: int  # of the list and the fill
    bytes: int
    fill_chunks: int = 0  # of those, the fill's
    fill_skipped: bool = False  # the fill was not worth it (``fill_when``): those chunks were not fetched
    state: str = "running"  # running | done | cancelled | failed
    done_chunks: int = 0
    done_bytes: int = 0
    failed_chunks: int = 0
    started: str = field(default_factory=utc_now)
    finished: str = ""
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # Set once the fill may start (the daemon: once the layer is mounted, so that the fill's planning and
    # first reads do not hold up the mount it belongs to).
    fill_ready: trio.Event = field(default_factory=trio.Event)
    fill_order: FillOrder = field(default_factory=lambda: FillOrder([]))  # where the fill goes next

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("cancel_scope", "fill_ready", "fill_order")}


def prefetch_groups(entries: Iterable[PrefetchEntry]) -> Iterator[list[PrefetchEntry]]:
    """A prefetch list's entries, in order: a first group of at least PREFETCH_FIRST_GROUP_BYTES, then
    groups of at least PREFETCH_GROUP_BYTES (the last may be less)."""
    group: list[PrefetchEntry] = []
    group_bytes, target = 0, PREFETCH_FIRST_GROUP_BYTES
    for entry in entries:
        group.append(entry)
        group_bytes += entry.length
        if group_bytes >= target:
            yield group
            group, group_bytes, target = [], 0, PREFETCH_GROUP_BYTES
    if group:
        yield group


def _fitting(group: list[PrefetchEntry], room: int) -> list[PrefetchEntry]:
    """The longest head of ``group`` whose chunks fit in ``room`` bytes."""
    for count, entry in enumerate(group):
        room -= entry.length
        if room < 0:
            return group[:count]
    return group


class Prefetcher:
    """The node's prefetch jobs (kept after they end, for status), run in ``nursery``."""

    def __init__(self, memory: MemoryChunkCache, fetch_log: StoreFetchLog, nursery: trio.Nursery,
                 room: Callable[[], int]):
        self.memory = memory
        self.fetch_log = fetch_log
        self.room = room  # bytes the disk cache can still take without evicting
        self.jobs: list[PrefetchJob] = []
        self.fill_turns = FillTurns(FILL_READS)  # the fill reads at once, shared by every job's fill
        self._nursery = nursery

    @property
    def running(self) -> int:
        return sum(job.state == "running" for job in self.jobs)

    def start(self, layer: str, plist: PrefetchList | None, path: str, fetcher: ChunkFetcher, locate: Locate,
              trace: Callable[[], TraceWriter | None], *, fill: list[PrefetchEntry] = (),
              fill_when: Callable[[float], bool | None] = lambda waited: True,
              landed: Callable[[int], None] = lambda entry: None) -> PrefetchJob:
        """Fetch ``plist`` (if any, already verified against ``layer``'s blob map), then ``fill``, in the
        background; ``trace`` gives the trace to record landed chunks in (None once closed);
        ``landed(entry)`` is called with the blob-map entry of each chunk of ``plist`` that arrives. The
        fill waits for the job's ``fill_ready``, then for ``fill_when(seconds waited)`` to say whether it
        is worth it (None: not known yet; asked again every FILL_DECISION_POLL seconds, for
        FILL_DECISION_SECONDS)."""
        entries = plist.entries if plist else []
        job = PrefetchJob(layer=layer, list=path, chunks=len(entries) + len(fill),
                          bytes=sum(entry.length for entry in (*entries, *fill)), fill_chunks=len(fill),
                          fill_order=FillOrder(list(fill)))
        self.jobs.append(job)
        self._nursery.start_soon(self._run, entries, landed, job, fetcher, locate, trace, fill_when)
        return job

    async def _run(self, entries: list[PrefetchEntry], landed: Callable[[int], None], job: PrefetchJob,
                   fetcher: ChunkFetcher, locate: Locate, trace: Callable[[], TraceWriter | None],
                   fill_when: Callable[[float], bool | None]) -> None:
        started = time.monotonic()
        with job.cancel_scope:
            try:
                window = trio.Semaphore(PREFETCH_GROUPS_IN_FLIGHT)
                in_flight = [0]  # bytes of the groups and fill reads fetching now, not in the cache yet

                async def fetch_group(group: list[PrefetchEntry], size: int) -> None:
                    try:
                        await self._fetch_group(group, PREFETCH, job, fetcher, locate, trace, landed)
                    finally:
                        in_flight[0] -= size
                        window.release()

                async with trio.open_nursery() as nursery:
                    room_left = True
                    for group in prefetch_groups(entries):
                        await window.acquire()
                        fitting = _fitting(group, self.room() - in_flight[0])
                        if fitting:
                            size = sum(entry.length for entry in fitting)
                            in_flight[0] += size
                            nursery.start_soon(fetch_group, fitting, size)
                        else:
                            window.release()
                        if len(fitting) < len(group):
                            log.info("prefetch of layer %s stops at the cache bound", job.layer[:12])
                            room_left = False
                            break
                    if room_left and job.fill_order.left and await _fill_wanted(job, fill_when, fetcher):
                        job.fill_order.planned(await trio.to_thread.run_sync(
                            plan_reads, job.fill_order.entries, locate, FILL_READ_BYTES))
                        for _ in range(FILL_READS):
                            nursery.start_soon(self._fill, job, fetcher, locate, trace, in_flight)
                await fetcher.written_down_to(0)  # a job that is done has its chunks in the cache
                job.state = "done"
            except Exception as exc:
                job.state = "failed"
                log.error("prefetch of layer %s failed: %s", job.layer[:12], exc)
        if job.state == "running":
            job.state = "cancelled"
        job.finished = utc_now()
        log.info("prefetch of layer %s %s: %d of %d chunks (%d bytes) in %.1f s, %d failed", job.layer[:12],
                 job.state, job.done_chunks, job.chunks, job.done_bytes, time.monotonic() - started, job.failed_chunks)

    async def _fill(self, job: PrefetchJob, fetcher: ChunkFetcher, locate: Locate,
                    trace: Callable[[], TraceWriter | None], in_flight: list[int]) -> None:
        """Fill reads one after another, each in a turn of the node's (fill_order.FillTurns), each the
        next batch of the job's fill order, until none is left or the next would not fit in the cache's
        room (``in_flight``: bytes fetching now; the fetcher's ``unwritten_plain_bytes``: fetched, not in
        the cache yet; each chunk at its own size, which a kept frame takes once read, as the room counts
        the cache's frames: ChunkCache.frame_growth). A read's chunks land once they are read; the cache
        writer writes them afterwards, so a turn waits before its next read while more than
        FILL_UNWRITTEN_BYTES (stored bytes: what memory holds) wait for it: the fill goes as fast as the
        link or the cache's disk, whichever is slower, in bounded memory."""
        order = job.fill_order
        async with self.fill_turns.turn(order) as turn:
            while True:
                await fetcher.written_down_to(FILL_UNWRITTEN_BYTES)
                batch = order.take()
                if not batch:
                    return
                size = sum(entry.length for entry in batch)
                if size > self.room() - in_flight[0] - fetcher.unwritten_plain_bytes:
                    if not order.stopped:
                        log.info("fill of layer %s stops at the cache bound", job.layer[:12])
                    order.stop()
                    return
                in_flight[0] += size
                try:
                    await self._fetch_group(batch, FILL, job, fetcher, locate, trace, lambda entry: None)
                finally:
                    in_flight[0] -= size
                await turn.pass_on()

    async def _fetch_group(self, group: list[PrefetchEntry], priority: Priority, job: PrefetchJob,
                           fetcher: ChunkFetcher, locate: Locate, trace: Callable[[], TraceWriter | None],
                           on_landed: Callable[[int], None]) -> None:
        """Fetch one group into the cache (fetcher.warm: planned in one go, no bytes held); count and
        trace each chunk as it lands."""
        fetch_log, memory = self.fetch_log, self.memory
        entries = {entry.digest: entry for entry in group}
        mark, started = fetch_log.mark(), time.monotonic_ns()

        def landed(digest: bytes, data: bytes | None, error: BaseException | None) -> None:
            if error is not None and not isinstance(error, DsecError):
                raise error  # a bug, not a chunk the store failed to give: the job fails
            entry, bad = entries[digest], error is not None
            if bad:
                log.warning("prefetch of layer %s: %s", job.layer[:12], error)
            job.failed_chunks += bad
            job.done_chunks += not bad
            if data is not None and memory.bytes + len(data) <= memory.max_bytes:
                memory.put(digest, data)
            job.done_bytes += 0 if bad else entry.length
            if not bad:
                on_landed(entry.chunk)
            # A cancelled job's mount may have failed, its trace closed: it records nothing more.
            writer = None if job.cancel_scope.cancel_called else trace()
            if writer is not None:
                flags = FLAG_PREFETCH | FLAG_BLOB | (FLAG_ERROR if bad else 0)
                if fetch_log.fetched_since(mark, [digest]):
                    flags |= FLAG_MISS
                writer.record(nid=0, offset=entry.offset, length=entry.length, chunk=entry.chunk,
                              latency_us=(time.monotonic_ns() - started) // 1000, flags=flags)

        await fetcher.warm([(digest, locate(entry.chunk, digest)) for digest, entry in entries.items()],
                           priority=priority, label=job.layer, landed=landed)


async def _fill_wanted(job: PrefetchJob, fill_when: Callable[[float], bool | None], fetcher: ChunkFetcher) -> bool:
    """Once the job's layer is mounted: whether its fill goes ahead (``fill_when``); a fill not wanted,
    or not decided within FILL_DECISION_SECONDS, is skipped, and the job counts only its list."""
    await job.fill_ready.wait()
    started = trio.current_time()
    while (wanted := fill_when(trio.current_time() - started)) is None:
        if trio.current_time() - started > FILL_DECISION_SECONDS:
            break
        await trio.sleep(FILL_DECISION_POLL)
    if not wanted:
        job.fill_skipped = True
        job.chunks -= job.fill_chunks
        round_trip = fetcher.round_trip()
        log.info("fill of layer %s skipped: %s", job.layer[:12], "no store reads to judge it by" if round_trip is None
                 else f"its store answers in {round_trip * 1e3:.1f} ms")
    return bool(wanted)


def fill_entries(plist: PrefetchList | None, blob_map: EncodedBlobMap) -> list[PrefetchEntry]:
    """Every chunk of ``blob_map`` that ``plist`` (if any) does not name, in blob order, each once: a map
    may name a chunk at several entries (dsec_fs/blobmap.py), and the fill lists it at its first only
    (else its job counted one chunk it never fetched again, and its plan, which goes by digest, kept the
    last entry)."""
    listed = plist.chunks if plist else frozenset()
    seen = {entry.digest for entry in plist.entries} if plist else set()
    entries = []
    for index, (blkaddr, digest, length) in enumerate(blob_map.entries):
        if index in listed or digest in seen:
            continue
        seen.add(digest)
        entries.append(PrefetchEntry(chunk=index, digest=digest, offset=blkaddr * blob_map.block_size,
                                     length=length, first_read_us=0, traces=0))
    return entries
