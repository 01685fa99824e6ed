"""The node daemon's mounts (a part of NodeDaemon, daemon.py): the paths a request names (resolved in a
worker thread, never on our own mounts: request_paths.py), mount and unmount, what a layer mounted in a
mode shares with its other mounts in that mode (its Served: blob, trace, holders), and at start the
adoption of a dead daemon's mounts and the detaching of those it left behind (mount_table.py).

Threads: the methods run in the daemon's trio thread; resolving paths, mount(2) and umount(2), and
looking at what is mounted run in worker threads. Mounts of different layers run at once (a stack's
layers side by side, each its store round trips, its plans and its mount(2)); ``_turns`` (turns.py,
NodeDaemon's) makes the calls on one mountpoint take turns (``("mountpoint", path)``: a second mount
there waits, then finds it taken; an unmount waits for the mount under way), and so the calls on one
blob (``("blob", blob id)``: a layer's ``layers`` entry, its first open, shared by the mounts that wait
for it, its prefetch, its Served and the use counts, for every layer of that blob), taken in that order.
The tables themselves (``table``, ``layers``, ``_served``) change only between awaits. A layer's
manifest and metadata are read from its store before either turn, so a slow store holds up no other
mount.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator

import trio

from dsec_fs import api
from dsec_fs.api import FILLS, MODES
from dsec_fs.digest import is_hex_digest
from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError
from dsec_fs.layer import parse_ref, utc_now
from dsec_fs.mounts import identity_of, is_below, top_mount, umount_identified

from . import request_paths
from .fetcher import ChunkFetcher
from .layer_mount import LayerMounter, unmount_or_detach
from .mount_table import Mount, is_ours
from .prefetch_list import PrefetchList
from .prefetcher import AUTO_FILL_MIN_ROUND_TRIP, AUTO_FILL_PATIENCE, AUTO_FILL_SAMPLES, fill_entries
from .profile_keeper import ProfileKeeper
from .served_layers import Layer, Served, served_key
from .trace_holders import Holder, Label
from .traced_blob import TracedBlob

log = logging.getLogger(__name__)

MAX_PREFETCH_LIST_BYTES = 64 << 20  # about 400,000 entries: 400 GB of 1 MiB chunks


class DaemonMounts:
    """NodeDaemon's mounts (see the module docstring); its state is NodeDaemon's."""

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
        async with self._turns.take(("mountpoint", mountpoint), ("blob", files.manifest.blob_id)):
            if mountpoint in self.table.mounts:
                raise ConflictError("a layer is already mounted here", where=mountpoint)
            layer = self.layers.get(files.digest)
            new_layer = layer is None
            if new_layer:  # its first open, in its blob's turn: a mount of it that waits for this one shares it
                blob = await self._open_blob(files, store)
                if plist is not None:
                    plist.verify(blob.blob_map, layer=files.digest)
                layer = self._add_layer(files, store, blob)
            elif plist is not None:
                plist.verify(layer.blob.blob_map, layer=files.digest)
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
            if new_layer:
                self._map_files_at_mount(layer, plist)
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
            try:
                self.table.begin(mountpoint, mode, files.digest)
                await self._mounter.mount_layer(files, served.blob, mountpoint, mode=mode)
            except BaseException:
                if job is not None:
                    job.cancel_scope.cancel()
                self.table.end(mountpoint)
                self._drop_unused(layer, served)
                raise
            if job is not None:
                job.fill_ready.set()
            mount = self._record_mount(mountpoint, mode, ref, layer, key, served, prefetch=prefetch or "",
                                       created=utc_now(), prefetch_chunks=job.chunks if job else 0,
                                       profile_key=profile_key, holder=holder)
            self.table.end(mountpoint)
            log.info("mounted layer %s (%s) at %s in %s mode", files.digest[:12], ref, mountpoint, mode)
        return mount_info(mount)

    async def unmount(self, mountpoint: str, *, lazy: bool = False) -> str:
        """Unmount what this daemon mounted at ``mountpoint`` (returned as the table names it). A busy
        mount raises UnavailableError (transient) and stays, unless ``lazy``: then it is detached, and what
        it needs stays served (and traced) until the daemon stops."""
        mountpoint = await self._known_mountpoint(mountpoint)
        async with self._turn_at(mountpoint) as mount:
            if mount is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            await self._mounter.unmount(mountpoint, lazy=lazy)
            del self.table.mounts[mountpoint]
            self.table.save_after_change()
            log.info("unmounted %s%s", mountpoint, " (lazily)" if lazy else "")
            if not lazy:
                self._release(mount)  # (lazily: still served and traced, for its holders, until the daemon stops)
        return mountpoint

    @contextlib.asynccontextmanager
    async def _turn_at(self, mountpoint: str) -> AsyncIterator[Mount | None]:
        """The turn of ``mountpoint`` and of the blob of the layer mounted there; yields its Mount, or None
        (only the mountpoint's turn taken) if it has none."""
        async with self._turns.take(("mountpoint", mountpoint)):
            mount = self.table.mounts.get(mountpoint)
            if mount is None:
                yield None
                return
            async with self._turns.take(("blob", mount.blob_id)):
                yield mount

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
                await unmount_or_detach(self.unmount, mountpoint)

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
                              on_miss=functools.partial(self._missed_in, layer))
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
        self.table.save_after_change()

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
            try:  # the mount checked, even if a directory on the way is swapped meanwhile
                umount_identified(identity_of(entry), mountpoint, lazy=True)
            except DsecError as exc:
                log.error("cannot detach the stale mount %s: %s", mountpoint, exc)
                return detached
            detached = True


def _store_is_slow(fetcher: ChunkFetcher, waited: float) -> bool | None:
    """Fill ``auto``'s test (prefetcher.AUTO_FILL_MIN_ROUND_TRIP), ``waited`` seconds after the mount: None
    until the store's round trip is known well enough."""
    round_trip = fetcher.round_trip(AUTO_FILL_SAMPLES if waited < AUTO_FILL_PATIENCE else 1)
    return None if round_trip is None else round_trip >= AUTO_FILL_MIN_ROUND_TRIP


def mount_info(mount: Mount, *, idle_until: str = "") -> api.MountInfo:
    return api.MountInfo(**mount.to_json(), idle_until=idle_until)
