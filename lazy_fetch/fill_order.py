"""The order a fill fetches a layer's chunks in: on from where its readers last missed, and the layer
they missed in last first.

A fill (prefetcher.py) streams the chunks of a layer that no profile named into the cache, behind every
reader. With no profile, what the first command reads is the only guide to what it reads next, and it
reads files near the ones it read: the files of a package, a directory, lie side by side in the blob.
So a fill does not hand its whole layer to the fetcher in blob order, but one store read at a time,
each chosen when a fill read may start: the next from a cursor that a reader's miss moves to the read
holding the chunk it missed; once a miss jumps ahead, what the fill skipped is fetched after it reaches
the layer's end. The reads are the same as before (runs of neighbours in a pack, planned over the whole
fill: in blob order the base layer's chunks change pack or jump within one every five chunks, so reads
of neighbours in the blob would be a fifth of the size and five times as many). The node's fill reads at once (fetcher.FILL_READS) are *turns* shared by every
layer filling: a turn that frees goes to the layer whose readers missed last, so a command that reads
the base layer's libraries first and then its toolkit's packages has the fill follow it from one to the
other, instead of streaming whichever layer's fill was planned first (measured, numpy's first-ever
start behind the 20 ms store: the toolkit streamed for the first 2.5 s while the command missed in the
base; docs/benchmarks.md, "Fill that follows the first command").

    order = FillOrder(entries)                 # a layer's fill entries, in blob order
    order.planned(plan_reads(entries, locate, FILL_READ_BYTES))   # its store reads (plan in a worker thread)
    order.missed(entry)                        # a reader missed blob-map entry ``entry``
    async with turns.turn(order) as turn:      # turns = FillTurns(FILL_READS), the node's
        while batch := order.take():           # the next store read's entries
            ...fetch batch...
            await turn.pass_on()               # to a fill missed in later, if one waits

Threads: FillOrder and FillTurns belong to the daemon's trio thread (readers' misses are noted there,
by traced_blob.LayerUsage); plan_reads may run in any thread.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from dsec_fs.chunks import ChunkLocation, plan_runs

from .prefetch_list import PrefetchEntry

Locate = Callable[[int, bytes], ChunkLocation]


class FillOrder:
    """A layer's fill, as store reads (runs of neighbours in a pack, planned over the whole fill so that
    chunks side by side in a pack share a read however far apart the blob has them), and where the next
    one starts: the reads in the blob order of their first chunk, from the one holding the readers' last
    miss. Until it is told its reads (``planned``), ``take`` has none."""

    def __init__(self, entries: list[PrefetchEntry]):
        self.entries = entries  # in blob order (prefetcher.fill_entries)
        self.left = len(entries)  # entries (reads, once planned) not taken yet
        self.missed_at = -math.inf  # trio.current_time() of its readers' last miss
        self.stopped = False  # no more fill reads (the cache bound)
        self._reads: list[list[PrefetchEntry]] = []  # by their first entry's place in the blob
        self._firsts: list[int] = []  # each read's first blob-map entry, for a miss outside the fill
        self._read_of: dict[int, int] = {}  # blob-map entry -> its read
        self._taken = bytearray()  # 1 for each read taken
        self._cursor = 0  # the read to start looking at
        self._missed: int | None = None  # an entry missed before the plan was made

    def planned(self, reads: list[list[PrefetchEntry]]) -> None:
        """The fill's store reads (``plan_reads`` of its entries)."""
        for number, read in enumerate(reads):
            for entry in read:
                self._read_of[entry.chunk] = number
        self._reads, self._taken, self.left = reads, bytearray(len(reads)), len(reads)
        self._firsts = [read[0].chunk for read in reads]
        if self._missed is not None:
            self._seek(self._missed)

    def missed(self, entry: int) -> None:
        """A reader missed blob-map entry ``entry``: the fill goes on from the read that holds it (the entry
        itself, in the cache now, is found there and counted), else from the first read after it; and
        this layer's fill is the one the next turn goes to."""
        self.missed_at = trio.current_time()
        if self._reads:
            self._seek(entry)
        else:
            self._missed = entry

    def _seek(self, entry: int) -> None:
        read = self._read_of.get(entry)
        if read is None:  # not the fill's (a profile's, or no chunk of this layer's fill)
            read = bisect.bisect_left(self._firsts, entry)
        self._cursor = read

    def take(self) -> list[PrefetchEntry]:
        """The entries of the next read, marked taken: the first not taken from the cursor on, wrapping
        around at the end. Empty when none is left (or before ``planned``, or once stopped)."""
        if self.stopped or not self.left or not self._reads:
            return []
        count = len(self._reads)
        number = self._cursor % count
        while self._taken[number]:
            number = (number + 1) % count
        self._taken[number] = 1
        self._cursor = number + 1
        self.left -= 1
        return self._reads[number]

    def stop(self) -> None:
        self.stopped = True


def plan_reads(entries: list[PrefetchEntry], locate: Locate, max_bytes: int) -> list[list[PrefetchEntry]]:
    """The store reads of a fill: ``plan_runs`` of its entries (each at most ``max_bytes``), each read's
    entries in blob order, the reads in the blob order of their first entry. Any thread."""
    by_digest = {entry.digest: entry for entry in entries}
    runs = plan_runs(((entry.digest, locate(entry.chunk, entry.digest)) for entry in entries), max_bytes=max_bytes)
    reads = [sorted((by_digest[digest] for digest, _location in run.chunks), key=lambda entry: entry.chunk)
             for run in runs]
    return sorted(reads, key=lambda read: read[0].chunk)


class FillTurns:
    """The node's fill reads at once, shared by the layers filling. A fill holds a turn while it has reads
    to make, and after each read hands it over (``pass_on``) if a waiting fill's readers missed later than
    its own (FillOrder.missed_at); a turn that frees goes to the waiting fill whose readers missed last
    (among equals, the first to wait). Fills nobody has missed in keep their turns: they run one after
    another, in the order they started."""

    def __init__(self, turns: int):
        self.free = turns
        self._waiting: list[tuple[FillOrder, trio.Event]] = []

    @asynccontextmanager
    async def turn(self, order: FillOrder) -> AsyncIterator[_Turn]:
        await self._wait(order)
        turn = _Turn(self, order)
        try:
            yield turn
        finally:
            if turn.held:
                self._release()

    async def _wait(self, order: FillOrder) -> None:
        if self.free and not self._waiting:
            self.free -= 1
            return
        waiter = (order, trio.Event())
        self._waiting.append(waiter)
        try:
            await waiter[1].wait()
        except BaseException:  # cancelled: a turn given to it meanwhile goes on to the next
            if waiter[1].is_set():
                self._release()
            else:
                self._waiting.remove(waiter)
            raise

    def _hotter(self, order: FillOrder) -> bool:
        return any(waiting.missed_at > order.missed_at for waiting, _event in self._waiting)

    def _release(self) -> None:
        if not self._waiting:
            self.free += 1
            return
        waiter = max(self._waiting, key=lambda waiter: waiter[0].missed_at)
        self._waiting.remove(waiter)
        waiter[1].set()


class _Turn:
    """A turn held (FillTurns.turn)."""

    def __init__(self, turns: FillTurns, order: FillOrder):
        self._turns, self._order = turns, order
        self.held = True

    async def pass_on(self) -> None:
        """Between two reads: if a waiting fill was missed in later, give it this turn and wait for
        another."""
        if self._turns._hotter(self._order):
            self.held = False
            self._turns._release()
            await self._turns._wait(self._order)
            self.held = True
