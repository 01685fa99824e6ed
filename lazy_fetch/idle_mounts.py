"""Layer mounts whose last user went, kept for a grace period, then unmounted.

    idle = IdleMounts(grace=60.0)
    nursery.start_soon(idle.run)                  # unmounts what stayed idle for the whole grace
    if not idle.park(mountpoint, unmount):        # the last user went; ``unmount``: async, no arguments
        await unmount()                           # parking is off (grace 0) or the daemon stops: now
    idle.take(mountpoint)                         # a new user came within the grace: it stays mounted
    await idle.unmount_all()                      # the daemon stops: every idle mount goes now

Why: a sandbox started again soon after its ``down`` (a retried task, the next step of an agent) finds
its layers still mounted, their metadata and blobs open and their pages in the page cache, and its
``up`` asks the store for nothing (overlay/node_service.py parks sandbox layers here). An idle mount
costs a kernel mount and the daemon's copy of the layer's metadata, nothing else; the grace bounds how
long that is held for nothing.

Whoever parks a mount owns the decision: ``unmount`` is called once the grace ends unless ``take`` came
first, and it must check for itself that the mount is still unused (a new user may be on its way in
between). A failing ``unmount`` is logged; the mount stays where it is, and the daemon's own stop
unmounts whatever is left.

Threads: the daemon's trio thread only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import trio

from dsec_fs.errors import DsecError

log = logging.getLogger(__name__)

DEFAULT_IDLE_GRACE = 60.0


@dataclass
class _Idle:
    unmount: Callable[[], Awaitable[None]]
    deadline: float  # trio.current_time() at which it goes
    until: str  # the same, as an ISO-8601 UTC time, for status


class IdleMounts:
    def __init__(self, grace: float = DEFAULT_IDLE_GRACE):
        self.grace = grace
        self._idle: dict[str, _Idle] = {}  # mountpoint -> when and how it goes
        self._changed = trio.Event()
        self._stopping = False

    def park(self, mountpoint: str, unmount: Callable[[], Awaitable[None]]) -> bool:
        """Keep ``mountpoint`` mounted for the grace; False (and nothing kept) when the grace is 0 or the
        daemon is stopping: the caller unmounts it now."""
        if self.grace <= 0 or self._stopping:
            return False
        until = datetime.fromtimestamp(time.time() + self.grace, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._idle[mountpoint] = _Idle(unmount, trio.current_time() + self.grace, until)
        self._changed.set()
        log.info("%s is idle: unmounted at %s unless used again", mountpoint, until)
        return True

    def take(self, mountpoint: str) -> bool:
        """A new user of ``mountpoint``: it is no longer idle. Whether it was."""
        return self._idle.pop(mountpoint, None) is not None

    def until(self, mountpoint: str) -> str:
        """When the idle ``mountpoint`` is to be unmounted (ISO-8601 UTC), or "" if it is not idle."""
        idle = self._idle.get(mountpoint)
        return idle.until if idle else ""

    def __len__(self) -> int:
        return len(self._idle)

    async def run(self) -> None:
        """Unmount each parked mount whose grace ended; runs until cancelled."""
        while True:
            now = trio.current_time()
            for mountpoint in [m for m, idle in self._idle.items() if idle.deadline <= now]:
                await self._unmount(mountpoint, self._idle.pop(mountpoint))
            self._changed = trio.Event()
            with trio.move_on_at(min((idle.deadline for idle in self._idle.values()), default=math.inf)):
                await self._changed.wait()

    async def unmount_all(self) -> None:
        """The daemon stops: unmount every idle mount now; later ``park`` calls return False."""
        self._stopping = True
        while self._idle:
            mountpoint = next(iter(self._idle))
            await self._unmount(mountpoint, self._idle.pop(mountpoint))

    @staticmethod
    async def _unmount(mountpoint: str, idle: _Idle) -> None:
        try:
            await idle.unmount()
        except DsecError as exc:
            log.error("cannot unmount the idle mount %s: %s", mountpoint, exc)
