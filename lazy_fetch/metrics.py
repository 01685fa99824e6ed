"""Prometheus metrics of the node daemon, read from its live counters at scrape time.

The only module that imports prometheus_client. Nothing is counted twice: the fetcher keeps its
FetchStats, the chunk cache its CacheStats, the daemon its per-layer read counts and mount table; at each
scrape of ``/metrics`` the daemon hands a ``NodeFigures`` snapshot of them to ``NodeCollector``, which
turns it into metric families:

    dsecfs_fetch_bytes_total{layer}            uncompressed bytes of chunks fetched from the store
    dsecfs_fetch_chunks_total{layer}           chunks fetched from the store (each verified)
    dsecfs_fetch_store_reads_total{layer}      store reads (batches of neighbouring chunks)
    dsecfs_fetch_coalesced_total{layer}        requests that joined a fetch already in the air
    dsecfs_fetch_readahead_chunks_total{layer} chunks of those fetched as miss readahead, not asked for
    dsecfs_fetch_errors_total{layer,kind}      chunks whose fetch failed: kind corrupt | timeout | stuck
                                               (refused at once: their store object has reads stuck) |
                                               other
    dsecfs_fetch_abandoned_reads_total{layer}  store reads left behind in the store at their deadline
    dsecfs_fetch_latency_seconds{layer}        histogram of store read latency (queueing included)
    dsecfs_layer_fetched_ratio{layer}          share of the layer's chunk bytes this node has served
                                               readers so far (from the store or the local caches)
    dsecfs_layer_reads_total{layer}            reads served from the layer's blob (FUSE reads)
    dsecfs_layer_read_errors_total{layer}      of those, reads that failed (EIO)
    dsecfs_layer_untraced_reads_total{layer}   of those, reads its trace left out (repeats; past its bound)
    dsecfs_layer_chunk_hits_total{layer}       chunk lookups the local disk cache answered
    dsecfs_layer_chunk_misses_total{layer}     chunk lookups that went to the store
    dsecfs_layer_prefetch_bytes{layer,outcome} how well the prefetch predicted the reads, in chunk bytes:
                                               outcome read (prefetched, then read) | unread (prefetched,
                                               never read so far) | missed (read, never prefetched)
    dsecfs_layer_profile{layer,source,key}     1 for the profile a mounted layer prefetched by: source
                                               combination | layer | name, key its store prefix
    dsecfs_cache_hits_total, dsecfs_cache_misses_total, dsecfs_cache_evictions_total,
    dsecfs_cache_rotten_total, dsecfs_cache_bytes, dsecfs_cache_max_bytes, dsecfs_cache_entries,
    dsecfs_cache_frames, dsecfs_cache_bad_frames_total
                                               the local chunk cache (disk); frames: a fill's chunks
                                               kept as fetched, not read yet, and those that failed
                                               their check when first read
    dsecfs_memory_cache_hits_total, dsecfs_memory_cache_misses_total, dsecfs_memory_cache_bytes
                                               the in-memory cache of recently read chunks
    dsecfs_mounts{mode}                        layers mounted now
    dsecfs_build_info{version,python}          1; and the process's own: process_cpu_seconds_total,
                                               process_resident_memory_bytes, process_open_fds, ...
    dsecfs_prefetch_running                    prefetch lists being fetched now
    dsecfs_store_reads_running, dsecfs_store_reads_waiting{priority}
    dsecfs_store_requests_total{op}            requests the stores answered (or failed), by operation:
                                               get | put | exists | size | list | ... (every kind of call)
    dsecfs_meta_cache_hits_total, dsecfs_meta_cache_misses_total
                                               layer metadata read from the node's copies, or not there
    dsecfs_idle_mounts                         sandbox layers mounted with no sandbox using them
    dsecfs_store_serial_round_trips            with an emulated store (--latency, benchmarks): the most
                                               store round trips waited for one after another so far

The TCP page (``--metrics-address``) is another matter: anyone who reaches the port may ask for it
without pause, from METRICS_CONNECTIONS connections at once (daemon.py), and a render holds the daemon's
trio thread, the one that serves every mounted layer's FUSE reads, for milliseconds to tens of them
(the figures walk every chunk of every layer the node has served since it started, mounted or not: a
GET /metrics of a daemon with 42 layers of 33,000 chunks mounted took 7.7 ms, with 202 layers of 21,000
chunks 35 ms; figures made up for 200 layers of 5,000 chunks each, 74 ms a render). A flood from 16
connections had it rendered 422 times in 3 s. So that page is rendered at most once per
SHARED_PAGE_SECONDS and answered from that rendering meanwhile (``shared``): one render in those 3 s. The
daemon's socket (root only) renders afresh for each request.

Threads: ``render`` and ``shared`` run in the daemon's trio thread, like everything that changes the
counters, so a snapshot is consistent (and ``shared``'s rendering needs no lock).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .cache import CacheStats
from .fetch_stats import LATENCY_BUCKETS, FetchStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds a rendering of the TCP page is answered for (see the module docstring): Prometheus scrapes every 10
# to 60 s, so a page up to 5 s old is as good to it as a fresh one, and a flood of requests takes the trio
# thread for at most one render per 5 s (under 2% of it at 74 ms a render).
SHARED_PAGE_SECONDS = 5.0


@dataclass(frozen=True)
class LayerFigures:
    layer: str  # digest
    fetch: FetchStats
    data_bytes: int  # bytes of the layer's distinct chunks
    used_bytes: int  # of those, bytes served to readers since the daemon started
    reads: int
    read_errors: int
    untraced_reads: int  # of those, reads its trace left out (traced_blob.TraceBound)
    prediction: dict[str, int] | None = None  # traced_blob.LayerUsage.prediction()
    profile: tuple[str, str] | None = None  # (source, store key) of the profile its mount prefetched by


@dataclass(frozen=True)
class MemoryFigures:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int


@dataclass(frozen=True)
class NodeFigures:
    layers: list[LayerFigures]
    cache: CacheStats
    memory: MemoryFigures
    mounts: dict[str, int]  # mode -> layers mounted in it
    prefetch_running: int
    store_reads_running: int
    store_reads_waiting: dict[str, int]  # priority name -> store reads queued for a slot
    store_requests: dict[str, int]  # operation -> requests the stores answered
    meta_cache_hits: int
    meta_cache_misses: int
    idle_mounts: int
    store_serial_round_trips: int  # with an emulated store link (--latency): LatencyStore.serial_round_trips


class NodeCollector(Collector):
    """Metric families from the NodeFigures that ``figures()`` returns at each scrape."""

    def __init__(self, figures: Callable[[], NodeFigures]):
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        node = self._figures()
        yield from _layer_families(node.layers)
        yield from _cache_families(node.cache, node.memory)
        yield _by_label(GaugeMetricFamily("dsecfs_mounts", "Layers mounted now, by mode.", labels=["mode"]),
                        node.mounts)
        yield GaugeMetricFamily("dsecfs_prefetch_running", "Prefetch lists being fetched now.",
                                value=node.prefetch_running)
        yield GaugeMetricFamily("dsecfs_store_reads_running", "Store reads holding a fetcher slot.",
                                value=node.store_reads_running)
        yield _by_label(GaugeMetricFamily("dsecfs_store_reads_waiting", "Store reads queued for a fetcher slot.",
                                          labels=["priority"]), node.store_reads_waiting)
        yield _by_label(_counter("dsecfs_store_requests", "Requests the stores answered, by operation.", ["op"]),
                        node.store_requests)
        yield CounterMetricFamily("dsecfs_meta_cache_hits", "Layer metadata read from the node's copies.",
                                  value=node.meta_cache_hits)
        yield CounterMetricFamily("dsecfs_meta_cache_misses", "Layer metadata not among the node's copies.",
                                  value=node.meta_cache_misses)
        yield GaugeMetricFamily("dsecfs_idle_mounts", "Sandbox layers mounted that no sandbox uses.",
                                value=node.idle_mounts)
        yield GaugeMetricFamily("dsecfs_store_serial_round_trips",
                                "Emulated store round trips (--latency) waited for one after another, at most.",
                                value=node.store_serial_round_trips)


def _by_label(family: GaugeMetricFamily | CounterMetricFamily, values: dict[str, int]) -> Metric:
    """``family`` with one sample per label value, in order."""
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


def _counter(name: str, documentation: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, labels=labels)


def _layer_families(layers: list[LayerFigures]) -> Iterator[Metric]:
    by_layer = ["layer"]
    fetch_bytes = _counter("dsecfs_fetch_bytes", "Uncompressed bytes of chunks fetched from the store.", by_layer)
    fetch_chunks = _counter("dsecfs_fetch_chunks", "Chunks fetched from the store and verified.", by_layer)
    store_reads = _counter("dsecfs_fetch_store_reads", "Store reads (batches of neighbouring chunks).", by_layer)
    coalesced = _counter("dsecfs_fetch_coalesced", "Chunk requests that joined a fetch in the air.", by_layer)
    readahead = _counter("dsecfs_fetch_readahead_chunks", "Chunks fetched as miss readahead, not asked for.",
                         by_layer)
    errors = _counter("dsecfs_fetch_errors", "Chunks whose fetch failed, by kind.", ["layer", "kind"])
    abandoned = _counter("dsecfs_fetch_abandoned_reads", "Store reads whose thread was still in the store at "
                         "the deadline, left behind.", by_layer)
    latency = HistogramMetricFamily("dsecfs_fetch_latency_seconds",
                                    "Store read latency, waiting for a fetcher slot included.", labels=by_layer)
    ratio = GaugeMetricFamily("dsecfs_layer_fetched_ratio",
                              "Share of the layer's chunk bytes served to readers on this node so far.",
                              labels=by_layer)
    reads = _counter("dsecfs_layer_reads", "Reads served from the layer's blob.", by_layer)
    read_errors = _counter("dsecfs_layer_read_errors", "Reads of the layer that failed (EIO).", by_layer)
    untraced = _counter("dsecfs_layer_untraced_reads", "Reads of the layer its trace left out: repeats of "
                        "reads it recorded, and past its bound.", by_layer)
    hits = _counter("dsecfs_layer_chunk_hits", "Chunk lookups answered by the local disk cache.", by_layer)
    misses = _counter("dsecfs_layer_chunk_misses", "Chunk lookups that went to the store.", by_layer)
    prediction = GaugeMetricFamily("dsecfs_layer_prefetch_bytes", "How well the prefetch predicted the reads, in "
                                   "chunk bytes: read (prefetched, read), unread (prefetched, never read), "
                                   "missed (read, never prefetched).", labels=["layer", "outcome"])
    profile = GaugeMetricFamily("dsecfs_layer_profile", "1 for the access profile a mounted layer prefetched by "
                                "(source: combination, layer or name; key: its store prefix).",
                                labels=["layer", "source", "key"])
    for figures in layers:
        label, stats = [figures.layer], figures.fetch
        fetch_bytes.add_metric(label, stats.bytes_fetched)
        fetch_chunks.add_metric(label, stats.chunks_fetched)
        store_reads.add_metric(label, stats.store_reads)
        coalesced.add_metric(label, stats.coalesced)
        readahead.add_metric(label, stats.readahead)
        other = stats.errors - stats.corrupt - stats.timeouts - stats.refused
        for kind, count in (("corrupt", stats.corrupt), ("timeout", stats.timeouts), ("stuck", stats.refused),
                            ("other", other)):
            errors.add_metric([figures.layer, kind], count)
        abandoned.add_metric(label, stats.abandoned)
        latency.add_metric(label, _buckets(stats.latency_counts), stats.latency_sum)
        ratio.add_metric(label, figures.used_bytes / figures.data_bytes if figures.data_bytes else 0.0)
        reads.add_metric(label, figures.reads)
        read_errors.add_metric(label, figures.read_errors)
        untraced.add_metric(label, figures.untraced_reads)
        hits.add_metric(label, stats.hits)
        misses.add_metric(label, stats.misses)
        if figures.prediction is not None:
            for outcome, name in (("read", "prefetched_read_bytes"), ("unread", "prefetched_unread_bytes"),
                                  ("missed", "read_not_prefetched_bytes")):
                prediction.add_metric([figures.layer, outcome], figures.prediction[name])
        if figures.profile is not None:
            profile.add_metric([figures.layer, *figures.profile], 1)
    yield from (fetch_bytes, fetch_chunks, store_reads, coalesced, readahead, errors, abandoned, latency, ratio, reads,
                read_errors, untraced, hits, misses, prediction, profile)


def _buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (FetchStats) as Prometheus' cumulative ``le`` buckets."""
    cumulative, total = [], 0
    for bound, count in zip(LATENCY_BUCKETS, counts):
        total += count
        cumulative.append(("+Inf" if math.isinf(bound) else repr(bound), total))
    return cumulative


def _cache_families(cache: CacheStats, memory: MemoryFigures) -> Iterator[Metric]:
    yield CounterMetricFamily("dsecfs_cache_hits", "Chunk lookups the disk cache answered.", value=cache.hits)
    yield CounterMetricFamily("dsecfs_cache_misses", "Chunk lookups the disk cache could not answer.",
                              value=cache.misses)
    yield CounterMetricFamily("dsecfs_cache_evictions", "Chunks evicted to stay under the cache size.",
                              value=cache.evictions)
    yield CounterMetricFamily("dsecfs_cache_rotten", "Cached chunks dropped because they failed their check.",
                              value=cache.rotten)
    yield GaugeMetricFamily("dsecfs_cache_bytes", "Bytes of chunks in the disk cache.", value=cache.bytes)
    yield GaugeMetricFamily("dsecfs_cache_max_bytes", "Size bound of the disk cache.", value=cache.max_bytes)
    yield GaugeMetricFamily("dsecfs_cache_entries", "Chunks in the disk cache.", value=cache.entries)
    yield GaugeMetricFamily("dsecfs_cache_frames", "Chunks in the disk cache kept as a fill fetched them, not "
                            "read (nor checked) yet.", value=cache.frames)
    yield CounterMetricFamily("dsecfs_cache_bad_frames", "Chunks a fill kept that were not their chunk when "
                              "first read (read from the store instead).", value=cache.bad_frames)
    yield CounterMetricFamily("dsecfs_memory_cache_hits", "Chunk lookups the in-memory cache answered.",
                              value=memory.hits)
    yield CounterMetricFamily("dsecfs_memory_cache_misses", "Chunk lookups the in-memory cache could not answer.",
                              value=memory.misses)
    yield GaugeMetricFamily("dsecfs_memory_cache_bytes", "Bytes of chunks in the in-memory cache.",
                            value=memory.bytes)


class MetricsPage:
    """The text ``/metrics`` answers: one registry holding one NodeCollector, the process's own metrics
    (process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...) and
    ``dsecfs_build_info{version, python}`` (always 1)."""

    content_type = CONTENT_TYPE

    def __init__(self, figures: Callable[[], NodeFigures], *, version: str):
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(NodeCollector(figures))
        ProcessCollector(registry=self._registry)
        Info("dsecfs_build", "The dsecfs version serving.", registry=self._registry).info(
            {"version": version, "python": platform.python_version()})
        self._shared: tuple[float, bytes] | None = None  # (monotonic time, page) of the TCP page's rendering

    def render(self) -> bytes:
        return generate_latest(self._registry)

    def shared(self) -> bytes:
        """The page as rendered at most SHARED_PAGE_SECONDS ago (rendered now if it was longer ago): for the
        TCP page, which anyone reaching the port may ask for as often as they like."""
        now = time.monotonic()
        if self._shared is None or now - self._shared[0] >= SHARED_PAGE_SECONDS:
            self._shared = (now, self.render())
        return self._shared[1]
