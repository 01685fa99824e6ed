"""The node daemon: layer mounts, the chunk cache and fetchers, access traces, prefetch and the HTTP API,
composed in one trio loop.

    trio.run(serve_until_signalled, NodeDaemon(DaemonOptions(socket_path=..., state_dir=..., ...)))

is what ``dsecfs daemon`` runs. The parts, one module each::

    HttpApi (http_api.py) on the unix socket, its routes (routes.py) typed by dsec_fs/api.py; /metrics (metrics.py)
      NodeDaemon (here): composition, life cycle, the signals; DaemonOptions (daemon_options.py); what it
        reports (node_status.py); its methods by concern, one mixin module each:
          daemon_stores.py: store contexts, layers opened from them, the miss readahead's file map
          daemon_mounts.py: the paths a request names, mount and unmount, adoption after a crash and
            stale mounts
          daemon_traces.py: prefetch lists and profiles, holders (``hold``, ``unhold``), flushing and
            pruning the traces
        LayerMounter (layer_mount.py): the one FUSE session; kernel-mode and fuse-mode mounts
        MountTable (mount_table.py): the live mounts and their persisted copy, state_dir/mounts.json
        request_paths.py: every path a request names, resolved in a worker thread, never on our own mounts
        per store URL, a StoreContext (served_layers.py): the store wrapped (faults, latency, limit, retry),
            its ChunkIndex, and a ChunkFetcher (single flight, priorities, deadlines) over the node's one
            ChunkCache (disk)
        MemoryChunkCache (memory_cache.py): recently read chunks, in front of every fetcher
        MetaCache (meta_cache.py): the node's copies of layer metadata by digest, in the cache directory;
            refs are read at most every ``ref_ttl`` (dsec_fs/store/ref_cache.py, outermost on each store)
        IdleMounts (idle_mounts.py): sandbox layers no sandbox uses, kept mounted for ``idle_grace``
        per served blob: a TracedBlob (traced_blob.py: each read counted and traced) and its TraceWriter
            (in segments, one per label of its holders, and the profiles learned from them: trace_segments.py)
        Prefetcher (prefetcher.py): prefetch lists fetched in the background

The daemon never waits on itself. Its trio thread serves the FUSE session (with the raw and pyfuse3
bindings), so nothing in that thread may look up a path: every path a request names is resolved in a
worker thread under a deadline and refused if it lies on one of the daemon's own mounts
(request_paths.py); the mountpoints the daemon already knows are matched by name first, with no lookup at
all. mount(2) and umount(2) run in worker threads too (layer_mount.py).

Traces. Each mount gets a trace file under ``state_dir/traces/`` (traced_blob.py, trace.py). Mounts of one
layer in one mode share the blob layer_mount serves them from, so they share the trace of the first of them,
which closes with the last. Each mount and each sandbox that holds it is a holder: while the holders' labels
(role, ref, combination) change, the trace goes on in a new segment under the new label (``hold``,
``unhold``; daemon_traces.py, trace_holders.py, trace_segments.py). Closed traces past
``trace_keep_seconds`` or beyond ``trace_keep_bytes`` in all are removed, oldest first, at start and every
TRACE_PRUNE_SECONDS.

Prefetch. A mount may name a prefetch list, read through request_paths.open_regular_file (a regular file, at
most MAX_PREFETCH_LIST_BYTES, opened O_NONBLOCK: /dev/zero and a FIFO are refused at once), checked against
the layer's blob map, and fetched in the background (prefetcher.py), starting just before mount(2). The
mount path itself makes its store round trips side by side where it can (``_open_layer``, daemon_stores.py).
A miss brings along more of its file while it is read in order, and a growing window while a reader walks
files in blob order (miss_readahead.py; ``miss_readahead_bytes``, 4 MiB; 0: off).

Persisted state and crashes. With the raw FUSE binding a daemon that dies (SIGKILL, a crash) leaves its
mounts alive: a holder process keeps the FUSE connection, and the next daemon takes it over and adopts
every complete mount the table lists (``_adopt_mounts``, daemon_mounts.py; "Daemon restarts" in docs/architecture.md).
Otherwise its mounts are left behind dead, and the next daemon on the same state directory detaches each
listed mountpoint it did not adopt that still carries one of our mounts, after layer_mount has detached
the dead FUSE session itself. The chunk cache repairs itself on open (cache.py).

Shutdown. ``shutdown()`` (SIGTERM, SIGINT) runs the stop hooks, stops the API and the prefetches, unmounts
every layer (lazily where busy), ends the FUSE session, cancels the fetches still in the air, then flushes
and closes the traces and closes the stores and the cache. ``serve_until_signalled`` installs the signal
handlers before anything is served, so libfuse2 (fusepy), which takes SIGTERM and SIGHUP when they are
left at their defaults, does not get them.

Extensions. Packages above lazy_fetch add to the daemon without it importing them (``run_daemon``'s
``extensions``, composed in cli/): routes on ``api``, and ``on_start`` / ``on_stop`` hooks. Start hooks
run once the FUSE session serves and stale mounts are detached, before the API answers; stop hooks run
(shielded, newest first) once shutdown is asked for, while the API still answers and every layer is still
mounted. overlay/node_service.py serves sandboxes this way.

Shared state. The three mixins are parts of one object: NodeDaemon.__init__ and ``run`` set every
attribute below, and the mixins read and change them as their own (a split by concern of one class, not
composed objects; making each part own its state is a larger change, left for later). Who writes, who reads:

    attribute                      set by (here)          changed by            read by
    options, state_dir, fuse_dir,  __init__               -                     all three
      trace_dir, api, memory
    stores (URL -> StoreContext)   __init__               stores (open, let go, stores; node_status
      stores_let_go                                         close)
    layers (digest -> Layer)       __init__               stores (add),         stores, mounts, traces;
                                                            mounts (release)      node_status
    usage (digest -> LayerUsage)   __init__               stores                stores; node_status
    _served ((mode, layer) ->      __init__               mounts (add, release) mounts, traces
      Served)                                               traces (clear at close)
    table (MountTable)             __init__               mounts (add, remove,  mounts, traces; mounts()
                                                            save)
    cleaned                        __init__               mounts (stale ones)   node_status
    _turns / _stores_lock          __init__               -                     mounts, traces / stores
    cache, _fetch_log, _own_dirs,  run                    -                     stores, mounts, traces
      meta_copies, profiles
    segments (TraceSegments)       run                    mounts, traces        mounts, traces
    _mounter (LayerMounter)        run (open_mounter)     mounts (at adoption)  mounts
    _flights / prefetcher          run                    -                     stores / traces
    _background (nursery)          run (None at stop)     -                     stores, traces

Methods they call across: mounts calls stores' ``_store_context``, ``_open_layer``, ``_add_layer``,
``_open_blob``, ``_missed_in``, ``_map_files_at_mount``, and traces' ``_start_prefetch``; traces calls
mounts' ``_known_mountpoint`` and ``_read_prefetch_list``; ``run`` calls the start and stop steps of each
(mounts: ``_adopt_mounts``, ``_clean_stale_mounts``, ``_unmount_all``; traces: ``_prune_traces``,
``_flush_traces_now_and_then``, ``_publish_the_rest``, ``_close_traces``, ``_cache_room``; stores:
``_close_stores``). node_status.py reads ``stores``, ``usage``, ``layers`` and ``cleaned`` for status.

Threads: everything here and in the three mixin modules runs in the daemon's trio thread, so the tables
and the traces need no lock; blocking work (opening layers and stores, resolving paths, mount(2), cache
eviction) runs in worker threads through trio.to_thread. ``_turns`` (turns.py) makes the calls on one
mountpoint, and those on one blob, take turns, while mounts of different layers run at once
(daemon_mounts.py); a layer is opened from its store before taking them, so a slow store holds up no
other mount. ``_stores_lock`` (a trio.Lock) makes a store URL opened once (``stores``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import trio

from dsec_fs import api
from dsec_fs.errors import InputError
from dsec_fs.files import private_dir
from dsec_fs.layer import utc_now

from . import node_status, routes
from .cache import ChunkCache
from .daemon_mounts import DaemonMounts, mount_info
from .daemon_options import DaemonOptions
from .daemon_stores import DaemonStores
from .daemon_traces import DaemonTraces
from .http_api import HttpApi, raise_fd_limit
from .idle_mounts import IdleMounts
from .layer_mount import LayerMounter, open_mounter
from .memory_cache import MemoryChunkCache
from .meta_cache import MetaCache
from .metrics import MetricsPage, NodeFigures
from .mount_table import MountTable
from .prefetcher import Prefetcher
from .profile_keeper import ProfileKeeper
from .served_layers import Layer, Served, StoreContext
from .trace_segments import TraceSegments
from .traced_blob import LayerUsage, StoreFetchLog
from .turns import Turns

log = logging.getLogger(__name__)

TRACE_DIR = "traces"
# Connections of the TCP metrics page at once: a scraper needs one or two, and anyone who reaches the port
# (another local user) may open them; each is a descriptor the mounts' reads need (with 512, the default of
# the API's socket, they took them all and every read failed).
METRICS_CONNECTIONS = 16


class NodeDaemon(DaemonStores, DaemonMounts, DaemonTraces):
    """See the module docstring. ``api`` may be given more routes before ``run`` starts serving."""

    def __init__(self, options: DaemonOptions, api: HttpApi | None = None):
        options.check()
        self.options = options
        self.state_dir = os.path.abspath(options.state_dir)
        self.fuse_dir = os.path.join(self.state_dir, "fuse")  # where layer_mount mounts the session
        self.trace_dir = os.path.join(self.state_dir, TRACE_DIR)
        self.api = api or HttpApi()
        self.memory = MemoryChunkCache(options.memory_cache_bytes)
        self.metrics = MetricsPage(self.figures, version=node_status.version())
        self.cleaned: list[str] = []  # stale mountpoints detached at start
        self.table = MountTable(self.state_dir)
        self._stop = trio.Event()
        self._turns = Turns()  # see "Threads" above
        self._stores_lock = trio.Lock()
        self.stores: dict[str, StoreContext] = {}
        self.stores_let_go = node_status.LetGoFigures()  # what the stores let go of had counted
        self.layers: dict[str, Layer] = {}
        self.usage: dict[str, LayerUsage] = {}
        self._served: dict[tuple[str, str], Served] = {}
        self.started = utc_now()
        self.cache: ChunkCache | None = None
        self._own_dirs: tuple[str, ...] = ()  # the state and cache directories, resolved: no mount may hide them
        self._fetch_log: StoreFetchLog | None = None
        self._mounter: LayerMounter | None = None
        self._flights: trio.Nursery | None = None
        self.prefetcher: Prefetcher | None = None
        self._background: trio.Nursery | None = None  # profile publishing; None once the daemon stops
        self.profiles: ProfileKeeper | None = None
        self.meta_copies: MetaCache | None = None  # the node's copies of layer metadata (meta_cache.py)
        self.idle = IdleMounts(options.idle_grace)  # sandbox layers no one uses, for a while (idle_mounts.py)
        self.on_start: list[Callable[[], Awaitable[None]]] = []  # see "Extensions" in the module docstring
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        routes.register(self.api, self)

    # -- life cycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``shutdown()``; reports started once the API answers. On the way out (in this
        order): the API and the prefetches stop, every layer is unmounted, the FUSE session ends, fetches
        still in the air are cancelled, traces are closed, then the stores and the cache."""
        options = self.options
        # Connections may take a quarter of the descriptors: mounts, the cache and store reads need the rest.
        self.api.max_connections = min(self.api.max_connections, max(8, raise_fd_limit() // 4))
        private_dir(self.state_dir)  # before anything below it, or makedirs would make it with the umask's mode
        private_dir(self.trace_dir)
        if options.profiles:
            self.profiles = ProfileKeeper(self.state_dir)
        self.segments = TraceSegments(self.trace_dir, enabled=options.trace, profiles=self.profiles,
                                      background=lambda: self._background)
        async with contextlib.AsyncExitStack() as stack:
            self.cache = stack.enter_context(ChunkCache(options.cache_dir, options.cache_bytes))
            self._fetch_log = StoreFetchLog()
            self._own_dirs = (os.path.realpath(self.state_dir), os.path.realpath(self.cache.directory))
            if options.meta_cache_bytes:
                self.meta_copies = MetaCache(os.path.join(self.cache.directory, "meta"), options.meta_cache_bytes)
            stack.callback(self._close_stores)
            stack.callback(self._close_traces)
            self._flights = await stack.enter_async_context(_nursery_cancelled_on_exit())
            self._mounter = await stack.enter_async_context(open_mounter(
                self.state_dir, binding=options.fuse_binding, adopt=self._adopt_mounts,
                read_ahead=options.read_ahead_bytes))
            if self.profiles is not None:  # runs after the unmounts below, so their profiles go out too
                stack.push_async_callback(self._publish_the_rest)
            stack.push_async_callback(self._unmount_all)
            await self._clean_stale_mounts()
            await self._prune_traces()
            async with _nursery_cancelled_on_exit() as nursery:
                self.prefetcher = Prefetcher(self.memory, self._fetch_log, nursery, self._cache_room)
                self._background = nursery
                for hook in self.on_start:
                    await hook()
                await nursery.start(self.api.serve, options.socket_path)
                if options.metrics_address:  # the metrics page alone, on TCP, for Prometheus
                    metrics_only = HttpApi(max_connections=METRICS_CONNECTIONS)
                    routes.register_metrics(metrics_only, self, shared=True)
                    await nursery.start(metrics_only.serve_tcp, options.metrics_address)
                    log.info("metrics on http://%s/metrics", options.metrics_address)
                nursery.start_soon(self._flush_traces_now_and_then)
                nursery.start_soon(self.idle.run)
                log.info("dsecfs daemon %d serving on %s (state %s, cache %s, FUSE %s)", os.getpid(),
                         options.socket_path, self.state_dir, self.cache.directory, options.fuse_binding)
                task_status.started()
                try:
                    await self._stop.wait()
                finally:
                    log.info("shutting down")
                    # Profiles of what unmounts from here on are published at the flush (the nursery is
                    # about to be cancelled: a publish started in it now would be lost).
                    self._background = None
                    if self.profiles is not None:  # a publish under way gets a deadline, then is given up
                        self.profiles.stop()
                    with trio.CancelScope(shield=True):
                        for hook in reversed(self.on_stop):
                            await hook()
                        await self.idle.unmount_all()
        log.info("stopped")

    def shutdown(self) -> None:
        """Ask ``run`` to stop (unmounting everything); safe to call from the trio thread at any time."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- status, cache, metrics (node_status.py)

    def mounts(self) -> list[api.MountInfo]:
        return [mount_info(mount, idle_until=self.idle.until(mount.mountpoint)) for mount in self.table.mounts.values()]

    def cache_status(self, *, evicted: int = 0) -> api.CacheInfo:
        return node_status.cache_info(self, evicted=evicted)

    async def evict(self, to_bytes: int) -> api.CacheInfo:
        """Evict the disk cache (least recently used first) and the memory cache down to ``to_bytes``."""
        if to_bytes < 0:
            raise InputError(f"cannot evict to a negative size ({to_bytes})", where="cache evict")
        evicted = await trio.to_thread.run_sync(self.cache.evict_to, to_bytes)
        self.memory.shrink_to(to_bytes)
        log.info("evicted %d chunks from the cache (down to %d bytes)", evicted, to_bytes)
        return self.cache_status(evicted=evicted)

    def figures(self) -> NodeFigures:
        return node_status.figures(self)

    def status(self) -> api.NodeStatus:
        return node_status.status(self)


@contextlib.asynccontextmanager
async def _nursery_cancelled_on_exit() -> AsyncIterator[trio.Nursery]:
    """A nursery for background tasks that run until the block is left."""
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        finally:
            nursery.cancel_scope.cancel()


async def serve_until_signalled(daemon: NodeDaemon, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``daemon`` until SIGTERM or SIGINT, then shut it down cleanly. The handlers are installed
    before anything is served; SIGHUP is taken too, and ignored, so libfuse2 cannot end the session."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, signals, daemon)
            await daemon.run(task_status=task_status)
            nursery.cancel_scope.cancel()


async def _watch_signals(signals, daemon: NodeDaemon) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log.info("ignoring %s", name)
        elif daemon.stopping:
            log.info("%s: already shutting down", name)
        else:
            log.info("%s: shutting down", name)
            daemon.shutdown()


def run_daemon(options: DaemonOptions, *, extensions: Iterable[Callable[[NodeDaemon], object]] = ()) -> None:
    """Run a daemon in this process until signalled (``dsecfs daemon``). Each of ``extensions`` is called
    with the NodeDaemon before it starts, to add routes and hooks. An error that stops it comes out as
    itself, not inside the exception groups of the nurseries it passed through."""
    daemon = NodeDaemon(options)
    for extend in extensions:
        extend(daemon)
    try:
        trio.run(serve_until_signalled, daemon)
    except BaseExceptionGroup as group:
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        raise error from None
