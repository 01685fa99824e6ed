"""The chunk cache directory's strays and modes (cache.py's rules: nothing left in the directory stops an
open, nothing in it is followed; everything in it private): removing what does not belong, making room
for the cache's own names, narrowing modes found wider. Also used by meta_cache.py for its directory.

Threads: plain functions with no state; called at open, in the thread that opens the cache (and by
meta_cache under its own lock).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat

from dsec_fs.mounts import is_mountpoint, mounts_below

log = logging.getLogger(__name__)

INDEX_FILES = ("data.mdb", "lock.mdb")


def scan(directory: str) -> list[os.DirEntry]:
    """The entries of ``directory``; none (logged) when it cannot be listed."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError as exc:
        log.warning("chunk cache: cannot list %s, skipping it: %s", directory, exc)
        return []


def make_room(path: str, *, directory: bool) -> None:
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


def narrow(fd: int, mode: int) -> None:
    """Take away the group and other bits ``mode`` does not have; a failure is logged, not fatal (the
    cache directory, 0700, guards what is below it anyway)."""
    try:
        current = stat.S_IMODE(os.fstat(fd).st_mode)
        if current & ~mode & 0o077:
            os.fchmod(fd, current & mode)
    except OSError as exc:
        log.warning("chunk cache: cannot narrow the mode of its lock file: %s", exc.strerror)


def narrow_path(path: str, mode: int) -> None:
    """_narrow by path (callers checked it is no symlink)."""
    try:
        current = stat.S_IMODE(os.lstat(path).st_mode)
        if current & ~mode & 0o077:
            os.chmod(path, current & mode)
    except OSError as exc:
        log.warning("chunk cache: cannot narrow the mode of %s: %s", path, exc.strerror)
