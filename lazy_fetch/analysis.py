"""Access-trace analysis: what sandboxes read of each layer, what their cold start waited on, and what other
chunk sizes and prefetch lists would have done. Figures only; report_html draws them.

``analyze(traces, store) -> Report`` is the entry point; ``Report.to_dict()`` is report.json. Layers are
opened from the store by the digest in each trace's header, once per run. Two reductions carry the work,
both in layer_index.py (with how records are mapped to files and which records count): ``LayerIndex``
(one per layer: its files and chunks) and ``TraceAccess`` (one per trace: its records reduced to ranges,
first reads and waits; records are dropped once reduced, so hundreds of traces fit in memory). The
report's dataclasses, and ``summarize`` (one trace's row), are in report_figures.py; here, the figures of
each layer, combination and the cross-layer table computed from them.

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
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from dsec_fs.digest import is_hex_digest, to_hex
from dsec_fs.errors import FormatError, InputError, NotFoundError
from dsec_fs.store.base import Store

from .layer_index import LayerIndex, TraceAccess, _merge
from .prefetch_list import DEFAULT_MIN_FRACTION, PrefetchList, evaluate, learn
from .report_figures import (PRODUCTION_BAND, SHARED, ChunkReaders, ChunkSizeEstimate, CombinationMember,
                             CombinationReport, CrossLayerSharing, CurveBand, HotDir, HotFile, LayerReport,
                             PrefetchQuality, Report, SharedChunk, Spread, Timeline, TimelineRow, TraceSummary, _ms,
                             _percentile, summarize)
from .trace import Trace, read_trace

CHUNK_SIZES = tuple(1 << bits for bits in range(16, 23))  # 64 KiB .. 4 MiB
PREFETCH_THRESHOLDS = (0.1, 0.25, 0.5, 0.75, 1.0)  # min_fraction values the prefetch table compares
ROLE_ORDER = ("base", "workspace", "toolkit", "")
DEFAULT_TOP = 100  # rows of the hot file and directory tables
DEFAULT_HOLDOUT = 0.2
TIMELINE_FILES = 60  # files shown in the cold-start timeline of a layer's representative trace
CURVE_POINTS = 60  # time points of the cumulative-bytes band


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
    lengths = layer.blob_map.lengths
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
    held = {d: layers[d].blob_map.indexes_of(read_in) for d in layers}  # one pass over each map
    for chunk in read_in:
        held_by = [d for d in layers if chunk in held[d]]
        if len(held_by) > 1:
            shared.append(SharedChunk(digest=to_hex(chunk), length=lengths[chunk],
                                      held_by=sorted(names[d] for d in held_by),
                                      read_in=sorted(names[d] for d in read_in[chunk]), traces=traces[chunk]))
    shared.sort(key=lambda s: (-s.traces, -s.length, s.digest))
    return CrossLayerSharing(layers=len(layers), read_bytes_per_layer=per_layer,
                             read_bytes_distinct=sum(lengths.values()), shared_chunks=len(shared),
                             shared_bytes=sum(s.length for s in shared), top=shared[:top])
