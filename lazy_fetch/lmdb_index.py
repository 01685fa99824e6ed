"""The index of the node's chunk cache, in LMDB: per cached chunk its size, last access time and xxh3_64
checksum, plus the running total of cached bytes. The only module of the project that imports lmdb.

One LMDB environment (a directory holding data.mdb and lock.mdb) with three named databases:

    entries   chunk digest (32 raw bytes) -> ENTRY (size, atime, checksum)
    lru       atime (8 bytes, big-endian) + chunk digest -> b""
              the access-ordered secondary key: a cursor from the first key walks the entries least
              recently used first, so eviction reads only the entries it removes
    totals    b"bytes" -> TOTAL: the sum of every entry's size

Each method is one transaction, and every change keeps the three databases in agreement inside it, so the
index is consistent after a crash at any point (LMDB commits are atomic). A commit flushes the data pages
but not the meta page (``metasync=False``, LMDB's MDB_NOMETASYNC): it keeps atomicity and consistency,
and a system crash may undo the last commit, which the cache does not mind (cache.py: an entry is
recorded only after its file is in place and removed before its file goes, and the check at open drops
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
from dsec_fs.errors import CorruptError, FormatError, UnavailableError

# The map is a sparse file; its size only caps growth. 1 GiB holds several million entries.
DEFAULT_MAP_SIZE = 1 << 30
# data.mdb and lock.mdb: the index says which chunks this node has read, which is nobody else's business.
FILE_MODE = 0o600

ENTRY = struct.Struct(
    "<"
    "Q"  # size: bytes of the cached chunk file, checked on every read
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

# lmdb errors that mean the files are not a sound LMDB environment (as opposed to full or busy).
_CORRUPT_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
                   lmdb.PanicError)


class IndexEntry(NamedTuple):
    size: int
    atime: int
    checksum: int


def pack_entry(entry: IndexEntry) -> bytes:
    return ENTRY.pack(*entry)


def unpack_entry(value: bytes, digest: bytes, *, source: str) -> IndexEntry:
    """Decode an entry value; FormatError names the chunk when the value has the wrong length."""
    if len(value) != ENTRY.size:
        raise FormatError(f"cache index entry of chunk {to_hex(digest)}", None,
                          f"{len(value)} bytes, expected {ENTRY.size}", source=source)
    return IndexEntry(*ENTRY.unpack(value))


class CacheIndex:
    """The LMDB environment at ``path`` (a directory, created 0700 if missing); its files are made readable
    by their owner only (FILE_MODE)."""

    def __init__(self, path: str, map_size: int = DEFAULT_MAP_SIZE):
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)  # lmdb would make it with FILE_MODE: no x bit
        try:
            self._env = lmdb.open(path, map_size=map_size, max_dbs=3, subdir=True, readahead=False, mode=FILE_MODE,
                                  create=False, metasync=False)
        except _CORRUPT_ERRORS as exc:
            raise CorruptError(f"not a sound LMDB environment: {exc}", where=path) from None
        except lmdb.Error as exc:
            raise UnavailableError(f"cannot open the cache index: {exc}", where=path, transient=False) from None
        try:
            with self._transaction(write=True) as txn:
                self._entries = self._env.open_db(b"entries", txn=txn)
                self._lru = self._env.open_db(b"lru", txn=txn)
                self._totals = self._env.open_db(b"totals", txn=txn)
        except BaseException:
            self._env.close()
            raise

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

    def put(self, digest: bytes, size: int, checksum: int, atime: int) -> None:
        """Record a chunk whose file is in place, replacing any previous entry for it."""
        self.put_many([(digest, size, checksum, atime)])

    def put_many(self, entries: Iterable[tuple[bytes, int, int, int]]) -> tuple[list[bytes], int]:
        """Record chunks whose files are in place, each (digest, size, checksum, atime), in one transaction
        (one commit for a whole batch); each replaces any previous entry for its digest. Returns the
        digests that had no entry before, and the total after."""
        added = []
        with self._transaction(write=True) as txn:
            total = self._total(txn)
            for digest, size, checksum, atime in entries:
                previous = self._remove(txn, digest)
                if previous is None:
                    added.append(digest)
                total += size - (previous or 0)
                txn.put(digest, pack_entry(IndexEntry(size, atime, checksum)), db=self._entries)
                txn.put(LRU_KEY.pack(atime, digest), b"", db=self._lru)
            self._set_total(txn, total)
        return added, total

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

    def delete(self, digests: Iterable[bytes]) -> int:
        """Remove the entries of ``digests`` (absent ones are skipped); returns the bytes they held."""
        with self._transaction(write=True) as txn:
            freed = sum(self._remove(txn, digest) or 0 for digest in digests)
            self._set_total(txn, self._total(txn) - freed)
        return freed

    def evict_to(self, max_total: int) -> list[bytes]:
        """Remove least recently used entries until the total is at most ``max_total``; returns their digests."""
        evicted: list[bytes] = []
        with self._transaction(write=True) as txn:
            total = self._total(txn)
            cursor = txn.cursor(db=self._lru)
            # Deleting the lru key under the cursor moves it on, so each turn starts again from the first.
            while total > max_total and cursor.first():
                _atime, digest = LRU_KEY.unpack(cursor.key())
                cursor.delete()
                value = txn.pop(digest, db=self._entries)
                if value is not None:
                    total -= unpack_entry(value, digest, source=self.path).size
                    evicted.append(digest)
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

    def sizes(self) -> dict[bytes, int]:
        """Every indexed digest -> its chunk's size (one pass over the entries; used to reconcile the index
        with the files)."""
        with self._transaction(write=False) as txn:
            return {digest: unpack_entry(value, digest, source=self.path).size
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

    def _remove(self, txn: lmdb.Transaction, digest: bytes) -> int | None:
        """Delete ``digest``'s entry and lru key inside ``txn``; returns its size (None when absent)."""
        value = txn.pop(digest, db=self._entries)
        if value is None:
            return None
        entry = unpack_entry(value, digest, source=self.path)
        txn.delete(LRU_KEY.pack(entry.atime, digest), db=self._lru)
        return entry.size

    def _total(self, txn: lmdb.Transaction) -> int:
        value = txn.get(TOTAL_KEY, db=self._totals)
        if value is None:
            return 0
        if len(value) != TOTAL.size:
            raise FormatError("cache index total", None, f"{len(value)} bytes, expected {TOTAL.size}", source=self.path)
        return TOTAL.unpack(value)[0]

    def _set_total(self, txn: lmdb.Transaction, total: int) -> None:
        txn.put(TOTAL_KEY, TOTAL.pack(total), db=self._totals)
