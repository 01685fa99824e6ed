"""The figures of the trace report (analysis.py computes them, report_html.py draws them): one dataclass per
table of report.json (``Report.to_dict()``), and ``summarize``, one trace's row.

Time. A record's time is when its read was answered; a read that fetched (FLAG_MISS) waited over
[time - latency, time]. "Stalled" is the wall time during which at least one read was waiting.

Threads: plain values and functions over them; nothing is shared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from .layer_index import LayerIndex, TraceAccess
from .prefetch_list import Wait

PRODUCTION_BAND = (0.042, 0.133)  # share of an image's bytes production sandboxes read


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
    lengths = layer.blob_map.lengths
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
        chunks_read=len(read_chunks), chunk_bytes=sum(lengths[c] for c in read_chunks),
        misses=len(waits), wait_ms=_ms(sum(w.latency_us for w in waits) * 1000), stalled_ms=_ms(_stalled_ns(waits)),
        last_wait_ms=_ms(max((w.end_ns for w in waits), default=0)), duration_ms=_ms(access.duration_ns),
        prefetched_bytes=sum(lengths[c] for c in access.prefetched),
        prefetch_used_bytes=sum(lengths[c] for c in access.prefetched if c in read_chunks),
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
    rows: list[TimelineRow]  # the first analysis.TIMELINE_FILES files, in first-read order
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
