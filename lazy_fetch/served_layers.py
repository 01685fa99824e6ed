"""What the node daemon holds for each layer it serves: the store it came from, its blob, its users.

    StoreContext  one per store URL: the store (wrapped: faults, latency, limit, retry, refs cached for a
                  short time), its ChunkIndex, its ChunkFetcher and the MemoryFrontedFetcher blobs read
                  through, the node's metadata copies (meta_cache.py), the requests the store saw and
                  the emulated link's round trips (LatencyStore), if there is one
    Layer         a layer some mount uses: its files, its blob, its store, its usage, its prefetch
    Served        the blob layer_mount serves for one layer in one mode, shared by that layer's mounts in
                  that mode, with their one trace (in segments, one per label: trace_holders.py)

Threads: plain records of the daemon's trio thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsec_fs.chunks import ChunkIndex
from dsec_fs.layer import LayerFiles
from dsec_fs.store.base import Store
from dsec_fs.store.wrappers import CountingStore, LatencyStore

from .layer_index import LayerIndex
from .blob_reader import LayerBlob
from .fetcher import ChunkFetcher
from .memory_cache import MemoryFrontedFetcher
from .meta_cache import MetaCache
from .miss_readahead import MissReadahead
from .prefetcher import PrefetchJob
from .profile_keeper import PublishedRun
from .trace_holders import Holders, Label
from .traced_blob import LayerUsage, TracedBlob


@dataclass
class StoreContext:
    url: str
    store: Store
    chunk_index: ChunkIndex
    fetcher: ChunkFetcher
    reader: MemoryFrontedFetcher
    indexed_layers: set[str] = field(default_factory=set)  # layers whose pack indexes chunk_index holds
    copies: MetaCache | None = None  # the node's copies of layer metadata (None: every open reads the store)
    requests: CountingStore | None = None  # the requests the store itself answered (below every wrapper)
    emulated: LatencyStore | None = None  # the emulated link to the store (benchmarks), if there is one

    @property
    def index_reads(self) -> Store:
        """Where pack indexes are read: the node's copies in front of the store."""
        return self.copies.pack_indexes(self.store) if self.copies else self.store


@dataclass
class Layer:
    files: LayerFiles
    blob: LayerBlob
    store: StoreContext
    usage: LayerUsage
    readahead: MissReadahead | None = None  # shared by its mounts in both modes
    files_mapped: bool = False  # the map of its readahead is being built or ready (daemon_stores.py _map_files_soon)
    # 1 for each blob-map entry the prefetch planned at its first mount brings: a read that waits for one
    # of them waits for the prefetch, not for a miss the readahead could help (daemon_stores.py _missed_in)
    planned: bytearray | None = None
    mounts: int = 0
    prefetch: PrefetchJob | None = None
    _index: LayerIndex | None = None

    def index(self) -> LayerIndex:
        """The layer's image walked once (layer_index.LayerIndex), for profile plans and publishing (the
        miss readahead reads its map from the image's records instead: miss_readahead.FileChunks.of_image);
        worker threads only (it walks the whole image the first time). Two threads that ask at once may
        both walk it: the index is a value, either one serves."""
        if self._index is None:
            self._index = LayerIndex.of_files(self.files, self.blob.blob_map)
        return self._index

    @property
    def digest(self) -> str:
        return self.files.digest


@dataclass
class Served:
    layer: Layer
    blob: TracedBlob
    trace_path: str  # the segment being written ("" between segments, or with tracing off)
    label: Label | None  # its holders' (None: no one holds it now)
    mode: str = "kernel"
    ref_name: str | None = None  # the layer's ref name as its first mount named it (for profiles)
    mounts: int = 0
    holders: Holders = field(default_factory=Holders)
    segments: list[str] = field(default_factory=list)  # the trace's segments that ended, oldest first
    run: PublishedRun = field(default_factory=PublishedRun)  # what its trace published, for the layer
    segment_run: PublishedRun = field(default_factory=PublishedRun)  # ... the segment, for its combination

    def close_trace(self, *, remove: bool = False) -> None:
        trace, self.blob.trace = self.blob.trace, None
        if trace is not None:
            trace.close()
            if remove:
                os.unlink(trace.path)


def served_key(mode: str, files: LayerFiles) -> tuple[str, str]:
    """layer_mount shares a kernel-mode blob by blob id and a fuse-mode tree by layer digest."""
    return (mode, files.manifest.blob_id if mode == "kernel" else files.digest)
