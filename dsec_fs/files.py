"""Small file helpers every package shares: atomic writes, directory locks, private directories, holes.

``write_atomic`` writes a file whole under a temporary name beside it and renames it into place, so a
reader (or a daemon started after a crash) sees the old file or the new one, never a torn one; the
temporary name is removed if writing fails (``unlink_if_present``); ``write_state_file`` is write_atomic for a daemon's state
files, a failure (a full disk) an UnavailableError naming the file. ``lock_directory`` takes the flock of
``DIR/lock`` that says one process owns a directory (a state directory, a chunk cache); the kernel lets go
of it when the process dies, so a crashed owner never leaves a stale lock.

Files are created 0600 unless told otherwise: what dsecfs keeps on a node (mount tables, session files,
sandbox states) is the node's, not its users'. ``private_dir`` makes a directory of such things (a state
directory: blob files, meta images, traces, the FUSE session, with every byte of every image, files an
image keeps 0600 included) 0700, and narrows one it finds wider (made by an older version, by hand, or
as a parent by ``os.makedirs``, whose mode applies to the last directory only), so that no file's mode
inside matters to another local user.

``punch_hole`` frees the disk blocks of a range of a file (fallocate FALLOC_FL_PUNCH_HOLE, keeping the
file's size: reads of the range give zeros), through the C library (os has no fallocate with a mode).

Threads: plain functions with no state; any thread.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import stat
from collections.abc import Callable

from .errors import ConflictError, InputError, UnavailableError

log = logging.getLogger(__name__)

LOCK_NAME = "lock"

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the blocks of ``length`` bytes at ``offset`` of the file open for writing at ``fd``; its size
    stays. OSError as fallocate(2) fails: EOPNOTSUPP where the filesystem cannot punch holes."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def write_atomic(path: str | os.PathLike, data: bytes | Callable[[int], None], *, mode: int = 0o600,
                 sync: bool = True, tmp_prefix: str = ".") -> None:
    """Make ``path`` hold ``data`` (bytes, or a function that writes the open fd) and nothing else, in
    one rename. ``sync`` fsyncs the file before the rename (for what must survive a power loss)."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f"{tmp_prefix}{name}.tmp-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        if callable(data):
            try:
                data(fd)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        else:
            write_and_close(fd, data, sync=sync)
        os.rename(tmp, path)
    except BaseException:
        unlink_if_present(tmp)
        raise


def unlink_if_present(path: str | os.PathLike) -> None:
    """Unlink ``path``; one that is gone already is not an error (another cleanup, or a crash, was first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_state_file(path: str | os.PathLike, data: bytes, *, what: str) -> None:
    """``write_atomic`` (not synced) of a daemon's state file, ``what`` it is ("the mount table"): a failure
    to write it (a full disk, ENOSPC or EDQUOT: the sandboxes' upper dirs share the state directory's;
    EIO) is UnavailableError (transient) naming the file, and nothing of the new file is left."""
    try:
        write_atomic(path, data, sync=False)
    except OSError as exc:
        raise UnavailableError(f"cannot write {what}: {exc.strerror or exc}", where=os.fspath(path),
                               transient=True) from None


def write_and_close(fd: int, data: bytes | memoryview, *, sync: bool) -> None:
    """Write all of ``data`` to ``fd`` (os.write may write less than asked), fsync it if ``sync``, and close
    it, whatever happens."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def lock_directory(directory: str | os.PathLike, *, what: str = "another process",
                   error: Callable[[str, str], Exception] | None = None) -> int:
    """The fd of ``directory``/lock, flock()ed exclusively; close it to let go. If another process holds
    it: ``error(message, where)`` raised (ConflictError by default), naming ``what`` holds it."""
    directory = os.fspath(directory)
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise (error or ConflictError)(f"{what} uses this directory", where=directory) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: str | os.PathLike) -> str:
    """Make directory ``path`` (with any missing parents, which get the usual modes) if it is not there,
    and leave it 0700: its owner's alone. One found with any group or other bits is narrowed to 0700,
    and that is logged. A symlink at ``path`` is followed (the operator named it); InputError if what is
    there is no directory. Returns ``path`` (a str)."""
    path = os.fspath(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError("not a directory", where=path)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        log.warning("%s was mode %04o: narrowed to 0700 (what is in it is the node's, not its users')", path, mode)
        os.chmod(path, 0o700)
    return path
