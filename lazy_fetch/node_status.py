"""What the node daemon reports, from its tables: ``status`` (the API's /v1/status, dsec_fs/api.py's
types) and ``figures`` (what metrics.py renders on /metrics).

Threads: the daemon's trio thread, which owns every table read here; the fetchers' counters are read as
they are (FetchStats: plain integers the trio thread updates).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict
from importlib import metadata
from typing import TYPE_CHECKING

from dsec_fs import api
from dsec_fs.api import MODES
from dsec_fs.store import default_store_url

from .fetch_stats import FetchStats
from .fetcher import Priority
from .metrics import LayerFigures, NodeFigures

if TYPE_CHECKING:
    from .daemon import NodeDaemon
    from .served_layers import StoreContext

SUMMED = ("hits", "misses", "coalesced", "chunks_fetched", "bytes_fetched", "store_reads", "errors", "corrupt",
          "timeouts", "abandoned", "refused", "readahead", "latency_sum")


class LetGoFigures:
    """What the store contexts the daemon let go of had counted (daemon_stores.py), so that its figures,
    summed over the stores, never go back."""

    def __init__(self) -> None:
        self.fetch: dict[str, FetchStats] = {}
        self.requests: Counter[str] = Counter()

    def add(self, context: StoreContext) -> None:
        for label, stats in context.fetcher.all_stats().items():
            self.fetch[label] = _add(self.fetch.get(label), stats)
        if context.requests is not None:
            self.requests.update(context.requests.snapshot()["calls"])


def fetch_stats(stores: dict[str, StoreContext], let_go: LetGoFigures) -> dict[str, FetchStats]:
    """FetchStats by layer, summed over the stores' fetchers (a layer read through two stores) and what
    the stores let go of had counted."""
    merged = dict(let_go.fetch)
    for context in stores.values():
        for label, stats in context.fetcher.all_stats().items():
            merged[label] = _add(merged.get(label), stats)
    return merged


def _add(total: FetchStats | None, stats: FetchStats) -> FetchStats:
    if total is None:
        return stats
    summed = FetchStats(stats.label)
    for name in SUMMED:
        setattr(summed, name, getattr(total, name) + getattr(stats, name))
    summed.latency_counts = [a + b for a, b in zip(total.latency_counts, stats.latency_counts)]
    return summed


def cache_info(daemon: NodeDaemon, *, evicted: int = 0) -> api.CacheInfo:
    stats = asdict(daemon.cache.stats())
    memory = asdict(daemon.memory.figures())
    return api.CacheInfo(directory=daemon.cache.directory, evicted=evicted, **stats,
                         **{f"memory_{k}": v for k, v in memory.items()})


def figures(daemon: NodeDaemon) -> NodeFigures:
    fetch = fetch_stats(daemon.stores, daemon.stores_let_go)
    profiles = {m.layer: (m.prefetch.removeprefix("profile:").split("+")[0], m.profile_key)
                for m in daemon.table.mounts.values() if m.profile_key}
    layers = []
    for digest in sorted(set(fetch) | set(daemon.usage)):
        usage = daemon.usage.get(digest)
        layers.append(LayerFigures(
            layer=digest, fetch=fetch.get(digest) or FetchStats(digest),
            data_bytes=usage.data_bytes if usage else 0, used_bytes=usage.used_bytes if usage else 0,
            reads=usage.reads if usage else 0, read_errors=usage.read_errors if usage else 0,
            untraced_reads=usage.untraced if usage else 0,
            prediction=usage.prediction() if usage else None, profile=profiles.get(digest)))
    fetchers = [context.fetcher for context in daemon.stores.values()]
    mounts = daemon.table.mounts.values()
    copies = daemon.meta_copies
    return NodeFigures(
        layers=layers, cache=daemon.cache.stats(), memory=daemon.memory.figures(),
        mounts={mode: sum(m.mode == mode for m in mounts) for mode in MODES},
        prefetch_running=daemon.prefetcher.running if daemon.prefetcher else 0,
        store_reads_running=sum(f.store_reads_running for f in fetchers),
        store_reads_waiting={p.name.lower(): sum(f.waiting(p) for f in fetchers) for p in Priority},
        store_requests=store_requests(daemon.stores, daemon.stores_let_go), meta_cache_hits=copies.hits if copies else 0,
        meta_cache_misses=copies.misses if copies else 0, idle_mounts=len(daemon.idle),
        store_serial_round_trips=max((c.emulated.serial_round_trips for c in daemon.stores.values() if c.emulated),
                                     default=0))


def store_requests(stores: dict[str, StoreContext], let_go: LetGoFigures) -> dict[str, int]:
    """Operation -> requests the stores answered, summed over the stores (those let go of too)."""
    total = Counter(let_go.requests)
    for context in stores.values():
        if context.requests is not None:
            total.update(context.requests.snapshot()["calls"])
    return dict(total)


def status(daemon: NodeDaemon) -> api.NodeStatus:
    fetch = fetch_stats(daemon.stores, daemon.stores_let_go)
    mounts = daemon.table.mounts.values()
    layers = []
    for digest, usage in sorted(daemon.usage.items()):
        stats = fetch.get(digest) or FetchStats(digest)
        layers.append(api.LayerStatus(
            layer=digest, mounts=sum(m.layer == digest for m in mounts),
            data_bytes=usage.data_bytes, used_bytes=usage.used_bytes,
            fetched_ratio=usage.used_bytes / usage.data_bytes if usage.data_bytes else 0.0,
            reads=usage.reads, read_errors=usage.read_errors,
            chunks_fetched=stats.chunks_fetched, bytes_fetched=stats.bytes_fetched,
            cache_hits=stats.hits, cache_misses=stats.misses, fetch_errors=stats.errors,
            corrupt=stats.corrupt, timeouts=stats.timeouts, abandoned=stats.abandoned, refused=stats.refused,
            **usage.prediction(), miss_readahead=_readahead_state(daemon, digest)))
    options = daemon.options
    return api.NodeStatus(
        pid=os.getpid(), version=version(), started=daemon.started, socket=options.socket_path,
        state_dir=daemon.state_dir, cache_dir=daemon.cache.directory,
        store=options.store_url or default_store_url(), fuse_binding=options.fuse_binding,
        mounts=daemon.mounts(), layers=layers, prefetches=daemon.prefetches(), cache=cache_info(daemon),
        cleaned=list(daemon.cleaned), connections=daemon.api.connections)


def _readahead_state(daemon: NodeDaemon, digest: str) -> str:
    layer = daemon.layers.get(digest)
    if layer is None or layer.readahead is None:
        return ""
    if layer.readahead.files is not None:
        return "ready"
    if layer.readahead.unmapped:
        return "refused"
    return "pending" if layer.files_mapped else "deferred"


def version() -> str:
    try:
        return metadata.version("dsecfs")
    except metadata.PackageNotFoundError:
        return "unknown"
