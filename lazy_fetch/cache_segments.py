"""The chunk cache's segment files (cache.py: the layout, the crash rule): writing one, reading a chunk's
bytes from one, punching the holes of evicted chunks, unlinking one. Nothing here follows a symlink or
blocks on what is put in a segment's place: segments are opened O_NOFOLLOW | O_NONBLOCK and used only if
regular; one is created O_EXCL | O_NOFOLLOW under a new temporary name.

Threads: plain functions with no state; any thread (cache.py says which of its locks each call needs).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat

import xxhash

from dsec_fs.files import punch_hole, unlink_if_present

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
DIR_MODE = 0o700
FILE_MODE = 0o600
# A stray whose name is a segment number this high does not move the count (the index holds 64 bits).
SEGMENT_NUMBER_LIMIT = 1 << 62
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a symlink: ELOOP; a FIFO: no wait
_PUNCH_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_IOV_MAX = os.sysconf("SC_IOV_MAX")


# A frame's checksum is seeded apart from a plain chunk's, so that an entry that reads as the other kind
# (a frame's 80-byte record damaged to 40 bytes) fails its check instead of serving a frame as the chunk.
FRAME_CHECKSUM_SEED = 0x6672616d65  # b"frame"


def checksum(data: bytes | memoryview, *, frame: bool = False) -> int:
    return xxhash.xxh3_64_intdigest(data, FRAME_CHECKSUM_SEED if frame else 0)


def segment_name(segment: int) -> str:
    return f"{segment:016x}"


def segment_number(name: str) -> int | None:
    """The number of a segment's name (16 lowercase hex digits); None for any other name."""
    if len(name) != 16 or name.strip("0123456789abcdef"):
        return None
    return int(name, 16)


def write_temporary(directory: str, views: list[memoryview]) -> str:
    """Write ``views`` end to end to a new temporary segment in ``directory``; returns its path. The
    directory is made again if someone removed it (the cache's open makes it)."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(8)}")
    try:
        try:
            fd = os.open(tmp, _CREATE_FLAGS, FILE_MODE)
        except FileNotFoundError:
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            fd = os.open(tmp, _CREATE_FLAGS, FILE_MODE)
        try:
            _write_all(fd, [view for view in views if view.nbytes])
        finally:
            os.close(fd)
    except BaseException:
        unlink_if_present(tmp)
        raise
    return tmp


def read_chunk(path: str, offset: int, size: int, xxh3: int, *, frame: bool = False) -> tuple[bytes | None, str]:
    """(bytes, "") when the segment at ``path`` holds ``size`` bytes at ``offset`` whose ``checksum`` (of
    a ``frame``'s kind) is ``xxh3``, else (None, why not)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None, "segment missing"
    except OSError as exc:  # ELOOP: a symlink in its place; EACCES, ...
        return None, f"cannot open its segment: {exc.strerror}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "its segment is not a regular file"
        data = os.pread(fd, size, offset)
    except OSError as exc:
        return None, f"cannot read its segment: {exc.strerror}"
    finally:
        os.close(fd)
    if len(data) != size:
        return None, f"its segment holds {len(data)} of its {size} bytes"
    if checksum(data, frame=frame) != xxh3:
        return None, "xxh3 mismatch"
    return data, ""


def punch_holes(path: str, ranges: list[tuple[int, int]]) -> bool:
    """Free the blocks of each (offset, size) of the segment at ``path``. False when the filesystem
    cannot punch holes (EOPNOTSUPP); True otherwise: done, or nothing to free (the segment gone, a stray
    in its place), or failed for another reason (logged)."""
    try:
        fd = os.open(path, _PUNCH_FLAGS)
    except OSError:  # gone, or a stray in its place: its entries go as they are read
        return True
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            for offset, size in ranges:
                if size:
                    punch_hole(fd, offset, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        log.warning("chunk cache: cannot free evicted bytes of the segment %s: %s", path, exc.strerror)
    finally:
        os.close(fd)
    return True


def unlink_segment(path: str) -> None:
    """Unlink a segment none of whose chunks is indexed; a stray in its place that unlink cannot remove
    (a directory) is logged and left to the next open."""
    try:
        unlink_if_present(path)
    except OSError as exc:
        log.warning("chunk cache: cannot remove the segment %s: %s", path, exc.strerror)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every byte of ``views`` (none empty), in order, with as few writev calls as the kernel allows."""
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first:first + _IOV_MAX])
        while written and written >= views[first].nbytes:
            written -= views[first].nbytes
            first += 1
        if written:
            views[first] = views[first][written:]
