"""What FUSE reads of a layer, counted and traced: the store fetch log, each layer's usage, traced blobs.

Traces. Each mount gets a trace file (trace.py). In kernel mode the daemon only sees reads of the virtual
blob, so records name blob ranges (FLAG_BLOB); in fuse mode LayerTree says which file it is reading
(fs_core.FILE_READ) and records name the nid and file offset. A record has FLAG_MISS when its read
waited for a chunk fetched from the store: ``StoreFetchLog`` numbers every chunk the fetchers read from
the store, before anyone is answered, so a read that finds one of its chunks numbered after it started
waited for the store.

Bounded traces. A reader that reads the same bytes again and again (O_DIRECT, or the kernel re-reading
what it evicted) reaches the daemon every time; a record each would grow the trace (on the state disk, and
in the memory of every publish and report that reads it back) by 40 bytes a read without end. A trace
keeps what profiles and reports learn from, every chunk's first reads in order: a read the trace
recorded among its last TRACE_RECENT_READS distinct reads (the same file or blob range, answered alike)
is a repeat, and past TRACE_MAX_RECORDS records a segment records only reads of chunks it never
recorded. What is left out is counted (``LayerUsage.untraced``: ``dsecfs_layer_untraced_reads_total``).

Preload. A blob read in order that has gone on for PRELOAD_AFTER_BYTES has the next PRELOAD_BYTES of
chunks loaded from the disk cache into memory ahead of it (memory_cache.MemoryFrontedFetcher.preload).

Threads: TracedBlob, LayerUsage and StoreFetchLog belong to the daemon's trio thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from dsec_fs.errors import DsecError

from .blob_reader import BlobChunk, LayerBlob
from .fs_core import FILE_READ
from .miss_readahead import MissReadahead
from .trace import FLAG_BLOB, FLAG_ERROR, FLAG_MISS, NO_CHUNK, TraceWriter

PRELOAD_BYTES = 4 << 20  # chunks ahead of a blob read in order loaded from the disk cache into memory
# (at most a quarter of the memory cache, so that what is preloaded does not push itself out), once the
# reads in order add up to PRELOAD_AFTER_BYTES: a cold start reads many small files, often one after the
# other in the blob, and preloading for them pushed prefetched chunks out of memory (kernel mode with a
# prefetch list: 0.97 s to 1.58 s)
PRELOAD_AFTER_BYTES = 2 << 20
TRACE_RECENT_READS = 4096  # distinct reads a trace remembers to know a repeat (4096 ranges of 64-128 KiB reads:
# far more than a working set re-read from the page cache between evictions of one file)
TRACE_MAX_RECORDS = 1 << 18  # records of one trace segment (10 MiB) past which only new chunks' reads are recorded
FETCH_LOG_KEPT = 1 << 16  # store fetches StoreFetchLog remembers: far more than can happen during one read


class StoreFetchLog:
    """Which chunks the fetchers read from the store, numbered: each fetcher ``note``s the chunks of a
    store read before anyone waiting for them is answered (its ``on_fetched``), so a read that finds one
    of its chunks numbered after it started waited for the store: take ``mark()`` before reading, ask
    ``fetched_since(mark, digests)`` after. Used in the trio thread only."""

    def __init__(self) -> None:
        self._count = 0
        self._fetched: OrderedDict[bytes, int] = OrderedDict()  # digest -> number of its latest fetch

    def note(self, digests: Iterable[bytes]) -> None:
        for digest in digests:
            self._count += 1
            self._fetched[digest] = self._count
            self._fetched.move_to_end(digest)
            if len(self._fetched) > FETCH_LOG_KEPT:
                self._fetched.popitem(last=False)

    def mark(self) -> int:
        return self._count

    def fetched_since(self, mark: int, digests: Iterable[bytes]) -> bool:
        return any(self._fetched.get(digest, 0) > mark for digest in digests)


class LayerUsage:
    """What readers used of one layer since the daemon started (kept after its mounts go, for metrics),
    and what its prefetches fetched, to say how well they predicted the reads."""

    def __init__(self, blob: LayerBlob):
        self._lengths = blob.blob_map.lengths
        self.data_bytes = sum(self._lengths)
        self.used_bytes = 0
        self.reads = 0
        self.read_errors = 0
        self.untraced = 0  # reads a trace left out: repeats, and past its bound (TracedBlob)
        self._used = bytearray(len(self._lengths))  # 1 for each blob-map entry served
        self._prefetched = bytearray(len(self._lengths))  # 1 for each blob-map entry a prefetch brought
        # Told of each blob-map entry a read missed (the layer's fill follows them: fill_order.py).
        self.on_miss: Callable[[int], None] = lambda entry: None

    def note(self, chunks: list[BlobChunk], failed: bool, missed: bool = False) -> None:
        """A read of ``chunks`` was served (or ``failed``); ``missed``: it waited for the store."""
        self.reads += 1
        if failed:
            self.read_errors += 1
            return
        if missed:
            for chunk in chunks:
                self.on_miss(chunk.entry)
        for chunk in chunks:
            if not self._used[chunk.entry]:
                self._used[chunk.entry] = 1
                self.used_bytes += chunk.length

    def note_prefetched(self, entry: int) -> None:
        self._prefetched[entry] = 1

    def prediction(self) -> dict[str, int]:
        """Bytes prefetched, prefetched and read, prefetched and never read, read and never prefetched."""
        both = prefetched = used = 0
        for length, was_used, was_prefetched in zip(self._lengths, self._used, self._prefetched):
            prefetched += length * was_prefetched
            used += length * was_used
            both += length * (was_used & was_prefetched)
        return {"prefetched_bytes": prefetched, "prefetched_read_bytes": both,
                "prefetched_unread_bytes": prefetched - both, "read_not_prefetched_bytes": used - both}


class TraceBound:
    """Which reads one trace segment records (see "Bounded traces" above): not a repeat of one of its
    last TRACE_RECENT_READS distinct reads, and within TRACE_MAX_RECORDS unless a chunk is new to it."""

    def __init__(self, chunks: int):
        self.records = 0
        self._recent: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()
        self._recorded = bytearray(chunks)  # 1 for each blob-map entry a record of this segment touched

    def admits(self, read: tuple[int, int, int, int], chunks: list[BlobChunk]) -> bool:
        """Whether to record ``read`` ((nid, offset, length, flags)) of ``chunks``."""
        if read in self._recent:
            self._recent.move_to_end(read)
            return False
        if self.records >= TRACE_MAX_RECORDS and all(self._recorded[chunk.entry] for chunk in chunks):
            return False
        self._recent[read] = None
        if len(self._recent) > TRACE_RECENT_READS:
            self._recent.popitem(last=False)
        for chunk in chunks:
            self._recorded[chunk.entry] = 1
        self.records += 1
        return True


class TracedBlob:
    """What FUSE reads of one layer's blob in one mode (what layer_mount serves): the LayerBlob, each read
    counted in the layer's usage and, while ``trace`` is open, recorded in it (within a TraceBound of
    each trace set)."""

    def __init__(self, blob: LayerBlob, usage: LayerUsage, fetch_log: StoreFetchLog, trace: TraceWriter | None,
                 readahead: MissReadahead | None = None, *,
                 on_miss: Callable[[list[BlobChunk]], bool] | None = None):
        self.blob = blob
        self.readahead = readahead  # what a read that misses brings along (miss_readahead.py)
        # Called with the chunks of each read that waited for the store, until it returns True.
        self.on_miss = on_miss
        self.size = blob.size
        self.usage = usage
        self.fetch_log = fetch_log
        self.trace = trace  # (the property below)
        # (end offset, last chunk's blob-map entry, bytes read in order up to it) of the latest read
        self._last_read = (-1, -1, 0)

    @property
    def trace(self) -> TraceWriter | None:
        return self._trace

    @trace.setter
    def trace(self, writer: TraceWriter | None) -> None:
        """A new trace (segment) has a bound of its own."""
        self._trace = writer
        self._bound = TraceBound(len(self.blob.blob_map.entries))

    async def read(self, offset: int, length: int) -> bytes:
        chunks = self.blob.chunks_for_range(offset, length)
        if chunks:
            end, entry, in_order = self._last_read
            in_order = in_order + length if offset == end else length
            if in_order >= PRELOAD_AFTER_BYTES and chunks[-1].entry != entry:  # a long read, into another chunk
                front = self.blob.fetcher
                front.preload(self.blob.following(chunks[-1].entry, min(PRELOAD_BYTES, front.memory.max_bytes // 4)))
            self._last_read = (offset + length, chunks[-1].entry, in_order)
        mark = self.fetch_log.mark()
        started = time.monotonic_ns()
        try:
            ahead = self.readahead.plan(chunks) if self.readahead is not None else []
            data = await self.blob.read(offset, length, readahead=ahead)
        except DsecError:
            self._note(offset, length, chunks, self._missed(mark, chunks), started, failed=True)
            raise
        self._note(offset, length, chunks, self._missed(mark, chunks), started, failed=False)
        if self.readahead is not None:
            self.blob.fetcher.warm_soon(self.readahead.to_warm(), self.blob.label)
        return data

    def _missed(self, mark: int, chunks: list[BlobChunk]) -> bool:
        """Whether the read that took ``mark`` waited for the store; if so ``on_miss`` is told, until it
        says it needs no more."""
        missed = self.fetch_log.fetched_since(mark, (chunk.digest for chunk in chunks))
        if missed and self.on_miss is not None and self.on_miss(chunks):
            self.on_miss = None
        return missed

    def _note(self, offset: int, length: int, chunks: list[BlobChunk], missed: bool, started: int, *,
              failed: bool) -> None:
        self.usage.note(chunks, failed, missed)
        if self.trace is None:
            return
        flags = FLAG_ERROR if failed else 0
        if missed:
            flags |= FLAG_MISS
        file_read = FILE_READ.get()  # set by LayerTree (fuse mode): the file and offset being read
        if file_read is None:
            nid, position = 0, offset
            flags |= FLAG_BLOB
        else:
            nid, position = file_read
        if not self._bound.admits((nid, position, length, flags), chunks):
            self.usage.untraced += 1
            return
        self.trace.record(nid=nid, offset=position, length=length, chunk=chunks[0].entry if chunks else NO_CHUNK,
                          latency_us=(time.monotonic_ns() - started) // 1000, flags=flags)
