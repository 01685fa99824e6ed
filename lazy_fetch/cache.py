"""The node's local chunk cache: chunk bytes (verified plain chunks, or a fill's frames as fetched)
appended to segment files, an LMDB index beside them saying where each chunk is, bounded in size with
least-recently-used eviction.

Layout of the cache directory (layout 3, lmdb_index.LAYOUT_VERSION)::

    lock                       flock()ed while a ChunkCache is open: one owner per directory
    index/                     the LMDB index (lmdb_index.py): per chunk its segment, offset, size, atime
                               and xxh3_64 (and a frame's plain size and pack), and the total bytes
    segments/<16 hex digits>   a segment: the stored bytes of the chunks of one put_many, end to end,
                               never appended to once in place; the number is the segment's, counted up
    segments/.tmp-<random>     a segment being written

The segment files' own I/O is cache_segments.py's; the strays and modes at open, cache_strays.py's.

A batch (what ``put_many`` is given: the fetcher's cache writer hands over the chunks of the store reads
since its last batch, up to fetcher.WRITE_BATCH_BYTES) is written to one new file, renamed into place and
recorded in one index commit: one file creation per batch, not per chunk, like a restic or borg pack.
Eviction drops a chunk's entry and then punches a hole in its segment (fallocate PUNCH_HOLE|KEEP_SIZE:
the blocks are freed, the offsets of the others stay); the segment is unlinked once none of its chunks is
indexed. Where the filesystem refuses to punch holes (EOPNOTSUPP), the bytes of evicted chunks stay on
disk until their segment goes, and until then count against ``max_bytes`` like live ones (more is
evicted), so the disk still holds at most ``max_bytes`` of segments; the count restarts at each open.

Layout 1 (before segments) kept a file per chunk under chunks/<hh>/ and an index without a layout mark:
such an index is refused (lmdb_index: UnsupportedError), never read as this layout, and the cache starts
again empty; the old chunks/ directory is removed at open. A node's cache is only ever a copy of what
the store holds, so losing it costs fetches, never data. Layout 2 (segments of plain chunks only) is kept
as it is: its entries are plain chunks, read as layout 3 reads those; its mark becomes 3 at open (logged).

Frames. A fill (prefetcher.py) brings a whole layer that nobody may read, so its chunks are put as
fetched (``Frame``: the zstd frame its pack holds, neither decompressed nor checked against its digest)
and cost a copy to disk, not the CPU of decompressing and hashing every one. ``get`` hands a frame back
as a Frame; the caller (fetcher.py) decompresses it within its plain size, checks its sha256, and puts
the plain chunk, which replaces the frame's entry; a frame that fails is dropped (``drop_frame``). The
xxh3 check on what is stored is the same for both: it catches damage at rest, not a lie of the store.
A frame never replaces a plain chunk: ``put_many`` skips one whose chunk is cached plain, and a
frame whose chunk another thread put plain while its segment was being written is left out of the
index commit, under ``_lock`` (its bytes punched out), so a checked chunk is never unchecked again.

The rule that keeps it consistent after SIGKILL at any point: an index entry is only ever added for bytes
already written and renamed into place in their segment, and removed before its bytes are punched out
or its segment unlinked. A crash can therefore leave only segments (temporary or complete) nobody
indexes, and evicted bytes not yet punched out of a segment still in use (disk the cache no longer
counts, freed when that segment goes). The next open deletes unindexed segments and temporaries in one
scan, and drops index entries whose segment has gone (someone deleted it) or is too short to hold them.
Segments are not fsynced: every read checks the size and xxh3_64 the index recorded, so bytes a power
cut lost (or a disk rotted) are found on read; such a rotten entry is dropped and reported as a miss,
and the fetcher fetches the chunk again. The index commits atomically, and a system crash may undo its
last commit (lmdb_index.py), which leaves at most segments nobody indexes, or entries whose segment went
or holes were punched: the first two are what the open's scan clears, the third a read finds rotten.

Nothing left in the directory stops an open (``_reconcile``, ``_make_room``): under segments/ whatever is
not a regular file with an indexed segment's name is removed, be it a directory, a symlink (never
followed), a FIFO, a socket or a file of the wrong name; so is a stray where ``segments``, ``index``,
``lock`` or an LMDB file belongs (a damaged index starts again empty). A stray that cannot be removed (a
mount point, a directory it may not write) is logged and left alone, and under segments/ that costs only
its chunks. Other names at the top are not the cache's and are left alone (``chunks``, the old layout's,
is removed).

Private: the directory is made 0700 (narrowed if found wider), segment and lock files 0600 and the index
files 0600 (lmdb_index.FILE_MODE); a segment or directory found wider is narrowed at open. Segments are
only ever opened O_NOFOLLOW | O_NONBLOCK and read (or holes punched) if regular, so nothing put in their
place can send a read elsewhere or make it block.

``max_bytes`` bounds the sum of the stored sizes (a frame's, for a frame; not the disk blocks they occupy,
nor the index; see above for a filesystem without holes). Hits move a chunk to the recent end of the LRU
order; those moves are collected in memory and written in one transaction per TOUCH_BATCH hits, and always
before eviction, so a hit does not cost an index commit. A crash loses at most the last batch of moves,
which only makes the LRU order slightly stale.

The cache trusts the plain bytes it is given: callers put as plain only chunks they verified against
their digest (the fetcher's read_chunks does), and anything else as a Frame.

``lacks(digest)`` answers from memory, without the index or a worker thread, that a chunk is surely not
cached, so that a miss need not wait for a worker thread to learn it (the fetcher goes to the store at
once): cache_presence.py's counters, kept in step with every change of the index.

Threads: every method blocks (disk I/O and index transactions); in the daemon they run in trio worker
threads and any number may run at once. ``_lock`` serialises the changes that must agree between segments
and index: rename + record (put, put_many), eviction, dropping a rotten entry or a bad frame, and guards
the per-segment counts (``_segments``, ``_dead_bytes``, ``_next_segment``, ``_can_punch``). A batch's
segment is written before ``_lock`` is taken. Reads take no lock: a read that races an eviction sees a
missing segment or a hole and re-checks under ``_lock`` before calling anything rotten. ``_counters_lock``
guards the statistics counters and the pending LRU moves (``_frames``, the frames indexed, and
``_frame_growth`` are changed under ``_lock``, read by ``stats`` and ``frame_growth`` without). The
presence counters are changed under ``_lock`` only, with the index, and read by ``lacks`` from any
thread without a lock; ``note_misses`` is called by one thread
(the fetcher's). ``read_index`` is for a closed cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from dsec_fs.digest import short, to_hex
from dsec_fs.errors import CorruptError, InputError, UnavailableError, UnsupportedError
from dsec_fs.files import LOCK_NAME, lock_directory, private_dir, unlink_if_present

from .cache_segments import (DIR_MODE, FILE_MODE, SEGMENT_NUMBER_LIMIT, checksum, punch_holes, read_chunk, segment_name,
                             segment_number, unlink_segment, write_temporary)
from .cache_presence import PresenceCounters
from .cache_strays import INDEX_FILES, make_room, narrow, narrow_path, remove_stray, scan
from .lmdb_index import DEFAULT_MAP_SIZE, LAYOUT_VERSION, CacheIndex, IndexEntry

log = logging.getLogger(__name__)

SEGMENTS = "segments"
INDEX = "index"
OLD_CHUNKS = "chunks"  # layout 1's directory of chunk files
# Hits remembered before their LRU moves are written to the index in one transaction.
TOUCH_BATCH = 64


@dataclass(frozen=True)
class CacheStats:
    entries: int  # chunks in the cache
    bytes: int  # sum of their sizes
    max_bytes: int
    hits: int  # gets answered, since open
    misses: int  # gets not answered (absent, raced an eviction, or rotten)
    evictions: int  # entries removed to stay under max_bytes
    rotten: int  # entries dropped because the segment was missing, too short or failed the xxh3 check
    reconciled: int  # segments (and strays) deleted and entries dropped by the check at open
    frames: int  # of the entries, those kept as a fill's frames, not yet read
    bad_frames: int  # frames dropped since open because they did not decompress to their chunk


class Frame(NamedTuple):
    """A chunk as its pack holds it: what a fill puts and what ``get`` answers for one not read since."""
    frame: bytes | memoryview  # the zstd frame, not checked against the chunk's digest
    plain_size: int  # the chunk's size, which the frame must decompress to
    pack_id: str  # the pack it was read from (a frame that fails is logged with its key)


@dataclass
class _Segment:
    """What the cache knows of one segment in place (under ``_lock``)."""
    size: int  # its bytes, as written
    chunks: int  # indexed chunks in it
    dead: int = 0  # bytes of chunks no longer indexed that are still on disk (no hole punched)


class ChunkCache:
    """The cache in ``directory`` (created if missing), holding at most ``max_bytes`` of chunks."""

    def __init__(self, directory: str, max_bytes: int, *, map_size: int = DEFAULT_MAP_SIZE):
        if max_bytes <= 0:
            raise InputError(f"the cache size must be positive, got {max_bytes}", where=directory)
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        self._segments_dir = os.path.join(self.directory, SEGMENTS)
        self._lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._pending_touches: dict[bytes, int] = {}
        self._hits = self._misses = self._evictions = self._rotten = self._bad_frames = 0
        self._frames = 0
        # The bytes the frames indexed will take beyond their own once read (made plain): the sum over them
        # of plain size minus frame size. Under ``_lock``; read without it (``frame_growth``).
        self._frame_growth = 0
        self._known_misses = 0  # misses that ``lacks`` answered (note_misses)
        self._segments: dict[int, _Segment] = {}
        self._dead_bytes = 0  # the sum of their ``dead``
        self._next_segment = 1
        self._can_punch = True  # until the filesystem refuses
        self._presence = PresenceCounters(max_bytes)
        private_dir(self.directory)
        make_room(self._segments_dir, directory=True)
        os.makedirs(self._segments_dir, mode=DIR_MODE, exist_ok=True)
        narrow_path(self._segments_dir, DIR_MODE)
        self._lock_fd = self._lock_directory()
        try:
            old_chunks = os.path.join(self.directory, OLD_CHUNKS)
            if os.path.lexists(old_chunks) and remove_stray(old_chunks):
                log.info("chunk cache %s: removed the chunk files of an older layout", self.directory)
            self._index = self._open_index(map_size)
            self._reconciled = self._reconcile()
            self.evict_to(max_bytes)  # in case it was reopened with a smaller limit
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _lock_directory(self) -> int:
        make_room(os.path.join(self.directory, LOCK_NAME), directory=False)
        fd = lock_directory(self.directory, what="another ChunkCache (this or another process)", error=_held)
        narrow(fd, FILE_MODE)
        return fd

    def _open_index(self, map_size: int) -> CacheIndex:
        """Open the index; a damaged one (or one LMDB will not open, or one of another layout) is a cache
        we can afford to lose, so it starts again empty. Anything in the index directory but LMDB's two
        files goes first."""
        index_dir = os.path.join(self.directory, INDEX)
        make_room(index_dir, directory=True)
        os.makedirs(index_dir, mode=DIR_MODE, exist_ok=True)
        narrow_path(index_dir, DIR_MODE)
        for entry in scan(index_dir):
            if entry.name in INDEX_FILES and entry.is_file(follow_symlinks=False):
                narrow_path(entry.path, FILE_MODE)
            else:
                remove_stray(entry.path)
        try:
            index = CacheIndex(index_dir, map_size)
        except (CorruptError, UnavailableError, UnsupportedError) as exc:
            log.warning("chunk cache %s: %s; starting with an empty cache", self.directory, exc)
        else:
            if index.upgraded_from is not None:
                log.info("chunk cache %s: an index of layout %d, whose chunks are all plain and verified: kept, "
                         "and marked layout %d", self.directory, index.upgraded_from, LAYOUT_VERSION)
            return index
        for name in os.listdir(index_dir):
            os.unlink(os.path.join(index_dir, name))
        return CacheIndex(index_dir, map_size)

    def _reconcile(self) -> int:
        """Make segments and index agree after a crash, and clear out strays: one pass over the index, one
        over segments/ (nothing in it is followed or opened)."""
        entries = self._index.entries()
        indexed = {entry.segment for entry in entries.values()}
        sizes: dict[int, int] = {}
        removed = 0
        kept: set[int] = set()  # numbers no new segment may take: segments and strays left in place
        for item in scan(self._segments_dir):
            segment = segment_number(item.name)
            if segment in indexed and item.is_file(follow_symlinks=False):
                st = item.stat(follow_symlinks=False)
                if st.st_mode & 0o077:
                    narrow_path(item.path, FILE_MODE)
                sizes[segment] = st.st_size
                kept.add(segment)
                continue
            # A temporary segment, one whose put never reached the index, one whose chunks were all
            # evicted from the index but that was not yet unlinked, or something that is not a segment.
            if remove_stray(item.path):
                removed += 1
            elif segment is not None and segment < SEGMENT_NUMBER_LIMIT:
                kept.add(segment)
        self._next_segment = max(kept, default=0) + 1
        unsound = []
        for digest, entry in entries.items():
            size = sizes.get(entry.segment)
            if size is None or entry.offset + entry.size > size:
                unsound.append(digest)
                continue
            known = self._segments.setdefault(entry.segment, _Segment(size=size, chunks=0))
            known.chunks += 1
            self._frames += entry.is_frame
            self._frame_growth += _growth(entry)
        for segment in sizes.keys() - self._segments.keys():  # every chunk of it was unsound
            removed += remove_stray(self._segment_path(segment))
        if unsound:
            self._index.delete(unsound)
        dropped = set(unsound)
        self._presence.count((digest for digest in entries if digest not in dropped), +1)
        if removed or unsound:
            log.info("chunk cache %s: removed %d unindexed segments or strays, dropped %d entries without a "
                     "sound segment", self.directory, removed, len(unsound))
        return removed + len(unsound)

    def _segment_path(self, segment: int) -> str:
        return os.path.join(self._segments_dir, segment_name(segment))

    def locate(self, digest: bytes) -> tuple[str, int, int] | None:
        """Where the index says a chunk's bytes are: (segment path, offset, size); None when not indexed."""
        entry = self._index.get(digest)
        return None if entry is None else (self._segment_path(entry.segment), entry.offset, entry.size)

    def get(self, digest: bytes) -> bytes | Frame | None:
        """The chunk's stored bytes, checked against the index: the chunk, or its Frame if a fill put it and
        nobody read it since (the module docstring: frames); None when it is not cached (or was rotten)."""
        entry = self._index.get(digest)
        data = None if entry is None else read_chunk(self._segment_path(entry.segment), entry.offset, entry.size,
                                                     entry.checksum, frame=entry.is_frame)[0]
        if entry is not None and data is None:
            entry, data = self._recheck(digest)
        with self._counters_lock:
            if data is None:
                self._misses += 1
                return None
            self._hits += 1
            self._pending_touches[digest] = time.time_ns()
            flush = len(self._pending_touches) >= TOUCH_BATCH
        if flush:
            self._flush_touches()
        return Frame(data, entry.plain_size, to_hex(entry.pack)) if entry.is_frame else data

    def drop_frame(self, digest: bytes) -> bool:
        """Drop ``digest``'s entry if it is (still) a frame: one that did not decompress to its chunk.
        False when there is none (evicted, or replaced by the plain chunk meanwhile)."""
        with self._lock:
            entry = self._index.get(digest)
            if entry is None or not entry.is_frame:
                return False
            self._drop_locked(digest)
        with self._counters_lock:
            self._bad_frames += 1
        return True

    def lacks(self, digest: bytes) -> bool:
        """True when the cache surely does not hold the chunk (the module docstring: presence counters);
        False when it may. Memory only: any thread, never blocks; counts nothing (``note_misses``)."""
        return self._presence.surely_absent(digest)

    def note_misses(self, count: int) -> None:
        """Count ``count`` chunks that ``lacks`` answered for as misses (they were not looked up)."""
        self._known_misses += count

    def holds(self, digests: Iterable[bytes]) -> set[bytes]:
        """Which of ``digests`` the index lists: nothing read or checked, no hit or miss counted (for
        readahead candidates, which are skipped when cached; a rotten one is found when it is read)."""
        return {digest for digest in digests if self._index.get(digest) is not None}

    def put(self, digest: bytes, data: bytes | memoryview | Frame) -> bool:
        """Cache a verified chunk (or a Frame); False when it is larger than the whole cache and so not kept."""
        return self.put_many([(digest, data)]) == 1

    def put_many(self, chunks: Iterable[tuple[bytes, bytes | memoryview | Frame]]) -> int:
        """Cache verified chunks, or Frames of chunks not verified: write the new ones end to end to a
        temporary segment, then rename it into place and record them in one index transaction. A plain
        chunk replaces its Frame; a chunk cached already is otherwise left as it is. Returns how many are
        kept (a chunk larger than the whole cache is not)."""
        kept = 0
        new: dict[bytes, tuple[memoryview, int, Frame | None]] = {}  # digest -> bytes, checksum, frame; in order
        for digest, data in chunks:
            frame = data if isinstance(data, Frame) else None
            view = memoryview(data if frame is None else frame.frame).cast("B")
            if view.nbytes > self.max_bytes:
                continue
            kept += 1
            if digest in new and (frame is not None or new[digest][2] is None):
                continue
            present = None if self.lacks(digest) else self._index.get(digest)
            if present is not None and (frame is not None or not present.is_frame):
                with self._counters_lock:
                    self._pending_touches[digest] = time.time_ns()
                continue
            new.pop(digest, None)  # a plain chunk after its frame in one batch: the frame is not written
            new[digest] = view, checksum(view, frame=frame is not None), frame
        if new:
            self._add_segment(new)
        return kept

    def evict_to(self, max_bytes: int) -> int:
        """Evict least recently used chunks until at most ``max_bytes`` are cached; returns how many."""
        with self._lock:
            return self._evict_locked(max_bytes)

    def stats(self) -> CacheStats:
        with self._counters_lock:
            hits, misses = self._hits, self._misses + self._known_misses
            evictions, rotten = self._evictions, self._rotten
            bad_frames = self._bad_frames
        return CacheStats(entries=len(self._index), bytes=self._index.total_bytes, max_bytes=self.max_bytes,
                          hits=hits, misses=misses, evictions=evictions, rotten=rotten,
                          reconciled=self._reconciled, frames=self._frames, bad_frames=bad_frames)

    @property
    def frame_growth(self) -> int:
        """Bytes the cache's frames will take beyond their own once read and made plain (each at its
        chunk's size): a fill's room is the bound less ``bytes`` and this, so that reading what it kept
        evicts nothing (the bound counts stored bytes: a fill that counted only those kept frames of
        two or three times the room's worth of chunks)."""
        return max(0, self._frame_growth)

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

    def _add_segment(self, new: dict[bytes, tuple[memoryview, int, Frame | None]]) -> None:
        """Write ``new``'s bytes to a temporary segment, then under ``_lock`` rename it into place as the
        next segment and record its chunks (the crash rule: bytes in place before their entries)."""
        tmp = write_temporary(self._segments_dir, [view for view, _checksum, _frame in new.values()])
        recorded = False
        try:
            with self._lock:
                segment = self._next_segment
                now, offset, entries, unused = time.time_ns(), 0, [], []
                for digest, (view, xxh3, frame) in new.items():
                    entry = IndexEntry(segment, offset, view.nbytes, now, xxh3)
                    if frame is not None:
                        if self._plain_meanwhile(digest):  # another thread put the chunk while this wrote
                            unused.append((offset, view.nbytes))
                            offset += view.nbytes
                            continue
                        entry = entry._replace(plain_size=frame.plain_size, pack=bytes.fromhex(frame.pack_id))
                    entries.append((digest, entry))
                    offset += view.nbytes
                if not entries:
                    return  # the temporary is unlinked below
                self._next_segment += 1
                path = self._segment_path(segment)
                os.rename(tmp, path)
                tmp = path  # unlinked below unless the index records it
                added, replaced, total = self._index.put_many(entries)
                recorded = True
                self._frames += sum(entry.is_frame for _digest, entry in entries)
                self._frame_growth += sum(_growth(entry) for _digest, entry in entries)
                self._segments[segment] = _Segment(size=offset, chunks=len(entries))
                self._presence.count(added, +1)
                self._release(replaced)  # put meanwhile by another thread: that copy's bytes are unused now
                self._free_unindexed(segment, unused)
                if total > self.max_bytes:
                    self._evict_locked(self.max_bytes)
        finally:
            if not recorded:
                unlink_if_present(tmp)

    def _plain_meanwhile(self, digest: bytes) -> bool:
        """With ``_lock`` held: whether ``digest`` is indexed as a plain chunk, which a frame must not
        replace (``put_many`` checked before its segment was written, without the lock)."""
        if self.lacks(digest):
            return False
        entry = self._index.get(digest)
        return entry is not None and not entry.is_frame

    def _free_unindexed(self, segment: int, ranges: list[tuple[int, int]]) -> None:
        """With ``_lock`` held: free the bytes of ``segment`` its index commit left out (``ranges``)."""
        if ranges and not self._punch(segment, ranges):
            freed = sum(size for _offset, size in ranges)
            self._segments[segment].dead += freed
            self._dead_bytes += freed

    def _recheck(self, digest: bytes) -> tuple[IndexEntry | None, bytes | None]:
        """A read failed: under ``_lock`` look again, and drop the entry only if it is still bad; returns
        the entry and its bytes, (None, None) when there are none.

        The lock keeps eviction and put out, so a chunk whose bytes vanished because it was evicted (its
        entry is gone too) or re-put meanwhile (its new bytes are good) is not mistaken for rot.
        """
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                return None, None
            data, problem = read_chunk(self._segment_path(entry.segment), entry.offset, entry.size, entry.checksum,
                                       frame=entry.is_frame)
            if data is not None:
                return entry, data
            log.warning("chunk cache: dropping rotten chunk %s (%s)", to_hex(digest), problem)
            self._drop_locked(digest)
        with self._counters_lock:
            self._rotten += 1
        return None, None

    def _drop_locked(self, digest: bytes) -> None:
        """With ``_lock`` held: remove ``digest``'s entry and free its bytes."""
        dropped = self._index.delete([digest])
        self._presence.count([digest], -1)
        self._release(dropped)

    def _evict_locked(self, max_bytes: int) -> int:
        """With ``_lock`` held: evict down to ``max_bytes``, counting bytes no hole freed (``_dead_bytes``)
        as cached; index first, then segments (see the module doc)."""
        self._flush_touches()
        evicted = 0
        while True:
            batch = self._index.evict_to(max(0, max_bytes - self._dead_bytes))
            if not batch:
                break
            self._presence.count((digest for digest, _entry in batch), -1)
            self._release(batch)
            evicted += len(batch)
            log.debug("chunk cache: evicted %d chunks, first %s", len(batch), short(batch[0][0]))
            if not self._dead_bytes:
                break
        with self._counters_lock:
            self._evictions += evicted
        return evicted

    def _release(self, removed: Iterable[tuple[bytes, IndexEntry]]) -> None:
        """With ``_lock`` held, after ``removed`` left the index: free their bytes, unlinking each segment
        left without an indexed chunk and punching holes in the others (one open per segment)."""
        holes: dict[int, list[IndexEntry]] = {}
        for _digest, entry in removed:
            self._frames -= entry.is_frame
            self._frame_growth -= _growth(entry)
            known = self._segments.get(entry.segment)
            if known is None:
                continue
            known.chunks -= 1
            holes.setdefault(entry.segment, []).append(entry)
        for segment, entries in holes.items():
            known = self._segments[segment]
            if not known.chunks:
                del self._segments[segment]
                self._dead_bytes -= known.dead
                unlink_segment(self._segment_path(segment))
            elif not self._punch(segment, [(entry.offset, entry.size) for entry in entries]):
                freed = sum(entry.size for entry in entries)
                known.dead += freed
                self._dead_bytes += freed

    def _punch(self, segment: int, ranges: list[tuple[int, int]]) -> bool:
        """Punch holes in ``segment``; False when the filesystem cannot (not tried again after the first)."""
        if self._can_punch and not punch_holes(self._segment_path(segment), ranges):
            log.info("chunk cache %s: the filesystem cannot punch holes; evicted bytes stay until their "
                     "segment goes, and count against the bound", self.directory)
            self._can_punch = False
        return self._can_punch

    def _flush_touches(self) -> None:
        with self._counters_lock:
            touches, self._pending_touches = self._pending_touches, {}
        if touches:
            self._index.touch(touches)


def _growth(entry: IndexEntry) -> int:
    """What ``entry`` will take beyond its stored bytes once made plain: a frame's plain size less its own."""
    return entry.plain_size - entry.size if entry.is_frame else 0


def _held(message: str, where: str) -> UnavailableError:
    """The error of a cache directory another ChunkCache holds: not transient (it holds it until closed)."""
    return UnavailableError(message, where=where, transient=False)


def read_index(directory: str) -> dict[bytes, IndexEntry]:
    """The index of the cache in ``directory`` while no ChunkCache has it open (UnavailableError then):
    digest -> its entry, nothing checked or changed (for benches and tests that look at what a daemon
    cached). Its segments are ``directory``/segments/``segment_name(entry.segment)``."""
    fd = lock_directory(directory, what="a ChunkCache", error=_held)
    try:
        index = CacheIndex(os.path.join(directory, INDEX))
        try:
            return index.entries()
        finally:
            index.close()
    finally:
        os.close(fd)
