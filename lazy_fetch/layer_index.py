"""One layer indexed to map trace records to its files and chunks (``LayerIndex``), and one trace reduced
against it (``TraceAccess``); analysis.py builds the trace report on them, and the daemon's mounts use
the index too (miss readahead, profiles: served_layers.py).

- ``LayerIndex`` (one per layer): every regular file of the image (its first path in walk order, size,
  and the blob-map entry of each chunk) and the reverse map, blob-map entry -> the file chunk holding it.
- ``TraceAccess`` (one per trace, from ``LayerIndex.access``): the records reduced to merged byte ranges
  per file, the first-read time of each file and chunk, the reads that waited for a fetch, and read
  sizes. Records are dropped once reduced, so hundreds of traces fit in memory.

Mapping records to files. A fuse-mode record names the file (nid, file offset). A kernel-mode record
(FLAG_BLOB) names a range of the virtual blob: it is cut at chunk boundaries through the blob map and each
piece is given to the file chunk that holds that blob-map entry. A chunk held by several files
(deduplicated content) is given to the first of them in path order: the kernel read it from the blob
once, whichever file asked, and counting it for every holder would multiply it. ``ambiguous_bytes`` says
how many read bytes were attributed that way.

Which records count. Reads by sandboxes. Records of the prefetcher (FLAG_PREFETCH) only score the
prefetcher (prefetched and used bytes); failed reads (FLAG_ERROR) are counted and otherwise ignored.

Threads: a LayerIndex is built in one thread (a worker thread in the daemon: it walks the whole image)
and then only read; ``dir_totals`` and ``dirs_of`` fill caches when first asked, so one thread at a time
asks them (the report's). No lock.
"""

from __future__ import annotations

import stat
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.errors import FormatError
from dsec_fs.layer import LayerFiles, open_layer
from dsec_fs.store.base import Store
from erofs_builder.ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from erofs_builder.ondisk.inode import LAYOUT_CHUNK_BASED
from erofs_builder.reader import ErofsImage

from .prefetch_list import ChunkUse, Wait
from .trace import FLAG_BLOB, FLAG_ERROR, FLAG_MISS, FLAG_PREFETCH, Trace, TraceHeader


# ---- one layer ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileEntry:
    nid: int
    path: str  # first path in walk order, "/"-rooted, undecodable bytes backslash-escaped
    size: int
    chunks: tuple[int | None, ...]  # blob-map entry of each chunk; None for a hole or data in the image


class Piece(NamedTuple):
    """Part of a read that fell in one chunk of one file."""

    nid: int
    start: int  # file offsets [start, end)
    end: int
    entry: int | None  # blob-map entry of the chunk; None for a hole


class LayerIndex:
    """One layer's files and blob, indexed to map trace records to files and chunks."""

    def __init__(self, digest: str, image: ErofsImage, blob_map: EncodedBlobMap):
        self.digest = digest
        self.blob_map = blob_map
        self.chunk_bits = blob_map.chunk_bits
        self.blob_bytes = blob_map.blocks * blob_map.block_size
        self.files: dict[int, FileEntry] = {}
        self.owner: list[tuple[int, int] | None] = [None] * len(blob_map)  # entry -> (nid, file offset)
        self.holders = [0] * len(blob_map)  # entry -> file chunks that hold it
        self._dirs: dict[int, tuple[str, ...]] = {}
        self._dir_totals: dict[str, list[int]] | None = None
        for raw_path, nid in image.walk():
            st = image.stat(nid)
            if not stat.S_ISREG(st.mode) or nid in self.files:
                continue
            file = FileEntry(nid, "/" + raw_path.decode("utf-8", "backslashreplace"), st.size,
                             self._chunks_of(image, nid, st.size))
            self.files[nid] = file
            for k, entry in enumerate(file.chunks):
                if entry is not None:
                    self.holders[entry] += 1
                    if self.owner[entry] is None:
                        self.owner[entry] = (nid, k << self.chunk_bits)
        self.layer_bytes = sum(file.size for file in self.files.values())
        self.layer_files = len(self.files)

    @classmethod
    def open(cls, store: Store, digest: str) -> LayerIndex:
        return cls.of_files(open_layer(store, digest))

    @classmethod
    def of_files(cls, files: LayerFiles, blob_map: EncodedBlobMap | None = None) -> LayerIndex:
        """The index of an opened layer (``blob_map``: its blob map, if decoded already). It walks the
        whole image: about 0.3 s for 8,000 files, so a worker thread's job in the daemon."""
        label = f"layer {files.digest[:12]}"
        image = ErofsImage(files.meta, source=f"{label} meta.erofs")
        return cls(files.digest, image, blob_map or EncodedBlobMap(files.blobmap, source=f"{label} blobmap"))

    @property
    def chunk_size(self) -> int:
        return self.blob_map.chunk_size

    def _chunks_of(self, image: ErofsImage, nid: int, size: int) -> tuple[int | None, ...]:
        count = -(-size >> self.chunk_bits)
        if image.inode(nid).layout != LAYOUT_CHUNK_BASED:
            return (None,) * count  # empty, or data kept in the image itself: nothing to fetch
        if image.chunk_size(nid) != self.chunk_size:
            raise FormatError(f"inode nid {nid}", None, f"chunk size {image.chunk_size(nid)}, the blob map's is "
                              f"{self.chunk_size}", source=image.source)
        chunks = []
        for k, (device, blkaddr) in enumerate(image.chunk_map(nid)):
            if blkaddr == HOLE or device != BLOB_DEVICE_ID:
                chunks.append(None)
                continue
            entry = self.blob_map.locate(blkaddr) if blkaddr < self.blob_map.blocks else -1
            if entry < 0 or self.blob_map.entries[entry][0] != blkaddr:
                raise FormatError(f"chunk index {k} of nid {nid}", None,
                                  f"block {blkaddr} is not the start of a chunk in the blob map", source=image.source)
            chunks.append(entry)
        return tuple(chunks)

    @property
    def dir_totals(self) -> dict[str, list[int]]:
        """Directory -> [files, bytes] below it. Made when first asked for (the trace report), not by the
        daemon's mounts, whose miss readahead needs only the files: a fifth of the index's time."""
        if self._dir_totals is None:
            totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            for nid, file in self.files.items():
                for directory in self.dirs_of(nid):
                    found = totals[directory]
                    found[0] += 1
                    found[1] += file.size
            self._dir_totals = totals
        return self._dir_totals

    def dirs_of(self, nid: int) -> tuple[str, ...]:
        """The directories above file ``nid`` (its first path), outermost first, the root left out."""
        found = self._dirs.get(nid)
        if found is None:
            parts = self.files[nid].path.split("/")[1:-1]
            found = tuple("/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1))
            self._dirs[nid] = found
        return found

    def pieces(self, nid: int, offset: int, length: int, flags: int) -> list[Piece] | None:
        """The file chunks one read touched (cut to the file's or blob's end); None if ``nid`` is not a
        regular file of this layer (for a fuse-mode read)."""
        if flags & FLAG_BLOB:
            return self._blob_pieces(offset, length)
        file = self.files.get(nid)
        if file is None:
            return None
        pieces = []
        start, end = offset, min(offset + length, file.size)
        while start < end:
            k = start >> self.chunk_bits
            stop = min(end, (k + 1) << self.chunk_bits)
            pieces.append(Piece(nid, start, stop, file.chunks[k]))
            start = stop
        return pieces

    def _blob_pieces(self, offset: int, length: int) -> list[Piece]:
        end = offset + length
        pieces = []
        entry_at, block_size = self.blob_map.entry, self.blob_map.block_size
        for entry in self.blob_map.entries_in(offset, end):
            owner = self.owner[entry]
            if owner is not None:  # bytes of a chunk no file holds are no file's
                nid, file_offset = owner
                blkaddr, _digest, chunk_length = entry_at(entry)
                chunk_start = blkaddr * block_size
                a, b = max(offset, chunk_start), min(end, chunk_start + chunk_length)
                pieces.append(Piece(nid, file_offset + a - chunk_start, file_offset + b - chunk_start, entry))
        return pieces

    def access(self, trace: Trace) -> TraceAccess:
        """Reduce ``trace`` (of this layer) to ranges, first reads and waits. FormatError names the trace
        file and record when a record does not fit the layer."""
        access = TraceAccess(trace.path, trace.header, trace.truncated, records=len(trace.records))
        ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
        first_file, first_chunk = access.first_file_read, access.use.first_read
        for index, record in enumerate(trace.records):
            pieces = self.pieces(record.nid, record.offset, record.length, record.flags)
            if pieces is None:
                raise FormatError(f"trace record {index}", None, f"nid {record.nid} is not a regular file of "
                                  f"layer {self.digest[:12]}", source=trace.path)
            access.duration_ns = max(access.duration_ns, record.time_ns)
            if record.flags & FLAG_ERROR:
                access.errors += 1
                continue
            if record.flags & FLAG_PREFETCH:
                access.prefetched.update(piece.entry for piece in pieces if piece.entry is not None)
                continue
            access.reads += 1
            access.bytes_requested += record.length
            if record.length:
                access.read_sizes[record.length.bit_length() - 1] += 1
            now = record.time_ns
            entries = []
            for piece in pieces:
                ranges[piece.nid].append((piece.start, piece.end))
                _keep_earliest(first_file, piece.nid, now)
                if piece.entry is not None:
                    entries.append(piece.entry)
                    _keep_earliest(first_chunk, piece.entry, now)
                    if record.flags & FLAG_BLOB and self.holders[piece.entry] > 1:
                        access.ambiguous_bytes += piece.end - piece.start
            if record.flags & FLAG_MISS:
                access.use.waits.append(Wait(now, record.latency_us, pieces[0].nid if pieces else 0, tuple(entries)))
        access.ranges = {nid: _merge(spans) for nid, spans in ranges.items()}
        return access

    def chunk_bytes(self, nid: int, k: int, chunk_size: int) -> int:
        """Bytes of chunk ``k`` of file ``nid`` at ``chunk_size``; 0 if it would lie wholly in holes."""
        file = self.files[nid]
        start = k * chunk_size
        end = min(start + chunk_size, file.size)
        own = file.chunks[start >> self.chunk_bits:((end - 1) >> self.chunk_bits) + 1]
        return end - start if any(entry is not None for entry in own) else 0


def _keep_earliest(first: dict[int, int], key: int, now: int) -> None:
    if key not in first or now < first[key]:
        first[key] = now


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans.sort()
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


# ---- one trace ---------------------------------------------------------------------------------------


@dataclass
class TraceAccess:
    """One trace reduced against its layer (see the module docstring)."""

    path: str
    header: TraceHeader
    truncated: bool
    records: int = 0
    reads: int = 0  # reads by sandboxes: not the prefetcher's, not failed
    errors: int = 0
    bytes_requested: int = 0  # what those reads asked for, before cutting at ends of files
    ambiguous_bytes: int = 0
    duration_ns: int = 0  # time of the last record
    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # nid -> merged [start, end)
    first_file_read: dict[int, int] = field(default_factory=dict)  # nid -> ns of its first read
    read_sizes: Counter = field(default_factory=Counter)  # log2 of the length -> reads
    prefetched: set[int] = field(default_factory=set)  # blob-map entries the prefetcher fetched
    use: ChunkUse = field(default_factory=ChunkUse)

    def bytes_read(self) -> int:
        return sum(end - start for spans in self.ranges.values() for start, end in spans)
