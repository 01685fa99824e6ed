"""Serve a filesystem core (fs_core: LayerTree, BlobDirectory, SessionTree) over FUSE with pyfuse3.

The only module that imports pyfuse3. ``serve`` mounts, then runs pyfuse3's request loop as a task of the
caller's trio loop, so the core's async reads (the lazy blob fetches) run in that same loop.

pyfuse3 keeps its session in module globals: one FUSE session per process. ``serve`` refuses a second
one (ConflictError); the daemon serves everything through one SessionTree (see layer_mount.py).

Caching: images are immutable, so entries and attributes the core marks immutable are cached by the
kernel for CACHE_SECONDS, and so is the absence of a name from an immutable directory (a negative
entry); file pages are kept across opens (keep_cache); direct_io and the writeback cache are off (the
filesystem is read-only). Synthetic directories (whose entries come and go) get no entry or attribute
caching.

Threads: everything runs in the trio thread that called ``serve``. A caller that makes the kernel send
requests to this filesystem (mount(2) of an EROFS image whose device= is a file here, a bind mount,
stat) must do it from another thread (trio.to_thread) while this loop keeps serving, or it deadlocks.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Iterable

import pyfuse3
import trio

from dsec_fs.errors import ConflictError, UnavailableError

from .fs_core import Attributes, Filesystem, FsError, errno_for

CACHE_SECONDS = 3600.0
BLOCK_SIZE = 4096  # st_blksize and statfs block size: EROFS blocks
NAME_MAX = 255

_session_mountpoint: str | None = None  # the mountpoint of this process's one pyfuse3 session, if any


def _errno_replies(handler):
    """Answer a request whose core call raised with an errno instead of ending pyfuse3's main loop."""

    @functools.wraps(handler)
    async def wrapper(self, *args):
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise pyfuse3.FUSEError(errno_for(exc, f"FUSE {handler.__name__}{args[:2]}")) from None

    return wrapper


class _Operations(pyfuse3.Operations):
    """pyfuse3 request handlers over a core ``Filesystem``; a file or directory handle is its inode."""

    enable_writeback_cache = False

    def __init__(self, fs: Filesystem):
        super().__init__()
        self.fs = fs

    def _entry(self, attrs: Attributes, *, names_cached: bool = True) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attrs.ino
        entry.generation = 0
        entry.entry_timeout = CACHE_SECONDS if names_cached else 0
        entry.attr_timeout = CACHE_SECONDS if attrs.immutable else 0
        entry.st_mode = attrs.mode
        entry.st_nlink = attrs.nlink
        entry.st_uid = attrs.uid
        entry.st_gid = attrs.gid
        entry.st_rdev = attrs.rdev
        entry.st_size = attrs.size
        entry.st_blksize = BLOCK_SIZE
        entry.st_blocks = -(-attrs.size // 512)
        entry.st_atime_ns = entry.st_ctime_ns = entry.st_mtime_ns = attrs.mtime_ns
        return entry

    @_errno_replies
    async def lookup(self, parent_inode, name, ctx):
        names_cached = self.fs.names_immutable(parent_inode)
        try:
            attrs = self.fs.lookup(parent_inode, name)
        except FsError as exc:
            if exc.errno != errno.ENOENT or not names_cached:
                raise
            # A name missing from an immutable directory stays missing: let the kernel remember that
            # (an entry with inode 0), so PATH searches and import probes ask once.
            absent = pyfuse3.EntryAttributes()
            absent.st_ino = 0
            absent.entry_timeout = CACHE_SECONDS
            return absent
        return self._entry(attrs, names_cached=names_cached)

    @_errno_replies
    async def getattr(self, inode, ctx):
        return self._entry(self.fs.getattr(inode))

    @_errno_replies
    async def readlink(self, inode, ctx):
        return self.fs.readlink(inode)

    @_errno_replies
    async def opendir(self, inode, ctx):
        if not stat.S_ISDIR(self.fs.getattr(inode).mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_errno_replies
    async def readdir(self, fh, start_id, token):
        names_cached = self.fs.names_immutable(fh)
        for entry in self.fs.readdir(fh, start_id):
            attrs = self._entry(self.fs.getattr(entry.ino), names_cached=names_cached)
            if not pyfuse3.readdir_reply(token, entry.name, attrs, entry.next):
                break

    async def releasedir(self, fh):
        pass

    @_errno_replies
    async def open(self, inode, flags, ctx):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        if not stat.S_ISREG(self.fs.getattr(inode).mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    @_errno_replies
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    async def release(self, fh):
        pass

    @_errno_replies
    async def listxattr(self, inode, ctx):
        return self.fs.listxattr(inode)

    @_errno_replies
    async def getxattr(self, inode, name, ctx):
        return self.fs.getxattr(inode, name)

    async def statfs(self, ctx):
        # Sizes mean little for an image whose data is fetched on demand: report block size and name limit.
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = BLOCK_SIZE
        data.f_namemax = NAME_MAX
        return data


async def serve(fs: Filesystem, mountpoint: str, options: Iterable[str], *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Mount ``fs`` at ``mountpoint`` with libfuse ``options`` ("ro", "fsname=dsecfs", ...), report started
    once mounted, and serve until the filesystem is unmounted from outside or this task is cancelled;
    either way the mount is gone when this returns."""
    global _session_mountpoint
    if _session_mountpoint is not None:
        raise ConflictError(f"pyfuse3 serves one FUSE session per process, already at {_session_mountpoint}",
                            where=mountpoint)
    _session_mountpoint = mountpoint
    try:
        try:
            pyfuse3.init(_Operations(fs), mountpoint, set(options))
        except RuntimeError as exc:  # pyfuse3 logs libfuse's reason
            raise UnavailableError(f"cannot mount FUSE: {exc}", where=mountpoint, transient=False) from None
        try:
            task_status.started()
            await pyfuse3.main()
        finally:
            pyfuse3.close(unmount=True)
    finally:
        _session_mountpoint = None
