"""Access-trace analysis: what sandboxes read of each layer, what their cold start waited on, and what other
chunk sizes and prefetch lists would have done. Figures only; report_html draws them.

``analyze(traces, store) -> Report`` is the entry point; ``Report.to_dict()`` is report.json. Layers are
opened from the store by the digest in each trace's header, once per run. Two reductions carry the work:

- ``LayerIndex`` (one per layer): every regular file of the image (its first path in walk order, size,
  and the blob-map entry of each chunk) and the reverse map, blob-map entry -> the file chunk holding it.
- ``TraceAccess`` (one per trace): the records reduced to merged byte ranges per file, the first-read
  time of each file and chunk, the reads that waited for a fetch, and read sizes. Records are dropped
  once reduced, so hundreds of traces fit in memory.

Mapping records to files. A fuse-mode record names the file (nid, file offset). A kernel-mode record
(FLAG_BLOB) names a range of the virtual blob: it is cut at chunk boundaries through the blob map and each
piece is given to the file chunk that holds that blob-map entry. A chunk held by several files
(deduplicated content) is given to the first of them in path order: the kernel read it from the blob
once, whichever file asked, and counting it for every holder would multiply it. ``ambiguous_bytes`` says
how many read bytes were attributed that way.

Which records count. Reads by sandboxes. Records of the prefetcher (FLAG_PREFETCH) only score the
prefetcher (prefetched and used bytes); failed reads (FLAG_ERROR) are counted and otherwise ignored.

Time. A record's time is when its read was answered; a read that fetched (FLAG_MISS) waited over
[time - latency, time]. "Stalled" is the wall time during which at least one read was waiting.

Other chunk sizes. From the byte ranges each trace read, the chunks of size 64 KiB .. 4 MiB those ranges
touch, and their bytes: what a cold node would have fetched at that chunk size. Content dedup at another
chunk size cannot be known without the data, so it is not counted (at the layer's own size the table
shows the deduplicated figure beside it); a chunk that would lie wholly in holes is not counted.

Prefetch quality. Per layer, traces in start order: the first (1 - holdout) learn a list
(prefetch_list.learn) at several thresholds and the rest are scored with it (prefetch_list.evaluate).

Threads: plain functions over values; nothing is shared.
"""

from __future__ import annotations

import bisect
import math
import os
import stat
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import NamedTuple

from dsec_fs.digest import is_hex_digest, to_hex
from dsec_fs.errors import FormatError, InputError, NotFoundError
from dsec_fs.layer import LayerFiles, open_layer
from dsec_fs.store.base import Store
from dsec_fs.blobmap import BlobMap
from erofs_builder.ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from erofs_builder.ondisk.inode import LAYOUT_CHUNK_BASED
from erofs_builder.reader import ErofsImage

from .prefetch_list import DEFAULT_MIN_FRACTION, ChunkUse, PrefetchList, Wait, evaluate, learn
from .trace import FLAG_BLOB, FLAG_ERROR, FLAG_MISS, FLAG_PREFETCH, Trace, TraceHeader, read_trace

CHUNK_SIZES = tuple(1 << bits for bits in range(16, 23))  # 64 KiB .. 4 MiB
PRODUCTION_BAND = (0.042, 0.133)  # share of an image's bytes production sandboxes read
PREFETCH_THRESHOLDS = (0.1, 0.25, 0.5, 0.75, 1.0)  # min_fraction values the prefetch table compares
ROLE_ORDER = ("base", "workspace", "toolkit", "")
DEFAULT_TOP = 100  # rows of the hot file and directory tables
DEFAULT_HOLDOUT = 0.2
TIMELINE_FILES = 60  # files shown in the cold-start timeline of a layer's representative trace
CURVE_POINTS = 60  # time points of the cumulative-bytes band


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

    def __init__(self, digest: str, image: ErofsImage, blob_map: BlobMap):
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
    def of_files(cls, files: LayerFiles, blob_map: BlobMap | None = None) -> LayerIndex:
        """The index of an opened layer (``blob_map``: its blob map, if decoded already). It walks the
        whole image: about 0.3 s for 8,000 files, so a worker thread's job in the daemon."""
        label = f"layer {files.digest[:12]}"
        image = ErofsImage(files.meta, source=f"{label} meta.erofs")
        return cls(files.digest, image, blob_map or BlobMap.decode(files.blobmap, source=f"{label} blobmap"))

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
        end = min(offset + length, self.blob_bytes)
        if offset >= end:
            return []
        entries, block_size = self.blob_map.entries, self.blob_map.block_size
        pieces = []
        for entry in range(self.blob_map.locate(offset // block_size), len(entries)):
            blkaddr, _digest, chunk_length = entries[entry]
            chunk_start = blkaddr * block_size
            if chunk_start >= end:
                break
            a, b = max(offset, chunk_start), min(end, chunk_start + chunk_length)
            owner = self.owner[entry]
            if a < b and owner is not None:  # bytes in the padding, or of a chunk no file holds, are no file's
                nid, file_offset = owner
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


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _stalled_ns(waits: Sequence[Wait]) -> int:
    """Wall time covered by at least one waiting read."""
    spans = sorted((w.end_ns - w.latency_us * 1000, w.end_ns) for w in waits)
    total, reach = 0, None
    for start, end in spans:
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


@dataclass
class TraceSummary:
    path: str
    layer: str
    ref: str
    role: str
    combination: str
    mode: str
    started: str  # ISO-8601 UTC
    records: int
    truncated: bool
    reads: int
    errors: int
    bytes_requested: int
    bytes_read: int  # distinct file bytes read
    files_read: int
    byte_fraction: float  # bytes_read / bytes of the layer's regular files
    file_fraction: float  # files_read / regular files of the layer
    chunks_read: int  # distinct blob-map entries touched
    chunk_bytes: int  # their bytes: what a cold node fetched for this sandbox
    misses: int  # reads that waited for a fetch
    wait_ms: float  # their latencies, summed
    stalled_ms: float  # wall time with at least one read waiting
    last_wait_ms: float  # when the last waiting read was answered: the end of the cold start
    duration_ms: float
    prefetched_bytes: int
    prefetch_used_bytes: int  # of those, bytes of chunks a reader then read
    ambiguous_bytes: int
    holders: int = 1  # distinct holders sharing the blob while it was written (trace_holders.py)
    prefetch: str = ""  # what its mount prefetched by (a list, "profile:combination|layer|name", "fill")
    profile_key: str = ""  # the store prefix of that profile


def summarize(access: TraceAccess, layer: LayerIndex) -> TraceSummary:
    h = access.header
    lengths = layer.blob_map.entries
    read_chunks = access.use.first_read
    waits = access.use.waits
    bytes_read = access.bytes_read()
    files_read = len(access.ranges)
    return TraceSummary(
        path=access.path, layer=h.layer, ref=h.ref, role=h.role, combination=h.combination, mode=h.mode,
        started=datetime.fromtimestamp(h.started_ns / 1e9, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        records=access.records, truncated=access.truncated, reads=access.reads, errors=access.errors,
        bytes_requested=access.bytes_requested, bytes_read=bytes_read, files_read=files_read,
        byte_fraction=bytes_read / layer.layer_bytes if layer.layer_bytes else 0.0,
        file_fraction=files_read / layer.layer_files if layer.layer_files else 0.0,
        chunks_read=len(read_chunks), chunk_bytes=sum(lengths[c][2] for c in read_chunks),
        misses=len(waits), wait_ms=_ms(sum(w.latency_us for w in waits) * 1000), stalled_ms=_ms(_stalled_ns(waits)),
        last_wait_ms=_ms(max((w.end_ns for w in waits), default=0)), duration_ms=_ms(access.duration_ns),
        prefetched_bytes=sum(lengths[c][2] for c in access.prefetched),
        prefetch_used_bytes=sum(lengths[c][2] for c in access.prefetched if c in read_chunks),
        ambiguous_bytes=access.ambiguous_bytes, holders=h.holders, prefetch=h.prefetch, profile_key=h.profile_key,
    )


# ---- the report --------------------------------------------------------------------------------------


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of sorted values."""
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Spread:
    min: float
    p10: float
    median: float
    mean: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        ordered = sorted(values)
        if not ordered:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return cls(ordered[0], _percentile(ordered, 0.1), _percentile(ordered, 0.5), sum(ordered) / len(ordered),
                   _percentile(ordered, 0.9), ordered[-1])


@dataclass
class HotFile:
    path: str
    size: int
    traces: int  # traces that read it
    trace_fraction: float
    mean_bytes_read: float  # per trace that read it
    read_fraction: float  # mean_bytes_read / size
    first_read_ms: float  # median over the traces that read it
    waits: int
    wait_ms: float  # summed over traces


@dataclass
class HotDir:
    path: str
    files: int  # regular files below it
    bytes: int  # their bytes
    traces: int  # traces that read something below it
    mean_bytes_read: float  # per trace of the layer
    read_fraction: float  # mean_bytes_read / bytes


@dataclass
class ChunkSizeEstimate:
    chunk_size: int
    current: bool  # the layer's own chunk size
    mean_bytes: float  # fetched per trace (cold node, no dedup)
    mean_chunks: float  # fetches per trace
    union_bytes: int  # fetched for all traces of the layer together
    union_chunks: int
    amplification: float  # mean_bytes / mean bytes read


@dataclass
class ChunkReaders:
    traces: int  # how many traces read each of these chunks
    chunks: int
    bytes: int


@dataclass
class TimelineRow:
    path: str
    first_read_ms: float
    bytes_read: int
    waits: list[tuple[float, float]]  # (start ms, end ms) of reads of this file that fetched


@dataclass
class Timeline:
    """The cold start of one representative trace (the median by stalled time)."""

    trace: str
    rows: list[TimelineRow]  # the first TIMELINE_FILES files, in first-read order
    more_files: int  # files read after those


@dataclass
class CurveBand:
    """Chunk bytes needed so far (first reads of chunks, summed), across traces, at each time."""

    t_ms: list[float]
    p10: list[float]
    median: list[float]
    p90: list[float]


@dataclass
class PrefetchQuality:
    scope: str  # "all" (every trace of the layer) or a combination key
    min_fraction: float
    train_traces: int
    test_traces: int
    list_chunks: int
    list_bytes: int
    needed_bytes: int
    hit_bytes: int
    wasted_bytes: int
    coverage: float
    precision: float
    waits: int
    saved_waits: int
    wait_ms: float
    saved_wait_ms: float
    saved_wait_fraction: float


@dataclass
class LayerReport:
    layer: str
    name: str  # the ref it was mounted as, else the short digest
    roles: list[str]
    chunk_size: int
    layer_bytes: int
    layer_files: int
    blob_bytes: int
    traces: int
    byte_fraction: Spread
    file_fraction: Spread
    union_bytes_read: int  # read by any of the traces
    union_files_read: int
    union_byte_fraction: float
    mean_chunk_bytes: float  # deduplicated chunk bytes per trace, at the layer's chunk size
    union_chunk_bytes: int
    core_chunk_bytes: int  # of chunks every trace read
    ambiguous_bytes: int
    stalled_ms: Spread
    last_wait_ms: Spread
    hot_files: list[HotFile]
    wait_files: list[HotFile]  # the files reads waited on longest
    hot_dirs: list[HotDir]
    read_sizes: list[tuple[int, int]]  # (size class: reads of at least this many bytes and under twice it, reads)
    chunk_sizes: list[ChunkSizeEstimate]
    chunk_readers: list[ChunkReaders]
    timeline: Timeline
    cold_start: CurveBand
    prefetch: list[PrefetchQuality]


@dataclass
class CombinationMember:
    role: str
    layer: str
    name: str
    traces: int
    layer_bytes: int
    layer_files: int
    mean_bytes_read: float
    mean_files_read: float
    byte_fraction: float  # mean over the member's traces
    mean_stalled_ms: float
    # which profiles its mounts prefetched by ("profile:combination <store prefix>", ...), and how well
    # they predicted its reads, in chunk bytes summed over its traces:
    profiles: list[str] = field(default_factory=list)
    prefetched_bytes: int = 0
    prefetched_read_bytes: int = 0
    prefetched_unread_bytes: int = 0
    read_not_prefetched_bytes: int = 0


SHARED = "(shared)"  # the combination of trace segments written while sandboxes of several shared the layer


@dataclass
class CombinationReport:
    combination: str
    members: list[CombinationMember]
    byte_fraction: float  # sum of members' mean bytes read / sum of their layer bytes
    file_fraction: float
    mean_stalled_ms: float  # summed over members
    in_band: bool


@dataclass
class SharedChunk:
    digest: str
    length: int
    held_by: list[str]  # names of the report's layers whose blob holds it
    read_in: list[str]  # names of the layers in whose traces it was read
    traces: int


@dataclass
class CrossLayerSharing:
    layers: int
    read_bytes_per_layer: int  # chunk bytes read, counted per layer (a chunk read in two layers counts twice)
    read_bytes_distinct: int  # counted once per chunk: what one node's cache fetches for all of them
    shared_chunks: int  # read chunks held by at least two of the report's layers
    shared_bytes: int
    top: list[SharedChunk]


@dataclass
class Report:
    traces: list[TraceSummary]
    layers: list[LayerReport]
    combinations: list[CombinationReport]
    cross_layer: CrossLayerSharing
    notes: list[str]
    band: tuple[float, float] = PRODUCTION_BAND
    generated: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def to_dict(self) -> dict:
        return asdict(self)


class LayerCache:
    """Layers opened from a store, once each; errors name the trace that asked."""

    def __init__(self, store: Store):
        self.store = store
        self.layers: dict[str, LayerIndex] = {}

    def get(self, trace: Trace) -> LayerIndex:
        digest = trace.header.layer
        found = self.layers.get(digest)
        if found is None:
            if not is_hex_digest(digest):
                raise FormatError("trace header", None, f"layer {digest[:80]!r} is not a layer digest",
                                  source=trace.path)
            try:
                found = LayerIndex.open(self.store, digest)
            except NotFoundError as exc:
                raise NotFoundError(exc.message, where=f"{trace.path}: {exc.where}") from None
            self.layers[digest] = found
        return found


def _load(item: Trace | str | os.PathLike) -> Trace:
    return item if isinstance(item, Trace) else read_trace(os.fspath(item))


def analyze(traces: Iterable[Trace | str | os.PathLike], store: Store, *, top: int = DEFAULT_TOP,
            holdout: float = DEFAULT_HOLDOUT) -> Report:
    """Every figure of the report. ``traces`` are Trace objects or paths (read one at a time, records
    dropped after reduction); a trace file that is corrupt raises FormatError naming it and the record."""
    cache = LayerCache(store)
    by_layer: dict[str, list[TraceAccess]] = defaultdict(list)
    for item in traces:
        trace = _load(item)
        by_layer[trace.header.layer].append(cache.get(trace).access(trace))
    if not by_layer:
        raise InputError("no traces to analyse", where="trace report")
    summaries: dict[str, list[TraceSummary]] = {}
    layer_reports = []
    for digest, accesses in by_layer.items():
        layer = cache.layers[digest]
        accesses.sort(key=lambda a: (a.header.started_ns, a.path))
        summaries[digest] = [summarize(a, layer) for a in accesses]
        layer_reports.append(_layer_report(layer, accesses, summaries[digest], top=top, holdout=holdout))
    layer_reports.sort(key=lambda r: (ROLE_ORDER.index(r.roles[0]) if r.roles[0] in ROLE_ORDER else 9, r.name))
    names = {r.layer: r.name for r in layer_reports}
    all_summaries = [s for r in layer_reports for s in summaries[r.layer]]
    notes = []
    truncated = [f"{s.path} (record {s.records})" for s in all_summaries if s.truncated]
    if truncated:
        notes.append(f"{len(truncated)} trace(s) end inside a record (the writer stopped mid-write); that partial "
                     f"record is ignored: {', '.join(truncated[:5])}{' ...' if len(truncated) > 5 else ''}")
    ambiguous = sum(s.ambiguous_bytes for s in all_summaries)
    if ambiguous:
        notes.append(f"{ambiguous:,} bytes of kernel-mode reads fell in chunks that several files hold; each such "
                     "read is attributed to the first of those files in path order")
    return Report(traces=all_summaries, layers=layer_reports,
                  combinations=_combinations(all_summaries, cache.layers, names),
                  cross_layer=_cross_layer(by_layer, cache.layers, names, top=top), notes=notes)


def learn_prefetch_list(traces: Iterable[Trace | str | os.PathLike], store: Store, *,
                        min_fraction: float = DEFAULT_MIN_FRACTION) -> PrefetchList:
    """Learn one layer's prefetch list from its traces (InputError if they name more than one layer)."""
    cache = LayerCache(store)
    uses = []
    for item in traces:
        trace = _load(item)
        layer = cache.get(trace)
        if len(cache.layers) > 1:
            raise InputError(f"traces of more than one layer ({', '.join(d[:12] for d in cache.layers)}); "
                             "a prefetch list is for one layer", where=trace.path)
        uses.append(layer.access(trace).use)
    if not uses:
        raise InputError("no traces to learn from", where="prefetch list")
    (digest, layer), = cache.layers.items()
    return learn(uses, layer.blob_map, layer=digest, min_fraction=min_fraction)


# ---- per-layer figures -------------------------------------------------------------------------------


def _layer_report(layer: LayerIndex, accesses: list[TraceAccess], summaries: list[TraceSummary], *,
                  top: int, holdout: float) -> LayerReport:
    n = len(accesses)
    lengths = [length for _blkaddr, _digest, length in layer.blob_map.entries]
    refs = Counter(a.header.ref for a in accesses if a.header.ref)
    union_ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for a in accesses:
        for nid, spans in a.ranges.items():
            union_ranges[nid].extend(spans)
    union_bytes = sum(end - start for spans in union_ranges.values() for start, end in _merge(spans))
    readers = Counter(c for a in accesses for c in a.use.first_read)
    hot_files, wait_files = _hot_files(layer, accesses, top)
    read_sizes = sum((a.read_sizes for a in accesses), Counter())
    return LayerReport(
        layer=layer.digest, name=refs.most_common(1)[0][0] if refs else layer.digest[:12],
        roles=sorted({a.header.role for a in accesses}, key=lambda r: ROLE_ORDER.index(r) if r in ROLE_ORDER else 9),
        chunk_size=layer.chunk_size, layer_bytes=layer.layer_bytes, layer_files=layer.layer_files,
        blob_bytes=layer.blob_bytes, traces=n,
        byte_fraction=Spread.of(s.byte_fraction for s in summaries),
        file_fraction=Spread.of(s.file_fraction for s in summaries),
        union_bytes_read=union_bytes, union_files_read=len(union_ranges),
        union_byte_fraction=union_bytes / layer.layer_bytes if layer.layer_bytes else 0.0,
        mean_chunk_bytes=sum(s.chunk_bytes for s in summaries) / n,
        union_chunk_bytes=sum(lengths[c] for c in readers),
        core_chunk_bytes=sum(lengths[c] for c, k in readers.items() if k == n),
        ambiguous_bytes=sum(a.ambiguous_bytes for a in accesses),
        stalled_ms=Spread.of(s.stalled_ms for s in summaries),
        last_wait_ms=Spread.of(s.last_wait_ms for s in summaries),
        hot_files=hot_files, wait_files=wait_files, hot_dirs=_hot_dirs(layer, accesses, top),
        read_sizes=sorted((1 << bucket, count) for bucket, count in read_sizes.items()),
        chunk_sizes=_chunk_sizes(layer, accesses, sum(s.bytes_read for s in summaries) / n),
        chunk_readers=_chunk_readers(readers, lengths),
        timeline=_timeline(layer, accesses, summaries),
        cold_start=_cold_start(accesses, lengths),
        prefetch=_prefetch(layer, accesses, holdout),
    )


def _hot_files(layer: LayerIndex, accesses: list[TraceAccess], top: int) -> tuple[list[HotFile], list[HotFile]]:
    traces: Counter = Counter()
    read: Counter = Counter()
    firsts: dict[int, list[int]] = defaultdict(list)
    waits: Counter = Counter()
    wait_us: Counter = Counter()
    for a in accesses:
        for nid, spans in a.ranges.items():
            traces[nid] += 1
            read[nid] += sum(end - start for start, end in spans)
            firsts[nid].append(a.first_file_read[nid])
        for wait in a.use.waits:
            if wait.nid in layer.files:
                waits[wait.nid] += 1
                wait_us[wait.nid] += wait.latency_us

    def row(nid: int) -> HotFile:
        file = layer.files[nid]
        mean = read[nid] / traces[nid] if traces[nid] else 0.0
        return HotFile(path=file.path, size=file.size, traces=traces[nid], trace_fraction=traces[nid] / len(accesses),
                       mean_bytes_read=mean, read_fraction=mean / file.size if file.size else 0.0,
                       first_read_ms=_ms(_percentile(sorted(firsts[nid]), 0.5)), waits=waits[nid],
                       wait_ms=_ms(wait_us[nid] * 1000))

    hot = sorted(traces, key=lambda nid: (-traces[nid], -read[nid], layer.files[nid].path))[:top]
    waited = sorted(wait_us, key=lambda nid: (-wait_us[nid], layer.files[nid].path))[:top]
    return [row(nid) for nid in hot], [row(nid) for nid in waited]


def _hot_dirs(layer: LayerIndex, accesses: list[TraceAccess], top: int) -> list[HotDir]:
    traces: Counter = Counter()
    read: Counter = Counter()
    for a in accesses:
        per_dir: Counter = Counter()
        for nid, spans in a.ranges.items():
            got = sum(end - start for start, end in spans)
            for directory in layer.dirs_of(nid):
                per_dir[directory] += got
        traces.update(per_dir.keys())
        read.update(per_dir)
    rows = []
    for directory in sorted(read, key=lambda d: (-read[d], d))[:top]:
        files, size = layer.dir_totals[directory]
        mean = read[directory] / len(accesses)
        rows.append(HotDir(path=directory, files=files, bytes=size, traces=traces[directory], mean_bytes_read=mean,
                           read_fraction=mean / size if size else 0.0))
    return rows


def _chunk_sizes(layer: LayerIndex, accesses: list[TraceAccess], mean_read: float) -> list[ChunkSizeEstimate]:
    estimates = []
    n = len(accesses)
    for chunk_size in CHUNK_SIZES:
        union: set[tuple[int, int]] = set()
        sizes_of: dict[tuple[int, int], int] = {}  # traces read mostly the same chunks: each is measured once
        total_bytes = total_chunks = 0
        for a in accesses:
            keys = {(nid, k) for nid, spans in a.ranges.items() for start, end in spans
                    for k in range(start // chunk_size, (end - 1) // chunk_size + 1)}
            union |= keys
            for key in keys - sizes_of.keys():
                sizes_of[key] = layer.chunk_bytes(key[0], key[1], chunk_size)
            sizes = [sizes_of[key] for key in keys]
            total_bytes += sum(sizes)
            total_chunks += sum(1 for size in sizes if size)
        union_sizes = [sizes_of[key] for key in union]
        mean_bytes = total_bytes / n
        estimates.append(ChunkSizeEstimate(
            chunk_size=chunk_size, current=chunk_size == layer.chunk_size, mean_bytes=mean_bytes,
            mean_chunks=total_chunks / n, union_bytes=sum(union_sizes), union_chunks=sum(1 for s in union_sizes if s),
            amplification=mean_bytes / mean_read if mean_read else 0.0))
    return estimates


def _chunk_readers(readers: Counter, lengths: list[int]) -> list[ChunkReaders]:
    chunks: Counter = Counter()
    size: Counter = Counter()
    for entry, k in readers.items():
        chunks[k] += 1
        size[k] += lengths[entry]
    return [ChunkReaders(traces=k, chunks=chunks[k], bytes=size[k]) for k in sorted(chunks)]


def _timeline(layer: LayerIndex, accesses: list[TraceAccess], summaries: list[TraceSummary]) -> Timeline:
    order = sorted(range(len(accesses)), key=lambda i: (summaries[i].stalled_ms, summaries[i].path))
    a = accesses[order[len(order) // 2]]
    waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for wait in a.use.waits:
        waits[wait.nid].append((_ms(wait.end_ns - wait.latency_us * 1000), _ms(wait.end_ns)))
    files = sorted(a.first_file_read, key=lambda nid: (a.first_file_read[nid], layer.files[nid].path))
    rows = [TimelineRow(path=layer.files[nid].path, first_read_ms=_ms(a.first_file_read[nid]),
                        bytes_read=sum(end - start for start, end in a.ranges[nid]), waits=waits.get(nid, []))
            for nid in files[:TIMELINE_FILES]]
    return Timeline(trace=a.path, rows=rows, more_files=max(0, len(files) - TIMELINE_FILES))


def _cold_start(accesses: list[TraceAccess], lengths: list[int]) -> CurveBand:
    curves = []
    for a in accesses:
        firsts = sorted((ns, lengths[c]) for c, ns in a.use.first_read.items())
        times = [ns for ns, _length in firsts]
        cumulative = [0]
        for _ns, length in firsts:
            cumulative.append(cumulative[-1] + length)
        curves.append((times, cumulative))
    end = max((times[-1] for times, _ in curves if times), default=0)
    grid = [end * i / (CURVE_POINTS - 1) for i in range(CURVE_POINTS)]
    band = CurveBand(t_ms=[_ms(t) for t in grid], p10=[], median=[], p90=[])
    for t in grid:
        values = sorted(cumulative[bisect.bisect_right(times, t)] for times, cumulative in curves)
        band.p10.append(_percentile(values, 0.1))
        band.median.append(_percentile(values, 0.5))
        band.p90.append(_percentile(values, 0.9))
    return band


def _prefetch(layer: LayerIndex, accesses: list[TraceAccess], holdout: float) -> list[PrefetchQuality]:
    """Learn on the earlier traces, score on the later ones: over every trace of the layer at each
    threshold, and per combination (when it has its own traces to spare) at the default threshold."""
    results = _prefetch_scope("all", layer, accesses, holdout, PREFETCH_THRESHOLDS)
    groups: dict[str, list[TraceAccess]] = defaultdict(list)
    for a in accesses:
        groups[a.header.combination].append(a)
    if len(groups) > 1:
        for combination in sorted(groups):
            if combination:
                results += _prefetch_scope(combination, layer, groups[combination], holdout, (DEFAULT_MIN_FRACTION,))
    return results


def _prefetch_scope(scope: str, layer: LayerIndex, accesses: list[TraceAccess], holdout: float,
                    thresholds: Sequence[float]) -> list[PrefetchQuality]:
    n = len(accesses)
    if n < 2:
        return []
    n_test = min(n - 1, max(1, round(n * holdout)))
    train = [a.use for a in accesses[:n - n_test]]
    test = [a.use for a in accesses[n - n_test:]]
    results = []
    for min_fraction in thresholds:
        plist = learn(train, layer.blob_map, layer=layer.digest, min_fraction=min_fraction)
        score = evaluate(plist, test, layer.blob_map)
        results.append(PrefetchQuality(
            scope=scope, min_fraction=min_fraction, train_traces=len(train), test_traces=len(test),
            list_chunks=score.list_chunks, list_bytes=score.list_bytes, needed_bytes=score.needed_bytes,
            hit_bytes=score.hit_bytes, wasted_bytes=score.wasted_bytes, coverage=score.coverage,
            precision=score.precision, waits=score.waits, saved_waits=score.saved_waits,
            wait_ms=_ms(score.wait_us * 1000), saved_wait_ms=_ms(score.saved_wait_us * 1000),
            saved_wait_fraction=score.saved_wait_fraction))
    return results


# ---- across layers -----------------------------------------------------------------------------------


def _combinations(summaries: list[TraceSummary], layers: dict[str, LayerIndex],
                  names: dict[str, str]) -> list[CombinationReport]:
    groups: dict[str, dict[tuple[str, str], list[TraceSummary]]] = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        groups[SHARED if s.holders > 1 else s.combination][(s.role, s.layer)].append(s)
    reports = []
    for combination in sorted(groups):
        members = []
        for (role, digest), group in sorted(groups[combination].items(),
                                            key=lambda item: (ROLE_ORDER.index(item[0][0])
                                                              if item[0][0] in ROLE_ORDER else 9, item[0][1])):
            layer, n = layers[digest], len(group)
            members.append(CombinationMember(
                role=role, layer=digest, name=names[digest], traces=n, layer_bytes=layer.layer_bytes,
                layer_files=layer.layer_files, mean_bytes_read=sum(s.bytes_read for s in group) / n,
                mean_files_read=sum(s.files_read for s in group) / n,
                byte_fraction=sum(s.byte_fraction for s in group) / n,
                mean_stalled_ms=sum(s.stalled_ms for s in group) / n, **_prediction(group)))
        total_bytes = sum(m.layer_bytes for m in members)
        total_files = sum(m.layer_files for m in members)
        byte_fraction = sum(m.mean_bytes_read for m in members) / total_bytes if total_bytes else 0.0
        reports.append(CombinationReport(
            combination=combination, members=members, byte_fraction=byte_fraction,
            file_fraction=sum(m.mean_files_read for m in members) / total_files if total_files else 0.0,
            mean_stalled_ms=sum(m.mean_stalled_ms for m in members),
            in_band=PRODUCTION_BAND[0] <= byte_fraction <= PRODUCTION_BAND[1]))
    return reports


def _prediction(group: list[TraceSummary]) -> dict:
    """The profiles the traces' mounts prefetched by, and how well the prefetch predicted their reads."""
    prefetched = sum(s.prefetched_bytes for s in group)
    read = sum(s.prefetch_used_bytes for s in group)
    return {"profiles": sorted({f"{s.prefetch} {s.profile_key}".strip() for s in group if s.prefetch}),
            "prefetched_bytes": prefetched, "prefetched_read_bytes": read,
            "prefetched_unread_bytes": prefetched - read,
            "read_not_prefetched_bytes": sum(s.chunk_bytes for s in group) - read}


def _cross_layer(by_layer: dict[str, list[TraceAccess]], layers: dict[str, LayerIndex], names: dict[str, str], *,
                 top: int) -> CrossLayerSharing:
    read_in: dict[bytes, set[str]] = defaultdict(set)
    traces: Counter = Counter()
    lengths: dict[bytes, int] = {}
    per_layer = 0
    for digest, accesses in by_layer.items():
        entries = layers[digest].blob_map.entries
        read = Counter(c for a in accesses for c in a.use.first_read)
        for entry, k in read.items():
            _blkaddr, chunk, length = entries[entry]
            read_in[chunk].add(digest)
            traces[chunk] += k
            lengths[chunk] = length
            per_layer += length
    shared = []
    for chunk in read_in:
        held_by = [d for d in layers if chunk in layers[d].blob_map]
        if len(held_by) > 1:
            shared.append(SharedChunk(digest=to_hex(chunk), length=lengths[chunk],
                                      held_by=sorted(names[d] for d in held_by),
                                      read_in=sorted(names[d] for d in read_in[chunk]), traces=traces[chunk]))
    shared.sort(key=lambda s: (-s.traces, -s.length, s.digest))
    return CrossLayerSharing(layers=len(layers), read_bytes_per_layer=per_layer,
                             read_bytes_distinct=sum(lengths.values()), shared_chunks=len(shared),
                             shared_bytes=sum(s.length for s in shared), top=shared[:top])
