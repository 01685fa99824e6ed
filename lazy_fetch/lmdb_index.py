"""The index of the node's chunk cache, in LMDB: per cached chunk its size, last access time and xxh3_64
checksum, and whether it is kept plain or as its pack's frame, plus the running total of cached bytes.
The only module of the project that imports lmdb.

One LMDB environment (a directory holding data.mdb and lock.mdb) with four named databases:

    entries   chunk digest (32 raw bytes) -> ENTRY (segment, offset, size, atime, checksum): where the
              chunk's bytes are (cache.py: the segment file, the offset in it) and how to check them;
              a verified plain chunk. Or -> FRAME_ENTRY, the same and (plain size, pack): the chunk kept
              as the zstd frame its pack holds, not yet checked against its digest (cache.py: frames)
    lru       atime (8 bytes, big-endian) + chunk digest -> b""
              the access-ordered secondary key: a cursor from the first key walks the entries least
              recently used first, so eviction reads only the entries it removes
    totals    b"bytes" -> TOTAL: the sum of every entry's size
    meta      b"layout" -> LAYOUT: the cache layout the index describes (LAYOUT_VERSION). An environment
              with databases but not this version (layout 1, a file per chunk, had no meta database)
              is refused with UnsupportedError, never read with this entry format; except layout 2,
              whose entries are all ENTRY (plain chunks, which layout 3 reads as it always did): its
              mark is moved to 3 at open, and its entries are kept

Each method is one transaction, and every change keeps the three databases in agreement inside it, so the
index is consistent after a crash at any point (LMDB commits are atomic). A commit flushes the data pages
but not the meta page (``metasync=False``, LMDB's MDB_NOMETASYNC): it keeps atomicity and consistency,
and a system crash may undo the last commit, which the cache does not mind (cache.py: an entry is
recorded only after its bytes are in place and removed before they go, and the check at open drops
whatever a rolled-back commit leaves unmatched). One flush a commit instead of two: the commit is what a
cache write waits for, and it held the disk from the reads behind it.

Threads: LMDB forbids opening an environment twice in one process, so each cache directory has one
CacheIndex per process (ChunkCache holds a lock file to enforce that). Any thread may call any method at
the same time: py-lmdb transactions are not tied to a thread (MDB_NOTLS), each method begins and ends its
own, writers are serialised by LMDB's writer lock and readers never block. In the node daemon the callers
are trio worker threads (trio.to_thread.run_sync) doing ChunkCache's work; the trio thread never calls in.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import lmdb

from dsec_fs.digest import DIGEST_SIZE, to_hex
from dsec_fs.errors import CorruptError, FormatError, UnavailableError, UnsupportedError

# The map is a sparse file; its size only caps growth. 1 GiB holds several million entries.
DEFAULT_MAP_SIZE = 1 << 30
# data.mdb and lock.mdb: the index says which chunks this node has read, which is nobody else's business.
FILE_MODE = 0o600

ENTRY = struct.Struct(
    "<"
    "Q"  # segment: the number of the segment file holding the chunk's bytes (cache.py names it)
    "Q"  # offset: where in the segment they start
    "Q"  # size: how many bytes they are, checked on every read
    "Q"  # atime: nanoseconds since the epoch of the last access (put or hit); also in the lru key
    "Q"  # checksum: xxh3_64 of the chunk's bytes, checked on every read to catch local disk rot
)

LRU_KEY = struct.Struct(
    ">"  # big-endian, so LMDB's bytewise key order is numeric order of atime
    "Q"  # atime: as in the entry
    f"{DIGEST_SIZE}s"  # digest: makes the key unique when two accesses share a nanosecond
)

TOTAL = struct.Struct(
    "<"
    "Q"  # bytes: sum of the size of every entry
)
TOTAL_KEY = b"bytes"

# Layout 1 kept a file per chunk and had no meta database; 2 keeps chunks in segments; 3 keeps a fill's
# chunks as their packs' frames (FRAME_ENTRY) until first read.
LAYOUT_VERSION = 3
# Layouts whose index this version reads as its own, marking it LAYOUT_VERSION: 2's entries are all ENTRY.
LAYOUT_READABLE = (2,)
LAYOUT = struct.Struct(
    "<"
    "Q"  # version: LAYOUT_VERSION of the cache that wrote the index
)
LAYOUT_KEY = b"layout"

# lmdb errors that mean the files are not a sound LMDB environment (as opposed to full or busy).
_CORRUPT_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
                   lmdb.PanicError)


FRAME_ENTRY = struct.Struct(
    "<"
    "QQQQQ"  # as in ENTRY: segment, offset, size (of the frame), atime, checksum (of the frame's bytes, seeded:
    # cache_segments.FRAME_CHECKSUM_SEED)
    "Q"  # plain_size: the chunk's own bytes, the most its frame may decompress to
    f"{DIGEST_SIZE}s"  # pack: the id (raw) of the pack the frame was read from, for the log of a bad one
)


class IndexEntry(NamedTuple):
    segment: int
    offset: int
    size: int  # the bytes stored: the chunk's, or its frame's
    atime: int
    checksum: int
    plain_size: int = 0  # a frame's: its chunk's size; 0 for a plain chunk
    pack: bytes = b""  # a frame's: the raw id of the pack it came from; b"" for a plain chunk

    @property
    def is_frame(self) -> bool:
        return bool(self.pack)


def pack_entry(entry: IndexEntry) -> bytes:
    return FRAME_ENTRY.pack(*entry) if entry.is_frame else ENTRY.pack(*entry[:5])


def unpack_entry(value: bytes, digest: bytes, *, source: str) -> IndexEntry:
    """Decode an entry value (of either form, told apart by length); FormatError names the chunk when the
    value has another length."""
    if len(value) == ENTRY.size:
        return IndexEntry(*ENTRY.unpack(value))
    if len(value) == FRAME_ENTRY.size:
        return IndexEntry(*FRAME_ENTRY.unpack(value))
    raise FormatError(f"cache index entry of chunk {to_hex(digest)}", None,
                      f"{len(value)} bytes, expected {ENTRY.size} or {FRAME_ENTRY.size}", source=source)


class CacheIndex:
    """The LMDB environment at ``path`` (a directory, created 0700 if missing); its files are made readable
    by their owner only (FILE_MODE). UnsupportedError when it is the index of another cache layout."""

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE):
        self.path = path
        self.upgraded_from: int | None = None  # the LAYOUT_READABLE layout found and marked LAYOUT_VERSION
        os.makedirs(path, mode=0o700, exist_ok=True)  # lmdb would make it with FILE_MODE: no x bit
        try:
            self._env = lmdb.open(path, map_size=map_size, max_dbs=4, subdir=True, readahead=False, mode=FILE_MODE,
                                  create=False, metasync=False)
        except _CORRUPT_ERRORS as exc:
            raise CorruptError(f"not a sound LMDB environment: {exc}", where=path) from None
        except lmdb.Error as exc:
            raise UnavailableError(f"cannot open the cache index: {exc}", where=path, transient=False) from None
        try:
            with self._transaction(write=True) as txn:
                self._check_layout(txn)
                self._entries = self._env.open_db(b"entries", txn=txn)
                self._lru = self._env.open_db(b"lru", txn=txn)
                self._totals = self._env.open_db(b"totals", txn=txn)
        except BaseException:
            self._env.close()
            raise

    def _check_layout(self, txn: lmdb.Transaction) -> None:
        """Mark a new environment (or one of a LAYOUT_READABLE layout: ``upgraded_from`` says which) with
        LAYOUT_VERSION; refuse one of databases of another (or no) version."""
        named = list(txn.cursor().iternext(keys=True, values=False))  # the main database names the others
        meta = self._env.open_db(b"meta", txn=txn)
        found = txn.get(LAYOUT_KEY, db=meta)
        version = LAYOUT.unpack(found)[0] if found is not None and len(found) == LAYOUT.size else None
        if found is None and not named or version in LAYOUT_READABLE:
            self.upgraded_from = version
            txn.put(LAYOUT_KEY, LAYOUT.pack(LAYOUT_VERSION), db=meta)
        elif version != LAYOUT_VERSION:
            raise UnsupportedError(f"a cache index of layout {1 if version is None else version}; this version "
                                   f"reads layouts {', '.join(map(str, (*LAYOUT_READABLE, LAYOUT_VERSION)))}",
                                   where=self.path)

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[lmdb.Transaction]:
        """One transaction; lmdb's errors leave here as dsecfs errors naming the index directory."""
        try:
            with self._env.begin(write=write) as txn:
                yield txn
        except lmdb.MapFullError:
            raise UnavailableError("the cache index is full (raise its map size)", where=self.path,
                                   transient=False) from None
        except _CORRUPT_ERRORS as exc:
            raise CorruptError(f"cache index is damaged: {exc}", where=self.path) from None
        except lmdb.Error as exc:
            raise UnavailableError(f"cache index: {exc}", where=self.path, transient=False) from None

    def get(self, digest: bytes) -> IndexEntry | None:
        with self._transaction(write=False) as txn:
            value = txn.get(digest, db=self._entries)
        return None if value is None else unpack_entry(value, digest, source=self.path)

    def put_many(self, entries: Iterable[tuple[bytes, IndexEntry]]) -> tuple[list[bytes], list[tuple[bytes, IndexEntry]], int]:
        """Record chunks whose bytes are in place, each (digest, entry), in one transaction (one commit for
        a whole batch); each replaces any previous entry for its digest. Returns the digests that had no
        entry before, the (digest, entry) pairs replaced, and the total after."""
        added: list[bytes] = []
        replaced: list[tuple[bytes, IndexEntry]] = []
        with self._transaction(write=True) as txn:
            total = self._total(txn)
            for digest, entry in entries:
                previous = self._remove(txn, digest)
                if previous is None:
                    added.append(digest)
                else:
                    replaced.append((digest, previous))
                    total -= previous.size
                total += entry.size
                txn.put(digest, pack_entry(entry), db=self._entries)
                txn.put(LRU_KEY.pack(entry.atime, digest), b"", db=self._lru)
            self._set_total(txn, total)
        return added, replaced, total

    def touch(self, accesses: Mapping[bytes, int]) -> None:
        """Move each digest's atime forward to the given time; digests no longer indexed are skipped."""
        with self._transaction(write=True) as txn:
            for digest, atime in accesses.items():
                value = txn.get(digest, db=self._entries)
                if value is None:
                    continue
                old = unpack_entry(value, digest, source=self.path)
                if atime <= old.atime:
                    continue
                txn.delete(LRU_KEY.pack(old.atime, digest), db=self._lru)
                txn.put(digest, pack_entry(old._replace(atime=atime)), db=self._entries)
                txn.put(LRU_KEY.pack(atime, digest), b"", db=self._lru)

    def delete(self, digests: Iterable[bytes]) -> list[tuple[bytes, IndexEntry]]:
        """Remove the entries of ``digests`` (absent ones are skipped); returns them, (digest, entry)."""
        removed: list[tuple[bytes, IndexEntry]] = []
        with self._transaction(write=True) as txn:
            for digest in digests:
                entry = self._remove(txn, digest)
                if entry is not None:
                    removed.append((digest, entry))
            self._set_total(txn, self._total(txn) - sum(entry.size for _digest, entry in removed))
        return removed

    def evict_to(self, max_total: int) -> list[tuple[bytes, IndexEntry]]:
        """Remove least recently used entries until the total is at most ``max_total``; returns them,
        (digest, entry), least recent first."""
        evicted: list[tuple[bytes, IndexEntry]] = []
        with self._transaction(write=True) as txn:
            total = self._total(txn)
            cursor = txn.cursor(db=self._lru)
            # Deleting the lru key under the cursor moves it on, so each turn starts again from the first.
            while total > max_total and cursor.first():
                _atime, digest = LRU_KEY.unpack(cursor.key())
                cursor.delete()
                value = txn.pop(digest, db=self._entries)
                if value is not None:
                    entry = unpack_entry(value, digest, source=self.path)
                    total -= entry.size
                    evicted.append((digest, entry))
            self._set_total(txn, total)
        return evicted

    def least_recent(self, count: int) -> list[tuple[bytes, IndexEntry]]:
        """Up to ``count`` entries, least recently used first."""
        found: list[tuple[bytes, IndexEntry]] = []
        with self._transaction(write=False) as txn:
            for key in txn.cursor(db=self._lru).iternext(keys=True, values=False):
                if len(found) == count:
                    break
                _atime, digest = LRU_KEY.unpack(key)
                found.append((digest, unpack_entry(txn.get(digest, db=self._entries), digest, source=self.path)))
        return found

    def entries(self) -> dict[bytes, IndexEntry]:
        """Every indexed digest -> its entry (one pass; used to reconcile the index with the segments)."""
        with self._transaction(write=False) as txn:
            return {digest: unpack_entry(value, digest, source=self.path)
                    for digest, value in txn.cursor(db=self._entries).iternext(keys=True, values=True)}

    def __len__(self) -> int:
        with self._transaction(write=False) as txn:
            return txn.stat(self._entries)["entries"]

    @property
    def total_bytes(self) -> int:
        with self._transaction(write=False) as txn:
            return self._total(txn)

    def close(self) -> None:
        self._env.close()

    def _remove(self, txn: lmdb.Transaction, digest: bytes) -> IndexEntry | None:
        """Delete ``digest``'s entry and lru key inside ``txn``; returns the entry (None when absent)."""
        value = txn.pop(digest, db=self._entries)
        if value is None:
            return None
        entry = unpack_entry(value, digest, source=self.path)
        txn.delete(LRU_KEY.pack(entry.atime, digest), db=self._lru)
        return entry

    def _total(self, txn: lmdb.Transaction) -> int:
        value = txn.get(TOTAL_KEY, db=self._totals)
        if value is None:
            return 0
        if len(value) != TOTAL.size:
            raise FormatError("cache index total", None, f"{len(value)} bytes, expected {TOTAL.size}", source=self.path)
        return TOTAL.unpack(value)[0]

    def _set_total(self, txn: lmdb.Transaction, total: int) -> None:
        txn.put(TOTAL_KEY, TOTAL.pack(total), db=self._totals)
