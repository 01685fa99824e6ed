"""The fill's order (fill_order.py, prefetcher.py): it goes on from where a reader missed, and the node's
fill reads go to the layer missed in last. Real parts: a FilesystemStore of packs, a ChunkCache, the
fetcher; the store only records which pack each read asks for, and answers after a delay, or once the
test opens its gate: a test that acts while the first reads are in the air holds them there, so that a
loaded machine's late trio loop cannot let the next reads start first."""

from __future__ import annotations

import functools
import threading
import time

import trio

from dsec_fs.chunks import ChunkLocation
from dsec_fs.store import keys
from dsec_fs.store.wrappers import StoreWrapper
from lazy_fetch.blob_reader import open_layer_blob
from lazy_fetch.fetcher import FILL_READS, ChunkFetcher, open_fetcher
from lazy_fetch.fill_order import FillOrder, FillTurns, plan_reads
from lazy_fetch.memory_cache import MemoryChunkCache
from lazy_fetch.prefetch_list import PrefetchEntry
from lazy_fetch.prefetcher import Prefetcher
from lazy_fetch.traced_blob import LayerUsage, StoreFetchLog, TracedBlob
from tests.lazy_fetch.conftest import BLOCK_SIZE
from tests.lazy_fetch.test_fetcher import backend, cache, chunk, until, upload  # noqa: F401 (fixtures)

ANSWER = 0.05  # seconds each store read takes


class PackLog(StoreWrapper):
    """Records the pack each get asks for, as it is asked; answers ANSWER seconds later, and not before
    ``gate`` is open (it is unless the test closes it)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.packs: list[str] = []
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def _call(self, op, key, fn, sent=0):
        if op == "get":
            with self._lock:
                self.packs.append(key)
            time.sleep(ANSWER)
            if not self.gate.wait(timeout=30):
                raise AssertionError("the test never opened the store's gate")
        return fn()


def layer_fill(backend, first: int, count: int) -> tuple[list[PrefetchEntry], dict[bytes, ChunkLocation], list[str]]:
    """``count`` chunks, each in a pack of its own (a store read each): their fill entries in blob order,
    their locations, and their packs' keys in the same order."""
    items = [upload(backend, [chunk(n)])[0] for n in range(first, first + count)]
    entries = [PrefetchEntry(chunk=number, digest=digest, offset=number * 4096, length=4096, first_read_us=0,
                             traces=0) for number, (digest, _location) in enumerate(items)]
    return entries, dict(items), [keys.pack(location.pack_id) for _digest, location in items]


def turns(reads: list) -> list[set]:
    """The reads FILL_READS by FILL_READS (side by side: which of them asks first is the threads')."""
    return [set(reads[n:n + FILL_READS]) for n in range(0, len(reads), FILL_READS)]


def run_fills(store, cache, steps) -> list:
    """Run ``steps(start)`` (async; ``start(name, entries, locations)`` starts a layer's fill and returns
    its job) on one fetcher and prefetcher, then wait until every fill is done; returns the jobs."""
    jobs = []

    async def main():
        async with open_fetcher(store, cache) as fetcher, trio.open_nursery() as nursery:
            prefetcher = Prefetcher(MemoryChunkCache(1 << 20), StoreFetchLog(), nursery, room=lambda: 1 << 30)

            def start(name, entries, locations):
                job = prefetcher.start(name, None, "fill", fetcher, lambda entry, digest: locations[digest],
                                       lambda: None, fill=entries)
                job.fill_ready.set()
                jobs.append(job)
                return job

            start.prefetcher = prefetcher
            try:
                await steps(start)
            finally:
                if isinstance(store, PackLog):
                    store.gate.set()
            await until(lambda: all(job.state == "done" for job in jobs))

    trio.run(main)
    return jobs


def test_the_fill_goes_on_from_where_a_reader_missed(backend, cache):
    entries, locations, packs = layer_fill(backend, 0, 12)
    store = PackLog(backend)
    store.gate.clear()

    async def steps(start):
        job = start("layer", entries, locations)
        await until(lambda: len(store.packs) == FILL_READS)  # the first reads are in the air, held there
        job.fill_order.missed(8)  # a reader jumped ahead

    (job,) = run_fills(store, cache, steps)
    assert job.done_chunks == len(entries)
    # Each once, from the miss on, wrapping around at the end; the fill's reads go FILL_READS side by side.
    assert FILL_READS <= 8
    expected = [*range(FILL_READS), 8, 9, 10, 11, *range(FILL_READS, 8)]
    assert turns([packs.index(pack) for pack in store.packs]) == turns(expected)


def test_the_fill_reads_go_to_the_layer_missed_in_last(backend, cache):
    base, base_locations, base_packs = layer_fill(backend, 0, 6)
    toolkit, toolkit_locations, toolkit_packs = layer_fill(backend, 100, 6)
    store = PackLog(backend)
    store.gate.clear()

    async def steps(start):
        start("base", base, base_locations)
        await until(lambda: len(store.packs) == FILL_READS)  # the base's fill has every turn, its reads held
        toolkit_job = start("toolkit", toolkit, toolkit_locations)
        toolkit_job.fill_order.missed(3)  # the command reads the toolkit now
        turns_ = start.prefetcher.fill_turns
        await until(lambda: any(order is toolkit_job.fill_order for order, _event in turns_._waiting))

    run_fills(store, cache, steps)
    # Every turn that freed went to the toolkit until its fill was done (from its miss on, wrapping),
    # then back to the base.
    reads = [f"base{base_packs.index(pack)}" if pack in base_packs else f"toolkit{toolkit_packs.index(pack)}"
             for pack in store.packs]
    assert FILL_READS <= 6
    expected = [*(f"base{n}" for n in range(FILL_READS)), *(f"toolkit{n}" for n in (3, 4, 5, 0, 1, 2)),
                *(f"base{n}" for n in range(FILL_READS, 6))]
    assert turns(reads) == turns(expected)


def test_a_fill_order_gives_each_read_once_however_the_misses_jump():
    locations = {bytes([n]) * 32: ChunkLocation(f"pack{n % 2}", (n // 2) * 100, 100, 4096) for n in range(10)}
    entries = [PrefetchEntry(chunk=n, digest=bytes([n]) * 32, offset=n * 4096, length=4096, first_read_us=0, traces=0)
               for n in range(10)]
    order = FillOrder(entries)

    async def main():
        order.missed(7)  # before the plan: remembered
        # Neighbours in a pack share a read, however far apart the blob has them: two reads, one a pack.
        order.planned(plan_reads(entries, lambda chunk, digest: locations[digest], 1 << 20))
        assert order.left == 2
        first = order.take()
        assert [entry.chunk for entry in first] == [1, 3, 5, 7, 9]  # the read holding entry 7
        order.missed(7)  # taken already: the next read not taken, wrapping
        assert [entry.chunk for entry in order.take()] == [0, 2, 4, 6, 8]
        assert order.take() == [] and order.left == 0

    trio.run(main)


def test_a_cancelled_fill_gives_its_turn_to_the_next():
    async def main():
        turns, first, second, third = FillTurns(1), FillOrder([]), FillOrder([]), FillOrder([])
        got = []

        async def take_turn(order, name):
            async with turns.turn(order):
                got.append(name)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take_turn, first, "first")
            await trio.sleep(0.01)
            cancelled = trio.CancelScope()

            async def waits_then_is_cancelled():
                with cancelled:
                    await take_turn(second, "second")

            nursery.start_soon(waits_then_is_cancelled)
            nursery.start_soon(take_turn, third, "third")
            await trio.sleep(0.01)
            second.missed_at = 1.0  # it would be next
            cancelled.cancel()
        assert got == ["first", "third"] and turns.free == 1

    trio.run(main)


def test_a_read_that_misses_tells_the_layers_fill_and_one_that_hits_does_not(built_layer, cache):
    missed = []

    async def main():
        async with trio.open_nursery() as nursery:
            fetch_log = StoreFetchLog()
            fetcher = ChunkFetcher(built_layer.store, cache, nursery, on_fetched=fetch_log.note)
            blob = await open_layer_blob(built_layer.layer, fetcher)
            usage = LayerUsage(blob)
            usage.on_miss = missed.append
            traced = TracedBlob(blob, usage, fetch_log, None)
            wanted = [chunk.entry for chunk in blob.chunks_for_range(0, 3 * BLOCK_SIZE)]
            await traced.read(0, 3 * BLOCK_SIZE)  # from the store
            assert missed == wanted
            await traced.read(0, 3 * BLOCK_SIZE)  # from the cache
            assert missed == wanted
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_fill_reads_on_while_the_cache_writes_and_waits_once_too_much_is_unwritten(backend, tmp_path, monkeypatch):
    import lazy_fetch.prefetcher as prefetcher_module
    from tests.lazy_fetch.test_fetcher import BlockingPutCache

    bound_chunks = FILL_READS  # the reads' worth in the air at once may wait for the writer, no more
    entries, locations, _packs = layer_fill(backend, 0, 4 * FILL_READS)
    stored = {location.clen for location in locations.values()}  # a frame each: what waits, as the cache stores it
    assert len(stored) == 1
    monkeypatch.setattr(prefetcher_module, "FILL_UNWRITTEN_BYTES", bound_chunks * stored.pop())
    store = PackLog(backend)
    cache = BlockingPutCache(str(tmp_path / "slow-cache"), 64 << 20)

    async def steps(start):
        start("layer", entries, locations)
        try:
            await until(lambda: cache.puts == 1)  # the first write hangs
            await trio.sleep(8 * ANSWER)
            reads_while_the_write_hangs.append(len(store.packs))
        finally:  # else the fetcher's shielded write would keep trio.run from returning
            cache.release.set()

    reads_while_the_write_hangs = []
    try:
        (job,) = run_fills(store, cache, steps)
        # Reads went on past the FILL_READS that held their slots through the write before, and stopped
        # once more than the bound waited for the writer: at most one read beyond it per turn.
        assert FILL_READS < reads_while_the_write_hangs[0] <= bound_chunks + FILL_READS, reads_while_the_write_hangs
        assert job.done_chunks == len(entries) and len(store.packs) == len(entries)
        assert all(cache.get(entry.digest) is not None for entry in entries)
    finally:
        cache.release.set()
        cache.close()


def test_a_fill_counts_its_kept_frames_at_their_chunks_size_so_reading_them_evicts_nothing(backend, tmp_path):
    # A fill keeps frames, smaller than their chunks; its room (the daemon's: a share of the bound less
    # what is cached) counted them as stored, so it kept about twice the room's worth of these chunks,
    # and reading them (each made plain) evicted what readers had read.
    from types import SimpleNamespace

    from dsec_fs import compress
    from dsec_fs.chunks import ChunkIndex, ChunkUploader
    from dsec_fs.digest import sha256
    from lazy_fetch.cache import ChunkCache
    from lazy_fetch.daemon_traces import DaemonTraces

    plain = [bytes(4096) + chunk(n) for n in range(24)]  # half zeros: a frame of about half the chunk
    locations = {}
    for data in plain:  # a pack each: a fill read each
        index = ChunkIndex()
        uploader = ChunkUploader(backend, index)
        uploader.add(sha256(data), len(data), compress.compress(data))
        uploader.flush()
        locations[sha256(data)] = index.get(sha256(data))
    entries = [PrefetchEntry(chunk=n, digest=sha256(data), offset=n * 8192, length=len(data), first_read_us=0,
                             traces=0) for n, data in enumerate(plain)]
    bound = 12 * len(plain[0])  # half the layer
    read_before = [bytes(4096) + chunk(100)]  # what a reader read before the fill

    async def main():
        with ChunkCache(str(tmp_path / "cache"), bound) as cache:
            cache.put(sha256(read_before[0]), read_before[0])
            room = functools.partial(DaemonTraces._cache_room, SimpleNamespace(cache=cache))
            async with open_fetcher(backend, cache) as fetcher, trio.open_nursery() as nursery:
                prefetcher = Prefetcher(MemoryChunkCache(1 << 20), StoreFetchLog(), nursery, room=room)
                job = prefetcher.start("layer", None, "fill", fetcher, lambda entry, digest: locations[digest],
                                       lambda: None, fill=entries)
                job.fill_ready.set()
                await until(lambda: job.state == "done")
                kept = [entry for entry in entries if cache.holds([entry.digest])]
                assert 0 < len(kept) < len(entries)  # it stopped at the room
                for entry in kept:
                    assert await fetcher.fetch(entry.digest, locations[entry.digest]) == plain[entry.chunk]
                await fetcher.written_down_to(0)
                assert cache.stats().evictions == 0 and cache.get(sha256(read_before[0])) == read_before[0]
                assert cache.stats().frames == 0 and cache.stats().bytes <= bound

    trio.run(main)


def test_a_chunk_the_blob_map_names_twice_is_filled_once_at_its_first_entry(backend, cache):
    """A blob map may name one chunk at two entries (accepted at mount: dsec_fs/blobmap.py). The store is
    asked for it once (the fill's plan and the fetcher go by digest), checked with a counting store; but
    before, the fill listed both entries and counted the chunk once done, so its job never reached its
    total (5 of 6 chunks), and its plan kept the later entry, so a reader's miss at the first was not found
    in the fill's reads. Now the fill lists the chunk at its first entry only."""
    from dsec_fs.blobmap import BlobMap, EncodedBlobMap
    from dsec_fs.store.wrappers import CountingStore
    from lazy_fetch.prefetcher import fill_entries

    items = [upload(backend, [chunk(n)])[0] for n in range(6)]
    blob_map = BlobMap(BLOCK_SIZE)
    for digest, _location in items:
        blob_map.add(digest, BLOCK_SIZE)
    twice = EncodedBlobMap(blob_map.encode().replace(items[4][0], items[1][0]), source="test")
    assert [digest for _blkaddr, digest, _length in twice.entries].count(items[1][0]) == 2
    fill = fill_entries(None, twice)
    assert [entry.chunk for entry in fill] == [0, 1, 2, 3, 5]
    counting = CountingStore(backend)
    locations = dict(items)

    async def steps(start):
        start("layer", fill, locations)

    (job,) = run_fills(counting, cache, steps)
    assert job.done_chunks == job.chunks == 5 and job.failed_chunks == 0
    assert counting.calls == {"get": 5}
