"""Leases: a build's notice to gc that it may be about to name packs gc thinks are garbage.

gc removes a pack in two steps (gc.py): it first soft-deletes it (removes the pack's index object, so
builds that start later no longer deduplicate against it, and writes a trash marker with the time), and
only a later run deletes the pack itself. A build that listed the pack indexes before the soft delete
may still publish a layer that names the pack; its lease is what keeps the pack alive until then:

- a build writes ``leases/<random id>`` before it lists the store's pack indexes, refreshes it every
  ``refresh_seconds`` while it runs, and deletes it when it ends, failed or not;
- gc hard-deletes a trashed pack only when no live lease started before the pack was trashed;
- a lease whose holder has not refreshed it for ``max_age`` (default 24 h) is stale: its holder crashed
  or hangs. gc ignores stale leases and removes them. A holder that could not refresh for that long must
  not publish anything any more: ``Lease.check`` raises.

The same objects under ``gc-locks/`` keep two gc runs from overlapping (``exclusive_lease``): a gc writes
its lease, lists the prefix, and goes ahead only if its own is the only live one there, otherwise it
removes its own and fails. Two runs that start together may both back off; they never both go ahead.

Lease object (JSON)::

    {"started": 1732867200.5,   host wall clock, seconds since the epoch, when the holder began
     "refreshed": 1732867800.5, host wall clock of the last refresh (staleness is measured from it)
     "host": "builder-3", "pid": 4242,  who holds it, for people reading a stuck store
     "purpose": "build base/debian:12"}

A lease is written with ``Store.put_ephemeral``: it means something only while its holder runs, so on a
local store it is not fsynced (a crash that loses it ends its holder too). One a crash left torn or empty
cannot be parsed, so gc counts it as live, blocking every hard delete, until its mtime is max_age old:
about as long as a crashed holder's intact lease blocks them.

Times come from each host's own clock; comparisons across hosts allow ``CLOCK_SKEW``. A lease object that
cannot be parsed is taken at its word as little as possible: it counts as live (started at time 0, so it
blocks every hard delete) until the store's own modification time of the object is older than max_age.

Threads: the thread that acquired a Lease calls ``check``, ``release`` and the context-manager methods.
The lease's refresher thread only writes the lease object and, under ``_lock``, the time of its last
successful refresh, which ``check`` reads.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from .errors import ConflictError, DsecError, NotFoundError, UnavailableError
from .store import keys
from .store.base import Store

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE = 24 * 3600.0
# Hosts' clocks may disagree by this much; every cross-host comparison of times leans the safe way by it.
CLOCK_SKEW = 300.0
# Refresh often enough that dozens of missed refreshes still leave the lease far from stale.
REFRESHES_PER_MAX_AGE = 48


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as read back from the store."""

    key: str
    started: float
    refreshed: float
    host: str
    pid: int
    purpose: str

    def is_stale(self, now: float, max_age: float = DEFAULT_MAX_AGE) -> bool:
        return now - self.refreshed > max_age + CLOCK_SKEW

    def to_dict(self) -> dict:
        return {"key": self.key, "started": self.started, "refreshed": self.refreshed, "host": self.host,
                "pid": self.pid, "purpose": self.purpose}


class Lease:
    """A lease this process holds: ``with Lease(store, purpose=...):`` or ``acquire()`` / ``release()``."""

    def __init__(
        self,
        store: Store,
        *,
        purpose: str = "",
        prefix: str = keys.LEASES,
        max_age: float = DEFAULT_MAX_AGE,
        refresh_seconds: float | None = None,
    ):
        self.store = store
        self.purpose = purpose
        self.key = f"{prefix}{os.urandom(16).hex()}"
        self.max_age = max_age
        self.refresh_seconds = refresh_seconds or max_age / REFRESHES_PER_MAX_AGE
        self.started: float | None = None
        self._lock = threading.Lock()
        self._refreshed_ok = 0.0  # monotonic time of the last successful write; guarded by _lock
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self) -> "Lease":
        """Write the lease and start refreshing it. Raises the store's error if the first write fails."""
        self.started = time.time()
        self._write()
        self._refresher = threading.Thread(target=self._refresh_loop, name=f"lease-{self.key[-8:]}", daemon=True)
        self._refresher.start()
        return self

    def check(self) -> None:
        """Raise UnavailableError if the lease may have gone stale: gc may have deleted what we use."""
        with self._lock:
            since = time.monotonic() - self._refreshed_ok
        if since > self.max_age / 2:  # gc waits max_age + CLOCK_SKEW: a wide margin for what we do next
            raise UnavailableError(
                f"lease not refreshed for {since:.0f} s (max age {self.max_age:.0f} s): gc may have removed "
                "packs this work depends on; start it again", where=self.key, transient=False,
            )

    def release(self) -> None:
        """Stop refreshing and delete the lease. A failed delete is logged, not raised: the lease then
        simply goes stale after max_age, and the caller's own outcome (often an error) stays what it is."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
            self._refresher = None
        try:
            self.store.delete(self.key)
        except DsecError as exc:
            log.warning("could not delete lease %s (it goes stale in %.0f s): %s", self.key, self.max_age, exc)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _write(self) -> None:
        now = time.time()
        body = {"started": self.started, "refreshed": now, "host": os.uname().nodename, "pid": os.getpid(),
                "purpose": self.purpose}
        self.store.put_ephemeral(self.key, json.dumps(body, sort_keys=True).encode())
        with self._lock:
            self._refreshed_ok = time.monotonic()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            try:
                self._write()
            except DsecError as exc:
                log.warning("could not refresh lease %s: %s", self.key, exc)


def list_leases(store: Store, prefix: str = keys.LEASES) -> list[LeaseInfo]:
    """Every lease under ``prefix``, stale ones included (see ``LeaseInfo.is_stale``)."""
    leases = []
    for key in store.list(prefix):
        try:
            leases.append(_parse(key, store.get(key)))
        except NotFoundError:
            continue  # released since it was listed
        except ValueError:
            try:
                mtime = store.mtime(key)
            except NotFoundError:
                continue
            log.warning("lease %s is not a lease object; treating it as live until %.0f", key, mtime)
            leases.append(LeaseInfo(key=key, started=0.0, refreshed=mtime, host="?", pid=0, purpose="unreadable"))
    return leases


def _parse(key: str, data: bytes) -> LeaseInfo:
    """Raises ValueError (json's or ours) when ``data`` is not a lease object."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    started, refreshed = obj.get("started"), obj.get("refreshed")
    if not all(type(t) in (int, float) for t in (started, refreshed)):
        raise ValueError("no times")
    pid = obj.get("pid")
    return LeaseInfo(key=key, started=float(started), refreshed=float(refreshed), host=str(obj.get("host", "?")),
                     pid=pid if type(pid) is int else 0, purpose=str(obj.get("purpose", "")))


def exclusive_lease(
    store: Store, prefix: str, *, purpose: str = "", max_age: float = DEFAULT_MAX_AGE,
) -> Lease:
    """Acquire a lease under ``prefix`` that is the only live one there, or raise ConflictError naming the
    holder of another. The caller releases it."""
    lease = Lease(store, purpose=purpose, prefix=prefix, max_age=max_age).acquire()
    try:
        now = time.time()
        others = [info for info in list_leases(store, prefix)
                  if info.key != lease.key and not info.is_stale(now, max_age)]
    except BaseException:
        lease.release()
        raise
    if others:
        lease.release()
        other = others[0]
        raise ConflictError(
            f"another holder is active: {other.purpose or 'unknown'} on {other.host} pid {other.pid}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(other.started))} UTC",
            where=other.key,
        )
    return lease
