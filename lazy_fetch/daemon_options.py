"""The node daemon's options (``dsecfs daemon``'s flags, cli/daemon_cmds.py), checked once.

Threads: a value, made before the daemon starts and never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec_fs.api import BINDINGS, DEFAULT_FILL, FILLS
from dsec_fs.client import DEFAULT_CACHE_DIR, DEFAULT_SOCKET, DEFAULT_STATE_DIR
from dsec_fs.errors import InputError

from .fetcher import DEFAULT_MAX_CONCURRENT, DEFAULT_TIMEOUT
from .idle_mounts import DEFAULT_IDLE_GRACE
from .layer_mount import DEFAULT_READ_AHEAD
from .memory_cache import DEFAULT_MEMORY_CACHE_BYTES
from .meta_cache import DEFAULT_META_CACHE_BYTES
from .miss_readahead import DEFAULT_WINDOW

DEFAULT_CACHE_BYTES = 10 << 30
# Store calls at once (fetches, index loads, layer opens), per store: twice the fetcher's own bound, so the
# opens of an up find room beside a full fetcher, and a new node's up of two layers (its meta.erofs, blob
# maps, profiles, pack indexes and pack checks: about 25 small requests side by side) is one round trip.
DEFAULT_STORE_CONCURRENCY = 32
DEFAULT_TRACE_KEEP_BYTES = 1 << 30
DEFAULT_TRACE_KEEP_SECONDS = 7 * 86400.0
DEFAULT_REF_TTL = 15.0
DEFAULT_PROFILE_PUBLISH_SECONDS = 600.0


@dataclass
class DaemonOptions:
    socket_path: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR
    cache_dir: str = DEFAULT_CACHE_DIR
    cache_bytes: int = DEFAULT_CACHE_BYTES
    store_url: str | None = None  # store of mounts that name none; None: $DSECFS_STORE, else the default
    fuse_binding: str = "raw"
    latency: float | None = None  # seconds added to every store request (benchmarks)
    bandwidth: float | None = None  # bytes per second of the emulated link to the store (benchmarks)
    faults: str | None = None  # FaultStore rules; None: $DSECFS_FAULTS
    fetch_timeout: float = DEFAULT_TIMEOUT
    fetch_concurrency: int = DEFAULT_MAX_CONCURRENT
    store_concurrency: int = DEFAULT_STORE_CONCURRENCY
    memory_cache_bytes: int = DEFAULT_MEMORY_CACHE_BYTES
    # The window a miss brings along while a reader walks files in blob order (miss_readahead.py), beside
    # the rest of the file it reads; 0: no readahead at all.
    miss_readahead_bytes: int = DEFAULT_WINDOW
    read_ahead_bytes: int = DEFAULT_READ_AHEAD  # the kernel's readahead in a layer's files (layer_mount.py)
    trace: bool = True
    metrics_address: str | None = None  # HOST:PORT to serve /metrics alone on over TCP; None: off
    profiles: bool = True  # learn access profiles from traces, share them through the store, prefetch by them
    # A live mount's profile is also published this often, from its trace so far (0: only when it ends).
    profile_publish_seconds: float = DEFAULT_PROFILE_PUBLISH_SECONDS
    fill: str = DEFAULT_FILL  # what a new mount fetches in the background (FILLS); a mount may say otherwise
    trace_keep_bytes: int | None = DEFAULT_TRACE_KEEP_BYTES  # closed traces beyond this go, oldest first
    trace_keep_seconds: float | None = DEFAULT_TRACE_KEEP_SECONDS  # closed traces older than this go
    # A repeat sandbox up (docs/architecture.md, "Repeat starts"): refs read from the store are used for
    # this long (dsec_fs/store/ref_cache.py; 0: always read); layer metadata is kept in the cache directory
    # up to this size (meta_cache.py; 0: not kept); a sandbox layer no one uses stays mounted this long
    # (idle_mounts.py; 0: unmounted at once).
    ref_ttl: float = DEFAULT_REF_TTL
    meta_cache_bytes: int = DEFAULT_META_CACHE_BYTES
    idle_grace: float = DEFAULT_IDLE_GRACE

    def check(self) -> None:
        if self.fuse_binding not in BINDINGS:
            raise InputError(f"unknown FUSE binding {self.fuse_binding!r} (one of {', '.join(BINDINGS)})",
                             where="daemon options")
        for name in ("cache_bytes", "fetch_timeout", "fetch_concurrency", "store_concurrency"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be positive, got {getattr(self, name)}", where="daemon options")
        for name in ("miss_readahead_bytes", "read_ahead_bytes", "ref_ttl", "meta_cache_bytes", "idle_grace",
                     "profile_publish_seconds"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must not be negative, got {getattr(self, name)}", where="daemon options")
        for name in ("trace_keep_bytes", "trace_keep_seconds"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InputError(f"{name} must not be negative, got {getattr(self, name)}", where="daemon options")
        if self.fill not in FILLS:
            raise InputError(f"unknown fill policy {self.fill!r} (one of {', '.join(FILLS)})", where="daemon options")
        if self.memory_cache_bytes < 0:
            raise InputError("memory_cache_bytes must not be negative", where="daemon options")
