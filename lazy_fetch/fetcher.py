"""The node daemon's chunk fetcher: local cache first, then the store; one fetch per chunk at a time.

    async with open_fetcher(store, cache) as fetcher:
        data = await fetcher.fetch(digest, location, priority=ONDEMAND, label="base/debian:12")
        chunks = await fetcher.fetch_many([(digest, location), ...], priority=PREFETCH, label=...)
        chunks = await fetcher.fetch_many(wanted, readahead=[(digest, location), ...], label=...)

How a request is served:

- **Single flight.** The first request for a chunk starts a *flight*; requests for the same chunk that
  arrive while it is in the air wait for it and get its result. A failure is delivered to every waiter and
  forgotten: the next request starts a new flight.
- **Cache, then store.** A flight looks the chunk up in the ChunkCache (in a worker thread), unless the
  cache says from memory that it surely lacks it (``ChunkCache.lacks``): then the miss goes to the store
  at once, one worker-thread hop fewer (that hop cost a cold miss 0.1-1 ms on a busy two-core node, as
  much as the store read behind a 1 ms store). One call's misses are planned into *runs* (``plan_runs``):
  chunks that are neighbours in a pack, fetched with one ranged GET of at most MAX_READ_BYTES; each run is
  one *store read*, in a worker thread of its own, and the runs of a call go to the store side by side,
  queued for store slots in the order of their first chunk in the call (a prefetch list names the
  first-needed chunks first). A store read decompresses and sha256-verifies each chunk before anything
  else sees it (a fill's excepted: below), and the chunks go into the cache in a worker thread: for a
  prefetch, by the read's own thread before the read is done (one ``put_many``, one index commit, per
  read); for a fill's read or one a reader waits for, after its slot is free and its waiters have the
  bytes, by the fetcher's *cache writer*: one task that puts the runs handed over since its last write (up
  to WRITE_BATCH_BYTES) in one ``put_many`` (one index commit for all of them: a reader that misses file
  after file hands over a run every millisecond or two, and a commit per run took the disk and the GIL
  from the misses behind it), their flights still listed (done) until they are in, so a request meanwhile
  takes them from the flight rather than reading the store again. The caching is the fetcher's task, not
  the caller's, so a fetch whose caller gave up still fills the cache. When a run fails on one corrupt
  chunk, each chunk of it is read alone, so the good ones are still served and only the bad one fails,
  with an error naming it.
- **A fill's chunks as fetched.** A store read at FILL priority (``StoreReads._read_frames``) keeps its
  chunks as their packs' frames (cache.Frame), neither decompressed nor checked: they land so, and the
  cache writer writes them so (cache.py: frames), for the cost of a copy to disk instead of the CPU of the
  whole layer beside the command. A flight whose waiters want bytes (``_Flight.plain``: fetch_many's, a
  readahead's, and a warm's above FILL priority, whose chunks a reader reads next; not the fill's) checks
  a Frame it meets, in the cache or in a fill's flight that ended (``_cache_lookup``, ``_check_kept``) or
  in a fill read it joined in the air (``_read_run``), kept_frames.py: decompressed within the size the
  blob map gives, its sha256 checked, right before it lands (a reader may join while a flight is in a
  worker thread, so a flight checks again after each hop); and hands the plain chunk to the cache writer,
  which replaces the frame's entry, its flight listed until then, so readers of one chunk at once or
  meanwhile check it once. A frame that is not its chunk (a store writer that lied to the fill) is
  dropped, logged with the chunk and the pack, and the chunk read from the store as a miss (LayerBlob
  tries its other locations after that).
- **Readahead on a miss.** A caller may name ``readahead`` chunks it expects to be read next (LayerBlob:
  the chunks that follow the range in the blob, i.e. the rest of the file and the files stored after
  it). They are looked at only when one of the wanted chunks missed the cache, and only those that
  ``plan_runs`` merges into a run carrying a wanted chunk are fetched: they ride along in a GET that is
  made anyway, so readahead costs link bytes but never a request or a store slot, and nobody waits for
  it but the run it rides in (a few ms of transfer on top of a round trip), and not for its check: the
  read's thread checks the chunks readers wait for and keeps the readahead as fetched
  (``StoreReads._read_wanted``), their flights land, and the readahead is checked after, in a worker
  thread, before its flights land (a reader that joins one meanwhile waits for that check); a bad
  readahead chunk fails alone. Without it a reader that
  walks files one by one (an import, a dpkg database scan) pays one round trip per file; with it, files
  stored side by side arrive together. Readahead chunks get flights at PREFETCH priority, so a reader
  that needs one meanwhile joins it.
- **Bounded concurrency with priorities.** At most ``max_concurrent`` store reads (GETs) run at once, and
  prefetch and fill reads use at most ``prefetch_slots`` of them, so on-demand reads always find a slot
  soon; fill reads (the rest of a layer) are at most FILL_READS of FILL_READ_BYTES and start only while
  no on-demand read waits (store_slots.py says why). Queued on-demand reads go before queued prefetch
  reads, those before fill; a queued read that a request of a higher priority joins is promoted.

The store reads themselves (each in a worker thread, its object's bound, the threads a deadline leaves
behind, the store's round trip, and ``call_store``) are store_reads.py's: the fetcher plans them, gives
them their priority and deadline, and lands their chunks.

Threads: ChunkFetcher lives in the trio thread; every method but ``cached`` and ``note_round_trip`` (any
thread: store_reads.py), the flights and the FetchStats are used from there only, so they need no locks.
Store reads (store_reads.py says in which threads) and cache calls run in worker threads via
trio.to_thread.run_sync: the trio thread never blocks on a store or the disk. Flights run as tasks of the
fetcher's own nursery (open_fetcher), not of the caller: a caller that is cancelled stops waiting, and the
fetch goes on for the others and the cache.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

import trio

from dsec_fs.chunks import ChunkLocation, ChunkRun, plan_runs
from dsec_fs.digest import to_hex
from dsec_fs.errors import CorruptError, DsecError, InputError, UnavailableError
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .cache import ChunkCache, Frame
from .fetch_stats import FetchStats
from .kept_frames import check_fetched, check_kept
from .store_reads import StoreReads
from .store_slots import FILL, ONDEMAND, PREFETCH, Priority, Refused, StoreSlots, Ticket

log = logging.getLogger(__name__)

# Store reads at once. A store answers each GET after a round trip (tens of ms), so reads side by side are
# what fills the link; by default a quarter of the slots are kept for on-demand reads.
DEFAULT_MAX_CONCURRENT = 16
DEFAULT_TIMEOUT = 30.0
# Reads of one store object in the air at once, abandoned ones included (module docstring).
DEFAULT_OBJECT_READS = 4
# Threads left behind in the store at most, over all objects.
DEFAULT_MAX_ABANDONED = 64
# Compressed bytes per store read: large enough to merge a run of neighbours, small enough that a big
# request is spread over several slots and its first chunks are not held up by its last.
MAX_READ_BYTES = 4 * 1024 * 1024
# Fill reads (store_slots.FILL) at once, and their compressed bytes per store read. The link is shared by
# the transfers on it, so a miss beside them gets a fifth of it (a 256 KiB chunk: 13 ms at 100 MB/s, on
# top of its round trip), and a miss that needs a chunk of a fill read in the air waits for at most 2 MiB.
# Four side by side keep a 100 MB/s link busy behind a 20 ms round trip, so the fill gets ahead of the
# first command's misses: against two of 1 MiB, a first-ever start behind 20 ms waited half the serial
# round trips and took 0.84-0.94x the time (docs/benchmarks.md, "fill10"); 4 MiB reads were slower (a
# miss promoted into one waits for all of it), and six of 2 MiB no faster.
FILL_READS = 4
FILL_READ_BYTES = 2 * 1024 * 1024
# Runs whose waiters have their bytes that may wait for the cache writer (their bytes in memory, at most
# MAX_READ_BYTES compressed each); beyond that a run's readers wait for its own write, by at most
# CACHE_WRITERS worker threads at once.
UNCACHED_RUNS = 32
CACHE_WRITERS = 4
# Uncompressed bytes the cache writer puts in one put_many (one index commit) at most, beyond its first run:
# so runs handed over behind a fill's are written (and their memory freed) soon.
WRITE_BATCH_BYTES = 8 << 20


class _Flight:
    """One chunk's fetch in the air: the result every waiter gets, once ``done`` is set."""

    __slots__ = ("done", "data", "error", "priority", "plain", "ticket")

    def __init__(self, priority: Priority, plain: bool):
        self.done = trio.Event()
        self.data: bytes | Frame | None = None  # a Frame: a fill's chunk as fetched (module docstring)
        self.error: BaseException | None = None
        self.priority = priority
        self.plain = plain  # someone waits for its bytes: it does not end with a fill's Frame
        self.ticket: Ticket | None = None  # the store-slot claim of its run, once it has one


class ChunkFetcher:
    """Made by open_fetcher, which owns the nursery the flights run in."""

    def __init__(
        self,
        store: Store,
        cache: ChunkCache,
        nursery: trio.Nursery,
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        prefetch_slots: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        object_reads: int = DEFAULT_OBJECT_READS,
        max_abandoned: int = DEFAULT_MAX_ABANDONED,
        on_fetched: Callable[[list[bytes]], object] = lambda digests: None,
    ):
        """``on_fetched(digests)`` is told, in the trio thread, of the chunks each store read brought,
        before anyone waiting for them has them."""
        prefetch_slots = max(1, max_concurrent * 3 // 4) if prefetch_slots is None else prefetch_slots
        if max_concurrent < 1 or not 0 < prefetch_slots <= max_concurrent:
            raise InputError(f"need 0 < prefetch_slots ({prefetch_slots}) <= max_concurrent ({max_concurrent})",
                             where="chunk fetcher")
        if object_reads < 1 or max_abandoned < 1:
            raise InputError(f"object_reads ({object_reads}) and max_abandoned ({max_abandoned}) must be positive",
                             where="chunk fetcher")
        self.store = store
        self.cache = cache
        self.timeout = timeout
        self._on_fetched = on_fetched
        self._nursery = nursery
        slots = StoreSlots(max_concurrent, prefetch_slots, min(FILL_READS, prefetch_slots), object_reads, max_abandoned)
        self._store_reads = StoreReads(store, slots, timeout=timeout, cache_put=self._cache_put)
        # The store-read side's gauges and calls, as the fetcher's callers know them (StoreReads says what each is).
        self.waiting = self._store_reads.waiting
        self.stuck_objects = self._store_reads.stuck_objects
        self.round_trip = self._store_reads.round_trip
        self.note_round_trip = self._store_reads.note_round_trip
        self.call_store = self._store_reads.call_store
        self._flights: dict[bytes, _Flight] = {}
        self._cache_writers = trio.CapacityLimiter(CACHE_WRITERS)
        self._uncached_runs = 0  # runs whose readers have their bytes, not in the cache yet
        self._unwritten: list[tuple[str, list[tuple[bytes, bytes | Frame]]]] = []  # those queued for the cache writer
        self._cache_writer_running = False
        self.unwritten_bytes = 0  # stored bytes (a Frame's, for a frame) of the runs in _unwritten and being written
        self.unwritten_plain_bytes = 0  # the same at their chunks' size: what they take in the cache once read
        self._written = trio.lowlevel.ParkingLot()  # woken after each write of the cache writer
        self._stats: dict[str, FetchStats] = {}
        self._reads_planned = 0  # numbers the store reads' tickets (see StoreSlots)

    def stats(self, label: str = "") -> FetchStats:
        """The counters of ``label`` (created on first use)."""
        stats = self._stats.get(label)
        if stats is None:
            stats = self._stats[label] = FetchStats(label)
        return stats

    def all_stats(self) -> dict[str, FetchStats]:
        return dict(self._stats)

    @property
    def store_reads_running(self) -> int:
        """StoreReads.store_reads_running (a gauge)."""
        return self._store_reads.store_reads_running

    @property
    def abandoned_reads(self) -> int:
        """StoreReads.abandoned_reads (a gauge)."""
        return self._store_reads.abandoned_reads

    @property
    def in_flight(self) -> int:
        """Chunks being fetched right now (in the cache lookup, queued, being read, or being cached)."""
        return len(self._flights)

    async def fetch(self, digest: bytes, location: ChunkLocation, *, priority: Priority = ONDEMAND,
                    label: str = "") -> bytes:
        """The verified bytes of one chunk."""
        return (await self.fetch_many([(digest, location)], priority=priority, label=label))[digest]

    async def fetch_many(self, items: Iterable[tuple[bytes, ChunkLocation]], *, priority: Priority = ONDEMAND,
                         label: str = "", readahead: Iterable[tuple[bytes, ChunkLocation]] = ()) -> dict[bytes, bytes]:
        """digest -> verified bytes for every item. Raises the error of the first failed chunk (in the order
        given) after that chunk's flight ends; the other chunks' flights go on and fill the cache.
        ``readahead``: chunks to fetch along, if a GET for a missed item is made anyway (module docstring);
        they are not waited for nor returned."""
        chunks: dict[bytes, bytes] = {}
        for digest, flight in self._join(items, priority, label, readahead, plain=True).items():
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            chunks[digest] = flight.data
        return chunks

    async def warm(self, items: Iterable[tuple[bytes, ChunkLocation]], *, priority: Priority = PREFETCH,
                   label: str = "", landed: Callable[[bytes, bytes | None, BaseException | None], object]) -> None:
        """Fetch ``items`` into the cache as fetch_many does, without gathering their bytes: a prefetch of
        a long list plans it in one go (so neighbours in a pack share GETs however far apart the list
        names them) and holds in memory only what landed ahead of the first chunk still in the air.
        ``landed(digest, data, error)`` is called for each item in the order given once its flight has
        ended: its bytes (None for a fill's, kept as fetched) and None once it is cached, else None and the
        error. Above FILL priority (a prefetch, a miss's readahead window) a chunk the cache keeps as a
        fill fetched it is checked and made plain as a read would: these are what a reader reads next, and
        checked here, in the background, they cost that reader nothing (left to the read, first-ever
        starts behind 20 ms took 0.89-1.25x main's seconds, against 0.77-0.86x: docs/benchmarks.md)."""
        waits = self._join(items, priority, label, (), plain=priority < FILL)
        while waits:
            digest = next(iter(waits))
            flight = waits.pop(digest)
            await flight.done.wait()
            landed(digest, None if isinstance(flight.data, Frame) else flight.data, flight.error)

    def _join(self, items: Iterable[tuple[bytes, ChunkLocation]], priority: Priority, label: str,
              readahead: Iterable[tuple[bytes, ChunkLocation]], *, plain: bool) -> dict[bytes, _Flight]:
        """The flight of each item: one in the air, or a new one (started with ``readahead``). ``plain``:
        the caller wants the chunks' bytes (fetch_many; not warm), so it takes no fill's chunk as
        fetched: the flight is marked so (``_Flight.plain``), and one that ended with a Frame (its write to
        the cache still to come) is followed by one that checks that frame (``_fly``)."""
        stats = self.stats(label)
        waits: dict[bytes, _Flight] = {}
        started: list[tuple[bytes, ChunkLocation, _Flight]] = []
        frames: dict[bytes, Frame] = {}  # the fill's frames of done flights that such a request follows
        for digest, location in items:
            if digest in waits:
                continue
            flight = self._flights.get(digest)
            if flight is not None and plain and flight.done.is_set() and isinstance(flight.data, Frame):
                frames[digest], flight = flight.data, None
            if flight is None:
                flight = self._flights[digest] = _Flight(priority, plain)
                started.append((digest, location, flight))
            else:
                stats.coalesced += 1
                flight.plain = flight.plain or plain
                if priority < flight.priority:
                    flight.priority = priority
                    if flight.ticket is not None:
                        self._store_reads.promote(flight.ticket, priority)
            waits[digest] = flight
        if started:
            self._nursery.start_soon(self._fly, started, stats, list(readahead), frames)
        return waits

    async def _fly(self, started: list[tuple[bytes, ChunkLocation, _Flight]], stats: FetchStats,
                   readahead: list[tuple[bytes, ChunkLocation]], frames: dict[bytes, Frame]) -> None:
        """Serve new flights: cache lookups (``frames``: those of them whose Frame is known, not looked
        up), then the store for the misses, in runs read side by side. A flight whose waiters want bytes
        (``_Flight.plain``) and that finds a Frame checks it (``_cache_lookup``, then again after each hop
        for the readers that joined meanwhile) and hands the plain chunk to the cache writer, its flight
        listed until written, so readers meanwhile take it from there and it is checked once."""
        try:
            readahead = [(digest, location) for digest, location in readahead if digest not in self._flights]
            # What the cache surely lacks is not looked up: a miss goes to the store without a worker-thread
            # hop first. Readahead the cache may hold is looked up only in a hop made anyway; without one
            # it is left out (it is most likely cached).
            maybe_cached = [(digest, location) for digest, location, _ in started
                            if digest in frames or not self.cache.lacks(digest)]
            ahead_unknown = [digest for digest, _ in readahead if not self.cache.lacks(digest)]
            known_misses = len(started) - len(maybe_cached)
            checked: dict[str, list[tuple[bytes, bytes]]] = {}
            if maybe_cached:
                plain = {digest for digest, _, flight in started if flight.plain}
                write_now = self._uncached_runs >= UNCACHED_RUNS  # else the cache writer writes the checked
                cached, checked, ahead_cached = await trio.to_thread.run_sync(
                    self._cache_lookup, maybe_cached, frames, plain, write_now, ahead_unknown, known_misses > 0)
                # Readers that joined a flight during the hop want its bytes too: its Frame is checked now.
                while joined := [(digest, location) for digest, location, flight in started
                                 if flight.plain and isinstance(cached.get(digest), Frame)]:
                    await trio.to_thread.run_sync(self._check_kept, joined, cached, checked)
            else:
                cached, ahead_cached = {}, set(ahead_unknown)
            self.cache.note_misses(known_misses)
            missed: dict[bytes, tuple[ChunkLocation, _Flight]] = {}
            handed_over = {digest for chunks in checked.values() for digest, _data in chunks}
            for digest, location, flight in started:
                if digest in cached:
                    stats.hits += 1
                    self._land(digest, flight, data=cached[digest], cached=digest not in handed_over)
                else:
                    stats.misses += 1
                    missed[digest] = (location, flight)
            for pack_id, chunks in checked.items():
                if self._hand_over(pack_id, chunks):
                    self._nursery.start_soon(self._write_handed_over)
            ahead = {digest: location for digest, location in readahead
                     if digest not in ahead_cached and digest not in self._flights}
            filling = all(flight.priority == FILL for _location, flight in missed.values())
            runs = plan_runs([*((digest, location) for digest, (location, _) in missed.items()), *ahead.items()],
                             max_bytes=FILL_READ_BYTES if filling else MAX_READ_BYTES)
            first = {digest: n for n, digest in enumerate(missed)}
            planned = []
            for run in runs:
                position = min(first.get(digest, len(first)) for digest, _ in run.chunks)
                if position < len(first):  # a run of readahead chunks alone is not worth a GET
                    planned.append((position, run))
            planned.sort(key=lambda item: item[0])
            reads = []
            for _position, run in planned:
                flights = []
                for digest, location in run.chunks:
                    if digest in missed:
                        flights.append(missed[digest][1])
                    else:
                        flight = self._flights[digest] = _Flight(PREFETCH, True)
                        started.append((digest, location, flight))  # so the finally below lands it
                        flights.append(flight)
                        stats.readahead += 1
                self._reads_planned += 1
                ticket = Ticket(keys.pack(run.pack_id), min(flight.priority for flight in flights), self._reads_planned)
                for flight in flights:
                    flight.ticket = ticket
                reads.append((run, flights, ticket, stats))
            if len(reads) == 1:  # most misses: read in this task, not one started for it (a scheduling round less)
                await self._read_run(*reads[0])
            elif reads:
                async with trio.open_nursery() as nursery:
                    for read in reads:
                        nursery.start_soon(self._read_run, *read)
        finally:
            # Only when the fetcher shuts down (or on a bug) can a flight still be in the air here;
            # nobody may wait for it forever.
            for digest, _, flight in started:
                if not flight.done.is_set():
                    self._land(digest, flight, error=UnavailableError(
                        "the chunk fetcher stopped before the chunk arrived", where=f"chunk {to_hex(digest)}"))

    async def _read_run(self, run: ChunkRun, flights: list[_Flight], ticket: Ticket, stats: FetchStats) -> None:
        """One store read: ``run``'s chunks (``flights`` are theirs, in the same order) land when it ends."""
        items = list(run.chunks)
        started_at = trio.current_time()
        stats.store_reads += 1
        logged: set[int] = set()  # a whole-run error is logged once
        try:
            with trio.fail_after(self.timeout):
                results = await self._store_reads.read(run, ticket, stats, lambda: {
                    digest for (digest, _location), flight in zip(items, flights) if flight.priority == ONDEMAND})
        except trio.TooSlowError:
            stats.timeouts += len(items)
            error = UnavailableError(f"the store did not answer within {self.timeout:g} s",
                                     where=_chunks_name(items), transient=True)
            results = dict.fromkeys((digest for digest, _ in items), error)
        except Refused as refused:  # counted, not logged: the stall was, once
            stats.refused += len(items)
            error = UnavailableError(str(refused), where=f"store object {ticket.key} ({_chunks_name(items)})",
                                     transient=True)
            logged.add(id(error))
            results = dict.fromkeys((digest for digest, _ in items), error)
        except Exception as exc:  # whatever the store raised goes to the waiters
            results = dict.fromkeys((digest for digest, _ in items), exc)
        stats.observe_latency(trio.current_time() - started_at)

        # A prefetch run was cached by its read's thread (ticket.cached), so a job that is done has its
        # chunks in the cache and its bound on the cache's room holds. Any other run (asked for, promoted,
        # or a fill's) is handed to its waiters first, and the cache writer writes it afterwards, with the
        # other runs handed over meanwhile, its store slot free already: a fill read's slot held through
        # its cache write (a hundred ms or more for a MiB of small chunks) kept the link idle most of the
        # time (docs/benchmarks.md, "fill8"). A fill counts the bytes not written yet against the cache's
        # room (``unwritten_bytes``) and waits while too many are (``written_down_to``). Until the chunks
        # are in, their flights stay listed (done), so a request meanwhile gets the bytes from the flight
        # instead of missing the cache and reading the store again. Runs handed over so are at most
        # UNCACHED_RUNS at once (their bytes stay in memory until written): beyond that, as when the
        # cache's disk is slower than the store, readers wait for the write.
        readers_first = not ticket.cached and self._uncached_runs < UNCACHED_RUNS
        # The chunks of an on-demand read that readers wait for land before the readahead it carries is
        # checked (StoreReads._read_wanted kept that as fetched): a miss waited for the decompression and
        # check of its whole run, up to MAX_READ_BYTES of readahead (docs/benchmarks.md, "miss14").
        landed: set[bytes] = set()
        if readers_first:
            self._land_run(items, flights, results, stats, logged, landed)
        # A fill's read that readers joined (before it landed), and an on-demand read's readahead: their
        # chunks are checked for them, until none that a reader wants is left a Frame (one may join during
        # each hop).
        while joined := [(digest, location) for (digest, location), flight in zip(items, flights)
                         if flight.plain and isinstance(results[digest], Frame)]:
            results.update(await trio.to_thread.run_sync(check_fetched, joined, results))
        verified = [(digest, result) for digest, result in results.items() if not isinstance(result, BaseException)]
        if verified and not ticket.cached and not readers_first:
            await trio.to_thread.run_sync(self._cache_put, run.pack_id, verified, limiter=self._cache_writers)
        self._land_run(items, flights, results, stats, logged, landed, cached=not readers_first)
        if verified and readers_first and self._hand_over(run.pack_id, verified):
            await self._write_handed_over()  # this task is the cache writer until the queue is empty

    def _land_run(self, items: list[tuple[bytes, ChunkLocation]], flights: list[_Flight],
                  results: dict[bytes, bytes | Frame | BaseException], stats: FetchStats, logged: set[int],
                  landed: set[bytes], *, cached: bool = False) -> None:
        """Land the flights of a store read's chunks not in ``landed`` (added to it) whose result is final:
        an error, or bytes for a flight, or a Frame for one nobody wants the bytes of (a fill's, not
        joined); the others are left for the check that follows. ``on_fetched`` is told of them first.
        Unless ``cached``, the flights of those with bytes stay listed (the cache writer unlists them)."""
        ready = [(digest, flight) for (digest, _location), flight in zip(items, flights)
                 if digest not in landed and not (flight.plain and isinstance(results[digest], Frame))]
        self._on_fetched([digest for digest, _flight in ready if not isinstance(results[digest], BaseException)])
        for digest, flight in ready:
            landed.add(digest)
            result = results[digest]
            if isinstance(result, BaseException):
                stats.errors += 1
                stats.corrupt += isinstance(result, CorruptError)
                if id(result) not in logged:
                    logged.add(id(result))
                    log.error("fetching chunk %s failed: %s", to_hex(digest), result)
                self._land(digest, flight, error=result)
            else:
                stats.chunks_fetched += 1
                stats.bytes_fetched += _plain_size(result)
                self._land(digest, flight, data=result, cached=cached)

    def _hand_over(self, pack_id: str, chunks: list[tuple[bytes, bytes | Frame]]) -> bool:
        """Queue chunks (of ``pack_id``) whose flights have landed, still listed, for the cache writer;
        True when none is running: the caller is to run ``_write_handed_over`` then."""
        self._uncached_runs += 1
        self.unwritten_bytes += sum(_stored_size(data) for _digest, data in chunks)
        self.unwritten_plain_bytes += sum(_plain_size(data) for _digest, data in chunks)
        self._unwritten.append((pack_id, chunks))
        starts, self._cache_writer_running = not self._cache_writer_running, True
        return starts

    async def _write_handed_over(self) -> None:
        """The cache writer: put the runs handed over (``_unwritten``) into the cache, those queued up to
        WRITE_BATCH_BYTES in one worker-thread call (one index commit), until none is left; then unlist
        their flights (those still holding what was written). The first run handed over while none is
        writing writes, in its own task: its thread starts before its readers run. Shielded: runs handed
        over are written even when the fetcher shuts down, as a write under way always was (a worker
        thread is not stopped)."""
        try:
            while self._unwritten:
                taken, size, plain_size = 0, 0, 0
                while taken < len(self._unwritten) and (not taken or size < WRITE_BATCH_BYTES):
                    size += sum(_stored_size(data) for _digest, data in self._unwritten[taken][1])
                    plain_size += sum(_plain_size(data) for _digest, data in self._unwritten[taken][1])
                    taken += 1
                batch, self._unwritten = self._unwritten[:taken], self._unwritten[taken:]
                try:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(self._cache_put_runs, batch)
                finally:
                    self._uncached_runs -= len(batch)
                    self.unwritten_bytes -= size
                    self.unwritten_plain_bytes -= plain_size
                    self._written.unpark_all()
                    for _pack_id, verified in batch:
                        for digest, data in verified:
                            flight = self._flights.get(digest)
                            if flight is not None and flight.done.is_set() and flight.data is data:
                                del self._flights[digest]
        finally:
            self._cache_writer_running = False

    async def written_down_to(self, limit: int) -> None:
        """Wait until the bytes handed over and not yet in the cache are at most ``limit``."""
        while self.unwritten_bytes > limit:
            await self._written.park()

    def _land(self, digest: bytes, flight: _Flight, *, data: bytes | None = None,
              error: BaseException | None = None, cached: bool = True) -> None:
        """End ``flight``; unless ``cached`` is False (its bytes are still to be put in the cache: the
        caller unlists it then), it leaves the table of flights."""
        flight.data, flight.error = data, error
        if cached and self._flights.get(digest) is flight:
            del self._flights[digest]
        flight.done.set()

    # -- worker threads

    def _cache_lookup(self, items: list[tuple[bytes, ChunkLocation]], frames: dict[bytes, Frame], plain: set[bytes],
                      write_now: bool, ahead: list[bytes],
                      missed: bool) -> tuple[dict[bytes, bytes | Frame], dict[str, list[tuple[bytes, bytes]]], set[bytes]]:
        """The cached chunks among ``items`` (those in ``frames`` not looked up: that is their Frame), those
        of ``plain`` checked if the cache kept them as Frames (``_check_kept``); the chunks so checked, by
        pack, unless ``write_now`` (then they are put here and now); and, if any of ``items`` missed (or
        ``missed``: other wanted chunks did), which of ``ahead`` (readahead candidates) the cache holds
        already: asked of its index only (nothing read, no miss counted: the cache's misses are chunks a
        read wanted). A cache that fails is logged and bypassed: the store has every chunk."""
        found: dict[bytes, bytes | Frame] = {}
        checked: dict[str, list[tuple[bytes, bytes]]] = {}
        for digest, location in items:
            stored = frames.get(digest) or self._cache_get(digest)
            if stored is not None:
                found[digest] = stored
        self._check_kept([(digest, location) for digest, location in items
                          if digest in plain and isinstance(found.get(digest), Frame)], found, checked)
        if checked and write_now:
            self._cache_put_runs(list(checked.items()))
            checked = {}
        if not missed and len(found) == len({digest for digest, _location in items}):
            return found, checked, set()
        try:
            return found, checked, self.cache.holds(ahead)
        except (DsecError, OSError) as exc:
            log.warning("chunk cache lookup of readahead failed, reading the store: %s", exc)
            return found, checked, set()

    def _check_kept(self, items: list[tuple[bytes, ChunkLocation]], found: dict[bytes, bytes | Frame],
                    checked: dict[str, list[tuple[bytes, bytes]]]) -> None:
        """Check the Frame ``found`` holds for each of ``items`` (kept_frames.check_kept): its chunk
        replaces it there and is added to ``checked`` (by pack); one that is not its chunk (dropped from
        the cache) leaves ``found``, a miss. Worker threads, while the flight that owns both dicts waits."""
        for digest, location in items:
            frame = found[digest]
            data = check_kept(self.cache, digest, location, frame)
            if data is None:
                del found[digest]
            else:
                found[digest] = data
                checked.setdefault(frame.pack_id, []).append((digest, data))

    def cached(self, digests: Iterable[bytes]) -> dict[bytes, bytes]:
        """The chunks among ``digests`` that the cache holds, read and checked, a fill's kept as Frames
        left out (a read checks those, in its flight); the store is not asked. Blocks: for worker threads."""
        found = {}
        for digest in digests:
            data = self._cache_get(digest)
            if data is not None and not isinstance(data, Frame):
                found[digest] = data
        return found

    def _cache_get(self, digest: bytes) -> bytes | Frame | None:
        """``cache.get``; a cache that fails is logged and answers None (the store has every chunk)."""
        try:
            return self.cache.get(digest)
        except (DsecError, OSError) as exc:
            log.warning("chunk cache lookup of %s failed, reading the store: %s", to_hex(digest), exc)
            return None

    def _cache_put(self, pack_id: str, verified: list[tuple[bytes, bytes | Frame]]) -> None:
        self._cache_put_runs([(pack_id, verified)])

    def _cache_put_runs(self, runs: list[tuple[str, list[tuple[bytes, bytes | Frame]]]]) -> None:
        """Put the verified chunks of ``runs`` (pack id, chunks) into the cache in one ``put_many``; a
        failure is logged (the store still has them)."""
        try:
            self.cache.put_many([item for _pack_id, verified in runs for item in verified])
        except (DsecError, OSError) as exc:
            packs = sorted({pack_id for pack_id, _verified in runs})
            log.warning("caching %d chunks of pack %s failed: %s", sum(len(verified) for _pack_id, verified in runs),
                        ", ".join(packs[:3]) + (f" and {len(packs) - 3} more" if len(packs) > 3 else ""), exc)



def _stored_size(data: bytes | Frame) -> int:
    """The bytes a chunk takes in the cache: its own, or its frame's."""
    return len(data.frame) if isinstance(data, Frame) else len(data)


def _plain_size(data: bytes | Frame) -> int:
    """The bytes a chunk takes in the cache once read: its own (a frame's chunk's)."""
    return data.plain_size if isinstance(data, Frame) else len(data)


def _chunks_name(items: list[tuple[bytes, ChunkLocation]]) -> str:
    first = f"chunk {to_hex(items[0][0])} in pack {items[0][1].pack_id}"
    return first + (f" and {len(items) - 1} more" if len(items) > 1 else "")


@asynccontextmanager
async def open_fetcher(
    store: Store,
    cache: ChunkCache,
    *,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    prefetch_slots: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    object_reads: int = DEFAULT_OBJECT_READS,
    max_abandoned: int = DEFAULT_MAX_ABANDONED,
) -> AsyncIterator[ChunkFetcher]:
    """A ChunkFetcher whose flights run in a nursery of its own; leaving the block cancels the flights
    still in the air (their waiters get UnavailableError). ``prefetch_slots`` defaults to three quarters
    of the slots."""
    async with trio.open_nursery() as nursery:
        fetcher = ChunkFetcher(store, cache, nursery, max_concurrent=max_concurrent, prefetch_slots=prefetch_slots,
                               timeout=timeout, object_reads=object_reads, max_abandoned=max_abandoned)
        try:
            yield fetcher
        finally:
            nursery.cancel_scope.cancel()
