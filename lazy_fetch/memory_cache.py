"""The node's memory cache of chunks, and the fetcher every layer blob reads through.

Why a memory cache in front of the fetchers. FUSE reads arrive in pieces of 128 KiB (the kernel's
readahead window) while chunks are 1 MiB: without it, each piece went to a worker thread that re-read and
re-checked (xxh3) the whole chunk from the disk cache, eight times the disk and hashing work per chunk.
``MemoryFrontedFetcher`` answers chunks it holds right in the trio thread and hands the rest to the
ChunkFetcher (disk cache, then store), keeping what comes back; it is bounded (64 MiB by default, least
recently used out). Prefetched chunks go to memory only while it has free room (a prefetch never evicts
what readers use). A long blob read in order has the chunks after it loaded from the disk cache into
memory ahead of it (``MemoryFrontedFetcher.preload``, each chunk read in a worker thread of its own;
never from the store): the reader no longer stops at each chunk while a worker thread reads and checks it,
which had kept warm sequential reads at about 0.6 GB/s.

Threads: both classes belong to the daemon's trio thread (no locks); disk reads of a preload run in
worker threads through trio.to_thread and hand their chunk back to the trio thread.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable

import trio

from dsec_fs.chunks import ChunkLocation

from .fetcher import ONDEMAND, PREFETCH, ChunkFetcher, Priority
from .metrics import MemoryFigures

DEFAULT_MEMORY_CACHE_BYTES = 64 << 20


class MemoryChunkCache:
    """Recently read chunks by digest, at most ``max_bytes`` of them, least recently used out first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._chunks

    def get(self, digest: bytes) -> bytes | None:
        data = self._chunks.get(digest)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        self._chunks.move_to_end(digest)
        return data

    def put(self, digest: bytes, data: bytes) -> None:
        if len(data) > self.max_bytes or digest in self._chunks:
            return
        self._chunks[digest] = data
        self.bytes += len(data)
        self.shrink_to(self.max_bytes)

    def shrink_to(self, max_bytes: int) -> None:
        while self.bytes > max_bytes:
            _digest, data = self._chunks.popitem(last=False)
            self.bytes -= len(data)

    def figures(self) -> MemoryFigures:
        return MemoryFigures(entries=len(self._chunks), bytes=self.bytes, max_bytes=self.max_bytes,
                             hits=self.hits, misses=self.misses)


class MemoryFrontedFetcher:
    """The fetcher a LayerBlob reads through: chunks the MemoryChunkCache holds are answered at once, the
    others are fetched by ``fetcher`` (disk cache, then store) and remembered. Has what LayerBlob and
    open_layer_blob use of a ChunkFetcher: ``fetch_many``, ``call_store``, ``store`` and ``timeout``.
    ``preload`` tasks run in ``nursery``."""

    def __init__(self, fetcher: ChunkFetcher, memory: MemoryChunkCache, nursery: trio.Nursery):
        self.fetcher = fetcher
        self.memory = memory
        self.store = fetcher.store
        self.timeout = fetcher.timeout
        self.call_store = fetcher.call_store
        self._nursery = nursery
        self._preloading: dict[bytes, trio.Event] = {}  # digest -> set once its preload has ended

    async def fetch_many(self, items: Iterable[tuple[bytes, ChunkLocation]], *, priority: Priority = ONDEMAND,
                         label: str = "", readahead: Iterable[tuple[bytes, ChunkLocation]] = ()) -> dict[bytes, bytes]:
        found: dict[bytes, bytes] = {}
        missing: dict[bytes, ChunkLocation] = {}
        for digest, location in items:
            if digest in found or digest in missing:
                continue
            preloading = self._preloading.get(digest)
            if preloading is not None:  # being read from the disk cache: no second read of it
                await preloading.wait()
            data = self.memory.get(digest)
            if data is None:
                missing[digest] = location
            else:
                found[digest] = data
        if missing:
            ahead = [(digest, location) for digest, location in readahead if digest not in self.memory]
            fetched = await self.fetcher.fetch_many(missing.items(), priority=priority, label=label, readahead=ahead)
            for digest, data in fetched.items():
                self.memory.put(digest, data)
            found.update(fetched)
        return found

    def warm_soon(self, items: list[tuple[bytes, ChunkLocation]], label: str) -> None:
        """Fetch ``items`` into the disk cache in the background at PREFETCH priority (behind every
        on-demand read), as a prefetch does; nobody waits for them."""
        if items:
            self._nursery.start_soon(functools.partial(self.fetcher.warm, items, priority=PREFETCH, label=label,
                                                       landed=lambda digest, data, error: None))

    def preload(self, items: Iterable[tuple[bytes, ChunkLocation]]) -> None:
        """Start loading into memory those of ``items`` that the disk cache holds (the store is not
        asked), each in a worker thread of its own (disk reads side by side), so that a reader that
        comes for them finds them there."""
        for digest, _location in items:
            if digest not in self.memory and digest not in self._preloading:
                done = self._preloading[digest] = trio.Event()
                self._nursery.start_soon(self._preload, digest, done)

    async def _preload(self, digest: bytes, done: trio.Event) -> None:
        try:
            data = (await trio.to_thread.run_sync(self.fetcher.cached, [digest])).get(digest)
            if data is not None:
                self.memory.put(digest, data)
        finally:
            del self._preloading[digest]
            done.set()

