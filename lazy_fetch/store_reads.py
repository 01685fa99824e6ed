"""The chunk fetcher's store reads: each in a worker thread, within a deadline, scheduled by the
fetcher's StoreSlots; the threads a store that does not answer leaves behind; and the store's round trip.

    store_reads = StoreReads(store, StoreSlots(...), timeout=30.0, cache_put=put)
    results = await store_reads.read(run, ticket, stats)   # digest -> bytes, Frame or the chunk's error
    result = await store_reads.call_store("layer x in s3://...", fn, *args)

ChunkFetcher (fetcher.py) plans the reads, gives each its Ticket and deadline and lands their chunks; it
hands StoreReads its StoreSlots, which only StoreReads uses from then on, and ``cache_put(pack_id,
chunks)``, which a read's worker thread calls for the reads whose chunks it caches itself (``_read_for``).

- **Per object.** At most ``object_reads`` reads of one store object (a pack) are in the air at once, its
  abandoned ones (below) included, until it answers: while one of its reads came back within the last
  second (store_slots.ANSWERING_WINDOW) and none was abandoned, it may have as many as there are slots.
  Further reads of it queue without a slot, and reads of other objects go past them. So a pack read
  hard is read as fast as before (128 reads at once of one pack behind 20 ms: 0.27 s before, 0.29 s
  with the bound, side by side; 0.87 s with a fixed bound of 4), and one that does not answer gets
  ``object_reads`` threads, not every slot.
- **Timeout and abandoned threads.** Each store read (waiting for a slot or a place included) must finish within
  ``timeout`` seconds, else its chunks fail with UnavailableError(transient=True). A thread still in the
  store at its deadline cannot be stopped: it is *abandoned*. Its slot is given back at once (so an object
  that never answers cannot take the slots of the healthy ones), but it keeps its place among its object's
  ``object_reads`` until it really returns (its result, if it ever comes, is still cached). So one hung
  object holds at most ``object_reads`` threads: once all of them are abandoned, reads of it fail at once
  (UnavailableError naming the key) instead of starting threads that would hang too, and the first read
  after one returns goes ahead, which is the recovery, without a restart. Once ``max_abandoned`` threads
  are left behind over all objects, every new store read fails at once until some return (so at most
  ``max_abandoned + max_concurrent`` store threads ever exist). Each abandonment is counted
  (FetchStats.abandoned) and the first of an object's stall, and its end, logged with the key.
  ``call_store`` runs a mount's other store calls (pack indexes, a layer's objects) by the same rules,
  without a slot.

Threads: StoreReads lives in the trio thread; every method but ``note_round_trip`` (any thread) is called
from there, and the slots, ``_stalled_since`` and the FetchStats it counts in are used from there only,
so they need no locks. The round-trip samples are appended to by worker threads: ``_round_trips_lock``
guards them. ``_read_for`` (and ``cache_put``, ``_read_frames``, ``_read_wanted`` and ``_read``, which it
calls) runs in the read's worker thread, via trio.to_thread.run_sync: the trio thread never blocks on a
store. A store read's worker thread may block in the store for ever; nothing waits for it but the
flights of its own chunks, and those only until the deadline. Store-read threads are counted by a
limiter of their own (ThreadWatch), not trio's default one, so stuck ones never starve the daemon's other
worker threads (cache lookups, layer opens).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import trio

from dsec_fs.chunks import ChunkRun, decode_chunk, read_chunk, read_run, read_run_frames
from dsec_fs.errors import CorruptError, UnavailableError
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .cache import Frame
from .fetch_stats import FetchStats
from .store_slots import FILL, ONDEMAND, PREFETCH, Priority, StoreSlots, ThreadWatch, Ticket

log = logging.getLogger(__name__)
T = TypeVar("T")

# The store's round trip (``round_trip``): the least of the last ROUND_TRIP_SAMPLES times of small store
# calls: chunk reads of at most ROUND_TRIP_READ_BYTES (their transfer a small part: 2.6 ms at 100 MB/s),
# the slot's wait excluded, and what callers note (the daemon: a layer's manifest read). The least,
# because a call can only be slowed (a cold disk, a busy core), never sped up, by what is not the store.
ROUND_TRIP_SAMPLES = 16
ROUND_TRIP_READ_BYTES = 256 * 1024


class StoreReads:
    """The store reads of one ChunkFetcher, and its other store calls (``call_store``)."""

    def __init__(self, store: Store, slots: StoreSlots, *, timeout: float,
                 cache_put: Callable[[str, list[tuple[bytes, bytes | Frame]]], None]):
        self.store = store
        self.timeout = timeout
        self._slots = slots
        self._cache_put = cache_put
        self._stalled_since: dict[str, float] = {}  # store key -> when its first read still stuck was abandoned
        # Appended to by worker threads, read in the trio thread: _round_trips_lock guards it (iterating a
        # deque that another thread appends to raises).
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIP_SAMPLES)
        self._round_trips_lock = threading.Lock()

    def waiting(self, priority: Priority) -> int:
        """Store reads of ``priority`` queued for a slot (a gauge for metrics)."""
        return self._slots.waiting(priority)

    @property
    def store_reads_running(self) -> int:
        """Store reads holding a slot (a gauge; abandoned ones hold none)."""
        return self._slots.in_use

    @property
    def abandoned_reads(self) -> int:
        """Store reads abandoned at their deadline whose thread is still in the store (a gauge)."""
        return self._slots.abandoned_total

    def stuck_objects(self) -> dict[str, int]:
        """Store key -> its abandoned reads still in the store, for the keys that have any."""
        return dict(self._slots.abandoned_of)

    def round_trip(self, samples: int = 1) -> float | None:
        """Seconds a small store call takes (ROUND_TRIP_SAMPLES above), or None before ``samples`` were
        taken."""
        with self._round_trips_lock:
            return min(self._round_trips) if len(self._round_trips) >= samples else None

    def note_round_trip(self, seconds: float) -> None:
        """A small store call took ``seconds`` (any thread)."""
        with self._round_trips_lock:
            self._round_trips.append(seconds)

    def promote(self, ticket: Ticket, priority: Priority) -> None:
        """A request of ``priority`` joined the read of ``ticket``: it queues at that priority from now."""
        self._slots.promote(ticket, priority)

    async def call_store(self, what: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``: blocking store calls other than chunk reads (opening a layer, loading its pack
        indexes) in a worker thread, within the fetcher's deadline, else UnavailableError(transient)
        naming ``what``. They take no slot, but a thread still in the store at the deadline is left
        behind, bounded and logged as a store read's is, with ``what`` as its object: calls for a
        ``what`` whose places are all held by stuck threads fail at once, and none starts while
        ``max_abandoned`` are stuck. Its thread is not one of trio's default limiter, which stuck ones
        would exhaust for every other worker thread of the daemon."""
        ticket = Ticket(what, ONDEMAND, 0)
        refusal = self._slots.enter_unslotted(ticket)
        if refusal is not None:
            raise UnavailableError(refusal, where=what, transient=True)
        watch = ThreadWatch(ticket, self._abandoned_read_returned)
        try:
            with trio.fail_after(self.timeout):
                return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=watch)
        except trio.TooSlowError:
            raise UnavailableError(f"the store did not answer within {self.timeout:g} s", where=what,
                                   transient=True) from None
        finally:
            abandoned = watch.started and not watch.returned
            self._slots.leave(ticket, abandoned=abandoned, answered=watch.returned)
            if abandoned:
                self._note_abandoned(ticket.key)

    async def read(self, run: ChunkRun, ticket: Ticket, stats: FetchStats,
                   wanted: Callable[[], set[bytes]] = set) -> dict[bytes, bytes | Frame | Exception]:
        """Read ``run`` in a worker thread once ``ticket`` is granted (Refused if it may not start); a read
        cancelled at its deadline (the caller's: fetcher._read_run) whose thread is still in the store
        gives its slot back and leaves the thread behind, counted in ``stats`` (the module docstring).
        ``wanted()``, asked once the slot is granted: the chunks readers wait for; an on-demand read that
        carries others (readahead) checks only those and keeps the others as fetched (``_read_wanted``)."""
        await self._slots.acquire(ticket)
        # How to read is decided here, in the trio thread, as the read is handed to its thread: a request
        # that joins it later (promoting it) does not change it, so a fill's read that a reader joined
        # after this keeps its chunks as fetched, and its frames are checked for that reader
        # (fetcher._read_run), as kept_frames.check_fetched checks them, whatever zstd raises.
        as_frames = ticket.priority == FILL
        first = wanted() if ticket.priority == ONDEMAND else set()
        watch = ThreadWatch(ticket, self._abandoned_read_returned)
        try:
            return await trio.to_thread.run_sync(self._read_for, run, ticket, first, as_frames,
                                                 abandon_on_cancel=True, limiter=watch)
        finally:
            abandoned = watch.started and not watch.returned
            self._slots.release(ticket, abandoned=abandoned, answered=watch.returned)
            if abandoned:
                stats.abandoned += 1
                self._note_abandoned(ticket.key)

    def _note_abandoned(self, key: str) -> None:
        """Log the first abandoned call of a stall of ``key``, once."""
        if key not in self._stalled_since:
            self._stalled_since[key] = trio.current_time()
            log.warning("store object %s did not answer within %g s: its call is abandoned (the thread stays "
                        "in the store); once %d are, no call of it starts until one returns",
                        key, self.timeout, self._slots.per_object)

    def _abandoned_read_returned(self, ticket: Ticket) -> None:
        self._slots.returned(ticket)
        if ticket.key not in self._slots.abandoned_of:
            stalled = trio.current_time() - self._stalled_since.pop(ticket.key)
            log.warning("store object %s answered again, %.1f s after its first read was abandoned",
                        ticket.key, stalled)

    # -- worker threads

    def _read_for(self, run: ChunkRun, ticket: Ticket, wanted: set[bytes],
                  as_frames: bool) -> dict[bytes, bytes | Frame | Exception]:
        """``_read`` (a fill's read, nobody else waiting for it yet: ``_read_frames``; an on-demand read
        that carries chunks nobody waits for yet: ``_read_wanted``), and the cache put
        (``ticket.cached``) of a prefetch read (so a job that is done has its chunks in the cache) or of
        one abandoned at its deadline (nobody is left to take its result; one abandoned just as it returned
        may be cached by neither side, and is read again when next asked for). A fill's read is written by
        the cache writer, after its slot is free (``_read_run``)."""
        started = time.monotonic()
        if as_frames:
            results = self._read_frames(run)
        elif wanted and len(wanted) < len(run.chunks):
            results = self._read_wanted(run, wanted)
        else:
            results = self._read(run)
        if run.end - run.start <= ROUND_TRIP_READ_BYTES:
            self.note_round_trip(time.monotonic() - started)
        # A fill's read promoted to PREFETCH while in the store is written by the cache writer, after the
        # chunks its new waiters need are checked (``_read_run``), so those go in plain.
        if ticket.abandoned or ticket.priority == PREFETCH and not as_frames:
            self._cache_put(run.pack_id, [(digest, data) for digest, data in results.items()
                                          if isinstance(data, (bytes, Frame))])
            ticket.cached = True
        return results

    def _read_frames(self, run: ChunkRun) -> dict[bytes, Frame | Exception]:
        """A fill's read: its chunks as their pack holds them (Frames), neither decompressed nor checked
        (the cache keeps them so until read: module docstring). A pack shorter than its index says fails
        the whole GET: then each chunk is read (and checked) alone, as ``_read`` does."""
        try:
            frames = read_run_frames(self.store, run)
        except CorruptError:
            return self._read(run)
        return {digest: Frame(frames[digest], location.ulen, run.pack_id) for digest, location in run.chunks}

    def _read_wanted(self, run: ChunkRun, wanted: set[bytes]) -> dict[bytes, bytes | Frame | Exception]:
        """An on-demand read with readahead: the ``wanted`` chunks decompressed and checked, the others
        (readahead nobody waits for yet) as their pack holds them (Frames), so the reader is answered
        without waiting for the readahead's decompression and check, which the fetcher does next, before
        anyone has those bytes (fetcher.py, "Readahead on a miss"). A wanted chunk that fails its check is
        read again alone, as ``_read`` does; a pack shorter than its index says fails the whole GET: then
        each chunk is read (and checked) alone."""
        try:
            frames = read_run_frames(self.store, run)
        except CorruptError:
            return self._read(run)
        key = keys.pack(run.pack_id)
        results: dict[bytes, bytes | Frame | Exception] = {}
        for digest, location in run.chunks:
            if digest not in wanted:
                results[digest] = Frame(frames[digest], location.ulen, run.pack_id)
                continue
            try:
                results[digest] = decode_chunk(frames[digest], digest, location.ulen, key)
            except CorruptError:
                try:
                    results[digest] = read_chunk(self.store, digest, location)
                except CorruptError as exc:
                    results[digest] = exc
        return results

    def _read(self, run: ChunkRun) -> dict[bytes, bytes | Exception]:
        try:
            return dict(read_run(self.store, run))
        except CorruptError:
            if len(run.chunks) == 1:
                raise
        # One bad chunk fails a merged read as a whole: read each chunk alone so the good ones are served.
        results: dict[bytes, bytes | Exception] = {}
        for digest, location in run.chunks:
            try:
                results[digest] = read_chunk(self.store, digest, location)
            except CorruptError as exc:
                results[digest] = exc
        return results

