"""Walking and removing directory trees nested any depth: a sandbox's or a container's upper dir is a tree
its processes made, and may be nested deeper than Python's stack, on which shutil.rmtree and os.walk (a
stack frame a level) raise RecursionError, rmtree's ignore_errors or not; a path-based walk fails past
PATH_MAX (4,096 bytes) instead, about 2,000 levels down.

``walk_directories`` holds one directory open at a time and remembers the identity (device, inode) of
each above it, so that going back up through ".." is checked (OSError ESTALE if the tree moved meanwhile);
symlinks are never followed and a filesystem mounted below is not entered. ``remove_tree`` removes a tree
on it as ``rm -rf --one-file-system`` does.

Threads: plain functions with no state; any thread (they block on the disk: worker threads in the daemon).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def walk_directories(path: str | os.PathLike, visit: Callable[[int], list[str]],
                     leave: Callable[[int, str], None] = lambda parent_fd, name: None) -> None:
    """Call ``visit(fd)`` on the directory ``path`` and each directory below it on the same filesystem
    (``fd`` open on it for the call), depth first; ``visit`` returns the names of the subdirectories to
    enter. ``leave(parent_fd, name)`` follows once all of a subdirectory's own are done. Gone already:
    nothing is visited. OSError as the walk meets it."""
    try:
        fd = os.open(path, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        return
    device = os.fstat(fd).st_dev
    frames = [(_identity(fd), "", visit(fd))]  # (identity, name in its parent, subdirectories left)
    try:
        while True:
            _, name, subdirs = frames[-1]
            if subdirs:
                child = subdirs.pop()
                try:
                    sub = os.open(child, _DIRECTORY_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                if os.fstat(sub).st_dev != device:  # a mount below: not entered
                    os.close(sub)
                    continue
                os.close(fd)
                fd = sub
                frames.append((_identity(fd), child, visit(fd)))
                continue
            frames.pop()
            if not frames:
                return
            up = os.open("..", _DIRECTORY_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != frames[-1][0]:
                raise OSError(errno.ESTALE, "the tree moved while it was being walked", os.fspath(path))
            leave(fd, name)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove the directory ``path`` and everything in it; gone already is done. OSError if something
    could not be removed: a mount below (left, with the directories holding it, while the rest goes), a
    tree moved while being removed."""
    failures: list[OSError] = []

    def remove_directory(parent_fd: int, name: str) -> None:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError as exc:  # not empty: a mount below
            failures.append(exc)

    walk_directories(path, _remove_all_but_directories, remove_directory)
    if failures:
        raise failures[0]
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def remove_tree_or_log(path: str | os.PathLike, what: str) -> None:
    """``remove_tree``, for a directory the caller goes on without: a failure is logged, naming ``what``."""
    try:
        remove_tree(path)
    except OSError as exc:
        log.error("cannot remove %s %s: %s", what, os.fspath(path), exc)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _remove_all_but_directories(fd: int) -> list[str]:
    """Unlink every entry of the directory ``fd`` that is not a directory; the names of those that are."""
    directories = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                directories.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
    return directories
