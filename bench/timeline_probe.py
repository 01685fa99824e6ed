"""Time stamps of a cold start, for bench_fill_timeline.py: installed into a daemon process (or the bench's
own, for the pull) before it starts, it wraps a few methods and writes one JSON line per event to a file.

    import timeline_probe; timeline_probe.install("/tmp/events.jsonl")

Events (times are time.monotonic(), the same clock in every process):

- ``link``: a call to the emulated store (LatencyStore): its start, the end of its round trip, its end
  (the transfer's), the bytes it carried and the kind of object (pack, layer, bench tar, other);
- ``store_read``: one of the fetcher's store reads: queued for a slot, granted, ended; its priority when
  queued and as granted, its compressed bytes and chunks;
- ``read_for``: the same store read in its worker thread (StoreReads._read_for): when the thread began it
  and when it returned (after the store call, the chunks' decompression and check); ``ticket`` matches it
  with its ``store_read``, ``thread`` with its ``link`` calls;
- ``read``: a FUSE read of a layer's blob: start, end, whether it waited for the store;
- ``fill``: a fill's decision (prefetcher._fill_wanted) and when it was made;
- ``mount``: a layer mount by the daemon, start and end;
- ``span``: one call of a step of ``up`` and of a layer's mount (SPANS: the daemon's open of a layer, its
  blob, mount(2), the state files written, the overlay, the runtime's command), start, end and thread.

Nothing here changes what the daemon does; each event costs one write to a line-buffered file.

Threads: ``_emit`` may be called from any thread (its lock guards the file).
"""

from __future__ import annotations

import json
import threading
import time

_lock = threading.Lock()
_out = None
_restore: list = []  # what uninstall undoes (the bench's own process: the pull)


def _emit(kind: str, **fields) -> None:
    line = json.dumps({"kind": kind, **fields})
    with _lock:
        _out.write(line + "\n")


def _key_kind(key: str) -> str:
    for prefix, kind in (("packs/", "pack"), ("layers/", "layer"), ("bench/", "tar"), ("profiles/", "profile")):
        if key.startswith(prefix):
            return kind
    return "other"


def install(path: str, *, daemon: bool = True) -> None:
    global _out
    _out = open(path, "a", buffering=1)
    from dsec_fs.store.wrappers import LatencyStore

    def _call(self, op, key, fn, sent=0):
        started, marks, result = time.monotonic(), {}, None

        def fn_timed():
            marks["rtt"] = time.monotonic()
            return fn()

        try:
            result = _orig_call(self, op, key, fn_timed, sent)
            return result
        finally:
            got = len(result) if op == "get" and isinstance(result, (bytes, bytearray, memoryview)) else 0
            _emit("link", op=op, what=_key_kind(key), t0=started, t_rtt=marks.get("rtt", started),
                  t1=time.monotonic(), bytes=sent + got, thread=threading.get_ident())

    _orig_call = LatencyStore._call
    LatencyStore._call = _call
    _restore.append(lambda: setattr(LatencyStore, "_call", _orig_call))
    if not daemon:
        return

    from lazy_fetch import daemon as daemon_module
    from lazy_fetch import prefetcher
    from lazy_fetch.store_reads import StoreReads
    from lazy_fetch.store_slots import StoreSlots
    from lazy_fetch.traced_blob import TracedBlob

    granted: dict[int, float] = {}
    orig_acquire = StoreSlots.acquire

    async def acquire(self, ticket):
        await orig_acquire(self, ticket)
        granted[id(ticket)] = time.monotonic()

    StoreSlots.acquire = acquire
    orig_store_read = StoreReads.read

    async def store_read(self, run, ticket, stats, *args):
        queued, priority = time.monotonic(), int(ticket.priority)
        try:
            return await orig_store_read(self, run, ticket, stats, *args)
        finally:
            _emit("store_read", layer=stats.label[:12], t_queued=queued, t_granted=granted.pop(id(ticket), None),
                  t1=time.monotonic(), priority=priority, granted_as=int(ticket.granted_as),
                  bytes=run.end - run.start, chunks=len(run.chunks), ticket=id(ticket))

    StoreReads.read = store_read
    orig_read_for = StoreReads._read_for

    def read_for(self, run, ticket, *args):
        started = time.monotonic()
        try:
            return orig_read_for(self, run, ticket, *args)
        finally:
            _emit("read_for", t0=started, t1=time.monotonic(), ticket=id(ticket), thread=threading.get_ident())

    StoreReads._read_for = read_for
    orig_read = TracedBlob.read

    async def read(self, offset, length):
        started, mark = time.monotonic(), self.fetch_log.mark()
        try:
            return await orig_read(self, offset, length)
        finally:
            chunks = self.blob.chunks_for_range(offset, length)
            _emit("read", layer=self.blob.label[:12], t0=started, t1=time.monotonic(), offset=offset, length=length,
                  missed=self.fetch_log.fetched_since(mark, (chunk.digest for chunk in chunks)))

    TracedBlob.read = read
    orig_fill_wanted = prefetcher._fill_wanted

    async def _fill_wanted(job, fill_when, fetcher):
        started = time.monotonic()
        wanted = await orig_fill_wanted(job, fill_when, fetcher)
        _emit("fill", layer=job.layer[:12], t0=started, t1=time.monotonic(), wanted=wanted,
              round_trip=fetcher.round_trip())
        return wanted

    prefetcher._fill_wanted = _fill_wanted
    orig_mount = daemon_module.NodeDaemon.mount

    async def mount(self, ref, mountpoint, **kwargs):
        started = time.monotonic()
        try:
            return await orig_mount(self, ref, mountpoint, **kwargs)
        finally:
            _emit("mount", ref=ref[:40], t0=started, t1=time.monotonic())

    daemon_module.NodeDaemon.mount = mount
    for module, qualname in SPANS:
        _wrap_span(module, qualname)


# The steps of `up` and of a layer's mount timed as spans: (module, attribute path in it).
SPANS = (
    ("overlay.node_service", "DaemonLayers.acquire_async"),
    ("overlay.sandbox", "SandboxManager.up"),
    ("overlay.sandbox", "SandboxManager._save"),
    ("overlay.sandbox", "mount_stack"),
    ("overlay.sandbox", "_take_root_attributes"),
    ("overlay.node_service", "SandboxService._post_up"),
    ("overlay.node_service", "SandboxService._post_exec"),
    ("overlay.runtime", "RuncContainer.create"),
    ("overlay.runtime", "_communicate"),
    ("lazy_fetch.daemon_stores", "DaemonStores._open_layer"),
    ("lazy_fetch.daemon_stores", "DaemonStores._open_blob"),
    ("lazy_fetch.daemon_stores", "DaemonStores._add_layer"),
    ("lazy_fetch.daemon_stores", "DaemonStores._map_files_at_mount"),
    ("lazy_fetch.daemon_mounts", "DaemonMounts._served_for"),
    ("lazy_fetch.daemon_mounts", "DaemonMounts._start_prefetch"),
    ("lazy_fetch.daemon_mounts", "DaemonMounts._record_mount"),
    ("lazy_fetch.daemon_mounts", "fill_entries"),
    ("lazy_fetch.daemon_mounts", "ProfileKeeper.plan"),
    ("lazy_fetch.mount_table", "MountTable.save"),
    ("lazy_fetch.layer_mount", "LayerMounter.mount_layer"),
    ("lazy_fetch.layer_mount", "LayerMounter._place_meta_and_mount"),
    ("lazy_fetch.daemon_stores", "DaemonStores._map_files"),
    ("lazy_fetch.layer_mount", "LayerMounter.save_session_state"),
    ("lazy_fetch.layer_mount", "_check_image_filesystem"),
    ("lazy_fetch.layer_mount", "_mount_erofs_direct"),
    ("lazy_fetch.daemon_stores", "open_layer_blob"),
    ("lazy_fetch.daemon_stores", "open_layer"),
    ("lazy_fetch.daemon_stores", "check_packs_present"),
    ("lazy_fetch.daemon_stores", "ChunkIndex.load_packs"),
)


def _wrap_span(module_name: str, qualname: str) -> None:
    import functools
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    orig = getattr(owner, name, None)
    if orig is None:
        return  # not in this tree (a baseline's)

    def emit(started):
        _emit("span", what=qualname, t0=started, t1=time.monotonic(), thread=threading.current_thread().name)

    if inspect.iscoroutinefunction(orig):
        @functools.wraps(orig)
        async def wrapped(*args, **kwargs):
            started = time.monotonic()
            try:
                return await orig(*args, **kwargs)
            finally:
                emit(started)
    else:
        @functools.wraps(orig)
        def wrapped(*args, **kwargs):
            started = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                emit(started)
    setattr(owner, name, wrapped)


def uninstall() -> None:
    """Undo ``install(daemon=False)`` and close the file."""
    global _out
    while _restore:
        _restore.pop()()
    _out.close()
    _out = None
