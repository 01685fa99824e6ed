"""The scheduler of a ChunkFetcher's store calls: slots with priorities, places per store object, and the
threads left behind in a store that does not answer (fetcher.py's and store_reads.py's docstrings say
why; this is how).

    slots = StoreSlots(total=16, prefetch_limit=12, fill_limit=2, per_object=4, max_abandoned=64)
    ticket = Ticket(key, priority, order)
    await slots.acquire(ticket)          # or Refused: the object (or the store) has too many calls stuck
    watch = ThreadWatch(ticket, on_return=slots.returned)   # (StoreReads logs, then calls returned)
    try:
        await trio.to_thread.run_sync(read, abandon_on_cancel=True, limiter=watch)
    finally:
        slots.release(ticket, abandoned=watch.started and not watch.returned, answered=watch.returned)

A ticket holds a slot from its grant to ``release``, and a place among its object's calls from its grant
until its thread has really returned: at ``release`` for a call that ended, at ``returned`` (reported by
its ThreadWatch) for one abandoned at its deadline. Calls that take no slot (``enter_unslotted``) hold
only a place.

Threads: everything here is used from the trio thread only (ThreadWatch's release_on_behalf_of is called
there by trio), so it needs no lock.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable

import trio

# An object one of whose reads came back this recently (seconds) is answering: it may have more reads in
# the air than per_object. Round trips to a store take tens of milliseconds.
ANSWERING_WINDOW = 1.0


class Priority(enum.IntEnum):
    """Lower goes first."""

    ONDEMAND = 0  # a reader is waiting for these bytes (a FUSE read)
    PREFETCH = 1  # warming the cache ahead of need: chunks a profile or a list says will be read
    FILL = 2  # the rest of a layer, streamed in while nothing better uses the link (prefetcher.py)


ONDEMAND = Priority.ONDEMAND
PREFETCH = Priority.PREFETCH
FILL = Priority.FILL


class Ticket:
    """A store read's claim on a store slot and on a place among its object's reads."""

    __slots__ = ("key", "priority", "order", "queued", "granted", "granted_as", "cached", "event", "refused",
                 "abandoned")

    def __init__(self, key: str, priority: Priority, order: int):
        self.key = key  # the store object it reads
        self.priority = priority
        self.order = order  # queues are kept in this order: the fetcher numbers store reads as it plans them
        self.queued = False
        self.granted = False
        self.granted_as = priority  # the priority it was granted at, whose limits it counts against
        self.cached = False  # its read's worker thread put what it read into the cache (store_reads.StoreReads._read_for)
        self.event = trio.Event()
        self.refused: str | None = None  # why it may not start (too many reads stuck), once decided
        self.abandoned = False  # its thread passed the deadline in the store and still holds its place


class Refused(Exception):
    """A store read that may not start: its object, or the store, has too many reads stuck."""


class StoreSlots:
    """The scheduler of store reads. At most ``total`` at once, at most ``prefetch_limit`` of them
    prefetch or fill, at most ``fill_limit`` of those fill; queued reads are granted on-demand first, then
    prefetch, then fill, each queue in ticket ``order`` (the order the reads were planned in, not the order
    trio happens to start their tasks in). A fill read starts only while no on-demand read is queued, and
    fill reads are few because each one in the air takes a share of the link a miss beside it would
    have (fetcher.py says how many, FILL_READS of FILL_READ_BYTES).
    A ticket is granted only while its object has fewer than ``per_object`` reads in the air (abandoned
    ones included), or fewer than ``total`` while the object is *answering*: one of its reads came back
    within the last ANSWERING_WINDOW seconds and none was abandoned. So a pack being read hard gets every
    slot, as before, but one that has not answered yet (the first reads of a burst) or stopped answering
    gets ``per_object``. One whose object is full waits and lets the tickets behind it go first. A ticket
    is refused once ``per_object`` reads of its object are abandoned, or ``max_abandoned`` in all. (An
    object that stalls in the middle of a burst may have up to ``total`` reads abandoned: those granted
    in the window before its answers stopped.)"""

    def __init__(self, total: int, prefetch_limit: int, fill_limit: int, per_object: int, max_abandoned: int):
        self.total = total
        self.prefetch_limit = prefetch_limit
        self.fill_limit = fill_limit
        self.per_object = per_object
        self.max_abandoned = max_abandoned
        self.in_use = 0
        self.prefetch_in_use = 0  # granted as prefetch or fill
        self.fill_in_use = 0  # granted as fill
        self.abandoned_total = 0
        self.reads_of: dict[str, int] = {}  # store key -> reads of it in the air, abandoned ones included
        self.abandoned_of: dict[str, int] = {}  # store key -> of those, abandoned ones (keys with none absent)
        self.answered_at: dict[str, float] = {}  # store key (with reads in the air) -> when one last came back
        self._queues: dict[Priority, list[Ticket]] = {priority: [] for priority in Priority}

    def waiting(self, priority: Priority) -> int:
        return len(self._queues[priority])

    async def acquire(self, ticket: Ticket) -> None:
        """Wait for the ticket's grant; raises Refused when it may not start."""
        await trio.lowlevel.checkpoint_if_cancelled()
        refusal = self._refusal(ticket.key)
        if refusal is not None:
            raise Refused(refusal)
        self._enqueue(ticket)
        self._grant_queued()
        # Granted (or refused) at once: no scheduling round for it; the caller's thread hop that follows
        # is the checkpoint (a round per miss waited for the GIL behind worker threads: "miss14").
        if not ticket.event.is_set():
            try:
                await ticket.event.wait()
            except BaseException:  # cancelled (a timeout): give back what we hold, or leave the queue
                if ticket.granted:
                    self.release(ticket, abandoned=False, answered=False)
                elif ticket.queued:
                    self._queues[ticket.priority].remove(ticket)
                    ticket.queued = False
                raise
        if ticket.refused is not None:
            raise Refused(ticket.refused)

    def release(self, ticket: Ticket, *, abandoned: bool, answered: bool) -> None:
        """The read is over (``answered``: its thread came back from the store, in time), or
        ``abandoned`` (its thread stays in the store and keeps its object's place until ``returned``);
        either way its slot is free."""
        self.in_use -= 1
        if ticket.granted_as != ONDEMAND:
            self.prefetch_in_use -= 1
        if ticket.granted_as == FILL:
            self.fill_in_use -= 1
        self.leave(ticket, abandoned=abandoned, answered=answered)

    def enter_unslotted(self, ticket: Ticket) -> str | None:
        """Take a place among the ticket's object's calls at once, with no slot and no limit but the
        refusal; returns why not, or None. Pair it with ``leave``."""
        refusal = self._refusal(ticket.key)
        if refusal is None:
            self.reads_of[ticket.key] = self.reads_of.get(ticket.key, 0) + 1
        return refusal

    def leave(self, ticket: Ticket, *, abandoned: bool, answered: bool) -> None:
        """Give the ticket's place among its object's reads back, unless ``abandoned`` (see release)."""
        if abandoned:
            ticket.abandoned = True
            self.abandoned_total += 1
            self.abandoned_of[ticket.key] = self.abandoned_of.get(ticket.key, 0) + 1
            self._refuse_queued()
        else:
            if answered:
                self.answered_at[ticket.key] = trio.current_time()
            self._leave_object(ticket.key)
        self._grant_queued()

    def returned(self, ticket: Ticket) -> None:
        """An abandoned read's thread has come back from the store."""
        self.abandoned_total -= 1
        if self.abandoned_of[ticket.key] == 1:
            del self.abandoned_of[ticket.key]
        else:
            self.abandoned_of[ticket.key] -= 1
        self._leave_object(ticket.key)
        self._grant_queued()

    def promote(self, ticket: Ticket, priority: Priority = ONDEMAND) -> None:
        """Raise a ticket to ``priority``; a queued one moves to that queue."""
        if ticket.priority <= priority:
            return
        queued = ticket.queued
        if queued:
            self._queues[ticket.priority].remove(ticket)
        ticket.priority = priority
        if queued:
            self._enqueue(ticket)
        self._grant_queued()

    def _leave_object(self, key: str) -> None:
        if self.reads_of[key] == 1:
            del self.reads_of[key]
            self.answered_at.pop(key, None)  # the next burst starts at per_object again, until it answers
        else:
            self.reads_of[key] -= 1

    def _has_place(self, key: str, now: float) -> bool:
        reads = self.reads_of.get(key, 0)
        if reads < self.per_object:
            return True
        answering = now - self.answered_at.get(key, -math.inf) < ANSWERING_WINDOW and key not in self.abandoned_of
        return answering and reads < self.total

    def _enqueue(self, ticket: Ticket) -> None:
        ticket.queued = True
        bisect.insort(self._queues[ticket.priority], ticket, key=lambda t: t.order)

    def _may_start(self, priority: Priority) -> bool:
        if self.in_use >= self.total:
            return False
        if priority == ONDEMAND:
            return True
        if priority == FILL and (self._queues[ONDEMAND] or self.fill_in_use >= self.fill_limit):
            return False
        return self.prefetch_in_use < self.prefetch_limit

    def _refusal(self, key: str) -> str | None:
        stuck = self.abandoned_of.get(key, 0)
        if stuck >= self.per_object:
            return (f"{stuck} reads of this store object are stuck past their deadline; it is read again once one "
                    "returns")
        if self.abandoned_total >= self.max_abandoned:
            return (f"{self.abandoned_total} store reads (of {len(self.abandoned_of)} objects) are stuck past their "
                    "deadline, the most left behind; no read starts until one returns")
        return None

    def _grant_queued(self) -> None:
        """Grant queued tickets in order while slots are free, passing over those whose object is full."""
        now = trio.current_time()
        for priority in Priority:
            queue = self._queues[priority]
            position = 0
            while position < len(queue) and self._may_start(priority):
                ticket = queue[position]
                if self._has_place(ticket.key, now):
                    del queue[position]
                    self._grant(ticket)
                    ticket.queued = False
                    ticket.event.set()
                else:
                    position += 1

    def _refuse_queued(self) -> None:
        """After an abandonment: wake the queued tickets that may not start any more, refused."""
        for queue in self._queues.values():
            kept = []
            for ticket in queue:
                ticket.refused = self._refusal(ticket.key)
                if ticket.refused is None:
                    kept.append(ticket)
                else:
                    ticket.queued = False
                    ticket.event.set()
            queue[:] = kept

    def _grant(self, ticket: Ticket) -> None:
        ticket.granted = True
        ticket.granted_as = ticket.priority
        self.in_use += 1
        self.prefetch_in_use += ticket.priority != ONDEMAND
        self.fill_in_use += ticket.priority == FILL
        self.reads_of[ticket.key] = self.reads_of.get(ticket.key, 0) + 1


class ThreadWatch:
    """The limiter trio.to_thread.run_sync is given for one store call: it limits nothing (the ticket
    did), but learns when the thread really starts and ends, which for an abandoned thread is long after
    run_sync has returned; then ``on_return(ticket)`` is called, in the trio thread."""

    def __init__(self, ticket: Ticket, on_return: Callable[[Ticket], None]):
        self._ticket = ticket
        self._on_return = on_return
        self.started = False
        self.returned = False

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.started = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self.returned = True
        if self._ticket.abandoned:
            self._on_return(self._ticket)
