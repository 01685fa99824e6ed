"""The node daemon: layer mounts, the chunk cache and fetchers, access traces, prefetch and the HTTP API,
composed in one trio loop.

    trio.run(serve_until_signalled, NodeDaemon(DaemonOptions(socket_path=..., state_dir=..., ...)))

is what ``dsecfs daemon`` runs. The parts::

    HttpApi (http_api.py) on the unix socket: /v1/... routes and /metrics (metrics.py)
      NodeDaemon: mount table (persisted), per-layer state, prefetch tasks
        LayerMounter (layer_mount.py): the one FUSE session; kernel-mode and fuse-mode mounts
        per store URL: the store wrapped (faults, latency, limit, retry), its ChunkIndex, and a ChunkFetcher
            (single flight, priorities, timeout) over the node's one ChunkCache (disk)
        MemoryChunkCache: recently read chunks, in front of every fetcher
        per served blob: a TracedBlob (the LayerBlob, each read counted and traced) and its TraceWriter

Why a memory cache in front of the fetchers. FUSE reads arrive in pieces of 128 KiB (the kernel's
readahead window) while chunks are 1 MiB: without it, each piece went to a worker thread that re-read and
re-checked (xxh3) the whole chunk from the disk cache, eight times the disk and hashing work per chunk.
``MemoryFrontedFetcher`` answers chunks it holds right in the trio thread and hands the rest to the
ChunkFetcher (disk cache, then store), keeping what comes back; it is bounded (64 MiB by default, least
recently used out). Prefetched chunks go to the disk cache, and to memory only while it has free room
(a prefetch never evicts what readers use): at a cold start, when memory is empty, the workload's first
reads of prefetched chunks are then answered without a worker thread, a disk read and a hash each. A
long blob read in order (a big file, in either mode; PRELOAD_AFTER_BYTES) has the chunks after it
loaded from the disk cache into memory ahead of it (``MemoryFrontedFetcher.preload``, PRELOAD_BYTES,
each chunk read in a worker thread of its own; never from the store): the reader no longer stops at
each chunk while a worker thread reads and checks it, which had kept warm sequential reads at about
0.6 GB/s.

Traces. Each mount gets a trace file under ``state_dir/traces/`` (trace.py). In kernel mode the daemon
only sees reads of the virtual blob, so records name blob ranges (FLAG_BLOB); in fuse mode LayerTree says
which file it is reading (fs_core.FILE_READ) and records name the nid and file offset. A record has
FLAG_MISS when its read waited for a chunk fetched from the store: ``StoreFetchLog`` (the cache as the
fetchers see it) numbers every chunk the fetchers put into the cache, which they do for each chunk read
from the store before anyone is answered, so a read that finds one of its chunks numbered after it started
waited for the store. Mounts of one layer in one mode share the blob layer_mount serves them from, so
they share the trace of the first of them, which closes with the last. Prefetch reads are recorded
too (FLAG_PREFETCH). Closed traces past ``trace_keep_seconds`` or beyond ``trace_keep_bytes`` in all are
removed, oldest first, at start and every TRACE_PRUNE_SECONDS (trace.prune_traces).

Prefetch. A mount may name a prefetch list (prefetch_list.py, learned from traces). It is checked against
the layer's blob map, then fetched in the background at PREFETCH priority, starting just before mount(2)
so that its first store reads overlap the mount: a small first group, then large ones
(PREFETCH_FIRST_GROUP_BYTES, PREFETCH_GROUP_BYTES), PREFETCH_GROUPS_IN_FLIGHT at once, each one
``fetcher.warm`` (the fetcher reads their runs side by side, queued in list order so the first-needed
chunks arrive first, within its prefetch slots so on-demand reads go first). It stops when the layer's
last mount goes, or when the mount it was started with fails. The mount path itself makes its store
round trips side by side where it can (``_open_layer``). With ``miss_readahead_bytes`` set, each
on-demand miss also brings along the chunks stored after it (blob_reader.py, readahead; off by default).

Persisted state and crashes. ``state_dir/mounts.json`` lists the live mounts, rewritten (atomically) after
each mount and unmount, and before each mount with the mount being made (so a kill between mount(2) and
the update cannot leave an unlisted mount). With the raw FUSE binding a daemon that dies (SIGKILL, a
crash) leaves its mounts alive: a holder process keeps the FUSE connection, and the next daemon takes it
over and adopts every complete mount the table lists (``_adopt_mounts``; "Daemon restarts" in
docs/architecture.md). Otherwise its mounts are left behind dead (their FUSE connection is gone: readers
get ENOTCONN or EIO). The next daemon on the same state directory detaches each listed mountpoint it did
not adopt that still carries one of our mounts (an EROFS mount of our meta image, or a bind mount of our
FUSE session), after layer_mount has detached the dead FUSE session itself; it does not remount them. The chunk cache repairs itself on open (cache.py).

Shutdown. ``shutdown()`` (SIGTERM, SIGINT) runs the stop hooks, stops the API and the prefetches, unmounts
every layer (lazily where busy), ends the FUSE session, cancels the fetches still in the air, then flushes
and closes the traces and closes the stores and the cache.
``serve_until_signalled`` installs the signal handlers before anything is served, so libfuse2 (fusepy),
which takes SIGTERM and SIGHUP when they are left at their defaults, does not get them.

Extensions. Packages above lazy_fetch add to the daemon without it importing them (``run_daemon``'s
``extensions``, composed in cli/): routes on ``api``, and ``on_start`` / ``on_stop`` hooks. Start hooks
run once the FUSE session serves and stale mounts are detached, before the API answers; stop hooks run
(shielded, newest first) once shutdown is asked for, while the API still answers and every layer is still
mounted. overlay/node_service.py serves sandboxes this way.

Threads: everything here runs in the daemon's trio thread, so MemoryChunkCache, the tables and the traces
need no lock; blocking work (opening layers and stores, mount(2), cache eviction) runs in worker threads
through trio.to_thread. ``_lock`` (a trio.Lock) makes mount and unmount calls take turns over the tables;
a layer is opened from its store before taking it, so a slow store holds up no other mount.
``StoreFetchLog._lock`` guards its numbering, which the fetchers' worker threads change.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata

import trio

from dsec_fs.chunks import ChunkIndex, ChunkLocation
from dsec_fs.client import DEFAULT_CACHE_DIR, DEFAULT_SOCKET, DEFAULT_STATE_DIR
from dsec_fs.digest import is_hex_digest
from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError, UnavailableError
from dsec_fs.layer import LayerFiles, Manifest, open_layer, utc_now
from dsec_fs.mounts import umount
from dsec_fs.store import default_store_url, open_store
from dsec_fs.store.base import Store
from dsec_fs.store.wrappers import wrap_store

from . import prefetch_list
from .blob_reader import BlobChunk, LayerBlob, open_layer_blob
from .cache import ChunkCache
from .fetcher import DEFAULT_MAX_CONCURRENT, DEFAULT_TIMEOUT, ONDEMAND, PREFETCH, ChunkFetcher, FetchStats, Priority
from .fs_core import FILE_READ
from .http_api import HttpApi, Request, Response
from .layer_mount import BINDINGS, DEFAULT_READ_AHEAD, MODES, LayerMounter, open_mounter
from .metrics import LayerFigures, MemoryFigures, MetricsPage, NodeFigures
from .trace import (FLAG_BLOB, FLAG_ERROR, FLAG_MISS, FLAG_PREFETCH, NO_CHUNK, TRACE_SUFFIX, TraceHeader, TraceWriter,
                    prune_traces)

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 10 << 30
DEFAULT_MEMORY_CACHE_BYTES = 64 << 20
PRELOAD_BYTES = 4 << 20  # chunks ahead of a blob read in order loaded from the disk cache into memory
# (at most a quarter of the memory cache, so that what is preloaded does not push itself out), once the
# reads in order add up to PRELOAD_AFTER_BYTES: a cold start reads many small files, often one after the
# other in the blob, and preloading for them pushed prefetched chunks out of memory (kernel mode with a
# prefetch list: 0.97 s to 1.58 s)
PRELOAD_AFTER_BYTES = 2 << 20
DEFAULT_STORE_CONCURRENCY = 16  # store calls at once (fetches, index loads, layer opens), per store
FAULTS_ENV = "DSECFS_FAULTS"  # FaultStore rules for every store the daemon opens (tests)
MOUNT_TABLE = "mounts.json"
TRACE_DIR = "traces"
TRACE_FLUSH_SECONDS = 5.0  # so a live trace can be read while its mount lives
TRACE_PRUNE_SECONDS = 600.0  # how often old traces are pruned (and once at start)
DEFAULT_TRACE_KEEP_BYTES = 1 << 30
DEFAULT_TRACE_KEEP_SECONDS = 7 * 86400.0
# A prefetch asks for its list in groups of chunk bytes, PREFETCH_GROUPS_IN_FLIGHT at once, each one
# fetcher.warm (planned in one go, so the chunks of a group that lie side by side in a pack share a GET
# however far apart the list names them; no bytes held). The first group is small, so the chunks a workload
# needs first do not share the link (and the CPU that verifies them) with the rest of the list; the others
# are large, because every group boundary splits runs of neighbours into more GETs (with 16 MiB groups,
# the bench's 84 MB list took 223 GETs; in one group, 101). The group size bounds the flights and queued
# store reads a prefetch makes at once.
PREFETCH_FIRST_GROUP_BYTES = 2 << 20
PREFETCH_GROUP_BYTES = 256 << 20
PREFETCH_GROUPS_IN_FLIGHT = 2
FETCH_LOG_KEPT = 1 << 16  # store fetches StoreFetchLog remembers: far more than can happen during one read


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
    miss_readahead_bytes: int = 0  # chunk bytes a missed read brings along after it (blob_reader.py); 0: off
    read_ahead_bytes: int = DEFAULT_READ_AHEAD  # the kernel's readahead in a layer's files (layer_mount.py)
    trace: bool = True
    trace_keep_bytes: int | None = DEFAULT_TRACE_KEEP_BYTES  # closed traces beyond this go, oldest first
    trace_keep_seconds: float | None = DEFAULT_TRACE_KEEP_SECONDS  # closed traces older than this go

    def check(self) -> None:
        if self.fuse_binding not in BINDINGS:
            raise InputError(f"unknown FUSE binding {self.fuse_binding!r} (one of {', '.join(BINDINGS)})",
                             where="daemon options")
        for name in ("cache_bytes", "fetch_timeout", "fetch_concurrency", "store_concurrency"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be positive, got {getattr(self, name)}", where="daemon options")
        for name in ("miss_readahead_bytes", "read_ahead_bytes"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must not be negative, got {getattr(self, name)}", where="daemon options")
        for name in ("trace_keep_bytes", "trace_keep_seconds"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InputError(f"{name} must not be negative, got {getattr(self, name)}", where="daemon options")
        if self.memory_cache_bytes < 0:
            raise InputError("memory_cache_bytes must not be negative", where="daemon options")


# ---- chunk reads: memory cache, fetch log ------------------------------------------------------------


class MemoryChunkCache:
    """Recently read chunks by digest, at most ``max_bytes`` of them, least recently used out first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._chunks

    def get(self, digest: bytes) -> bytes | None:
        data = self._chunks.get(digest)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        self._chunks.move_to_end(digest)
        return data

    def put(self, digest: bytes, data: bytes) -> None:
        if len(data) > self.max_bytes or digest in self._chunks:
            return
        self._chunks[digest] = data
        self.bytes += len(data)
        self.shrink_to(self.max_bytes)

    def shrink_to(self, max_bytes: int) -> None:
        while self.bytes > max_bytes:
            _digest, data = self._chunks.popitem(last=False)
            self.bytes -= len(data)

    def figures(self) -> MemoryFigures:
        return MemoryFigures(entries=len(self._chunks), bytes=self.bytes, max_bytes=self.max_bytes,
                             hits=self.hits, misses=self.misses)


class MemoryFrontedFetcher:
    """The fetcher a LayerBlob reads through: chunks the MemoryChunkCache holds are answered at once, the
    others are fetched by ``fetcher`` (disk cache, then store) and remembered. Has what LayerBlob and
    open_layer_blob use of a ChunkFetcher: ``fetch_many``, ``store`` and ``timeout``. ``preload`` tasks
    run in ``nursery``."""

    def __init__(self, fetcher: ChunkFetcher, memory: MemoryChunkCache, nursery: trio.Nursery):
        self.fetcher = fetcher
        self.memory = memory
        self.store = fetcher.store
        self.timeout = fetcher.timeout
        self._nursery = nursery
        self._preloading: dict[bytes, trio.Event] = {}  # digest -> set once its preload has ended

    async def fetch_many(self, items: Iterable[tuple[bytes, ChunkLocation]], *, priority: Priority = ONDEMAND,
                         label: str = "", readahead: Iterable[tuple[bytes, ChunkLocation]] = ()) -> dict[bytes, bytes]:
        found: dict[bytes, bytes] = {}
        missing: dict[bytes, ChunkLocation] = {}
        for digest, location in items:
            if digest in found or digest in missing:
                continue
            preloading = self._preloading.get(digest)
            if preloading is not None:  # being read from the disk cache: no second read of it
                await preloading.wait()
            data = self.memory.get(digest)
            if data is None:
                missing[digest] = location
            else:
                found[digest] = data
        if missing:
            ahead = [(digest, location) for digest, location in readahead if digest not in self.memory]
            fetched = await self.fetcher.fetch_many(missing.items(), priority=priority, label=label, readahead=ahead)
            for digest, data in fetched.items():
                self.memory.put(digest, data)
            found.update(fetched)
        return found

    def preload(self, items: Iterable[tuple[bytes, ChunkLocation]]) -> None:
        """Start loading into memory those of ``items`` that the disk cache holds (the store is not
        asked), each in a worker thread of its own (disk reads side by side), so that a reader that
        comes for them finds them there."""
        for digest, _location in items:
            if digest not in self.memory and digest not in self._preloading:
                done = self._preloading[digest] = trio.Event()
                self._nursery.start_soon(self._preload, digest, done)

    async def _preload(self, digest: bytes, done: trio.Event) -> None:
        try:
            data = (await trio.to_thread.run_sync(self.fetcher.cached, [digest])).get(digest)
            if data is not None:
                self.memory.put(digest, data)
        finally:
            del self._preloading[digest]
            done.set()


class StoreFetchLog:
    """The ChunkCache as the fetchers see it. A fetcher puts each chunk it read from the store (and only
    those) before answering anyone, so numbering the puts tells a read whether it waited for the store:
    take ``mark()`` before reading, ask ``fetched_since(mark, digests)`` after. Worker threads put; the
    trio thread marks and asks; ``_lock`` guards the numbering."""

    def __init__(self, cache: ChunkCache):
        self.cache = cache
        self._lock = threading.Lock()
        self._count = 0
        self._fetched: OrderedDict[bytes, int] = OrderedDict()  # digest -> number of its latest put

    def get(self, digest: bytes) -> bytes | None:
        return self.cache.get(digest)

    def put_many(self, chunks: Iterable[tuple[bytes, bytes | memoryview]]) -> int:
        chunks = list(chunks)
        with self._lock:
            for digest, _data in chunks:
                self._count += 1
                self._fetched[digest] = self._count
                self._fetched.move_to_end(digest)
                if len(self._fetched) > FETCH_LOG_KEPT:
                    self._fetched.popitem(last=False)
        return self.cache.put_many(chunks)

    def mark(self) -> int:
        with self._lock:
            return self._count

    def fetched_since(self, mark: int, digests: Iterable[bytes]) -> bool:
        with self._lock:
            return any(self._fetched.get(digest, 0) > mark for digest in digests)


# ---- layers, traced blobs, mounts --------------------------------------------------------------------


@dataclass
class _StoreContext:
    url: str
    store: Store
    chunk_index: ChunkIndex
    fetcher: ChunkFetcher
    reader: MemoryFrontedFetcher
    indexed_layers: set[str] = field(default_factory=set)  # layers whose pack indexes chunk_index holds


class _LayerUsage:
    """What readers used of one layer since the daemon started (kept after its mounts go, for metrics)."""

    def __init__(self, blob: LayerBlob):
        self.data_bytes = sum(length for _blkaddr, _digest, length in blob.blob_map.entries)
        self.used_bytes = 0
        self.reads = 0
        self.read_errors = 0
        self._used = bytearray(len(blob.blob_map.entries))  # 1 for each blob-map entry served

    def note(self, chunks: list[BlobChunk], failed: bool) -> None:
        self.reads += 1
        if failed:
            self.read_errors += 1
            return
        for chunk in chunks:
            if not self._used[chunk.entry]:
                self._used[chunk.entry] = 1
                self.used_bytes += chunk.length


@dataclass
class _Prefetch:
    layer: str
    list: str  # path of the prefetch list
    chunks: int
    bytes: int
    state: str = "running"  # running | done | cancelled | failed
    done_chunks: int = 0
    done_bytes: int = 0
    failed_chunks: int = 0
    started: str = field(default_factory=utc_now)
    finished: str = ""
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cancel_scope"}


@dataclass
class _Layer:
    """A layer some mount uses: its files, its blob, the store it came from."""

    files: LayerFiles
    blob: LayerBlob
    store: _StoreContext
    usage: _LayerUsage
    mounts: int = 0
    prefetch: _Prefetch | None = None

    @property
    def digest(self) -> str:
        return self.files.digest


class TracedBlob:
    """What FUSE reads of one layer's blob in one mode (what layer_mount serves): the LayerBlob, each read
    counted in the layer's usage and, while ``trace`` is open, recorded in it."""

    def __init__(self, layer: _Layer, fetch_log: StoreFetchLog, trace: TraceWriter | None):
        self.blob = layer.blob
        self.size = layer.blob.size
        self.usage = layer.usage
        self.fetch_log = fetch_log
        self.trace = trace
        # (end offset, last chunk's blob-map entry, bytes read in order up to it) of the latest read
        self._last_read = (-1, -1, 0)

    async def read(self, offset: int, length: int) -> bytes:
        chunks = self.blob.chunks_for_range(offset, length)
        if chunks:
            end, entry, in_order = self._last_read
            in_order = in_order + length if offset == end else length
            if in_order >= PRELOAD_AFTER_BYTES and chunks[-1].entry != entry:  # a long read, into another chunk
                front = self.blob.fetcher
                front.preload(self.blob.following(chunks[-1].entry, min(PRELOAD_BYTES, front.memory.max_bytes // 4)))
            self._last_read = (offset + length, chunks[-1].entry, in_order)
        mark = self.fetch_log.mark()
        started = time.monotonic_ns()
        try:
            data = await self.blob.read(offset, length)
        except DsecError:
            self._note(offset, length, chunks, mark, started, failed=True)
            raise
        self._note(offset, length, chunks, mark, started, failed=False)
        return data

    def _note(self, offset: int, length: int, chunks: list[BlobChunk], mark: int, started: int, *,
              failed: bool) -> None:
        self.usage.note(chunks, failed)
        if self.trace is None:
            return
        flags = FLAG_ERROR if failed else 0
        if self.fetch_log.fetched_since(mark, (chunk.digest for chunk in chunks)):
            flags |= FLAG_MISS
        file_read = FILE_READ.get()  # set by LayerTree (fuse mode): the file and offset being read
        if file_read is None:
            nid, position = 0, offset
            flags |= FLAG_BLOB
        else:
            nid, position = file_read
        self.trace.record(nid=nid, offset=position, length=length, chunk=chunks[0].entry if chunks else NO_CHUNK,
                          latency_us=(time.monotonic_ns() - started) // 1000, flags=flags)


@dataclass
class _Served:
    """The blob layer_mount serves for one layer in one mode, shared by that layer's mounts in that mode."""

    blob: TracedBlob
    trace_path: str
    mounts: int = 0


@dataclass
class _Mount:
    mountpoint: str
    mode: str
    layer: str  # digest
    ref: str  # as the mount request named the layer (a ref or the digest)
    store: str  # store URL
    blob_id: str
    trace: str  # trace file ("" when tracing is off)
    prefetch: str  # prefetch list path, or ""
    created: str
    chunks: int
    data_bytes: int

    def to_json(self) -> dict:
        return asdict(self)


def _served_key(mode: str, files: LayerFiles) -> tuple[str, str]:
    """layer_mount shares a kernel-mode blob by blob id and a fuse-mode tree by layer digest."""
    return (mode, files.manifest.blob_id if mode == "kernel" else files.digest)


def _prefetch_groups(entries: Iterable[prefetch_list.PrefetchEntry]) -> Iterator[list[prefetch_list.PrefetchEntry]]:
    """A prefetch list's entries, in order: a first group of at least PREFETCH_FIRST_GROUP_BYTES, then
    groups of at least PREFETCH_GROUP_BYTES (the last may be less)."""
    group: list[prefetch_list.PrefetchEntry] = []
    group_bytes, target = 0, PREFETCH_FIRST_GROUP_BYTES
    for entry in entries:
        group.append(entry)
        group_bytes += entry.length
        if group_bytes >= target:
            yield group
            group, group_bytes, target = [], 0, PREFETCH_GROUP_BYTES
    if group:
        yield group


# ---- the daemon ----------------------------------------------------------------------------------------


class NodeDaemon:
    """See the module docstring. ``api`` may be given more routes before ``run`` starts serving."""

    def __init__(self, options: DaemonOptions, api: HttpApi | None = None):
        options.check()
        self.options = options
        self.state_dir = os.path.abspath(options.state_dir)
        self.trace_dir = os.path.join(self.state_dir, TRACE_DIR)
        self.api = api or HttpApi()
        self.memory = MemoryChunkCache(options.memory_cache_bytes)
        self.metrics = MetricsPage(self.figures)
        self.cleaned: list[str] = []  # stale mountpoints detached at start
        self._stop = trio.Event()
        self._lock = trio.Lock()
        self._stores_lock = trio.Lock()
        self._stores: dict[str, _StoreContext] = {}
        self._layers: dict[str, _Layer] = {}
        self._usage: dict[str, _LayerUsage] = {}
        self._served: dict[tuple[str, str], _Served] = {}
        self._mounts: dict[str, _Mount] = {}
        self._prefetches: list[_Prefetch] = []
        self._started = utc_now()
        self._cache: ChunkCache | None = None
        self._fetch_log: StoreFetchLog | None = None
        self._mounter: LayerMounter | None = None
        self._flights: trio.Nursery | None = None
        self._nursery: trio.Nursery | None = None
        self.on_start: list[Callable[[], Awaitable[None]]] = []  # see "Extensions" in the module docstring
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self._register_routes()

    # -- life cycle

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``shutdown()``; reports started once the API answers. On the way out (in this
        order): the API and the prefetches stop, every layer is unmounted, the FUSE session ends, fetches
        still in the air are cancelled, traces are closed, then the stores and the cache."""
        options = self.options
        os.makedirs(self.trace_dir, mode=0o755, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            self._cache = stack.enter_context(ChunkCache(options.cache_dir, options.cache_bytes))
            self._fetch_log = StoreFetchLog(self._cache)
            stack.callback(self._close_stores)
            stack.callback(self._close_traces)
            self._flights = await stack.enter_async_context(_nursery_cancelled_on_exit())
            self._mounter = await stack.enter_async_context(open_mounter(
                self.state_dir, binding=options.fuse_binding, adopt=self._adopt_mounts,
                read_ahead=options.read_ahead_bytes))
            stack.push_async_callback(self._unmount_all)
            await self._clean_stale_mounts()
            await self._prune_traces()
            async with _nursery_cancelled_on_exit() as nursery:
                self._nursery = nursery
                for hook in self.on_start:
                    await hook()
                await nursery.start(self.api.serve, options.socket_path)
                nursery.start_soon(self._flush_traces_now_and_then)
                log.info("dsecfs daemon %d serving on %s (state %s, cache %s, FUSE %s)", os.getpid(),
                         options.socket_path, self.state_dir, self._cache.directory, options.fuse_binding)
                task_status.started()
                try:
                    await self._stop.wait()
                finally:
                    log.info("shutting down")
                    with trio.CancelScope(shield=True):
                        for hook in reversed(self.on_stop):
                            await hook()
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

    async def _store_context(self, url: str | None) -> _StoreContext:
        url = url or self.options.store_url or default_store_url()
        async with self._stores_lock:
            context = self._stores.get(url)
            if context is None:
                options = self.options
                backend = await trio.to_thread.run_sync(open_store, url)
                faults = options.faults if options.faults is not None else os.environ.get(FAULTS_ENV)
                store = wrap_store(backend, retry=True, max_concurrent=options.store_concurrency,
                                   latency=options.latency, bandwidth=options.bandwidth, faults=faults or None)
                fetcher = ChunkFetcher(store, self._fetch_log, self._flights, max_concurrent=options.fetch_concurrency,
                                       timeout=options.fetch_timeout)
                context = _StoreContext(url, store, ChunkIndex(), fetcher,
                                        MemoryFrontedFetcher(fetcher, self.memory, self._flights))
                self._stores[url] = context
                log.info("opened store %s%s", backend.url, f" with faults {faults!r}" if faults else "")
        return context

    async def _open_layer(self, store: _StoreContext, ref: str) -> LayerFiles:
        """open_layer, loading the pack indexes of a layer this store context has not indexed yet while
        meta.erofs and the blob map are read (their round trips overlap; open_layer_blob then finds
        every chunk located and loads nothing)."""
        timeout = self.options.fetch_timeout
        indexed = frozenset(store.indexed_layers)

        def load_pack_indexes(manifest: Manifest) -> None:
            if manifest.layer not in indexed:
                store.chunk_index.load_packs(store.store, manifest.packs)

        try:
            with trio.fail_after(timeout):
                files = await trio.to_thread.run_sync(
                    functools.partial(open_layer, store.store, ref, on_manifest=load_pack_indexes),
                    abandon_on_cancel=True)
            store.indexed_layers.add(files.digest)
            return files
        except trio.TooSlowError:
            raise UnavailableError(f"the store did not answer within {timeout:g} s",
                                   where=f"layer {ref} in {store.url}", transient=True) from None

    def _open_trace(self, files: LayerFiles, mode: str, ref: str, blob: LayerBlob) -> tuple[str, TraceWriter | None]:
        if not self.options.trace:
            return "", None
        stats = files.manifest.stats
        header = TraceHeader(layer=files.digest, ref="" if is_hex_digest(ref.lower()) else ref, mode=mode,
                             chunk_size=files.manifest.chunk_size, layer_bytes=int(stats.get("bytes", 0)),
                             layer_files=int(stats.get("files", 0)), blob_bytes=blob.size)
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{files.digest[:12]}-{mode}-{secrets.token_hex(3)}{TRACE_SUFFIX}"
        path = os.path.join(self.trace_dir, name)
        return path, TraceWriter(path, header)

    # -- mounts

    async def mount(self, ref: str, mountpoint: str, *, mode: str = "kernel", store_url: str | None = None,
                    prefetch: str | None = None, fuse_binding: str | None = None) -> dict:
        """Mount layer ``ref`` (a ref or a digest, from ``store_url`` or the default store) at the
        directory ``mountpoint``; with ``prefetch`` (a prefetch list file) fetch that list in the
        background. Returns the mount's description."""
        if mode not in MODES:
            raise InputError(f"unknown mount mode {mode!r} (one of {', '.join(MODES)})", where=mountpoint)
        if fuse_binding and fuse_binding != self.options.fuse_binding:
            raise ConflictError(f"this daemon serves FUSE with {self.options.fuse_binding}, not {fuse_binding}; "
                                "restart it with --fuse-binding to change", where=mountpoint)
        mountpoint = _checked_mountpoint(mountpoint)
        store = await self._store_context(store_url)
        files = await self._open_layer(store, ref)
        plist = None
        if prefetch:
            prefetch = os.path.abspath(prefetch)
            plist = await trio.to_thread.run_sync(prefetch_list.load, prefetch)
        blob = None if files.digest in self._layers else await self._open_blob(files, store)
        async with self._lock:
            if mountpoint in self._mounts:
                raise ConflictError("a layer is already mounted here", where=mountpoint)
            layer = self._layers.get(files.digest)
            if layer is None:  # new, or its last mount went while we opened its blob
                blob = blob or await self._open_blob(files, store)
            if plist is not None:
                plist.verify((layer.blob if layer else blob).blob_map, layer=files.digest)
            if layer is None:
                layer = self._add_layer(files, store, blob)
            key, served = self._served_for(layer, mode, ref)
            # The prefetch starts before mount(2), so its first store reads overlap the mount.
            job = None if plist is None else self._start_prefetch(layer, plist, prefetch, served)
            # Written ahead: a daemon killed between mount(2) and the table update below still leaves
            # the mountpoint listed, so the next daemon detaches it.
            self._save_mount_table(mounting=(mountpoint, mode, files.digest))
            try:
                await self._mounter.mount_layer(files, served.blob, mountpoint, mode=mode)
            except BaseException:
                if job is not None:
                    job.cancel_scope.cancel()
                self._save_mount_table()
                self._drop_unused(layer, served)
                raise
            mount = self._record_mount(mountpoint, mode, ref, layer, key, served, prefetch=prefetch or "",
                                       created=utc_now())
            self._save_mount_table()
            log.info("mounted layer %s (%s) at %s in %s mode", files.digest[:12], ref, mountpoint, mode)
        return mount.to_json()

    async def _open_blob(self, files: LayerFiles, store: _StoreContext) -> LayerBlob:
        return await open_layer_blob(files, store.reader, chunk_index=store.chunk_index, label=files.digest,
                                     readahead_bytes=self.options.miss_readahead_bytes)

    def _add_layer(self, files: LayerFiles, store: _StoreContext, blob: LayerBlob) -> _Layer:
        usage = self._usage.get(files.digest) or self._usage.setdefault(files.digest, _LayerUsage(blob))
        layer = self._layers[files.digest] = _Layer(files, blob, store, usage)
        return layer

    async def unmount(self, mountpoint: str, *, lazy: bool = False) -> None:
        """Unmount what this daemon mounted at ``mountpoint``. A busy mount raises UnavailableError
        (transient) and stays, unless ``lazy``: then it is detached, and what it needs stays served (and
        traced) until the daemon stops."""
        mountpoint = os.path.realpath(mountpoint)
        async with self._lock:
            mount = self._mounts.get(mountpoint)
            if mount is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            await self._mounter.unmount(mountpoint, lazy=lazy)
            del self._mounts[mountpoint]
            self._save_mount_table()
            log.info("unmounted %s%s", mountpoint, " (lazily)" if lazy else "")
            if not lazy:
                self._release(mount)

    def _release(self, mount: _Mount) -> None:
        layer = self._layers[mount.layer]
        key = _served_key(mount.mode, layer.files)
        served = self._served[key]
        served.mounts -= 1
        if not served.mounts:
            del self._served[key]
            _close_trace(served)
        layer.mounts -= 1
        if not layer.mounts:
            del self._layers[mount.layer]
            if layer.prefetch is not None:
                layer.prefetch.cancel_scope.cancel()

    async def _unmount_all(self) -> None:
        """Unmount every mount, newest first, lazily where busy; one that fails is logged and skipped.
        Shielded: it runs when the daemon stops, cancelled or not."""
        with trio.CancelScope(shield=True):
            await self._unmount_each()

    async def _unmount_each(self) -> None:
        for mountpoint in reversed(list(self._mounts)):
            try:
                await self.unmount(mountpoint)
            except UnavailableError:
                try:
                    await self.unmount(mountpoint, lazy=True)
                except DsecError as exc:
                    log.error("cannot unmount %s: %s", mountpoint, exc)
            except DsecError as exc:
                log.error("cannot unmount %s: %s", mountpoint, exc)

    # -- persisted mount table and stale mounts

    def _mount_table_path(self) -> str:
        return os.path.join(self.state_dir, MOUNT_TABLE)

    def _save_mount_table(self, mounting: tuple[str, str, str] | None = None) -> None:
        """Write the live mounts, and ``mounting`` (mountpoint, mode, layer digest): the mount being made."""
        path = self._mount_table_path()
        tmp = f"{path}.tmp"
        entries = [m.to_json() for m in self._mounts.values()]
        if mounting is not None:
            entries.append(dict(zip(("mountpoint", "mode", "layer"), mounting), mounting=True))
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "mounts": entries}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _read_mount_table(self) -> list[dict]:
        """The entries of the mount table a daemon before us left (each with mountpoint, mode and layer)."""
        path = self._mount_table_path()
        try:
            with open(path) as f:
                entries = json.load(f)["mounts"]
            if not all({"mountpoint", "mode", "layer"} <= entry.keys() for entry in entries):
                raise ValueError("an entry lacks its mountpoint, mode or layer")
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the unreadable mount table %s: %s", path, exc)
            return []
        return entries

    def _served_for(self, layer: _Layer, mode: str, ref: str) -> tuple[tuple[str, str], _Served]:
        """The key and the _Served of ``layer`` in ``mode``: the one its mounts in that mode share, or a new
        one with a new trace (which the caller adds to ``_served`` once its mount is made)."""
        key = _served_key(mode, layer.files)
        served = self._served.get(key)
        if served is None:
            trace_path, trace = self._open_trace(layer.files, mode, ref, layer.blob)
            served = _Served(TracedBlob(layer, self._fetch_log, trace), trace_path)
        return key, served

    def _record_mount(self, mountpoint: str, mode: str, ref: str, layer: _Layer, key: tuple[str, str],
                      served: _Served, *, prefetch: str, created: str) -> _Mount:
        """A mount just made (or adopted) at ``mountpoint``: into the tables, counted as a user of
        ``served`` (now in ``_served``) and ``layer``."""
        self._served[key] = served
        served.mounts += 1
        layer.mounts += 1
        files = layer.files
        mount = self._mounts[mountpoint] = _Mount(
            mountpoint=mountpoint, mode=mode, layer=files.digest, ref=ref, store=layer.store.url,
            blob_id=files.manifest.blob_id, trace=served.trace_path, prefetch=prefetch, created=created,
            chunks=len(layer.blob.blob_map.entries), data_bytes=layer.usage.data_bytes)
        return mount

    def _drop_unused(self, layer: _Layer, served: _Served) -> None:
        """After a failed mount: drop the trace and the layer made for it, unless other mounts use them."""
        if not served.mounts:
            _close_trace(served, remove=True)
        if not layer.mounts:
            del self._layers[layer.digest]

    async def _adopt_mounts(self, mounter: LayerMounter) -> None:
        """raw binding, when open_mounter took over the FUSE session of a daemon that died (see "Daemon
        restarts" in docs/architecture.md): serve again each complete mount its table lists that is still
        ours at its mountpoint, as it was (layer, store, mode; a new trace, no prefetch). Runs before the
        session is served: nothing here may stat a mountpoint, which would wait for FUSE forever. A mount
        that cannot be adopted (its store fails) is left to _clean_stale_mounts, which detaches it."""
        self._mounter = mounter
        for entry in self._read_mount_table():
            mountpoint, mode, digest = entry["mountpoint"], entry["mode"], entry["layer"]
            if entry.get("mounting"):
                continue
            top = await trio.to_thread.run_sync(_top_mount, mountpoint)
            if top is None or not _is_ours(top, mode, mounter.meta_path(digest), digest):
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
        files = await self._open_layer(store, entry["layer"])
        layer = self._layers.get(files.digest) or self._add_layer(files, store, await self._open_blob(files, store))
        key, served = self._served_for(layer, mode, entry.get("ref", files.digest))
        try:
            await self._mounter.adopt_layer(files, served.blob, mountpoint, mode=mode)
        except BaseException:
            self._drop_unused(layer, served)
            raise
        self._record_mount(mountpoint, mode, entry.get("ref", files.digest), layer, key, served, prefetch="",
                           created=entry.get("created", utc_now()))

    async def _clean_stale_mounts(self) -> None:
        """Detach the mounts a dead daemon listed and left behind, but for those adopted (see the module
        docstring)."""
        for entry in self._read_mount_table():
            mountpoint, mode, layer = entry["mountpoint"], entry["mode"], entry["layer"]
            if mountpoint in self._mounts:
                continue
            detached = await trio.to_thread.run_sync(self._detach_stale, mountpoint, mode, layer)
            if detached:
                self.cleaned.append(mountpoint)
                log.warning("detached %s, left mounted (%s mode) by a daemon that died", mountpoint, mode)
        self._save_mount_table()

    def _detach_stale(self, mountpoint: str, mode: str, layer: str) -> bool:
        """Detach our mounts at ``mountpoint`` (several, if stacked); leave anything else there alone."""
        detached = False
        while True:
            entry = _top_mount(mountpoint)
            if entry is None or not _is_ours(entry, mode, self._mounter.meta_path(layer), layer):
                if entry is not None and not detached:
                    log.warning("%s holds a mount that is not ours (%s %s); leaving it", mountpoint, *entry[:2])
                return detached
            try:
                umount(mountpoint, lazy=True)
            except DsecError as exc:
                log.error("cannot detach the stale mount %s: %s", mountpoint, exc)
                return detached
            detached = True

    # -- prefetch

    def _start_prefetch(self, layer: _Layer, plist: prefetch_list.PrefetchList, path: str,
                        served: _Served) -> _Prefetch:
        if layer.prefetch is not None and layer.prefetch.state == "running":
            raise ConflictError("a prefetch of this layer is already running", where=f"layer {layer.digest}")
        job = _Prefetch(layer=layer.digest, list=path, chunks=len(plist.entries), bytes=plist.bytes)
        layer.prefetch = job
        self._prefetches.append(job)
        self._nursery.start_soon(self._prefetch, layer, plist, job, served)
        return job

    async def prefetch(self, mountpoint: str, path: str) -> dict:
        """Fetch the prefetch list at ``path`` for the layer mounted at ``mountpoint``, in the background."""
        mountpoint, path = os.path.realpath(mountpoint), os.path.abspath(path)
        plist = await trio.to_thread.run_sync(prefetch_list.load, path)
        async with self._lock:
            mount = self._mounts.get(mountpoint)
            if mount is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            layer = self._layers[mount.layer]
            plist.verify(layer.blob.blob_map, layer=layer.digest)
            served = self._served[_served_key(mount.mode, layer.files)]
            return self._start_prefetch(layer, plist, path, served).to_json()

    async def _prefetch(self, layer: _Layer, plist: prefetch_list.PrefetchList, job: _Prefetch,
                        served: _Served) -> None:
        started = time.monotonic()
        with job.cancel_scope:
            try:
                window = trio.Semaphore(PREFETCH_GROUPS_IN_FLIGHT)

                async def fetch_group(group: list[prefetch_list.PrefetchEntry]) -> None:
                    try:
                        await self._prefetch_group(layer, group, job, served)
                    finally:
                        window.release()

                async with trio.open_nursery() as nursery:
                    for group in _prefetch_groups(plist.entries):
                        await window.acquire()
                        nursery.start_soon(fetch_group, group)
                job.state = "done"
            except Exception as exc:
                job.state = "failed"
                log.error("prefetch of layer %s failed: %s", layer.digest[:12], exc)
        if job.state == "running":
            job.state = "cancelled"
        job.finished = utc_now()
        log.info("prefetch of layer %s %s: %d of %d chunks (%d bytes) in %.1f s, %d failed", layer.digest[:12],
                 job.state, job.done_chunks, job.chunks, job.done_bytes, time.monotonic() - started, job.failed_chunks)

    async def _prefetch_group(self, layer: _Layer, group: list[prefetch_list.PrefetchEntry], job: _Prefetch,
                              served: _Served) -> None:
        """Fetch one group into the cache (fetcher.warm: planned in one go, no bytes held); count and
        trace each chunk as it lands."""
        store, fetch_log = layer.store, self._fetch_log
        entries = {entry.digest: entry for entry in group}
        mark, started = fetch_log.mark(), time.monotonic_ns()

        def landed(digest: bytes, data: bytes | None, error: BaseException | None) -> None:
            if error is not None and not isinstance(error, DsecError):
                raise error  # a bug, not a chunk the store failed to give: the job fails
            entry, bad = entries[digest], error is not None
            if bad:
                log.warning("prefetch of layer %s: %s", layer.digest[:12], error)
            job.failed_chunks += bad
            job.done_chunks += not bad
            if data is not None and self.memory.bytes + len(data) <= self.memory.max_bytes:
                self.memory.put(digest, data)
            job.done_bytes += 0 if bad else entry.length
            # A cancelled job's mount may have failed, its trace closed: it records nothing more.
            trace = None if job.cancel_scope.cancel_called else served.blob.trace
            if trace is not None:
                flags = FLAG_PREFETCH | FLAG_BLOB | (FLAG_ERROR if bad else 0)
                if fetch_log.fetched_since(mark, [digest]):
                    flags |= FLAG_MISS
                trace.record(nid=0, offset=entry.offset, length=entry.length, chunk=entry.chunk,
                             latency_us=(time.monotonic_ns() - started) // 1000, flags=flags)

        await store.fetcher.warm([(digest, store.chunk_index.get(digest)) for digest in entries],
                                 priority=PREFETCH, label=layer.digest, landed=landed)

    # -- traces

    async def _flush_traces_now_and_then(self) -> None:
        next_prune = time.monotonic() + TRACE_PRUNE_SECONDS
        while True:
            await trio.sleep(TRACE_FLUSH_SECONDS)
            for served in self._served.values():
                if served.blob.trace is not None:
                    served.blob.trace.flush()
            if time.monotonic() >= next_prune:
                await self._prune_traces()
                next_prune = time.monotonic() + TRACE_PRUNE_SECONDS

    async def _prune_traces(self) -> None:
        """Remove old closed traces (trace.prune_traces) past the options' age and size limits."""
        open_traces = frozenset(served.trace_path for served in self._served.values())
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

    def _close_traces(self) -> None:
        for served in self._served.values():
            _close_trace(served)
        self._served.clear()

    def _close_stores(self) -> None:
        for context in self._stores.values():
            context.store.close()
        self._stores.clear()

    # -- status, cache, metrics

    def mounts(self) -> list[dict]:
        return [mount.to_json() for mount in self._mounts.values()]

    def cache_status(self) -> dict:
        stats = asdict(self._cache.stats())
        memory = asdict(self.memory.figures())
        return {"directory": self._cache.directory, **stats, **{f"memory_{k}": v for k, v in memory.items()}}

    async def evict(self, to_bytes: int) -> dict:
        """Evict the disk cache (least recently used first) and the memory cache down to ``to_bytes``."""
        if to_bytes < 0:
            raise InputError(f"cannot evict to a negative size ({to_bytes})", where="cache evict")
        evicted = await trio.to_thread.run_sync(self._cache.evict_to, to_bytes)
        self.memory.shrink_to(to_bytes)
        log.info("evicted %d chunks from the cache (down to %d bytes)", evicted, to_bytes)
        return {"evicted": evicted, **self.cache_status()}

    def _fetch_stats(self) -> dict[str, FetchStats]:
        """FetchStats by layer, summed over the stores' fetchers."""
        merged: dict[str, FetchStats] = {}
        for context in self._stores.values():
            for label, stats in context.fetcher.all_stats().items():
                merged[label] = _add_stats(merged.get(label), stats)
        return merged

    def figures(self) -> NodeFigures:
        fetch = self._fetch_stats()
        layers = []
        for digest in sorted(set(fetch) | set(self._usage)):
            usage = self._usage.get(digest)
            layers.append(LayerFigures(
                layer=digest, fetch=fetch.get(digest) or FetchStats(digest),
                data_bytes=usage.data_bytes if usage else 0, used_bytes=usage.used_bytes if usage else 0,
                reads=usage.reads if usage else 0, read_errors=usage.read_errors if usage else 0))
        fetchers = [context.fetcher for context in self._stores.values()]
        return NodeFigures(
            layers=layers, cache=self._cache.stats(), memory=self.memory.figures(),
            mounts={mode: sum(m.mode == mode for m in self._mounts.values()) for mode in MODES},
            prefetch_running=sum(job.state == "running" for job in self._prefetches),
            store_reads_running=sum(f.store_reads_running for f in fetchers),
            store_reads_waiting={p.name.lower(): sum(f.waiting(p) for f in fetchers) for p in Priority})

    def status(self) -> dict:
        fetch = self._fetch_stats()
        layers = []
        for digest, usage in sorted(self._usage.items()):
            stats = fetch.get(digest) or FetchStats(digest)
            layers.append({
                "layer": digest, "mounts": sum(m.layer == digest for m in self._mounts.values()),
                "data_bytes": usage.data_bytes, "used_bytes": usage.used_bytes,
                "fetched_ratio": usage.used_bytes / usage.data_bytes if usage.data_bytes else 0.0,
                "reads": usage.reads, "read_errors": usage.read_errors,
                "chunks_fetched": stats.chunks_fetched, "bytes_fetched": stats.bytes_fetched,
                "cache_hits": stats.hits, "cache_misses": stats.misses, "fetch_errors": stats.errors,
                "corrupt": stats.corrupt, "timeouts": stats.timeouts})
        return {
            "pid": os.getpid(), "version": _version(), "started": self._started, "socket": self.options.socket_path,
            "state_dir": self.state_dir, "cache_dir": self._cache.directory,
            "store": self.options.store_url or default_store_url(), "fuse_binding": self.options.fuse_binding,
            "mounts": self.mounts(), "layers": layers, "prefetches": [job.to_json() for job in self._prefetches],
            "cache": self.cache_status(), "cleaned": list(self.cleaned),
        }

    # -- HTTP routes

    def _register_routes(self) -> None:
        api = self.api
        api.route("GET", "/v1/status", self._get_status)
        api.route("GET", "/v1/mounts", self._get_mounts)
        api.route("POST", "/v1/mounts", self._post_mount)
        api.route("POST", "/v1/umount", self._post_umount)
        api.route("GET", "/v1/prefetch", self._get_prefetch)
        api.route("POST", "/v1/prefetch", self._post_prefetch)
        api.route("GET", "/v1/cache", self._get_cache)
        api.route("POST", "/v1/cache/evict", self._post_evict)
        api.route("GET", "/metrics", self._get_metrics)

    async def _get_status(self, request: Request) -> dict:
        return self.status()

    async def _get_mounts(self, request: Request) -> dict:
        return {"mounts": self.mounts()}

    async def _post_mount(self, request: Request) -> dict:
        body = request.json()
        return await self.mount(
            _field(body, "layer", str), _field(body, "mountpoint", str), mode=_field(body, "mode", str, "kernel"),
            store_url=_field(body, "store", str, None), prefetch=_field(body, "prefetch", str, None),
            fuse_binding=_field(body, "fuse_binding", str, None))

    async def _post_umount(self, request: Request) -> dict:
        body = request.json()
        mountpoint = _field(body, "mountpoint", str)
        await self.unmount(mountpoint, lazy=_field(body, "lazy", bool, False))
        return {"mountpoint": os.path.realpath(mountpoint)}

    async def _get_prefetch(self, request: Request) -> dict:
        return {"prefetches": [job.to_json() for job in self._prefetches]}

    async def _post_prefetch(self, request: Request) -> dict:
        body = request.json()
        return await self.prefetch(_field(body, "mountpoint", str), _field(body, "list", str))

    async def _get_cache(self, request: Request) -> dict:
        return self.cache_status()

    async def _post_evict(self, request: Request) -> dict:
        return await self.evict(_field(request.json(), "to", int, 0))

    async def _get_metrics(self, request: Request) -> Response:
        return Response(200, self.metrics.render(), MetricsPage.content_type)


@contextlib.asynccontextmanager
async def _nursery_cancelled_on_exit() -> AsyncIterator[trio.Nursery]:
    """A nursery for background tasks that run until the block is left."""
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        finally:
            nursery.cancel_scope.cancel()


_REQUIRED = object()


def _field(body: dict, name: str, kind: type, default=_REQUIRED):
    """``body[name]``, checked to be a ``kind`` (or null when the default is None)."""
    value = body.get(name, default)
    if value is _REQUIRED:
        raise InputError(f"the request needs the field {name!r}", where="request body")
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"field {name!r} must be a {kind.__name__}, got {value!r:.80}", where="request body")
    return value


def _checked_mountpoint(path: str) -> str:
    if not os.path.isabs(path):
        raise InputError("the mountpoint must be an absolute path (the daemon's working directory is not "
                         "yours)", where=path)
    path = os.path.realpath(path)
    if not os.path.isdir(path):
        raise InputError("the mountpoint is not an existing directory", where=path)
    return path


def _close_trace(served: _Served, *, remove: bool = False) -> None:
    trace, served.blob.trace = served.blob.trace, None
    if trace is not None:
        trace.close()
        if remove:
            os.unlink(trace.path)


def _add_stats(total: FetchStats | None, stats: FetchStats) -> FetchStats:
    if total is None:
        return stats
    summed = FetchStats(stats.label)
    for name in ("hits", "misses", "coalesced", "chunks_fetched", "bytes_fetched", "store_reads", "errors",
                 "corrupt", "timeouts", "latency_sum"):
        setattr(summed, name, getattr(total, name) + getattr(stats, name))
    summed.latency_counts = [a + b for a, b in zip(total.latency_counts, stats.latency_counts)]
    return summed


def _unescape_mountinfo(field_: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1:i + 4].isdigit():
            out.append(chr(int(field_[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def _top_mount(path: str) -> tuple[str, str, str] | None:
    """(fstype, source, root) of the topmost mount at exactly ``path``, or None."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            if _unescape_mountinfo(fields[4]) == path:
                found = (fields[separator + 1], _unescape_mountinfo(fields[separator + 2]),
                         _unescape_mountinfo(fields[3]))
    return found


def _is_ours(entry: tuple[str, str, str], mode: str, meta_path: str, layer: str) -> bool:
    """A kernel-mode mount is EROFS from our meta image; a fuse-mode one a bind mount of our session's
    layers/<digest>/ directory."""
    fstype, source, root = entry
    if mode == "kernel":
        return fstype == "erofs" and source == meta_path
    return fstype.startswith("fuse") and source == "dsecfs" and root == f"/layers/{layer}"


def _version() -> str:
    try:
        return metadata.version("dsecfs")
    except metadata.PackageNotFoundError:
        return "unknown"


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
