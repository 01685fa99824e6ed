"""The node daemon's stores and layers (a part of NodeDaemon, daemon.py): one StoreContext per store URL,
opened and wrapped once (faults, latency, limit, retry, the ref cache outermost), its chunk index and
fetcher; layers opened from them (``_open_layer``: the ref, the manifest, then meta.erofs, the blob map,
the pack indexes and the profile objects side by side, within the fetcher's deadline), and the map of a
layer's miss readahead, built in the background when first needed.

Threads: the methods run in the daemon's trio thread; opening a store or a layer runs in worker threads
(trio.to_thread, fetcher.call_store). ``_stores_lock`` (a trio.Lock, NodeDaemon's) guards ``stores``, so
a URL is opened once; the rest of the state is NodeDaemon's and needs no lock (one trio thread).

Bounds: at most MAX_STORES store contexts; when a new URL finds them all open, those no layer uses (but
the daemon's own store's) are let go: dropped from ``stores``, their counters kept for the figures
(node_status.LetGoFigures), not closed (a mount opening a layer, or a profile publish queued, may still
hold one: it closes when the last of them lets go of it). If every one is used, the new URL is refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import trio

from dsec_fs import api
from dsec_fs.chunks import ChunkIndex, check_packs_present
from dsec_fs.errors import DsecError, UnavailableError
from dsec_fs.layer import LayerFiles, Manifest, open_layer, parse_ref, resolve
from dsec_fs.store import default_store_url, keys, open_store
from dsec_fs.store.base import Store
from dsec_fs.store.ref_cache import RefCacheStore
from dsec_fs.store.wrappers import CountingStore, LatencyStore, StoreWrapper, find_wrapper, wrap_store

from .blob_reader import BlobChunk, LayerBlob, open_layer_blob
from .fetcher import ChunkFetcher
from .memory_cache import MemoryFrontedFetcher
from .miss_readahead import FileChunks, MissReadahead
from .prefetch_list import PrefetchList
from .profile_keeper import FoundProfile
from .served_layers import Layer, StoreContext
from .store_reads import ROUND_TRIP_READ_BYTES
from .traced_blob import LayerUsage

log = logging.getLogger(__name__)

FAULTS_ENV = "DSECFS_FAULTS"  # FaultStore rules for every store the daemon opens (tests)
# Store URLs held open at once. A node reads its layers from a handful of stores (its own, a team's, a
# base image's), but a mount request may name any URL, and each one opened holds a store client (boto3's
# takes MiBs), a chunk index of the packs it read and a fetcher, which were kept for ever: a client naming
# new URLs grew the daemon without bound. Past this many, those no layer uses are let go, and beyond
# those a new URL is refused.
MAX_STORES = 16


class DaemonStores:
    """NodeDaemon's stores and layers (see the module docstring); its state is NodeDaemon's."""

    async def store(self, url: str | None = None) -> Store:
        """The store at ``url`` (default: the daemon's), opened and wrapped as mounts read it."""
        return (await self._store_context(url)).store

    async def _store_context(self, url: str | None) -> StoreContext:
        own = self.options.store_url or default_store_url()
        url = url or own
        async with self._stores_lock:
            context = self.stores.get(url)
            if context is None:
                if len(self.stores) >= MAX_STORES:
                    self._let_go_unused_stores(keep=own)
                if len(self.stores) >= MAX_STORES:
                    raise UnavailableError(f"the daemon reads from {MAX_STORES} stores already (at most "
                                           f"{MAX_STORES}), each used by a mounted layer; unmount the layers of "
                                           "one of them first", where=url, transient=False)
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

    def _let_go_unused_stores(self, *, keep: str) -> None:
        """Drop the store contexts no layer uses, but ``keep``'s (see the module docstring)."""
        used = {id(layer.store) for layer in self.layers.values()}
        for url, context in list(self.stores.items()):
            if url != keep and id(context) not in used:
                del self.stores[url]
                self.stores_let_go.add(context)
                log.info("let go of store %s: no mounted layer reads from it", url)

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
            try:
                if keeper is None:
                    return open_layer(reads, digest, on_manifest=on_manifest, reads=store.copies), None
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="profile-lookup") as pool:
                    lookup = pool.submit(keeper.lookup, store.store, digest, profile_of, combination)
                    files = open_layer(reads, digest, on_manifest=on_manifest, reads=store.copies)
                    return files, lookup.result()
            except DsecError:
                _forget_manifest(store, digest)  # here, not after the deadline: this thread may outlive it
                raise

        # Within the fetcher's deadline and its bounds on stuck threads (fetcher.call_store).
        files, found = await store.fetcher.call_store(f"layer {ref} in {store.url}", open_with_profile)
        store.indexed_layers.add(files.digest)
        return files, found

    async def _open_blob(self, files: LayerFiles, store: StoreContext) -> LayerBlob:
        try:
            return await open_layer_blob(files, store.reader, chunk_index=store.chunk_index, label=files.digest)
        except DsecError:  # the manifest may be what failed (its blob_blocks): read it again next time
            await trio.to_thread.run_sync(_forget_manifest, store, files.digest)
            raise

    def _add_layer(self, files: LayerFiles, store: StoreContext, blob: LayerBlob) -> Layer:
        """A layer new to this daemon; its mount (or adoption) then calls ``_map_files_at_mount``."""
        usage = self.usage.get(files.digest) or self.usage.setdefault(files.digest, LayerUsage(blob))
        layer = self.layers[files.digest] = Layer(files, blob, store, usage)
        if self.options.miss_readahead_bytes and self._background is not None:
            layer.readahead = MissReadahead(blob, self.options.miss_readahead_bytes)
        return layer

    def _map_files_at_mount(self, layer: Layer, plist: PrefetchList | None) -> None:
        """At a new layer's first mount, with the prefetch it starts (``plist``: a profile's or a list's,
        or None): build the map of its miss readahead now only when its first reads will miss, that is
        when the node holds none of its chunks and no prefetch brings any; otherwise at the first read
        that waits for the store for a chunk the prefetch does not bring (``_missed_in``)."""
        if layer.readahead is None:
            return
        if plist is not None and plist.entries:
            layer.planned = bytearray(len(layer.blob.blob_map.entries))
            for entry in plist.entries:
                layer.planned[entry.chunk] = 1
        elif all(self.cache.lacks(digest) for _blkaddr, digest, _length in layer.blob.blob_map.entries):
            self._map_files_soon(layer)  # nothing of it on this node, and nothing coming: its first reads miss

    def _missed_in(self, layer: Layer, chunks: list[BlobChunk]) -> bool:
        """TracedBlob's ``on_miss``: a read of ``layer`` waited for the store. True (and the map started)
        unless it waited only for chunks the layer's prefetch brings."""
        if layer.planned is not None and all(layer.planned[chunk.entry] for chunk in chunks):
            return False
        self._map_files_soon(layer)
        return True

    def _map_files_soon(self, layer: Layer) -> None:
        """Start building the map of the layer's miss readahead, unless it is under way or built
        (``_map_files_at_mount`` says when). When it walked the image into a LayerIndex it was the biggest
        piece of a warm start's own work (0.6 s of CPU for the numpy toolkit and its base, sampled,
        contending for the GIL with up and with the trio thread serving the command's reads; issue 13,
        other8 in docs/benchmarks.md); read from the image's records it is a quarter of that (ramap14),
        and on a node that holds every chunk a start reads it is still never needed."""
        if layer.readahead is None or layer.files_mapped or self._background is None:
            return
        layer.files_mapped = True
        self._background.start_soon(self._map_files, layer)

    async def _map_files(self, layer: Layer) -> None:
        """Which chunks belong to which file, for the layer's miss readahead (a worker thread: it reads
        the image's records); reads before it is done bring nothing along."""
        label = f"layer {layer.digest[:12]} meta.erofs"
        try:
            files = await trio.to_thread.run_sync(
                lambda: FileChunks.of_image(layer.files.meta, layer.blob.blob_map, source=label))
        except DsecError as exc:
            log.warning("no miss readahead for layer %s: %s", layer.digest[:12], exc)
            layer.readahead.unmapped = True
            return
        layer.readahead.ready(files)

    def _close_stores(self) -> None:
        for context in self.stores.values():
            context.store.close()
        self.stores.clear()


def _forget_manifest(store: StoreContext, digest: str) -> None:
    """An open of layer ``digest`` failed: the node's copy of its manifest goes (meta_cache.py says why)."""
    if store.copies is not None:
        store.copies.forget_manifest(store.store, digest)


class _LayerObjectTimer(StoreWrapper):
    """The store as a layer open sees it, telling ``note`` how long each GET of a small layer object took
    (its manifest, its blob map, at most store_reads.ROUND_TRIP_READ_BYTES): a sample of the store's round
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
