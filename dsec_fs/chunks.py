"""Chunks on a store: where each chunk lives (ChunkIndex), writing new ones (ChunkUploader), reading them
back verified (read_chunk, read_chunks; or plan_runs and read_run, for callers that fetch runs in parallel;
or read_run_frames and, later, decode_chunk, for one that keeps chunks as fetched until they are read).

A chunk is named by the sha256 of its plain bytes and stored as one zstd frame inside a pack (pack.py).
The store is not trusted: every chunk read is decompressed with its promised size and re-hashed before it
is returned. Nor is any one index object: in a shared store a writer may put an index that claims other
layers' chunks in its own pack. So ChunkIndex keeps every location given for a chunk, first seen first,
and ``locations(digest, prefer)`` puts those in the packs a layer's manifest names first (a reader tries
them in turn, the next after an integrity failure); ``verify_pack`` reads a whole pack and checks every
chunk its index claims (what a build checks before it deduplicates against a pack it did not write). Nor
the size an index gives a chunk: a forger's may claim a GiB for a 4 KiB chunk, with a frame declaring as
much, and zstd allocates what a frame declares before it decompresses; a reader that knows the chunk's
size from its layer (the blob map) reads only a location that claims that size (``location_of_size``;
``size_claim_error`` for one that does not, naming its pack index and the chunk).

Threads:
- ChunkIndex: any thread may call any method; ``_lock`` guards the digest -> location dicts and the set
  of packs loaded.
- ChunkUploader: builder worker threads call ``add`` (or ``claim`` or ``claim_many``, and ``add_claimed``
  or ``add_claimed_many``) concurrently;
  one thread calls ``flush`` (or ``close``) after every ``add`` has returned. ``_lock`` guards the open
  pack, the set of queued (or claimed) digests,
  the statistics, the list of written packs and the first upload error. Uploads run on the uploader's own
  threads; ``_slots`` (a semaphore) bounds the packs sealed but not yet uploaded, and a thread that
  seals a pack waits for a slot, so memory stays near (upload_threads + 1) x pack_target.
- read_chunk, read_chunks, plan_runs, read_run, read_run_frames, decode_chunk, location_of_size,
  size_claim_error: plain functions, safe from any thread.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict
from collections.abc import Collection, Container, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import compress
from .digest import is_hex_digest, to_hex, verify
from .errors import CorruptError, FormatError, InputError, NotFoundError
from .pack import MAX_INDEX_BYTES, PackEntry, PackWriter, decode_index, entries_of_records
from .store import keys
from .store.base import Store, get_small, side_by_side

DEFAULT_PACK_TARGET = 16 * 1024 * 1024
# A pack is read whole only to restore its index (pack_indexes.restore_pack_index), at most this many bytes: far
# more than a pack sealed at DEFAULT_PACK_TARGET (its last frame of at most a 16 MiB chunk past it, and
# its index), so only a store writer's object is refused.
MAX_PACK_BYTES = 256 << 20
# Ranges in one pack closer than this are fetched with one GET: a request costs more than 64 KiB of transfer.
MERGE_GAP = 64 * 1024
# Index objects are small; reading several at once hides the store's per-request latency. A layer of a
# few hundred MB has tens of packs, and loading their indexes is on the path of its first mount: 16 at
# once (the daemon's store concurrency) makes that two or three round trips.
INDEX_LOAD_THREADS = 16
# verify_pack reads a pack in ranged GETs of at most this many bytes, so a pack whose index claims huge
# frames costs bounded memory.
VERIFY_READ_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    pack_id: str
    offset: int
    clen: int
    ulen: int


class ChunkIndex:
    """Chunk digest (32 raw bytes) -> ChunkLocation, filled from index objects and from new uploads.

    ``get`` answers the first location recorded; ``locations`` all of them (see the module docstring).
    A chunk held by one pack, the usual case, costs one dict entry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locations: dict[bytes, ChunkLocation] = {}
        self._more: dict[bytes, list[ChunkLocation]] = {}  # digest -> its later locations, in other packs
        self._packs: set[str] = set()  # packs recorded with add_pack

    def get(self, digest: bytes) -> ChunkLocation | None:
        with self._lock:
            return self._locations.get(digest)

    def pack_of(self, digest: bytes) -> str | None:
        """The id of the pack ``get`` answers for ``digest``; None if no pack holds it."""
        location = self.get(digest)
        return None if location is None else location.pack_id

    def locations(self, digest: bytes, prefer: Container[str] = ()) -> list[ChunkLocation]:
        """Every location of ``digest``: those in the packs ``prefer`` names first, each group first seen
        first."""
        with self._lock:
            first = self._locations.get(digest)
            every = [] if first is None else [first, *self._more.get(digest, ())]
        return sorted(every, key=lambda location: location.pack_id not in prefer)  # stable: order kept

    def demote(self, digest: bytes, location: ChunkLocation) -> None:
        """Put ``location`` of ``digest`` last (a read from it failed where another succeeded), so that
        ``get`` answers a location that works. It is kept: its failure may have been the store's once."""
        with self._lock:
            more = self._more.get(digest)
            if not more:
                return
            if self._locations.get(digest) == location:
                self._locations[digest] = more.pop(0)
            elif location in more:
                more.remove(location)
            else:
                return
            more.append(location)

    def has_packs(self, pack_ids: Iterable[str]) -> bool:
        """Whether every one of these packs has been recorded."""
        with self._lock:
            return all(pack_id in self._packs for pack_id in pack_ids)

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._locations

    def __len__(self) -> int:
        with self._lock:
            return len(self._locations)

    def add_pack(self, pack_id: str, entries: Iterable[PackEntry]) -> None:
        """Record a pack's chunks. A chunk already known keeps its first location, so ``get`` is stable;
        a location in another pack is kept after it."""
        with self._lock:
            self._packs.add(pack_id)
            for entry in entries:
                location = ChunkLocation(pack_id, entry.offset, entry.clen, entry.ulen)
                first = self._locations.setdefault(entry.digest, location)
                if first.pack_id != pack_id:
                    more = self._more.setdefault(entry.digest, [])
                    if all(other.pack_id != pack_id for other in more):
                        more.append(location)

    def add_pack_records(self, pack_id: str, records: bytes, digests: Collection[bytes] | None = None) -> None:
        """``add_pack`` of the entries that ``records`` (pack.INDEX_ENTRY records) hold; ``digests``, if
        given, are the same chunks' digests as objects the caller holds anyway (the uploader's are the
        chunker's, which the tree holds too), so that an index keyed by them makes no copy of each."""
        self.add_pack(pack_id, entries_of_records(records))

    def load(self, store: Store) -> int:
        """Read every index object of ``store``; returns how many were read."""
        return self._load_keys(store, list(store.list(keys.INDEX)))

    def load_packs(self, store: Store, pack_ids: Iterable[str]) -> int:
        """Read the index objects of the given packs only (e.g. those a layer manifest lists)."""
        return self._load_keys(store, [keys.index(pack_id) for pack_id in pack_ids])

    def _load_keys(self, store: Store, index_keys: list[str]) -> int:
        def load_one(key: str) -> None:
            pack_id = keys.id_from_key(key)
            if not is_hex_digest(pack_id):
                raise FormatError("index key", None, "the last component is not a pack id", source=key)
            self.add_pack(pack_id, read_index_object(store, key))

        with ThreadPoolExecutor(max_workers=INDEX_LOAD_THREADS, thread_name_prefix="index-load") as pool:
            for _ in pool.map(load_one, index_keys):  # re-raises the first failure, naming its key
                pass
        return len(index_keys)


class ChunkUploader:
    """Deduplicates new chunks against a ChunkIndex, fills packs, and uploads them in the background.

    Each sealed pack costs two PUTs: the pack object, then its index object (``Store.put_all``: the index
    only once the pack is stored). Only after both succeed do its chunks enter the ChunkIndex, so the
    index never points at a pack that is not in the store.
    """

    def __init__(
        self,
        store: Store,
        index: ChunkIndex,
        *,
        pack_target: int = DEFAULT_PACK_TARGET,
        upload_threads: int = 2,
    ):
        if upload_threads < 1:
            raise InputError(f"upload_threads must be at least 1, got {upload_threads}", where="ChunkUploader")
        self.store = store
        self.index = index
        self.pack_target = pack_target
        self._upload_threads = upload_threads
        self._slots = threading.BoundedSemaphore(upload_threads)
        self._lock = threading.Lock()
        self._writer = PackWriter()
        self._queued: set[bytes] = set()  # added in this session, not yet in the index
        self._uploads: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self._error: Exception | None = None
        self._pack_ids: list[str] = []
        self.new_chunks = 0
        self.new_bytes = 0  # uncompressed
        self.stored_bytes = 0  # compressed: the frames queued for upload
        self.packs = 0

    def add(self, digest: bytes, ulen: int, frame: bytes) -> bool:
        """Queue one chunk (``frame`` is its zstd frame). False when the chunk is already stored or queued.

        May block while the upload slots are full. Raises the first upload error once one has happened.
        """
        if not self.claim(digest):
            return False
        self.add_claimed(digest, ulen, frame)
        return True

    def claim(self, digest: bytes) -> bool:
        """True exactly once per chunk that is neither stored nor queued: the caller then compresses it and
        must hand it to ``add_claimed`` (until then, other threads' ``claim`` and ``add`` of it say False).
        This is how a builder compresses each new chunk once, however many threads meet it."""
        return self.claim_many((digest,))[0]

    def add_claimed(self, digest: bytes, ulen: int, frame: bytes) -> None:
        """Queue a chunk this caller claimed (``claim`` said True); may block as ``add`` does."""
        self.add_claimed_many(((digest, ulen, frame),))

    def add_claimed_many(self, chunks: Iterable[tuple[bytes, int, bytes]]) -> None:
        """``add_claimed`` of each (digest, ulen, frame) in turn, each claimed by this caller: one lock taken
        and one PackWriter.add_many per pack filled, not a call a chunk (a batch of small files' chunks);
        may block as ``add`` does."""
        chunks = list(chunks)
        while chunks:
            with self._lock:
                if self._error is not None:
                    raise self._error
                writer = self._writer
                # The writer is sealed after the chunk that brings it to pack_target: ``fits`` chunks go in.
                ends = list(itertools.accumulate((len(frame) for _digest, _ulen, frame in chunks),
                                                 initial=writer.size))
                fits = bisect.bisect_left(ends, self.pack_target, lo=1)
                taken, chunks = chunks[:fits], chunks[fits:]
                digests, ulens, frames = zip(*taken)
                writer.add_many(digests, frames, ulens)
                self.new_chunks += len(taken)
                self.new_bytes += sum(ulens)
                self.stored_bytes += ends[len(taken)] - ends[0]
                sealed = self._seal_if(writer.size >= self.pack_target)
            if sealed is not None:
                self._submit(sealed)

    def claim_many(self, digests: Iterable[bytes]) -> list[bool]:
        """``claim`` of each of ``digests`` in turn, under one lock (a digest that comes twice is claimed
        the first time only)."""
        with self._lock:
            if self._error is not None:
                raise self._error
            queued, index = self._queued, self.index
            claimed = []
            for digest in digests:
                fresh = digest not in queued and digest not in index
                if fresh:
                    queued.add(digest)
                claimed.append(fresh)
        return claimed

    def send(self) -> None:
        """Start uploading the open pack, without waiting for it (``flush`` waits). Call it after every
        ``add`` has returned."""
        with self._lock:
            sealed = self._seal_if(self._writer.count > 0 and self._error is None)
        if sealed is not None:
            self._submit(sealed)

    def flush(self) -> list[str]:
        """Upload the open pack, wait for every upload, and return the ids of all packs written.

        Re-raises the first upload error. Call it after every ``add`` has returned.
        """
        self.send()
        self.close()
        with self._lock:
            if self._error is not None:
                raise self._error
            return list(self._pack_ids)

    def close(self) -> None:
        """Wait for uploads in flight and stop the upload threads; the open pack is not uploaded."""
        with self._lock:
            uploads, self._uploads = self._uploads, []
            pool, self._pool = self._pool, None
        for upload in uploads:
            upload.exception()  # waits; the error itself was recorded by _upload
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "ChunkUploader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _seal_if(self, condition: bool) -> PackWriter | None:
        """With ``_lock`` held: hand back the open pack and start a new one when ``condition`` holds."""
        if not condition:
            return None
        sealed, self._writer = self._writer, PackWriter()
        return sealed

    def _submit(self, writer: PackWriter) -> None:
        self._slots.acquire()  # released by _upload when the pack is in the store (or failed)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._upload_threads, thread_name_prefix="pack-upload")
            self._uploads.append(self._pool.submit(self._upload, writer))

    def _upload(self, writer: PackWriter) -> None:
        try:
            records, digests = writer.records, writer.digests
            pack_id, pack_bytes, index_bytes = writer.finish()
            # The index names the pack: it is written once the pack is stored, both files' fsyncs side by side.
            self.store.put_all([(keys.pack(pack_id), pack_bytes)], (keys.index(pack_id), index_bytes))
            self.index.add_pack_records(pack_id, records, digests)
            with self._lock:
                self._queued.difference_update(digests)
                self._pack_ids.append(pack_id)
                self.packs += 1
        except Exception as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise
        finally:
            self._slots.release()


def read_index_object(store: Store, key: str) -> list[PackEntry]:
    """The entries of the pack index object ``key``, read only up to MAX_INDEX_BYTES: anyone who writes
    the store can grow it (FormatError naming the key, past that)."""
    return decode_index(get_small(store, key, MAX_INDEX_BYTES, "pack index"), source=key)


def location_of_size(locations: list[ChunkLocation], digest: bytes, length: int) -> ChunkLocation:
    """The first of ``locations`` (of chunk ``digest``, at least one) whose pack index claims the chunk is
    ``length`` bytes, the size its layer's blob map gives it; CorruptError (``size_claim_error`` of the
    first) if none does."""
    for location in locations:
        if location.ulen == length:
            return location
    raise size_claim_error(locations[0], digest, length)


def size_claim_error(location: ChunkLocation, digest: bytes, length: int) -> CorruptError:
    """The error for ``location``, whose pack index claims another size for chunk ``digest`` than the
    ``length`` its layer's blob map gives it: it is not read (the module docstring)."""
    return CorruptError(f"the pack index says the chunk is {location.ulen} bytes, the layer's blob map {length}",
                        where=f"chunk {to_hex(digest)} in {keys.index(location.pack_id)}")


def read_chunk(store: Store, digest: bytes, loc: ChunkLocation) -> bytes:
    """Fetch one chunk with one ranged GET, decompress it and check its sha256."""
    key = keys.pack(loc.pack_id)
    frame = _get_range(store, key, loc.offset, loc.clen, what=_chunk_name(digest, key))
    return decode_chunk(frame, digest, loc.ulen, key)


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Chunks of one pack close enough together to be fetched with one ranged GET of [start, end)."""

    pack_id: str
    start: int
    end: int
    chunks: tuple[tuple[bytes, ChunkLocation], ...]  # (digest, location), by offset


def plan_runs(wanted: Iterable[tuple[bytes, ChunkLocation]], *, max_bytes: int | None = None) -> list[ChunkRun]:
    """Group chunks into runs: per pack, frames that lie within MERGE_GAP of each other, cut where a run
    would span more than ``max_bytes`` (a single larger frame still makes a run of its own)."""
    by_pack: dict[str, dict[bytes, ChunkLocation]] = defaultdict(dict)
    for digest, loc in wanted:
        by_pack[loc.pack_id][digest] = loc
    runs: list[ChunkRun] = []
    for pack_id, locations in by_pack.items():
        members: list[tuple[bytes, ChunkLocation]] = []
        start = end = 0
        for digest, loc in sorted(locations.items(), key=lambda item: item[1].offset):
            loc_end = loc.offset + loc.clen
            too_far = loc.offset - end > MERGE_GAP
            too_long = max_bytes is not None and max(end, loc_end) - start > max_bytes
            if members and (too_far or too_long):
                runs.append(ChunkRun(pack_id, start, end, tuple(members)))
                members = []
            if not members:
                start = end = loc.offset
            members.append((digest, loc))
            end = max(end, loc_end)
        runs.append(ChunkRun(pack_id, start, end, tuple(members)))
    return runs


def read_run(store: Store, run: ChunkRun) -> dict[bytes, bytes]:
    """Fetch one run with one ranged GET; each chunk is decompressed and its sha256 checked."""
    key = keys.pack(run.pack_id)
    frames = read_run_frames(store, run)
    return {digest: decode_chunk(frames[digest], digest, loc.ulen, key) for digest, loc in run.chunks}


def read_run_frames(store: Store, run: ChunkRun) -> dict[bytes, memoryview]:
    """Fetch one run with one ranged GET, as read_run does, but neither decompress nor check its chunks:
    digest -> its frame as the pack holds it (a view of the GET's bytes), for a caller that keeps it
    and checks it with ``decode_chunk`` before anyone reads it (the node daemon's fill)."""
    key = keys.pack(run.pack_id)
    first = run.chunks[0][0]
    what = _chunk_name(first, key) + (f" and {len(run.chunks) - 1} more" if len(run.chunks) > 1 else "")
    data = memoryview(_get_range(store, key, run.start, run.end - run.start, what=what))
    return {digest: data[loc.offset - run.start : loc.offset - run.start + loc.clen] for digest, loc in run.chunks}


def read_chunks(store: Store, wanted: Iterable[tuple[bytes, ChunkLocation]]) -> dict[bytes, bytes]:
    """Fetch many chunks, one GET per run (plan_runs), one run after another."""
    chunks: dict[bytes, bytes] = {}
    for run in plan_runs(wanted):
        chunks.update(read_run(store, run))
    return chunks


def verify_pack(store: Store, pack_id: str, entries: Iterable[PackEntry]) -> None:
    """Read every chunk ``entries`` (a pack's index) claims the pack holds, in ranged GETs of at most
    VERIFY_READ_BYTES, and check each one's size and sha256: CorruptError (naming the chunk) at the first
    that does not match, NotFoundError if the pack is gone. Memory: one GET at a time."""
    wanted = [(entry.digest, ChunkLocation(pack_id, entry.offset, entry.clen, entry.ulen)) for entry in entries]
    for run in plan_runs(wanted, max_bytes=VERIFY_READ_BYTES):
        read_run(store, run)


def _get_range(store: Store, key: str, offset: int, length: int, *, what: str) -> bytes:
    try:
        return store.get(key, offset, length)
    except CorruptError as exc:  # a pack shorter than its index promised
        raise CorruptError(exc.message, where=what) from exc


def decode_chunk(frame: bytes | memoryview, digest: bytes, ulen: int, key: str) -> bytes:
    """The chunk ``frame`` (read from the store object ``key``) holds: decompressed to exactly ``ulen``
    bytes and never more (CorruptError else), and checked against ``digest`` (IntegrityError)."""
    what = _chunk_name(digest, key)
    data = compress.decompress(frame, ulen, what=what)
    verify(data, digest, what=what)
    return data


def _chunk_name(digest: bytes, key: str) -> str:
    return f"chunk {to_hex(digest)} in {key}"


def missing_packs(store: Store, pack_ids: list[str]) -> list[str]:
    """Those of ``pack_ids`` the store does not hold, in their order; asked for side by side, in one round
    trip (one after another on a local store: ``side_by_side``)."""
    present = side_by_side(store, lambda pack: store.exists(keys.pack(pack)), pack_ids, threads=INDEX_LOAD_THREADS,
                           name="check-packs")
    return [pack for pack, there in zip(pack_ids, present) if not there]


def check_packs_present(store: Store, pack_ids: list[str], *, where: str) -> None:
    """NotFoundError (naming ``where`` and the first missing pack) unless every pack is in the store."""
    missing = missing_packs(store, pack_ids)
    if missing:
        raise NotFoundError(f"{len(missing)} of the {len(pack_ids)} packs holding the layer's chunks are "
                            "not in the store", where=f"{where}, pack {missing[0]}")
