"""Serve a filesystem core (fs_core) over FUSE with fusepy (libfuse2), for hosts where pyfuse3 cannot be
built (``--fuse-binding fusepy``). The only module that imports fusepy (module ``fuse``).

fusepy drives libfuse2's high-level, path-based API from libfuse's own threads. Each request resolves
its path to an inode with ``lookup`` from the root (the core's lookups are dictionary or binary searches
on a parsed image, so this stays cheap); file and directory handles are inode numbers, so reads and
listings skip that. ``use_ino`` makes stat show the core's inode numbers, so hard links look like hard
links. Paths and names cross fusepy as latin-1 strings, which map each byte to one character and back,
so names that are not UTF-8 survive.

Caching is per mount in libfuse2, not per entry: entries and attributes are cached CACHE_SECONDS and
pages are kept across opens (kernel_cache). That is right for the synthetic directories too, because
their names are content hashes (a blob id, a layer digest): a name that goes and comes back means the
same bytes.

Threads and the trio loop: ``serve`` runs as a trio task; it starts a thread that calls fusepy's FUSE(),
which mounts and then blocks in libfuse's multi-threaded loop until the filesystem is unmounted. Metadata
requests call the core directly in libfuse's threads (the core is thread-safe); reads run the core's async
``read`` in the trio loop of ``serve`` through trio.from_thread, because the blobs belong to that loop.
Several FUSE() sessions can run in one process, each in its own thread; libfuse2 then prints "fuse:
fuse_remove_signal_handlers: unknown session" when one ends, which is harmless. libfuse2 installs
handlers for SIGHUP and SIGTERM (those still at SIG_DFL) that end the FUSE loop instead of the process,
so a daemon should install its own before serving. When a session ends, libfuse2 also sets SIGPIPE back
to SIG_DFL if it finds it ignored (fuse_remove_signal_handlers), as Python starts every process: the next
write to a pipe or socket whose reader is gone would kill the process (a daemon stopping with its log
reader gone died with status -13). The FUSE thread puts it back as soon as FUSE() returns.

Stopping: cancelling ``serve`` unmounts lazily and waits for libfuse's loop to end, which it does when the
kernel drops the filesystem, i.e. when its last user is gone. A lazily detached layer mount whose files
are still open therefore holds ``serve`` until they are closed (pyfuse3 closes its connection instead, so
those users get ENOTCONN); libfuse2 gives us no way to abort the connection without fusectl mounted.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import stat
import threading
from collections.abc import Iterable

import fuse
import trio

from dsec_fs import mounts
from dsec_fs.errors import UnavailableError

from .fs_core import ROOT_INO, Filesystem, errno_for

log = logging.getLogger(__name__)

CACHE_SECONDS = 3600
BLOCK_SIZE = 4096  # st_blksize and statfs block size: EROFS blocks
NAME_MAX = 255
_ENCODING = "latin-1"  # bytes <-> str one to one (see the module docstring)


def _text(name: bytes) -> str:
    return name.decode(_ENCODING)


class _Operations(fuse.Operations):
    """fusepy handlers over a core ``Filesystem``; ``on_init`` is called (in libfuse's thread) once mounted."""

    use_ns = True  # times as integer nanoseconds

    def __init__(self, fs: Filesystem, trio_token: trio.lowlevel.TrioToken, on_init):
        self.fs = fs
        self.trio_token = trio_token
        self.on_init = on_init

    def __call__(self, op, *args):
        try:
            return super().__call__(op, *args)
        except fuse.FuseOSError:
            raise
        except Exception as exc:
            raise fuse.FuseOSError(errno_for(exc, f"FUSE {op}{args[:1]}")) from None

    def _resolve(self, path: str) -> int:
        ino = ROOT_INO
        for name in path.encode(_ENCODING).split(b"/"):
            if name:
                ino = self.fs.lookup(ino, name).ino
        return ino

    def init(self, path):
        self.on_init()

    def getattr(self, path, fh=None):
        attrs = self.fs.getattr(self._resolve(path) if fh is None else fh)
        return {
            "st_ino": attrs.ino, "st_mode": attrs.mode, "st_nlink": attrs.nlink, "st_uid": attrs.uid,
            "st_gid": attrs.gid, "st_rdev": attrs.rdev, "st_size": attrs.size, "st_blksize": BLOCK_SIZE,
            "st_blocks": -(-attrs.size // 512),
            "st_atime": attrs.mtime_ns, "st_mtime": attrs.mtime_ns, "st_ctime": attrs.mtime_ns,
        }

    def readlink(self, path):
        return _text(self.fs.readlink(self._resolve(path)))

    def opendir(self, path):
        ino = self._resolve(path)
        if not stat.S_ISDIR(self.fs.getattr(ino).mode):
            raise fuse.FuseOSError(errno.ENOTDIR)
        return ino

    def readdir(self, path, fh):
        """The whole listing, each name with its inode number and type (libfuse2 fills d_ino and d_type from
        the stat given; with a bare name getdents shows d_ino 0xffffffff and DT_UNKNOWN). Offsets 0: fusepy
        does not pass the offset to continue from, so libfuse2 keeps the listing and answers each READDIR
        from it, cut to the size the kernel asked for."""
        return [(_text(entry.name), {"st_ino": entry.ino, "st_mode": self.fs.getattr(entry.ino).mode}, 0)
                for entry in self.fs.readdir(fh, 0)]

    def open(self, path, flags):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise fuse.FuseOSError(errno.EROFS)
        ino = self._resolve(path)
        if not stat.S_ISREG(self.fs.getattr(ino).mode):
            raise fuse.FuseOSError(errno.EINVAL)
        return ino

    def read(self, path, size, offset, fh):
        return trio.from_thread.run(self.fs.read, fh, offset, size, trio_token=self.trio_token)

    def listxattr(self, path):
        return [_text(name) for name in self.fs.listxattr(self._resolve(path))]

    def getxattr(self, path, name, position=0):
        return self.fs.getxattr(self._resolve(path), name.encode(_ENCODING))

    def statfs(self, path):
        return {"f_bsize": BLOCK_SIZE, "f_frsize": BLOCK_SIZE, "f_namemax": NAME_MAX}


def _fusepy_options(options: Iterable[str]) -> dict[str, object]:
    """libfuse "-o" options ("ro", "fsname=dsecfs") as FUSE() keyword arguments, plus the high-level ones."""
    kwargs: dict[str, object] = {}
    for option in options:
        name, eq, value = option.partition("=")
        kwargs[name] = value if eq else True
    kwargs.update(foreground=True, use_ino=True, kernel_cache=True, entry_timeout=CACHE_SECONDS,
                  attr_timeout=CACHE_SECONDS, negative_timeout=0)
    return kwargs


_libc = ctypes.CDLL(None, use_errno=True)
_libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
_libc.signal.restype = ctypes.c_void_p
_SIG_IGN = 1  # libc's (sighandler_t) 1


def _ignore_sigpipe_again() -> None:
    """SIGPIPE ignored again, as Python had it before libfuse2 ended a session (see the module docstring).
    Through libc: Python's signal.signal works in the main thread only, and this is the FUSE thread."""
    if signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN:
        _libc.signal(signal.SIGPIPE, _SIG_IGN)


async def serve(fs: Filesystem, mountpoint: str, options: Iterable[str], *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Mount ``fs`` at ``mountpoint`` with libfuse ``options``, report started once mounted, and serve
    until the filesystem is unmounted from outside or this task is cancelled (then it unmounts); the
    FUSE thread has ended when this returns."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel(2)  # "mounted" (from init), then "stopped" (FUSE() returned)
    failure: list[BaseException] = []

    def notify(event: str) -> None:
        trio.from_thread.run_sync(send.send_nowait, event, trio_token=token)

    def run() -> None:
        try:
            fuse.FUSE(_Operations(fs, token, lambda: notify("mounted")),
                      os.fsencode(mountpoint).decode(_ENCODING), encoding=_ENCODING, **_fusepy_options(options))
        except BaseException as exc:  # reported to serve, which raises
            failure.append(exc)
        finally:
            _ignore_sigpipe_again()
            notify("stopped")

    thread = threading.Thread(target=run, name=f"fusepy {mountpoint}", daemon=True)
    thread.start()
    state = "starting"  # then "mounted", then "stopped" (FUSE() returned), as the thread reports
    try:
        state = await receive.receive()
        if state == "stopped":
            raise UnavailableError(f"fusepy could not mount: {failure[0] if failure else 'unknown reason'}",
                                   where=mountpoint, transient=False)
        task_status.started()
        state = await receive.receive()
    finally:
        with trio.CancelScope(shield=True):
            while state != "stopped":
                if state == "mounted":
                    try:
                        await trio.to_thread.run_sync(mounts.umount, mountpoint, True)
                    except UnavailableError as exc:  # unmounted from outside meanwhile: the loop is ending
                        log.warning("unmounting the fusepy session: %s", exc)
                state = await receive.receive()
            await trio.to_thread.run_sync(thread.join)
