"""Sources of a layer's virtual blob (EROFS device 1) for the userspace reader.

A blob source (``Blob``) has ``size`` (bytes) and ``read(offset, length) -> bytes``, which returns exactly
``length`` bytes of [offset, offset+length) or raises; a range outside the blob is an InputError.

- ``FileBlob``: a materialised blob file (export_layer's ``blob``, or mkfs.erofs's ``--blobdev``).
- ``StoreBlob``: the blob as the blob map describes it, every byte produced from chunks fetched from a
  store and verified (dsec_fs.chunks.read_chunks), so nothing has to store the blob itself. Each chunk
  starts on a block boundary and is zero-padded to a whole block.

Threads: both may be read from any thread at the same time. FileBlob uses pread only. StoreBlob's
``_lock`` guards its LRU of recently used chunks (``_cache`` and ``_cached_bytes``) and is never held
while fetching: two threads that miss on the same chunk may both fetch it, which costs a fetch, not
correctness (the node daemon's own fetcher is where single-flight matters).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Protocol

from dsec_fs.chunks import ChunkIndex, location_of_size, read_chunks
from dsec_fs.digest import to_hex
from dsec_fs.errors import CorruptError, InputError, NotFoundError, UnavailableError
from dsec_fs.layer import LayerFiles
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from dsec_fs.blobmap import EncodedBlobMap

DEFAULT_CACHE_BYTES = 64 << 20  # a few chunks: enough that sequential small reads fetch each chunk once
# Chunk bytes per read_chunks call for bulk readers (export, fsck): large enough that neighbouring frames
# merge into few store requests, small enough to bound memory.
BATCH_BYTES = 64 << 20


class Blob(Protocol):
    """What ErofsImage needs of device 1."""

    size: int  # bytes

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``, or an error; never a short answer."""


def _check_range(offset: int, length: int, size: int, where: str) -> None:
    if offset < 0 or length < 0 or offset + length > size:
        raise InputError(f"range [{offset}, {offset + length}) is outside the blob ({size} bytes)", where=where)


class FileBlob:
    """A blob stored as a plain file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError("no such blob file", where=self.path) from None
        except OSError as exc:
            raise UnavailableError(f"cannot open blob: {exc.strerror}", where=self.path, transient=False) from None
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, length: int) -> bytes:
        _check_range(offset, length, self.size, self.path)
        pieces = []
        while length:
            try:
                piece = os.pread(self._fd, length, offset)  # Linux caps one read near 2 GiB
            except OSError as exc:
                raise UnavailableError(f"cannot read blob: {exc.strerror}", where=self.path, transient=False) from None
            if not piece:
                raise CorruptError(f"blob file ends at byte {offset}, {length} bytes short", where=self.path)
            pieces.append(piece)
            offset += len(piece)
            length -= len(piece)
        return b"".join(pieces)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileBlob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoreBlob:
    """The virtual blob of one layer, assembled from verified chunks of ``store``."""

    def __init__(self, store: Store, blobmap: EncodedBlobMap, chunk_index: ChunkIndex, *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, readahead_bytes: int = 0):
        """``readahead_bytes``: on a miss, also fetch (in the same merged request) the chunks that follow
        in the blob up to this many bytes. For readers that go through the blob in order, such as
        extract: the blob is laid out in tree order, the order ErofsImage.walk visits files. Keep it well
        below ``cache_bytes`` so chunks read ahead are still cached when they are needed."""
        self.store = store
        self.blobmap = blobmap
        self.chunk_index = chunk_index
        self.block_size = blobmap.block_size
        self.size = blobmap.blocks * blobmap.block_size
        self.readahead_bytes = readahead_bytes
        self._cache_limit = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()  # digest -> chunk bytes, least recent first
        self._cached_bytes = 0

    @classmethod
    def for_layer(cls, store: Store, layer: LayerFiles, **kw) -> "StoreBlob":
        """The blob of an opened layer: its blob map, and the indexes of the packs its manifest lists."""
        blobmap = EncodedBlobMap(layer.blobmap, source=keys.layer_blobmap(layer.digest))
        chunk_index = ChunkIndex()
        chunk_index.load_packs(store, layer.manifest.packs)
        return cls(store, blobmap, chunk_index, **kw)

    def read(self, offset: int, length: int) -> bytes:
        _check_range(offset, length, self.size, "virtual blob")
        if length == 0:
            return b""
        end = offset + length
        entries = self.blobmap.entries
        first = self.blobmap.locate(offset // self.block_size)
        last = self.blobmap.locate((end - 1) // self.block_size)
        chunks = self._chunks(first, last)
        out = bytearray(length)  # bytes past a chunk's end up to its block boundary stay zero
        for blkaddr, digest, chunk_length in entries[first:last + 1]:
            chunk_start = blkaddr * self.block_size
            lo, hi = max(offset, chunk_start), min(end, chunk_start + chunk_length)
            if lo < hi:
                out[lo - offset:hi - offset] = memoryview(chunks[digest])[lo - chunk_start:hi - chunk_start]
        return bytes(out)

    def fetch(self, entries: list[tuple[int, bytes, int]]) -> dict[bytes, bytes]:
        """digest -> bytes of blob-map ``entries``, fetched in one read_chunks call (neighbouring frames
        merged), verified, bypassing the LRU. NotFoundError if a chunk is in no pack the index knows;
        CorruptError, before anything is read, if no location claims the size the blob map gives it (a
        forged claim of a GiB had zstd allocate it: dsec_fs.chunks, ``location_of_size``)."""
        wanted = []
        for _blkaddr, digest, length in entries:
            locations = self.chunk_index.locations(digest)
            if not locations:
                raise NotFoundError("chunk of the blob map is in no pack the layer lists",
                                    where=f"chunk {to_hex(digest)}")
            wanted.append((digest, location_of_size(locations, digest, length)))
        return read_chunks(self.store, wanted)  # each exactly its location's size, the blob map's

    def _chunks(self, first: int, last: int) -> dict[bytes, bytes]:
        """digest -> bytes of blob-map entries first..last, from the LRU or fetched (with the read-ahead)
        and remembered."""
        entries = self.blobmap.entries
        found: dict[bytes, bytes] = {}
        with self._lock:
            for _blkaddr, digest, _length in entries[first:last + 1]:
                data = self._cache.get(digest)
                if data is not None:
                    self._cache.move_to_end(digest)
                    found[digest] = data
            missing = [entry for entry in entries[first:last + 1] if entry[1] not in found]
            if missing:
                missing += self._ahead_of(last + 1)
        if missing:
            fetched = self.fetch(missing)
            found.update(fetched)
            with self._lock:
                for digest, data in fetched.items():
                    self._remember(digest, data)
        return found

    def _ahead_of(self, index: int) -> list[tuple[int, bytes, int]]:
        """With ``_lock`` held: the uncached entries from ``index`` on, up to readahead_bytes."""
        ahead, budget = [], self.readahead_bytes
        for entry in self.blobmap.entries[index:]:
            if entry[2] > budget:
                break
            budget -= entry[2]
            if entry[1] not in self._cache:
                ahead.append(entry)
        return ahead

    def _remember(self, digest: bytes, data: bytes) -> None:
        """With ``_lock`` held: add a chunk to the LRU and evict the least recent ones beyond the limit."""
        if len(data) > self._cache_limit or digest in self._cache:
            return
        self._cache[digest] = data
        self._cached_bytes += len(data)
        while self._cached_bytes > self._cache_limit:
            _old, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= len(evicted)


def chunk_batches(entries: list[tuple[int, bytes, int]], limit: int) -> list[list[tuple[int, bytes, int]]]:
    """Blob-map entries cut, in order, into runs of at most ``limit`` bytes (a bigger chunk runs alone)."""
    batches: list[list[tuple[int, bytes, int]]] = []
    size = limit
    for entry in entries:
        if size + entry[2] > limit:
            batches.append([])
            size = 0
        batches[-1].append(entry)
        size += entry[2]
    return batches
