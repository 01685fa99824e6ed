"""The node daemon's prefetches and traces (a part of NodeDaemon, daemon.py): prefetch lists and profiles
fetched in the background for a mounted layer (prefetcher.py), the holders of each served blob (``hold``,
``unhold``: a sandbox holding a layer may start the prefetch of its combination's profile) and the traces
they label (trace_segments.py), flushed every TRACE_FLUSH_SECONDS and pruned every TRACE_PRUNE_SECONDS.

Threads: the methods run in the daemon's trio thread; profile lookups and plans and trace pruning run in
worker threads. What looks at a mount takes the turns of its mountpoint and its blob (``_turn_at``,
daemon_mounts.py), so it waits for a mount or unmount of it under way; the rest of the state is
NodeDaemon's and needs no lock (one trio thread).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import trio

from dsec_fs import api
from dsec_fs.errors import ConflictError, DsecError, NotFoundError

from .prefetch_list import PrefetchEntry, PrefetchList
from .prefetcher import PrefetchJob
from .profile_keeper import ProfileKeeper
from .served_layers import Layer, Served, served_key
from .trace import prune_traces
from .trace_holders import Holder

log = logging.getLogger(__name__)

TRACE_FLUSH_SECONDS = 5.0  # so a live trace can be read while its mount lives
TRACE_PRUNE_SECONDS = 600.0  # how often old traces are pruned (and once at start)
FILL_CACHE_SHARE = 0.9  # a prefetch stops before the disk cache would hold more than this share of its bound


class DaemonTraces:
    """NodeDaemon's prefetches and traces (see the module docstring); its state is NodeDaemon's."""

    # -- prefetch

    def _cache_room(self) -> int:
        stats = self.cache.stats()  # the frames a fill kept count at the size reading them makes them
        return int(stats.max_bytes * FILL_CACHE_SHARE) - stats.bytes - self.cache.frame_growth

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
        async with self._turn_at(mountpoint) as mount:
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
        async with self._turn_at(mountpoint):
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
            async with self._turn_at(mountpoint) as now:
                if found is None or now is not mount or (
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
        async with self._turn_at(mountpoint):
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
