"""The node daemon's side of access profiles (profile.py): look them up for a mount, publish them after.

- ``lookup`` (called by the daemon as it opens a layer, once the layer's digest is known, so its two round
  trips overlap those of the manifest, meta.erofs and the blob map): the merged profile of the layer in the
  sandbox's combination, if it has one, else that of the layer's digest, else that of its ref name (a new
  tag of a known name), else None; the three are listed at once. ``lookup_combination``: the combination's
  only, for a sandbox that joins a layer already mounted for others (its prefetch, in the background).
- ``plan`` turns the profile into the PrefetchList of the layer being mounted (a worker thread).
- ``publish_soon``: once the last mount of a layer in a mode goes and its trace is closed, a background
  task learns the trace's profile (from all its segments, trace_holders.py) and merges it into this node's
  objects in the store, under the layer's digest and, if the mount named one, its ref name; and when a
  segment that only one combination's sandboxes held ends, under that combination; and while a mount
  lives, every ``profile_publish_seconds`` (trace_segments.publish_running), from its trace so far, so a
  long run is learned from before it ends. A run's publishes share a PublishedRun: each takes the one
  before it back out of the node's object (profile.without), and one that finishes after a newer one of
  the same run writes nothing, so the run counts once, with all it read. Best effort and off
  every request's path: a failure is logged, never raised. When the daemon stops (``stop``), a publish
  under way has FLUSH_SECONDS more to finish, and ``flush`` (after the last unmounts) publishes what is
  still queued, within FLUSH_SECONDS of its own. A publish past its time (a store that never answers: a
  hung mount, an endpoint that accepts and never replies) is given up, its profile lost (logged), and
  its worker thread abandoned where it waits, so the daemon still exits.

The node id names this node's objects: 16 random hex digits made once, kept in ``state_dir/node-id``.

Threads: ``lookup`` and ``plan`` block (worker threads); ``publish_soon``, ``stop`` and ``flush`` are
called in the daemon's trio thread and run the store calls in worker threads; ``_deadline`` and
``_under_way`` are the trio thread's.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import trio

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.errors import DsecError
from dsec_fs.files import private_dir, write_atomic
from dsec_fs.layer import LayerFiles
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from . import profile
from .layer_index import LayerIndex
from .prefetch_list import PrefetchList
from .trace import join_segments, read_trace

log = logging.getLogger(__name__)

NODE_ID_FILE = "node-id"
FLUSH_SECONDS = 15.0


@dataclass
class PublishedRun:
    """What one run (a served blob's whole trace, or one segment of it for a combination) published so
    far, by key, and what its publishes learned from its trace so far. ``lock`` (worker threads) guards
    ``published``, ``newest``, ``records_read`` and ``first_read``; ``last``, ``unfinished`` and ``_seq``
    are the trio thread's."""

    published: dict[str, profile.Profile] = field(default_factory=dict)
    newest: int = -1  # the sequence number of the newest publish that wrote
    # A publish reads only the records written since the one before (its time and memory would grow
    # with the run's age otherwise): records read of each segment, by path; the first read of each
    # blob-map entry (at most one item an entry of the layer) on the time base of the first segment.
    records_read: dict[str, int] = field(default_factory=dict)
    first_read: dict[int, int] = field(default_factory=dict)
    last: float = field(default_factory=time.monotonic)  # when it was last queued (or the run began)
    unfinished: int = 0  # its publishes queued or under way (the trio thread's)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: itertools.count = field(default_factory=itertools.count)

    def next(self) -> int:
        self.last = time.monotonic()
        return next(self._seq)

    def learn(self, index: LayerIndex, trace_paths: list[str], combination: str) -> profile.Profile | None:
        """The profile of the trace in ``trace_paths`` (the run's segments so far, in order), reading only
        what it gained since the last call (``lock`` held)."""
        gained = [read_trace(path, skip=self.records_read.get(path, 0)) for path in trace_paths]
        first_read = index.access(join_segments(gained)).use.first_read  # raises before anything changes
        for entry, first_ns in first_read.items():
            if first_ns < self.first_read.get(entry, first_ns + 1):
                self.first_read[entry] = first_ns
        for trace in gained:
            self.records_read[trace.path] = self.records_read.get(trace.path, 0) + len(trace.records)
        return profile.learned_from(index, self.first_read, combination=combination)


@dataclass
class _Publish:
    store: Store
    files: LayerFiles
    index: Callable[[], LayerIndex]
    trace_paths: list[str]  # the segments of the trace, in order
    ref_name: str | None
    combination: str  # "": publish for the layer (and its name); else for this combination only
    run: PublishedRun
    seq: int
    started: bool = False


@dataclass(frozen=True)
class FoundProfile:
    profile: profile.Profile
    source: str  # "combination" (this layer in this stack), "layer" (this layer) or "name" (its ref name)
    key: str  # the store prefix it was read from


class ProfileKeeper:
    def __init__(self, state_dir: str):
        self.node_id = _node_id(state_dir)
        self.published = 0
        self.publish_failures = 0
        self._queued: list[_Publish] = []
        self._deadline = math.inf  # when publishes are given up (trio's clock): set at the stop
        self._under_way: set[trio.CancelScope] = set()  # of the publishes in a worker thread

    def lookup(self, store: Store, digest: str, ref_name: str | None, combination: str = "") -> FoundProfile | None:
        """Two round trips: the combination's, the layer's and the ref name's objects are listed side by
        side; then the objects of the first of those that has any are read side by side (and, only if none
        of them decodes, the next one's)."""
        choices = [(keys.combination_profiles(combination, digest), "combination")] if combination else []
        choices.append((keys.layer_profiles(digest), "layer"))
        if ref_name:
            choices.append((keys.name_profiles(profile.name_id(ref_name)), "name"))
        with ThreadPoolExecutor(max_workers=len(choices), thread_name_prefix="profile-list") as pool:
            listings = list(pool.map(lambda choice: profile.listed(store, choice[0]), choices))
        for (key, source), names in zip(choices, listings):
            checked = {"combination": combination, "layer": digest} if source == "combination" else {}
            found = profile.load(store, names, **checked)
            if found is not None:
                return FoundProfile(found, source, key)
        return None

    @staticmethod
    def lookup_combination(store: Store, digest: str, combination: str) -> FoundProfile | None:
        """The merged profile of layer ``digest`` in ``combination`` (every node's), or None."""
        key = keys.combination_profiles(combination, digest)
        found = profile.fetch(store, key, combination=combination, layer=digest)
        return None if found is None else FoundProfile(found, "combination", key)

    @staticmethod
    def plan(found: FoundProfile, files: LayerFiles, blob_map: EncodedBlobMap,
             index: Callable[[], LayerIndex]) -> PrefetchList:
        """``index``: the layer's LayerIndex, asked for only if a changed file is looked up by path."""
        return profile.to_prefetch_list(found.profile, files.digest, blob_map, index)

    def publish_soon(self, nursery: trio.Nursery | None, store: Store, files: LayerFiles,
                     index: Callable[[], LayerIndex], trace_paths: list[str], ref_name: str | None, *,
                     run: PublishedRun, combination: str = "", if_idle: bool = False) -> None:
        """Publish in a task of ``nursery``; with None (the daemon is stopping), at ``flush``. ``index``:
        the layer's LayerIndex (called in a worker thread). ``trace_paths``: the segments of one trace,
        learned as one; with ``combination``, one segment, published for that combination only. ``run``:
        the trace's (or, with ``combination``, the segment's) PublishedRun. ``if_idle`` (a periodic
        publish): nothing, if a publish of ``run`` is still queued or under way. A store that does not
        answer holds a worker thread a publish, each waiting on the run's lock behind the first: queued
        every period regardless, they took one of trio's worker threads (40) each, until every store
        call and read of the daemon waited for a thread."""
        if if_idle and run.unfinished:
            return
        run.unfinished += 1
        job = _Publish(store, files, index, list(trace_paths), ref_name, combination, run, run.next())
        self._queued.append(job)
        if nursery is not None:
            nursery.start_soon(self._publish, job)

    def stop(self) -> None:
        """The daemon stops: publishes under way get FLUSH_SECONDS more, then are given up."""
        self._give_up_in(FLUSH_SECONDS)

    async def flush(self) -> None:
        """Publish what is still queued, for at most FLUSH_SECONDS (shielded: the daemon is stopping)."""
        self._give_up_in(FLUSH_SECONDS)
        with trio.CancelScope(shield=True):
            for job in list(self._queued):
                await self._publish(job)

    def _give_up_in(self, seconds: float) -> None:
        self._deadline = trio.current_time() + seconds
        for scope in self._under_way:
            scope.deadline = self._deadline

    async def _publish(self, job: _Publish) -> None:
        if job.started:
            return
        # A task started in a nursery that is being cancelled stops here, its job still queued for flush.
        await trio.lowlevel.checkpoint_if_cancelled()
        job.started = True
        files, trace_path = job.files, job.trace_paths[-1]
        # Shielded, so that cancelling the daemon's background tasks does not cut a quick publish short;
        # bounded by the deadline ``stop`` and ``flush`` set instead, past which the thread is abandoned.
        with trio.CancelScope(shield=True, deadline=self._deadline) as waited:
            self._under_way.add(waited)
            try:
                learned = await trio.to_thread.run_sync(self._publish_blocking, job, abandon_on_cancel=True)
            except (DsecError, OSError) as exc:
                self.publish_failures += 1
                log.warning("cannot publish the profile of layer %s from %s: %s", files.digest[:12], trace_path, exc)
                return
            finally:
                self._under_way.discard(waited)
                self._queued.remove(job)
                job.run.unfinished -= 1
        if waited.cancelled_caught:
            self.publish_failures += 1
            log.warning("gave up publishing the profile of layer %s from %s: the store did not answer within "
                        "%g s of the daemon's stop; the profile is lost", files.digest[:12], trace_path, FLUSH_SECONDS)
            return
        if learned is not None:
            self.published += 1
            log.info("published the profile of layer %s%s (%d chunks, %d traces)", files.digest[:12],
                     f" in combination {job.combination[:12]}" if job.combination else "", len(learned.entries),
                     learned.traces)

    def _publish_blocking(self, job: _Publish) -> profile.Profile | None:
        store, files, ref_name, run = job.store, job.files, job.ref_name, job.run
        if job.combination:
            targets = [keys.combination_profiles(job.combination, files.digest)]
        else:
            targets = [keys.layer_profiles(files.digest)]
            if ref_name:
                targets.append(keys.name_profiles(profile.name_id(ref_name)))
        with run.lock:
            if job.seq < run.newest:  # a later publish of this run, which knew more, wrote already
                return None
            learned = run.learn(job.index(), job.trace_paths, job.combination)
            if learned is None:
                return None
            merged = []
            for target in targets:
                key = target + self.node_id
                merged.append(profile.publish(store, key, learned, replacing=run.published.get(key)))
                run.published[key] = learned
            run.newest = job.seq
        return merged[0]


def _node_id(state_dir: str) -> str:
    path = os.path.join(state_dir, NODE_ID_FILE)
    try:
        with open(path) as f:
            node_id = f.read().strip()
        if len(node_id) == 16 and all(c in "0123456789abcdef" for c in node_id):
            return node_id
    except FileNotFoundError:
        pass
    node_id = secrets.token_hex(8)
    private_dir(state_dir)
    write_atomic(path, node_id.encode() + b"\n")
    return node_id
