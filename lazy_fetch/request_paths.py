"""Paths a request names (mountpoints, prefetch lists), resolved without the daemon waiting on itself.

The daemon serves its own FUSE session from its trio thread (layer_mount.py). Any lookup of a path that
lies on that session, or that a symlink leads into, is a FUSE request to the daemon itself: made from the
trio thread it waits for an answer only that thread can give, and the whole daemon hangs for good (in D
state: not even SIGTERM gets through). So a request's path is resolved here, in a worker thread under a
deadline, and refused (InputError) if it lies on one of the daemon's own mounts: the FUSE session at
``state_dir/fuse``, a fuse-mode layer (a bind of that session) or a kernel-mode layer (EROFS over a blob
on it), checked twice: by name against /proc/self/mountinfo before anything is looked up, and by the
device number of the directory opened (O_PATH) once resolved, which no symlink can hide.

A mountpoint is also refused if another user could change where its path leads (``trusted_realpath``):
mount(2) and umount2(2) look their target up by name, following symlinks, so a directory on the path
that another user may write to (theirs, or one open to all without the sticky bit protecting root's
entries in it), or a symlink on the way that another user made in such a directory, would let them put
the daemon's mount where they like (a layer over /etc, by a rename between the checks here and mount(2),
or a symlink squatting a name in /tmp). (Unmounts go by the mount made, not by the path:
dsec_fs.mounts.umount_identified; a sandbox's root in which a layer is mounted passes this check, root in
the sandbox being root here, and its process may swap the path after the mount.) Python's
``os.path.realpath`` reads symlinks with readlink(2), which the kernel's fs.protected_symlinks does not
guard, so the daemon resolves the path itself.

Threads: ``resolve_directory`` and ``open_regular_file`` block and run in worker threads (the daemon
calls them through ``run_in_worker``); ``own_mounts`` reads /proc alone and may run anywhere.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from dsec_fs.errors import InputError, UnavailableError
from dsec_fs.mounts import is_below, mount_table

RESOLVE_SECONDS = 10.0  # a lookup that takes longer is on a filesystem that hangs: the request fails
MAX_SYMLINKS = 40  # symlinks followed resolving one path, as the kernel's limit (ELOOP past it)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

T = TypeVar("T")


@dataclass(frozen=True)
class OwnMounts:
    """The daemon's own mounts as /proc/self/mountinfo shows them now."""

    mountpoints: tuple[str, ...]
    devices: frozenset[int]

    def holding(self, path: str) -> str | None:
        """The own mountpoint ``path`` lies on (at or below), or None."""
        return next((m for m in self.mountpoints if is_below(path, m)), None)


def own_mounts(fuse_dir: str) -> OwnMounts:
    """The FUSE session mounted at ``fuse_dir``, every bind of it, and every EROFS mount whose image or
    blob lives in the state directory above it."""
    state_dir = os.path.dirname(fuse_dir)
    table = mount_table()
    session = [e.device for e in table if e.mountpoint == fuse_dir]
    ours = [e for e in table
            if e.mountpoint == fuse_dir or e.device in session
            or (e.fstype == "erofs" and is_below(e.source, state_dir))]
    mountpoints = tuple({fuse_dir, *(e.mountpoint for e in ours)})
    return OwnMounts(mountpoints, frozenset(_dev(e.device) for e in ours))


def _dev(major_minor: str) -> int:
    major, minor = major_minor.split(":")
    return os.makedev(int(major), int(minor))


def _refuse(path: str, mountpoint: str, what: str) -> InputError:
    return InputError(f"the {what} lies on the daemon's own mount {mountpoint}; a daemon cannot mount, "
                      "unmount or read through its own FUSE session", where=path)


def lexical(path: str, what: str) -> str:
    """``path`` made absolute-checked and normalised, with nothing looked up."""
    if not os.path.isabs(path):
        raise InputError(f"the {what} must be an absolute path (the daemon's working directory is not yours)",
                         where=path)
    if "\0" in path:
        raise InputError(f"the {what} holds a NUL byte", where=repr(path))
    return os.path.normpath(path)


def resolve_directory(path: str, fuse_dir: str, what: str = "mountpoint") -> str:
    """The real path of the existing directory ``path``, refused if it is on one of the daemon's mounts."""
    path = lexical(path, what)
    own = own_mounts(fuse_dir)
    if (held := own.holding(path)) is not None:
        raise _refuse(path, held, what)
    real = trusted_realpath(path, what)
    if (held := own.holding(real)) is not None:
        raise _refuse(path, held, what)
    try:
        fd = os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"the {what} is not an existing directory", where=real) from None
    except OSError as exc:
        raise InputError(f"the {what} cannot be opened: {exc.strerror}", where=real) from None
    try:
        if os.fstat(fd).st_dev in own.devices:
            raise _refuse(path, real, what)
    finally:
        os.close(fd)
    return real


def trusted_realpath(path: str, what: str) -> str:
    """``path`` (absolute, normalised) with every symlink on it resolved, as os.path.realpath gives it, each
    name looked up with lstat in the directory resolved so far. InputError naming the directory if one on
    the way is another user's to change: not owned by us (root), or writable by its group or others unless
    it is sticky and the entry taken from it is ours (so /tmp and /var/tmp pass, a name another user
    squats in them does not); and for a path that does not lead to a directory, or loops."""
    me = os.geteuid()
    resolved, todo, links = "/", [part for part in reversed(path.split("/")) if part], 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        entry = os.path.join(resolved, name)
        try:
            parent, st = os.lstat(resolved), os.lstat(entry)
        except OSError as exc:
            raise InputError(f"the {what} is not an existing directory ({exc.strerror})", where=entry) from None
        if parent.st_uid != me or (parent.st_mode & _OTHERS_WRITE
                                   and not (parent.st_mode & stat.S_ISVTX and st.st_uid == me)):
            raise InputError(f"the {what} is reached through a directory another user may change (owner uid "
                             f"{parent.st_uid}, mode {stat.S_IMODE(parent.st_mode):o}): its entry {name!r} "
                             "could be renamed or made a symlink to put the mount elsewhere", where=resolved)
        if not stat.S_ISLNK(st.st_mode):
            resolved = entry
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise InputError(f"the {what} leads through more than {MAX_SYMLINKS} symlinks", where=path)
        try:
            target = os.readlink(entry)
        except OSError as exc:  # no symlink any more: our own files, changed meanwhile
            raise InputError(f"the {what} changed while it was looked up ({exc.strerror})", where=entry) from None
        if target.startswith("/"):
            resolved = "/"
        todo += [part for part in reversed(target.split("/")) if part]
    return resolved


def open_regular_file(path: str, fuse_dir: str, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), refused if it is anything else (a
    FIFO, a device, a directory), bigger, or on one of the daemon's own mounts. Opened O_NONBLOCK, so a
    FIFO cannot make the open wait for a writer."""
    path = lexical(path, what)
    own = own_mounts(fuse_dir)
    if (held := own.holding(path)) is not None:
        raise _refuse(path, held, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise InputError(f"cannot open the {what}: {exc.strerror}", where=path) from None
    try:
        st = os.fstat(fd)
        if st.st_dev in own.devices:
            raise _refuse(path, path, what)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"the {what} is not a regular file", where=path)
        if st.st_size > max_bytes:
            raise InputError(f"the {what} holds {st.st_size} bytes, over the limit of {max_bytes}", where=path)
        data = os.read(fd, max_bytes + 1)
        while len(data) <= max_bytes and (more := os.read(fd, max_bytes + 1 - len(data))):
            data += more
        if len(data) > max_bytes:
            raise InputError(f"the {what} grew over the limit of {max_bytes} bytes while read", where=path)
        return data
    finally:
        os.close(fd)


async def run_in_worker(function: Callable[..., T], *args, where: str) -> T:
    """``function(*args)`` in a worker thread, given up on (UnavailableError) after RESOLVE_SECONDS: its
    thread is left to finish on its own, and the daemon goes on."""
    try:
        with trio.fail_after(RESOLVE_SECONDS):
            return await trio.to_thread.run_sync(functools.partial(function, *args), abandon_on_cancel=True)
    except trio.TooSlowError:
        raise UnavailableError(f"looking the path up took over {RESOLVE_SECONDS:g} s (a filesystem that hangs?)",
                               where=where, transient=True) from None
