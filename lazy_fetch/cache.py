"""The node's local chunk cache: verified chunk bytes in files keyed by digest, an LMDB index beside them,
bounded in size with least-recently-used eviction.

Layout of the cache directory::

    lock                       flock()ed while a ChunkCache is open: one owner per directory
    index/                     the LMDB index (lmdb_index.py): size, atime, xxh3_64 per chunk, total bytes
    chunks/<hh>/<digest hex>   a chunk's plain bytes; <hh> is the first two hex characters
    chunks/<hh>/.tmp-<random>  a chunk being written

The rule that keeps it consistent after SIGKILL at any point: an index entry is only ever added for a file
already renamed into place, and removed before its file is unlinked. A crash can therefore leave only
files nobody indexes (temporary or complete), and the next open deletes them in one scan, together with
index entries whose file has gone (someone deleted it) or is not the size the index says. Chunk files are
not fsynced: every read checks the size and xxh3_64 the index recorded, so bytes a power cut lost (or a
disk rotted) are found on read; such a rotten entry is dropped and reported as a miss, and the fetcher
fetches the chunk again. The index commits atomically, and a system crash may undo its last commit
(lmdb_index.py), which leaves at most files nobody indexes, or entries whose file went: both are what the
open's scan clears. A commit still costs a disk flush: ``put_many`` records a whole batch (the chunks of
the store reads handed over since the last one) in one commit, after renaming all its files into place.

Nothing left in the directory stops an open (``_reconcile``, ``_make_room``): under chunks/ whatever is
not a regular file of an indexed chunk, with its name, in its fan-out directory and of its indexed size,
is removed, be it a directory, a symlink (never followed), a FIFO, a socket or a file of the wrong name;
so is a stray where ``chunks``, ``index``, ``lock`` or an LMDB file belongs (a damaged index starts
again empty). A stray that cannot be removed (a mount point, a directory it may not write) is logged and
left alone, and under chunks/ that costs only its chunks. Other names at the top are not the cache's
and are left alone.

Private: the directory is made 0700 (narrowed if found wider), chunk and lock files 0600 and the index
files 0600 (lmdb_index.FILE_MODE); a chunk file or fan-out directory found wider, say from an older
version, is narrowed at open. Chunk files are only ever opened O_NOFOLLOW | O_NONBLOCK and read if
regular, so nothing put in their place can send a read elsewhere or make it block.

``max_bytes`` bounds the sum of the chunk sizes (not the disk blocks they occupy, nor the index). Hits
move a chunk to the recent end of the LRU order; those moves are collected in memory and written in
one transaction per TOUCH_BATCH hits, and always before eviction, so a hit does not cost an index commit.
A crash loses at most the last batch of moves, which only makes the LRU order slightly stale.

The cache trusts the bytes it is given: callers put only chunks they verified against their digest
(the fetcher's read_chunks does).

``lacks(digest)`` answers from memory, without the index or a worker thread, that a chunk is surely not
cached, so that a miss need not wait for a worker thread to learn it (the fetcher goes to the store at
once). It reads *presence counters*: a byte per slot, a digest's slot from its first bytes (digests are
sha256: uniform), counting the indexed chunks of the slot, kept in step with every change of the index
(built at open, counted up by put, down by eviction and drops; a count at 255 sticks). A slot at zero
means no indexed chunk has that slot. A non-zero slot (another chunk's, or one whose count stuck) only
means "look it up": ``lacks`` is never wrong the other way, except about a chunk being put at that
moment, which costs one store read that the put then finds cached. PRESENCE_SLOTS_PER_BYTE slots per byte
of the bound (a slot per 4 KiB: a full cache of chunks of 40 KiB or more takes at most one slot in ten),
at most PRESENCE_SLOTS_MAX (4 Mi slots, 4 MiB of memory, which the default 10 GiB bound gets).

Threads: every method blocks (disk I/O and index transactions); in the daemon they run in trio worker
threads and any number may run at once. ``_lock`` serialises the changes that must agree between files
and index: rename + record (put, put_many), eviction, dropping a rotten entry. Reads take no lock: a read that races
an eviction sees a missing file and re-checks under ``_lock`` before calling anything rotten.
``_counters_lock`` guards the statistics counters and the pending LRU moves. The presence counters are
changed under ``_lock`` only, with the index, and read by ``lacks`` from any thread without a lock (a byte
read is atomic); ``note_misses`` is called by one thread (the fetcher's).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from dsec_fs.digest import is_hex_digest, short, to_hex
from dsec_fs.errors import CorruptError, InputError, UnavailableError
from dsec_fs.files import LOCK_NAME, lock_directory, private_dir
from dsec_fs.mounts import is_mountpoint, mounts_below

from .lmdb_index import DEFAULT_MAP_SIZE, CacheIndex, IndexEntry

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
FAN_OUTS = frozenset(f"{n:02x}" for n in range(256))
DIR_MODE = 0o700
FILE_MODE = 0o600
# Chunk files are opened so: a symlink is not followed (ELOOP) and a FIFO does not block.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Hits remembered before their LRU moves are written to the index in one transaction.
TOUCH_BATCH = 64
# Presence counters (``lacks``): slots per byte of the cache's bound (a power of two at least this many),
# within these bounds.
PRESENCE_SLOTS_PER_BYTE = 1 / 4096
PRESENCE_SLOTS_MIN = 1 << 12
PRESENCE_SLOTS_MAX = 1 << 22
PRESENCE_STUCK = 255


@dataclass(frozen=True)
class CacheStats:
    entries: int  # chunks in the cache
    bytes: int  # sum of their sizes
    max_bytes: int
    hits: int  # gets answered, since open
    misses: int  # gets not answered (absent, raced an eviction, or rotten)
    evictions: int  # entries removed to stay under max_bytes
    rotten: int  # entries dropped because the file was missing, the wrong size or failed its xxh3 check
    reconciled: int  # files (and strays) deleted and entries dropped by the check at open


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


class ChunkCache:
    """The cache in ``directory`` (created if missing), holding at most ``max_bytes`` of chunks."""

    def __init__(self, directory: str, max_bytes: int, *, map_size: int = DEFAULT_MAP_SIZE):
        if max_bytes <= 0:
            raise InputError(f"the cache size must be positive, got {max_bytes}", where=directory)
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        self._chunks_dir = os.path.join(self.directory, "chunks")
        self._lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._pending_touches: dict[bytes, int] = {}
        self._hits = self._misses = self._evictions = self._rotten = 0
        self._known_misses = 0  # misses that ``lacks`` answered (note_misses)
        wanted = max(PRESENCE_SLOTS_MIN, min(PRESENCE_SLOTS_MAX, int(max_bytes * PRESENCE_SLOTS_PER_BYTE)))
        self._presence = bytearray(1 << (wanted - 1).bit_length())
        self._presence_mask = len(self._presence) - 1
        private_dir(self.directory)
        _make_room(self._chunks_dir, directory=True)
        os.makedirs(self._chunks_dir, mode=DIR_MODE, exist_ok=True)
        _narrow_path(self._chunks_dir, DIR_MODE)
        self._lock_fd = self._lock_directory()
        try:
            self._index = self._open_index(map_size)
            self._reconciled = self._reconcile()
            self.evict_to(max_bytes)  # in case it was reopened with a smaller limit
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _lock_directory(self) -> int:
        _make_room(os.path.join(self.directory, LOCK_NAME), directory=False)
        fd = lock_directory(self.directory, what="another ChunkCache (this or another process)",
                            error=lambda message, where: UnavailableError(message, where=where, transient=False))
        _narrow(fd, FILE_MODE)
        return fd

    def _open_index(self, map_size: int) -> CacheIndex:
        """Open the index; a damaged one (or one LMDB will not open) is a cache we can afford to lose, so
        it starts again empty. Anything in the index directory but LMDB's two files goes first."""
        index_dir = os.path.join(self.directory, "index")
        _make_room(index_dir, directory=True)
        os.makedirs(index_dir, mode=DIR_MODE, exist_ok=True)
        _narrow_path(index_dir, DIR_MODE)
        for entry in _scan(index_dir):
            if entry.name in INDEX_FILES and entry.is_file(follow_symlinks=False):
                _narrow_path(entry.path, FILE_MODE)
            else:
                remove_stray(entry.path)
        try:
            return CacheIndex(index_dir, map_size)
        except (CorruptError, UnavailableError) as exc:
            log.warning("chunk cache %s: %s; starting with an empty cache", self.directory, exc)
        for name in os.listdir(index_dir):
            os.unlink(os.path.join(index_dir, name))
        return CacheIndex(index_dir, map_size)

    def _reconcile(self) -> int:
        """Make files and index agree after a crash, and clear out strays: one pass over the index, one
        over chunks/ (nothing in it is followed or opened)."""
        sizes = self._index.sizes()
        present: set[bytes] = set()
        removed = 0
        for fan_out in _scan(self._chunks_dir):
            if fan_out.name not in FAN_OUTS or not fan_out.is_dir(follow_symlinks=False):
                removed += remove_stray(fan_out.path)
                continue
            _narrow_path(fan_out.path, DIR_MODE)
            for entry in _scan(fan_out.path):
                name = entry.name
                digest = bytes.fromhex(name) if is_hex_digest(name) and name.startswith(fan_out.name) else None
                if digest in sizes and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_size == sizes[digest]:
                        if st.st_mode & 0o077:
                            _narrow_path(entry.path, FILE_MODE)
                        present.add(digest)
                        continue
                # A temporary file, a chunk whose put never reached the index, one evicted from the index
                # but not yet unlinked, one truncated, or something that is not a chunk file at all.
                removed += remove_stray(entry.path)
        missing = sizes.keys() - present
        if missing:
            self._index.delete(missing)
        self._count_presence(present, +1)
        if removed or missing:
            log.info("chunk cache %s: removed %d unindexed files or strays, dropped %d entries without a "
                     "sound file", self.directory, removed, len(missing))
        return removed + len(missing)

    def _path(self, digest: bytes) -> str:
        name = to_hex(digest)
        return os.path.join(self._chunks_dir, name[:2], name)

    def get(self, digest: bytes) -> bytes | None:
        """The chunk's bytes, checked against the index; None when it is not cached (or was rotten)."""
        entry = self._index.get(digest)
        data = None if entry is None else self._read_valid(digest, entry)[0]
        if entry is not None and data is None:
            data = self._recheck(digest)
        with self._counters_lock:
            if data is None:
                self._misses += 1
                return None
            self._hits += 1
            self._pending_touches[digest] = time.time_ns()
            flush = len(self._pending_touches) >= TOUCH_BATCH
        if flush:
            self._flush_touches()
        return data

    def lacks(self, digest: bytes) -> bool:
        """True when the cache surely does not hold the chunk (the module docstring: presence counters);
        False when it may. Memory only: any thread, never blocks; counts nothing (``note_misses``)."""
        return not self._presence[self._presence_slot(digest)]

    def note_misses(self, count: int) -> None:
        """Count ``count`` chunks that ``lacks`` answered for as misses (they were not looked up)."""
        self._known_misses += count

    def holds(self, digests: Iterable[bytes]) -> set[bytes]:
        """Which of ``digests`` the index lists: nothing read or checked, no hit or miss counted (for
        readahead candidates, which are skipped when cached; a rotten one is found when it is read)."""
        return {digest for digest in digests if self._index.get(digest) is not None}

    def put(self, digest: bytes, data: bytes | memoryview) -> bool:
        """Cache a verified chunk; False when it is larger than the whole cache and so not kept."""
        return self.put_many([(digest, data)]) == 1

    def put_many(self, chunks: Iterable[tuple[bytes, bytes | memoryview]]) -> int:
        """Cache verified chunks: write each new one to a temporary file, then rename them all into place
        and record them in one index transaction. Returns how many are kept (a chunk larger than the whole
        cache is not)."""
        kept = 0
        written: list[tuple[bytes, str, int, int]] = []  # digest, temporary path, size, checksum
        try:
            for digest, data in chunks:
                size = memoryview(data).nbytes
                if size > self.max_bytes:
                    continue
                kept += 1
                if not self.lacks(digest) and self._index.get(digest) is not None:
                    with self._counters_lock:
                        self._pending_touches[digest] = time.time_ns()
                    continue
                written.append((digest, self._write_temporary(digest, data), size, checksum(data)))
            if written:
                with self._lock:
                    for digest, tmp, _size, _checksum in written:
                        os.rename(tmp, self._path(digest))
                    now = time.time_ns()
                    added, total = self._index.put_many((digest, size, xxh3, now)
                                                        for digest, _tmp, size, xxh3 in written)
                    self._count_presence(added, +1)
                    if total > self.max_bytes:
                        self._evict_locked(self.max_bytes)
        except BaseException:
            for _digest, tmp, _size, _checksum in written:  # those renamed already are gone: no harm
                _unlink_if_present(tmp)
            raise
        return kept

    def evict_to(self, max_bytes: int) -> int:
        """Evict least recently used chunks until at most ``max_bytes`` are cached; returns how many."""
        with self._lock:
            return self._evict_locked(max_bytes)

    def stats(self) -> CacheStats:
        with self._counters_lock:
            hits, misses = self._hits, self._misses + self._known_misses
            evictions, rotten = self._evictions, self._rotten
        return CacheStats(entries=len(self._index), bytes=self._index.total_bytes, max_bytes=self.max_bytes,
                          hits=hits, misses=misses, evictions=evictions, rotten=rotten,
                          reconciled=self._reconciled)

    def close(self) -> None:
        """Write pending LRU moves and release the index and the directory lock. Call it after every
        other call has returned (a call after close raises UnavailableError)."""
        self._flush_touches()
        self._index.close()
        os.close(self._lock_fd)

    def __enter__(self) -> "ChunkCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_valid(self, digest: bytes, entry: IndexEntry) -> tuple[bytes | None, str]:
        """(bytes, "") when the file matches the index entry, else (None, why not)."""
        try:
            fd = os.open(self._path(digest), _READ_FLAGS)
        except FileNotFoundError:
            return None, "file missing"
        except OSError as exc:  # ELOOP: a symlink in its place; EACCES, ...
            return None, f"cannot open it: {exc.strerror}"
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None, "not a regular file"
            data = f.read(entry.size + 1)  # one byte more shows a file that grew
        if len(data) != entry.size:
            return None, f"{len(data)} bytes, the index says {entry.size}"
        if checksum(data) != entry.checksum:
            return None, "xxh3 mismatch"
        return data, ""

    def _recheck(self, digest: bytes) -> bytes | None:
        """A read failed: under ``_lock`` look again, and drop the entry only if it is still bad.

        The lock keeps eviction and put out, so a file that vanished because it was evicted (its entry is
        gone too) or re-put meanwhile (its new file is good) is not mistaken for rot.
        """
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                return None
            data, problem = self._read_valid(digest, entry)
            if data is not None:
                return data
            log.warning("chunk cache: dropping rotten chunk %s (%s)", to_hex(digest), problem)
            self._index.delete([digest])
            self._count_presence([digest], -1)
            self._unlink(digest)
        with self._counters_lock:
            self._rotten += 1
        return None

    def _evict_locked(self, max_bytes: int) -> int:
        """With ``_lock`` held: evict down to ``max_bytes``; index first, then files (see the module doc)."""
        self._flush_touches()
        evicted = self._index.evict_to(max_bytes)
        self._count_presence(evicted, -1)
        for digest in evicted:
            self._unlink(digest)
        if evicted:
            log.debug("chunk cache: evicted %d chunks, first %s", len(evicted), short(evicted[0]))
        with self._counters_lock:
            self._evictions += len(evicted)
        return len(evicted)

    def _presence_slot(self, digest: bytes) -> int:
        """A digest's presence counter: from its first bytes (digests are sha256: uniform)."""
        return int.from_bytes(digest[:8], "little") & self._presence_mask

    def _count_presence(self, digests: Iterable[bytes], step: int) -> None:
        """Count ``digests`` (newly indexed: +1; no longer: -1) in the presence counters; with ``_lock``
        held (or at open). A counter at PRESENCE_STUCK stays there: it may have lost count."""
        presence = self._presence
        for digest in digests:
            slot = self._presence_slot(digest)
            if presence[slot] != PRESENCE_STUCK:
                presence[slot] = max(0, presence[slot] + step)

    def _flush_touches(self) -> None:
        with self._counters_lock:
            touches, self._pending_touches = self._pending_touches, {}
        if touches:
            self._index.touch(touches)

    def _write_temporary(self, digest: bytes, data: bytes | memoryview) -> str:
        """Write ``data`` to a new temporary file beside the chunk's place; returns its path. The fan-out
        directory is made only when the open finds it missing (a stat and a mkdir per chunk were a tenth of
        a fill's cache writes, sampled)."""
        directory = os.path.dirname(self._path(digest))
        tmp = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, FILE_MODE)
            except FileNotFoundError:
                os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
                fd = os.open(tmp, flags, FILE_MODE)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except BaseException:
            _unlink_if_present(tmp)
            raise
        return tmp

    def _unlink(self, digest: bytes) -> None:
        _unlink_if_present(self._path(digest))


def _unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- strays and modes: used at open, in the thread that opens the cache

INDEX_FILES = ("data.mdb", "lock.mdb")


def _scan(directory: str) -> list[os.DirEntry]:
    """The entries of ``directory``; none (logged) when it cannot be listed."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError as exc:
        log.warning("chunk cache: cannot list %s, skipping it: %s", directory, exc)
        return []


def _make_room(path: str, *, directory: bool) -> None:
    """Remove what is at ``path`` unless it is a real directory (``directory``) or a regular file (not
    a symlink to one), so that the cache can make its own there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode):
        return
    log.warning("chunk cache: %s is not a %s; replacing it", path, "directory" if directory else "regular file")
    remove_stray(path)


def remove_stray(path: str) -> int:
    """Remove a file, symlink (not its target), FIFO, socket or directory tree that does not belong in
    the cache; 1 if removed, 0 (logged) when it cannot be, or holds a mount (whose files are not ours)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            if is_mountpoint(path) or mounts_below(path):
                raise OSError(errno.EBUSY, "a mount point is in it")
            shutil.rmtree(path)  # works on file descriptors: no symlink inside is followed
        else:
            os.unlink(path)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("cache: cannot remove the stray %s, leaving it: %s", path, exc.strerror or exc)
        return 0
    log.debug("cache: removed the stray %s", path)
    return 1


def _narrow(fd: int, mode: int) -> None:
    """Take away the group and other bits ``mode`` does not have; a failure is logged, not fatal (the
    cache directory, 0700, guards what is below it anyway)."""
    try:
        current = stat.S_IMODE(os.fstat(fd).st_mode)
        if current & ~mode & 0o077:
            os.fchmod(fd, current & mode)
    except OSError as exc:
        log.warning("chunk cache: cannot narrow the mode of its lock file: %s", exc.strerror)


def _narrow_path(path: str, mode: int) -> None:
    """_narrow by path (callers checked it is no symlink)."""
    try:
        current = stat.S_IMODE(os.lstat(path).st_mode)
        if current & ~mode & 0o077:
            os.chmod(path, current & mode)
    except OSError as exc:
        log.warning("chunk cache: cannot narrow the mode of %s: %s", path, exc.strerror)
