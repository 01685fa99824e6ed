"""The node daemon: layer mounts, the chunk cache and fetchers, access traces, prefetch and the HTTP API,
composed in one trio loop.

    trio.run(serve_until_signalled, NodeDaemon(DaemonOptions(socket_path=..., state_dir=..., ...)))

is what ``dsecfs daemon`` runs. The parts, one module each::

    HttpApi (http_api.py) on the unix socket, its routes (routes.py) typed by dsec_fs/api.py; /metrics (metrics.py)
      NodeDaemon (here): composition, mount and unmount, adoption after a crash; DaemonOptions
        (daemon_options.py); what it reports (node_status.py)
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
layer in one mode share the blob layer_mount serves them from, so they share the trace of the first of
them, which closes with the last. Each mount and each sandbox that holds it is a holder: while the
holders' labels (role, ref, combination) change, the trace goes on in a new segment under the new label
(``hold``, ``unhold``; trace_holders.py, trace_segments.py). Closed traces past ``trace_keep_seconds`` or beyond
``trace_keep_bytes`` in all are removed, oldest first, at start and every TRACE_PRUNE_SECONDS.

Prefetch. A mount may name a prefetch list, read through request_paths.open_regular_file (a regular
file, at most MAX_PREFETCH_LIST_BYTES, opened O_NONBLOCK: /dev/zero and a FIFO are refused at once),
checked against the layer's blob map, and fetched in the background (prefetcher.py), starting just
before mount(2). The mount path itself makes its store round trips side by side where it can
(``_open_layer``). A miss brings along more of its file while it is read in order, and a growing window
while a reader walks files in blob order (miss_readahead.py; ``miss_readahead_bytes``, 4 MiB; 0: off).

Persisted state and crashes. With the raw FUSE binding a daemon that dies (SIGKILL, a crash) leaves its
mounts alive: a holder process keeps the FUSE connection, and the next daemon takes it over and adopts
every complete mount the table lists (``_adopt_mounts``; "Daemon restarts" in docs/architecture.md).
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

Threads: everything here runs in the daemon's trio thread, so the tables and the traces need no lock;
blocking work (opening layers and stores, resolving paths, mount(2), cache eviction) runs in worker
threads through trio.to_thread. ``_lock`` (a trio.Lock) makes mount and unmount calls take turns over the
tables; a layer is opened from its store before taking it, so a slow store holds up no other mount.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import trio

from dsec_fs import api
from dsec_fs.api import FILLS, MODES
from dsec_fs.chunks import ChunkIndex, check_packs_present
from dsec_fs.digest import is_hex_digest
from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError, UnavailableError
from dsec_fs.files import private_dir
from dsec_fs.layer import LayerFiles, Manifest, open_layer, parse_ref, resolve, utc_now
from dsec_fs.mounts import is_below, top_mount, umount
from dsec_fs.store import default_store_url, keys, open_store
from dsec_fs.store.base import Store
from dsec_fs.store.ref_cache import RefCacheStore
from dsec_fs.store.wrappers import CountingStore, LatencyStore, StoreWrapper, find_wrapper, wrap_store

from . import node_status, request_paths, routes
from .blob_reader import LayerBlob, open_layer_blob
from .cache import ChunkCache
from .fetcher import ROUND_TRIP_READ_BYTES, ChunkFetcher
from .http_api import HttpApi, raise_fd_limit
from .idle_mounts import IdleMounts
from .layer_mount import LayerMounter, open_mounter
from .memory_cache import MemoryChunkCache, MemoryFrontedFetcher
from .meta_cache import MetaCache
from .metrics import MetricsPage, NodeFigures
from .mount_table import Mount, MountTable, is_ours
from .miss_readahead import FileChunks, MissReadahead
from .daemon_options import DaemonOptions
from .prefetch_list import PrefetchEntry, PrefetchList
from .prefetcher import (AUTO_FILL_MIN_ROUND_TRIP, AUTO_FILL_PATIENCE, AUTO_FILL_SAMPLES, PrefetchJob, Prefetcher,
                         fill_entries)
from .profile_keeper import FoundProfile, ProfileKeeper
from .served_layers import Layer, Served, StoreContext, served_key
from .trace import prune_traces
from .trace_holders import Holder, Label
from .trace_segments import TraceSegments
from .traced_blob import LayerUsage, StoreFetchLog, TracedBlob

log = logging.getLogger(__name__)

FAULTS_ENV = "DSECFS_FAULTS"  # FaultStore rules for every store the daemon opens (tests)
TRACE_DIR = "traces"
TRACE_FLUSH_SECONDS = 5.0  # so a live trace can be read while its mount lives
TRACE_PRUNE_SECONDS = 600.0  # how often old traces are pruned (and once at start)
MAX_PREFETCH_LIST_BYTES = 64 << 20  # about 400,000 entries: 400 GB of 1 MiB chunks
FILL_CACHE_SHARE = 0.9  # a prefetch stops before the disk cache would hold more than this share of its bound


class NodeDaemon:
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
        self._lock = trio.Lock()
        self._stores_lock = trio.Lock()
        self.stores: dict[str, StoreContext] = {}
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
                    metrics_only = HttpApi()
                    routes.register_metrics(metrics_only, self)
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

    # -- stores and layers

    async def store(self, url: str | None = None) -> Store:
        """The store at ``url`` (default: the daemon's), opened and wrapped as mounts read it."""
        return (await self._store_context(url)).store

    async def _store_context(self, url: str | None) -> StoreContext:
        url = url or self.options.store_url or default_store_url()
        async with self._stores_lock:
            context = self.stores.get(url)
            if context is None:
                options = self.options
                backend = await trio.to_thread.run_sync(open_store, url)
                requests = CountingStore(backend)  # what the store itself saw (metrics)
                faults = options.faults if options.faults is not None else os.environ.get(FAULTS_ENV)
                store = wrap_store(requests, retry=True, max_concurrent=options.store_concurrency,
                                   stuck_after=options.fetch_timeout, latency=options.latency,
                                   bandwidth=options.bandwidth, faults=faults or None)
                if options.ref_ttl:
                    store = RefCacheStore(store, options.ref_ttl)
                fetcher = ChunkFetcher(store, self.cache, self._flights, max_concurrent=options.fetch_concurrency,
                                       timeout=options.fetch_timeout, on_fetched=self._fetch_log.note)
                context = StoreContext(url, store, ChunkIndex(), fetcher,
                                       MemoryFrontedFetcher(fetcher, self.memory, self._flights),
                                       copies=self.meta_copies, requests=requests,
                                       emulated=find_wrapper(store, LatencyStore))
                self.stores[url] = context
                log.info("opened store %s%s", backend.url, f" with faults {faults!r}" if faults else "")
        return context

    def ref_moved(self, store_url: str, ref: str) -> None:
        """This node just pointed ``ref`` elsewhere in ``store_url`` through a store of its own (a sandbox
        commit): the ref cache of the daemon's store context for that URL forgets it."""
        name, tag = parse_ref(ref)
        for url, context in self.stores.items():
            if api.absolute_store(url) == api.absolute_store(store_url) and isinstance(context.store, RefCacheStore):
                context.store.forget(keys.ref(name, tag))

    async def _open_layer(self, store: StoreContext, ref: str, *, profile_of: str | None = None,
                          want_profile: bool = False, combination: str = "",
                          check_packs: bool = False) -> tuple[LayerFiles, FoundProfile | None]:
        """open_layer, and with it: the pack indexes of a layer this store context has not indexed yet;
        with ``check_packs``, that every pack the manifest lists is in the store (NotFoundError if not);
        with ``want_profile``, its access profile (profile_keeper.py; ``profile_of``: its ref name;
        ``combination``: the stack it is mounted for). What needs only the digest starts as soon as the
        ref is read, what needs the manifest as soon as it is, so a new node waits for three store round
        trips in a row: the ref; the manifest beside the profile listings; then meta.erofs, the blob map,
        the pack indexes and packs and the profile objects, side by side (open_layer_blob then finds every
        chunk located and loads nothing)."""
        indexed = frozenset(store.indexed_layers)
        keeper = self.profiles if want_profile else None
        reads = _LayerObjectTimer(store.store, store.fetcher.note_round_trip)

        def on_manifest(manifest: Manifest) -> None:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="check-packs") as pool:
                present = pool.submit(check_packs_present, store.store, manifest.packs,
                                      where=f"layer {manifest.layer}") if check_packs else None
                if manifest.layer not in indexed:
                    store.chunk_index.load_packs(store.index_reads, manifest.packs)
                if present is not None:
                    present.result()

        def open_with_profile() -> tuple[LayerFiles, FoundProfile | None]:
            digest = resolve(reads, ref)
            if keeper is None:
                return open_layer(reads, digest, on_manifest=on_manifest, reads=store.copies), None
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="profile-lookup") as pool:
                lookup = pool.submit(keeper.lookup, store.store, digest, profile_of, combination)
                files = open_layer(reads, digest, on_manifest=on_manifest, reads=store.copies)
                return files, lookup.result()

        # Within the fetcher's deadline and its bounds on stuck threads (fetcher.call_store).
        files, found = await store.fetcher.call_store(f"layer {ref} in {store.url}", open_with_profile)
        store.indexed_layers.add(files.digest)
        return files, found

    async def _open_blob(self, files: LayerFiles, store: StoreContext) -> LayerBlob:
        return await open_layer_blob(files, store.reader, chunk_index=store.chunk_index, label=files.digest)

    def _add_layer(self, files: LayerFiles, store: StoreContext, blob: LayerBlob) -> Layer:
        usage = self.usage.get(files.digest) or self.usage.setdefault(files.digest, LayerUsage(blob))
        layer = self.layers[files.digest] = Layer(files, blob, store, usage)
        if self.options.miss_readahead_bytes and self._background is not None:
            layer.readahead = MissReadahead(blob, self.options.miss_readahead_bytes)
            if all(self.cache.lacks(digest) for _blkaddr, digest, _length in blob.blob_map.entries):
                self._map_files_soon(layer)  # nothing of it on this node: its first reads miss
        return layer

    def _map_files_soon(self, layer: Layer) -> None:
        """Start building the map of the layer's miss readahead, unless it is under way or built: at its
        mount when the node holds none of its chunks, else at its first read that waits for the store
        (TracedBlob's ``on_miss``). Walking the image was the biggest piece of a warm start's own work
        (0.6 s of CPU for the numpy toolkit and its base, sampled, contending for the GIL with up and
        with the trio thread serving the command's reads), and on a node that holds every chunk a start
        reads it is never needed."""
        if layer.readahead is None or layer.files_mapped or self._background is None:
            return
        layer.files_mapped = True
        self._background.start_soon(self._map_files, layer)

    async def _map_files(self, layer: Layer) -> None:
        """Which chunks belong to which file, for the layer's miss readahead (a worker thread: it walks
        the image); reads before it is done bring nothing along."""
        try:
            files = await trio.to_thread.run_sync(lambda: FileChunks.of(layer.index()))
        except DsecError as exc:
            log.warning("no miss readahead for layer %s: %s", layer.digest[:12], exc)
            return
        layer.readahead.ready(files)

    # -- paths a request names

    async def _directory(self, path: str) -> str:
        """The real path of the directory ``path`` names, resolved in a worker thread, never on our mounts."""
        return await request_paths.run_in_worker(request_paths.resolve_directory, path, self.fuse_dir, where=path)

    async def _read_prefetch_list(self, path: str) -> tuple[str, PrefetchList]:
        path = request_paths.lexical(path, "prefetch list")
        data = await request_paths.run_in_worker(request_paths.open_regular_file, path, self.fuse_dir,
                                                 MAX_PREFETCH_LIST_BYTES, "prefetch list", where=path)
        return path, await trio.to_thread.run_sync(functools.partial(PrefetchList.from_json, data, source=path))

    async def _known_mountpoint(self, path: str) -> str:
        """The mountpoint of ours ``path`` names: by name if it is one as given, else once resolved."""
        path = request_paths.lexical(path, "mountpoint")
        if path in self.table.mounts:
            return path
        if is_below(path, self.fuse_dir):
            raise InputError("this is the daemon's own FUSE session, not a layer mounted by a request; stop "
                             "the daemon to unmount it", where=path)
        real = await request_paths.run_in_worker(os.path.realpath, path, where=path)  # a symlink to one of ours
        if real in self.table.mounts:
            return real
        return await self._directory(path)

    # -- mounts

    async def mount(self, ref: str, mountpoint: str, *, mode: str = "kernel", store_url: str | None = None,
                    prefetch: str | None = None, fuse_binding: str | None = None, profile: bool = True,
                    name: str | None = None, fill: str | None = None, holder: Holder | None = None,
                    check_packs: bool = False) -> api.MountInfo:
        """Mount layer ``ref`` (a ref or a digest, from ``store_url`` or the default store) at the
        directory ``mountpoint``; with ``prefetch`` (a prefetch list file) fetch that list in the
        background, else (unless ``profile`` is False) the layer's access profile from the store. ``name``:
        the layer's ref name when ``ref`` is a digest (for profiles); ``fill``: one of FILLS (default: the
        daemon's); ``holder``: who the mount is for (a sandbox's role, ref and combination; default a bare
        mount of its ref); ``check_packs``: refuse (NotFoundError) a layer whose packs are not all in the store.
        Returns the mount's description."""
        fill = fill or self.options.fill
        if fill not in FILLS:
            raise InputError(f"unknown fill policy {fill!r} (one of {', '.join(FILLS)})", where=mountpoint)
        if mode not in MODES:
            raise InputError(f"unknown mount mode {mode!r} (one of {', '.join(MODES)})", where=mountpoint)
        if fuse_binding and fuse_binding != self.options.fuse_binding:
            raise ConflictError(f"this daemon serves FUSE with {self.options.fuse_binding}, not {fuse_binding}; "
                                "restart it with --fuse-binding to change", where=mountpoint)
        if request_paths.lexical(mountpoint, "mountpoint") in self.table.mounts:
            raise ConflictError("a layer is already mounted here", where=mountpoint)
        mountpoint = await self._directory(mountpoint)
        if any(is_below(own, mountpoint) for own in self._own_dirs):
            raise InputError("a layer mounted here would hide the daemon's own state or cache directory",
                             where=mountpoint)
        plist = None
        if prefetch:
            prefetch, plist = await self._read_prefetch_list(prefetch)
        ref_name = name or (None if is_hex_digest(ref.lower()) else parse_ref(ref)[0])
        holder = holder or Holder(ref=ref_name or "" if is_hex_digest(ref.lower()) else ref)
        store = await self._store_context(store_url)
        want_profile = plist is None and profile and fill != "none" and self.profiles is not None
        files, found = await self._open_layer(store, ref, profile_of=ref_name, want_profile=want_profile,
                                              combination=holder.combination, check_packs=check_packs)
        profile_key = ""
        blob = None if files.digest in self.layers else await self._open_blob(files, store)
        async with self._lock:
            if mountpoint in self.table.mounts:
                raise ConflictError("a layer is already mounted here", where=mountpoint)
            layer = self.layers.get(files.digest)
            if layer is None:  # new, or its last mount went while we opened its blob
                blob = blob or await self._open_blob(files, store)
            if plist is not None:
                plist.verify((layer.blob if layer else blob).blob_map, layer=files.digest)
            if layer is None:
                layer = self._add_layer(files, store, blob)
            idle = layer.prefetch is None or layer.prefetch.state != "running"
            if found is not None and idle:
                plist = await trio.to_thread.run_sync(ProfileKeeper.plan, found, files, layer.blob.blob_map,
                                                      layer.index)
                prefetch, profile_key = f"profile:{found.source}", found.key
            fill_list, fill_when = [], (lambda waited: True)
            if idle and (fill == "layer" or (fill == "auto" and plist is None)):
                fill_list = await trio.to_thread.run_sync(fill_entries, plist, layer.blob.blob_map)
                if fill == "auto":
                    fill_when = functools.partial(_store_is_slow, layer.store.fetcher)
            if fill_list:
                prefetch = f"{prefetch}+fill" if prefetch else "fill"
            key, served = self._served_for(layer, mode, holder, ref_name, prefetch=prefetch or "",
                                           profile_key=profile_key)
            # The prefetch starts before mount(2), so its first store reads overlap the mount.
            job = None
            if (plist and plist.entries) or fill_list:
                job = self._start_prefetch(layer, plist, prefetch, served, fill=fill_list, fill_when=fill_when)
            # Written ahead: a daemon killed between mount(2) and the table update below still leaves
            # the mountpoint listed, so the next daemon detaches it.
            self.table.save(mounting=(mountpoint, mode, files.digest))
            try:
                await self._mounter.mount_layer(files, served.blob, mountpoint, mode=mode)
            except BaseException:
                if job is not None:
                    job.cancel_scope.cancel()
                self.table.save()
                self._drop_unused(layer, served)
                raise
            if job is not None:
                job.fill_ready.set()
            mount = self._record_mount(mountpoint, mode, ref, layer, key, served, prefetch=prefetch or "",
                                       created=utc_now(), prefetch_chunks=job.chunks if job else 0,
                                       profile_key=profile_key, holder=holder)
            self.table.save()
            log.info("mounted layer %s (%s) at %s in %s mode", files.digest[:12], ref, mountpoint, mode)
        return mount_info(mount)

    async def unmount(self, mountpoint: str, *, lazy: bool = False) -> str:
        """Unmount what this daemon mounted at ``mountpoint`` (returned as the table names it). A busy
        mount raises UnavailableError (transient) and stays, unless ``lazy``: then it is detached, and what
        it needs stays served (and traced) until the daemon stops."""
        mountpoint = await self._known_mountpoint(mountpoint)
        async with self._lock:
            mount = self.table.mounts.get(mountpoint)
            if mount is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            await self._mounter.unmount(mountpoint, lazy=lazy)
            del self.table.mounts[mountpoint]
            self.table.save()
            log.info("unmounted %s%s", mountpoint, " (lazily)" if lazy else "")
            if not lazy:
                self._release(mount)  # (lazily: still served and traced, for its holders, until the daemon stops)
        return mountpoint

    def _release(self, mount: Mount) -> None:
        layer = self.layers[mount.layer]
        key = served_key(mount.mode, layer.files)
        served = self._served[key]
        served.mounts -= 1
        served.holders.remove(mount.mountpoint)
        if not served.mounts:
            del self._served[key]
            self.segments.end(served)
        else:
            self.segments.relabel(served)
        layer.mounts -= 1
        if not layer.mounts:
            del self.layers[mount.layer]
            if layer.prefetch is not None:
                layer.prefetch.cancel_scope.cancel()

    async def _unmount_all(self) -> None:
        """Unmount every mount, newest first, lazily where busy; one that fails is logged and skipped.
        Shielded: it runs when the daemon stops, cancelled or not."""
        with trio.CancelScope(shield=True):
            for mountpoint in reversed(list(self.table.mounts)):
                try:
                    await self.unmount(mountpoint)
                except UnavailableError:
                    try:
                        await self.unmount(mountpoint, lazy=True)
                    except DsecError as exc:
                        log.error("cannot unmount %s: %s", mountpoint, exc)
                except DsecError as exc:
                    log.error("cannot unmount %s: %s", mountpoint, exc)

    def _served_for(self, layer: Layer, mode: str, holder: Holder, ref_name: str | None = None, *,
                    prefetch: str = "", profile_key: str = "") -> tuple[tuple[str, str], Served]:
        """The key and the Served of ``layer`` in ``mode``: the one its mounts in that mode share, or a new
        one with a new trace for ``holder`` (which the caller adds to ``_served`` once its mount is made)."""
        key = served_key(mode, layer.files)
        served = self._served.get(key)
        if served is None:
            label = Label(holder)
            trace_path, trace = self.segments.open(layer.files, mode, layer.blob, label, prefetch=prefetch,
                                                   profile_key=profile_key)
            blob = TracedBlob(layer.blob, layer.usage, self._fetch_log, trace, layer.readahead,
                              on_miss=functools.partial(self._map_files_soon, layer))
            served = Served(layer, blob, trace_path, label, mode=mode, ref_name=ref_name)
        return key, served

    def _record_mount(self, mountpoint: str, mode: str, ref: str, layer: Layer, key: tuple[str, str],
                      served: Served, *, prefetch: str, created: str, prefetch_chunks: int = 0,
                      profile_key: str = "", holder: Holder) -> Mount:
        """A mount just made (or adopted) at ``mountpoint`` for ``holder``: into the tables, counted as a
        user of ``served`` (now in ``_served``) and ``layer``."""
        self._served[key] = served
        served.mounts += 1
        served.holders.add(mountpoint, holder)
        self.segments.relabel(served)
        layer.mounts += 1
        files = layer.files
        mount = self.table.mounts[mountpoint] = Mount(
            mountpoint=mountpoint, mode=mode, layer=files.digest, ref=ref, store=layer.store.url,
            blob_id=files.manifest.blob_id, trace=served.trace_path, prefetch=prefetch, created=created,
            chunks=len(layer.blob.blob_map.entries), data_bytes=layer.usage.data_bytes,
            prefetch_chunks=prefetch_chunks, profile_key=profile_key)
        return mount

    def _drop_unused(self, layer: Layer, served: Served) -> None:
        """After a failed mount: drop the trace and the layer made for it, unless other mounts use them."""
        if not served.mounts:
            served.close_trace(remove=True)
        if not layer.mounts:
            del self.layers[layer.digest]

    # -- adoption and stale mounts (see mount_table.py)

    async def _adopt_mounts(self, mounter: LayerMounter) -> None:
        """raw binding, when open_mounter took over the FUSE session of a daemon that died (see "Daemon
        restarts" in docs/architecture.md): serve again each complete mount its table lists that is still
        ours at its mountpoint, as it was (layer, store, mode; a new trace, no prefetch). Runs before the
        session is served: nothing here may stat a mountpoint, which would wait for FUSE forever. A mount
        that cannot be adopted (its store fails) is left to _clean_stale_mounts, which detaches it."""
        self._mounter = mounter
        for entry in self.table.read_left():
            mountpoint, mode, digest = entry["mountpoint"], entry["mode"], entry["layer"]
            if entry.get("mounting"):
                continue
            top = await trio.to_thread.run_sync(top_mount, mountpoint)
            if top is None or not is_ours(top, mode, mounter.meta_path(digest), digest):
                continue
            try:
                await self._adopt(entry)
            except (DsecError, KeyError, TypeError) as exc:
                log.error("cannot adopt the mount at %s (layer %s, %s mode): %s", mountpoint, digest[:12], mode, exc)
            else:
                log.info("adopted the mount at %s (layer %s, %s mode)", mountpoint, digest[:12], mode)

    async def _adopt(self, entry: dict) -> None:
        mountpoint, mode = entry["mountpoint"], entry["mode"]
        store = await self._store_context(entry["store"])
        files, _profile = await self._open_layer(store, entry["layer"])
        layer = self.layers.get(files.digest) or self._add_layer(files, store, await self._open_blob(files, store))
        ref = entry.get("ref", files.digest)
        holder = Holder(ref="" if is_hex_digest(ref.lower()) else ref)  # its sandboxes, if any, hold it again
        key, served = self._served_for(layer, mode, holder)
        try:
            await self._mounter.adopt_layer(files, served.blob, mountpoint, mode=mode)
        except BaseException:
            self._drop_unused(layer, served)
            raise
        self._record_mount(mountpoint, mode, ref, layer, key, served, prefetch="",
                           created=entry.get("created", utc_now()), holder=holder)

    async def _clean_stale_mounts(self) -> None:
        """Detach the mounts a dead daemon listed and left behind, but for those adopted."""
        for entry in self.table.read_left():
            mountpoint, mode, layer = entry["mountpoint"], entry["mode"], entry["layer"]
            if mountpoint in self.table.mounts:
                continue
            detached = await trio.to_thread.run_sync(self._detach_stale, mountpoint, mode, layer)
            if detached:
                self.cleaned.append(mountpoint)
                log.warning("detached %s, left mounted (%s mode) by a daemon that died", mountpoint, mode)
        self.table.save()

    def _detach_stale(self, mountpoint: str, mode: str, layer: str) -> bool:
        """Detach our mounts at ``mountpoint`` (several, if stacked); leave anything else there alone."""
        detached = False
        while True:
            entry = top_mount(mountpoint)
            if entry is None or not is_ours(entry, mode, self._mounter.meta_path(layer), layer):
                if entry is not None and not detached:
                    log.warning("%s holds a mount that is not ours (%s %s); leaving it", mountpoint, entry.fstype,
                                entry.source)
                return detached
            try:
                umount(mountpoint, lazy=True)
            except DsecError as exc:
                log.error("cannot detach the stale mount %s: %s", mountpoint, exc)
                return detached
            detached = True

    # -- prefetch

    def _cache_room(self) -> int:
        stats = self.cache.stats()
        return int(stats.max_bytes * FILL_CACHE_SHARE) - stats.bytes

    def _start_prefetch(self, layer: Layer, plist: PrefetchList | None, path: str, served: Served, *,
                        fill: list[PrefetchEntry] = (),
                        fill_when: Callable[[float], bool | None] = lambda waited: True
                        ) -> PrefetchJob:
        if layer.prefetch is not None and layer.prefetch.state == "running":
            raise ConflictError("a prefetch of this layer is already running", where=f"layer {layer.digest}")
        layer.prefetch = self.prefetcher.start(layer.digest, plist, path, layer.store.fetcher,
                                                layer.blob.location, lambda: served.blob.trace, fill=fill,
                                                fill_when=fill_when,
                                                landed=layer.usage.note_prefetched)
        layer.usage.on_miss = layer.prefetch.fill_order.missed
        return layer.prefetch

    async def prefetch(self, mountpoint: str, path: str) -> api.PrefetchInfo:
        """Fetch the prefetch list at ``path`` for the layer mounted at ``mountpoint``, in the background."""
        mountpoint = await self._known_mountpoint(mountpoint)
        path, plist = await self._read_prefetch_list(path)
        async with self._lock:
            mount = self.table.mounts.get(mountpoint)
            if mount is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            layer = self.layers[mount.layer]
            plist.verify(layer.blob.blob_map, layer=layer.digest)
            served = self._served[served_key(mount.mode, layer.files)]
            return api.PrefetchInfo(**self._start_prefetch(layer, plist, path, served).to_json())

    def prefetches(self) -> list[api.PrefetchInfo]:
        jobs = self.prefetcher.jobs if self.prefetcher else []
        return [api.PrefetchInfo(**job.to_json()) for job in jobs]

    # -- traces

    async def _flush_traces_now_and_then(self) -> None:
        next_prune = time.monotonic() + TRACE_PRUNE_SECONDS
        while True:
            await trio.sleep(TRACE_FLUSH_SECONDS)
            for served in self._served.values():
                if served.blob.trace is not None:
                    served.blob.trace.flush()
            self.segments.publish_running(list(self._served.values()), self.options.profile_publish_seconds)
            if time.monotonic() >= next_prune:
                await self._prune_traces()
                next_prune = time.monotonic() + TRACE_PRUNE_SECONDS

    async def _prune_traces(self) -> None:
        """Remove old closed traces (trace.prune_traces) past the options' age and size limits."""
        open_traces = frozenset(path for served in self._served.values()
                                for path in (*served.segments, served.trace_path))
        try:
            result = await trio.to_thread.run_sync(functools.partial(
                prune_traces, self.trace_dir, max_bytes=self.options.trace_keep_bytes,
                max_age=self.options.trace_keep_seconds, keep=open_traces))
        except OSError as exc:
            log.error("cannot prune the traces in %s: %s", self.trace_dir, exc)
            return
        if result.removed:
            log.info("pruned %d old traces (%d bytes); %d kept (%d bytes)", len(result.removed),
                     result.removed_bytes, result.kept, result.kept_bytes)

    async def hold(self, mountpoint: str, holder: Holder, *, profile: bool = False, fill: str | None = None) -> None:
        """One more ``holder`` (a sandbox) of the layer mounted at ``mountpoint`` (by this daemon). With
        ``profile`` (and a ``fill`` other than none), the layer, mounted for others, then prefetches in the
        background by the profile of the holder's combination, if the store has one and no prefetch runs."""
        async with self._lock:
            served = self._served_at(mountpoint)
            served.holders.add(mountpoint, holder)
            self.segments.relabel(served)
        if (profile and (fill or self.options.fill) != "none" and holder.combination and self.profiles is not None
                and self._background is not None):
            self._background.start_soon(self._prefetch_for, mountpoint, holder.combination)

    async def _prefetch_for(self, mountpoint: str, combination: str) -> None:
        """A background task of ``hold``: never raises (a profile is only ever a help)."""
        mount = self.table.mounts.get(mountpoint)
        if mount is None:
            return
        layer = self.layers[mount.layer]
        try:
            found = await trio.to_thread.run_sync(self.profiles.lookup_combination, layer.store.store, layer.digest,
                                                  combination)
            async with self._lock:
                if found is None or self.table.mounts.get(mountpoint) is not mount or (
                        layer.prefetch is not None and layer.prefetch.state == "running"):
                    return
                plist = await trio.to_thread.run_sync(ProfileKeeper.plan, found, layer.files, layer.blob.blob_map,
                                                      layer.index)
                if plist.entries:
                    self._start_prefetch(layer, plist, f"profile:{found.source}", self._served_at(mountpoint))
        except DsecError as exc:
            log.warning("no prefetch of layer %s for combination %s: %s", layer.digest[:12], combination[:12], exc)

    async def unhold(self, mountpoint: str, holder: Holder) -> None:
        """One ``holder`` fewer of the layer mounted at ``mountpoint`` (its last goes with the unmount)."""
        async with self._lock:
            served = self._served_at(mountpoint)
            served.holders.remove(mountpoint, holder)
            self.segments.relabel(served)

    def _served_at(self, mountpoint: str) -> Served:
        mount = self.table.mounts.get(mountpoint)
        if mount is None:
            raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
        return self._served[served_key(mount.mode, self.layers[mount.layer].files)]

    async def _publish_the_rest(self) -> None:
        """At the stop, after the last unmounts: the traces still open (of mounts detached lazily, whose
        blob stayed served) are ended too, and every profile still queued is published."""
        for served in list(self._served.values()):
            if served.blob.trace is not None:
                self.segments.end(served)
        await self.profiles.flush()

    def _close_traces(self) -> None:
        for served in self._served.values():
            served.close_trace()
        self._served.clear()

    def _close_stores(self) -> None:
        for context in self.stores.values():
            context.store.close()
        self.stores.clear()

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


class _LayerObjectTimer(StoreWrapper):
    """The store as a layer open sees it, telling ``note`` how long each GET of a small layer object took
    (its manifest, its blob map, at most fetcher.ROUND_TRIP_READ_BYTES): a sample of the store's round
    trip for fill auto. An up of two layers makes four or more, so fill auto decides when the layers are
    mounted; timing the manifests alone gave two, and the fill waited for the command's small misses
    (0.2-0.5 s of idle link after up; docs/benchmarks.md, "fill8"). What the node's copies gave (or a ref
    its ref cache gave: refs are not layer objects) makes no GET here, so no sample: that would time
    this node's disk."""

    def __init__(self, inner: Store, note: Callable[[float], None]):
        super().__init__(inner)
        self._note = note

    def _call(self, op, key, fn, sent=0):
        if not (op == "get" and key.startswith(keys.LAYERS)):
            return fn()
        started = time.monotonic()
        result = fn()
        if len(result) <= ROUND_TRIP_READ_BYTES:
            self._note(time.monotonic() - started)
        return result


def _store_is_slow(fetcher: ChunkFetcher, waited: float) -> bool | None:
    """Fill ``auto``'s test (prefetcher.AUTO_FILL_MIN_ROUND_TRIP), ``waited`` seconds after the mount: None
    until the store's round trip is known well enough."""
    round_trip = fetcher.round_trip(AUTO_FILL_SAMPLES if waited < AUTO_FILL_PATIENCE else 1)
    return None if round_trip is None else round_trip >= AUTO_FILL_MIN_ROUND_TRIP


def mount_info(mount: Mount, *, idle_until: str = "") -> api.MountInfo:
    return api.MountInfo(**mount.to_json(), idle_until=idle_until)


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
