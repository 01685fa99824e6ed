"""Serve a filesystem core (fs_core) over FUSE by speaking the /dev/fuse protocol directly (``--fuse-binding
raw``), in the daemon's trio loop, on a connection that can outlive the daemon.

Why not libfuse. libfuse (pyfuse3, fusepy) cannot take over a connection another process set up: it
answers EIO to everything until it has seen FUSE_INIT, and the kernel sends INIT once per connection.
Here the connection is ours: ``mount`` opens /dev/fuse and calls mount(2) itself, a holder process
(fuse_holder.py) keeps a copy of the fd, and a daemon that starts after one that died takes that fd
back, restores the parameters INIT negotiated (``SessionParams``, persisted by the caller), and serves
on (``serve(..., resume=True)``): first it writes FUSE_NOTIFY_RESEND, which makes the kernel (6.9+) queue
again every request the dead daemon had read and not answered (their ``unique`` gains bit 63; the reply
names the unique as received), so a read that was in flight at the crash is answered by the new daemon.
Nothing else about a request depends on the daemon that took it: handles are inode numbers (fh = ino),
and the core gives every inode the same number after a restart (see layer_mount.py).

The protocol (include/uapi/linux/fuse.h, 7.38 here; the kernel takes the lower minor of the two): every
request is one read(2) of the fd, a ``fuse_in_header`` then the op's argument struct (and names, NUL
terminated); every reply is one write(2), a ``fuse_out_header`` (error = -errno, or 0 and the op's out
struct). FORGET, BATCH_FORGET and INTERRUPT get no reply. One ``struct.Struct`` per message below, a
comment per field. Ops not listed in ``_HANDLERS`` get ENOSYS, which the kernel remembers for some.

Caching is pyfuse3's (fuse_pyfuse3.py) and one more: entries and attributes the core marks immutable are
cached CACHE_SECONDS, names missing from an immutable directory are negative entries for as long, pages
are kept across opens (FOPEN_KEEP_CACHE), and so are directory listings and symlink targets
(FUSE_CACHE_SYMLINKS). OPENDIR and OPEN are answered ENOSYS, so the kernel opens directories and files
itself, caches listings, and never asks for an open or a release again: a warm walk never reaches the
daemon, a warm import only for what it reads (``_Session.opendir``, ``_Session.open``; pyfuse3 can do
neither). Attributes and entries of the synthetic directories are not cached. Requests are up to
MAX_PAGES pages (1 MiB; FUSE_MAX_PAGES), so a big direct read of a blob file is one Python callback, not
eight.

Threads: everything runs in the trio loop that called ``serve``. The fd is nonblocking; the loop waits
for it with trio.lowlevel.wait_readable, answers metadata requests inline (the core's metadata calls are
lookups in parsed images), and runs each READ as a task, because reads await lazy fetches. Writes to
/dev/fuse never block. A caller that makes the kernel send requests here (mount(2) of an EROFS image
whose device= is a file here, a bind mount, stat) must do it from another thread (trio.to_thread).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import stat
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import trio

from dsec_fs import mounts
from dsec_fs.errors import UnavailableError

from .fs_core import Attributes, Filesystem, FsError, errno_for

log = logging.getLogger(__name__)

CACHE_SECONDS = 3600  # as fuse_pyfuse3.CACHE_SECONDS
BLOCK_SIZE = 4096  # st_blksize and statfs block size: EROFS blocks
NAME_MAX = 255
PAGE = 4096
MAX_PAGES = 256  # pages per request: 1 MiB reads (the kernel's default limit, fs.fuse.max_pages_limit)
MAX_WRITE = 128 << 10  # read-only, so never used; but the read buffer must hold a write this big
MAX_BACKGROUND = 32  # asynchronous requests (readahead) the kernel keeps in flight at once
FUSE_MAJOR, FUSE_MINOR = 7, 38
UNIQUE_RESEND = 1 << 63  # the kernel's FUSE_UNIQUE_RESEND: set in the unique of a resent request
NOTIFY_RESEND = 7  # FUSE_NOTIFY_RESEND (Linux 6.9): queue again every request read and not answered

# INIT flags (fuse_init_in.flags / fuse_init_out.flags) we want, if the kernel offers them.
FUSE_ASYNC_READ = 1 << 0  # several READs of one file in flight at once
FUSE_AUTO_INVAL_DATA = 1 << 12  # drop cached pages when mtime or size change (never: immutable)
FUSE_DO_READDIRPLUS = 1 << 13  # READDIRPLUS: entries with their attributes
FUSE_READDIRPLUS_AUTO = 1 << 14  # ... only when the kernel thinks a stat of each entry follows
FUSE_NO_OPEN_SUPPORT = 1 << 17  # OPEN may be answered ENOSYS: the kernel then opens files itself
FUSE_PARALLEL_DIROPS = 1 << 18  # lookups and readdirs of one directory in parallel
FUSE_MAX_PAGES = 1 << 22  # fuse_init_out.max_pages is meant
FUSE_CACHE_SYMLINKS = 1 << 23  # the kernel keeps symlink targets in the page cache (one READLINK each)
FUSE_INIT_EXT = 1 << 30  # fuse_init_in/out carry flags2
WANTED_FLAGS = (FUSE_ASYNC_READ | FUSE_AUTO_INVAL_DATA | FUSE_NO_OPEN_SUPPORT | FUSE_DO_READDIRPLUS
                | FUSE_READDIRPLUS_AUTO | FUSE_PARALLEL_DIROPS | FUSE_CACHE_SYMLINKS | FUSE_MAX_PAGES)
FOPEN_KEEP_CACHE = 1 << 1  # fuse_open_out.open_flags: keep the file's pages across opens
FOPEN_NOFLUSH = 1 << 5  # ... and send no FLUSH when a descriptor of it is closed (see _Session.flush)

# Opcodes (enum fuse_opcode).
LOOKUP, FORGET, GETATTR, READLINK, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 5, 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 22, 23, 25, 26, 27, 28, 29
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET, READDIRPLUS = 34, 36, 38, 42, 44

# ---- messages ------------------------------------------------------------------------------------------

IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header:
# len (whole request, bytes), opcode, unique (request id; bit 63 on a resent one), nodeid (the inode the
# op is on), uid, gid, pid (of the caller), total_extlen (extensions, 8-byte units; none negotiated), padding
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header: len (whole reply), error (0 or -errno), unique
INIT_IN = struct.Struct("<IIIII")  # fuse_init_in (its start; 44 reserved bytes follow):
# major, minor (the kernel's protocol version), max_readahead (bytes), flags, flags2 (with FUSE_INIT_EXT)
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # fuse_init_out:
# major, minor (ours), max_readahead (bytes), flags (granted), max_background, congestion_threshold
# (background requests), max_write (bytes), time_gran (ns of timestamps), max_pages (per request),
# map_alignment (DAX, unused), flags2, 7 unused words
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr:
# ino, size, blocks (512-byte units), atime, mtime, ctime (seconds), atimensec, mtimensec, ctimensec,
# mode, nlink, uid, gid, rdev (new_encode_dev), blksize, flags (FUSE_ATTR_*)
ENTRY_OUT = struct.Struct("<QQQQII")  # fuse_entry_out (fuse_attr follows):
# nodeid (0: a negative entry), generation, entry_valid, attr_valid (seconds), entry_valid_nsec, attr_valid_nsec
ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out (fuse_attr follows): attr_valid (s), attr_valid_nsec, dummy
GETATTR_IN = struct.Struct("<IIQ")  # fuse_getattr_in: getattr_flags (FUSE_GETATTR_FH), dummy, fh
OPEN_IN = struct.Struct("<II")  # fuse_open_in (also OPENDIR): flags (open(2) flags), open_flags (FUSE_OPEN_*)
OPEN_OUT = struct.Struct("<QII")  # fuse_open_out: fh (our handle: the inode), open_flags (FOPEN_*), padding
READ_IN = struct.Struct("<QQIIQII")  # fuse_read_in (also READDIR, READDIRPLUS):
# fh, offset (bytes; for directories the offset of the last entry returned), size (at most this many
# bytes back), read_flags, lock_owner, flags (open flags), padding
GETXATTR_IN = struct.Struct("<II")  # fuse_getxattr_in (also LISTXATTR; the name follows): size (0: ask
# for the value's size), padding
GETXATTR_OUT = struct.Struct("<II")  # fuse_getxattr_out: size (of the value or list), padding
INTERRUPT_IN = struct.Struct("<Q")  # fuse_interrupt_in: unique (of the request to interrupt)
KSTATFS = struct.Struct("<QQQQQIIII24x")  # fuse_kstatfs:
# blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding, 6 spare words
DIRENT = struct.Struct("<QQII")  # fuse_dirent (the name follows, padded to 8 bytes):
# ino, off (offset to continue after this entry), namelen, type (S_IFMT >> 12)


@dataclass(frozen=True)
class SessionParams:
    """What INIT negotiated, which a daemon resuming the connection cannot ask again (persisted as JSON)."""

    minor: int  # protocol minor version in use
    flags: int  # INIT flags granted
    max_write: int  # the read buffer must hold a WRITE this big
    max_pages: int  # pages per request

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> SessionParams:
        return cls(**{name: int(value[name]) for name in ("minor", "flags", "max_write", "max_pages")})

    @property
    def buffer_size(self) -> int:
        """Enough for any request (the kernel refuses a read(2) smaller than its biggest WRITE)."""
        return max(8192, IN_HEADER.size + 80 + self.max_write, self.max_pages * PAGE) + PAGE


def attr_bytes(attrs: Attributes) -> bytes:
    seconds, nanoseconds = divmod(attrs.mtime_ns, 1_000_000_000)
    return ATTR.pack(attrs.ino, attrs.size, -(-attrs.size // 512), seconds, seconds, seconds,
                     nanoseconds, nanoseconds, nanoseconds, attrs.mode, attrs.nlink, attrs.uid, attrs.gid,
                     attrs.rdev & 0xFFFFFFFF, BLOCK_SIZE, 0)  # rdev: st_rdev cut to 32 bits, as libfuse does


def entry_bytes(attrs: Attributes, *, names_cached: bool) -> bytes:
    return ENTRY_OUT.pack(attrs.ino, 0, CACHE_SECONDS if names_cached else 0,
                          CACHE_SECONDS if attrs.immutable else 0, 0, 0) + attr_bytes(attrs)


def negative_entry_bytes() -> bytes:
    """A name that is not there, for CACHE_SECONDS (nodeid 0)."""
    return ENTRY_OUT.pack(0, 0, CACHE_SECONDS, 0, 0, 0) + bytes(ATTR.size)


def dirent_bytes(name: bytes, ino: int, next_offset: int, mode: int) -> bytes:
    record = DIRENT.pack(ino, next_offset, len(name), stat.S_IFMT(mode) >> 12) + name
    return record + bytes(-len(record) % 8)


def _name(body: bytes | memoryview) -> bytes:
    """A NUL-terminated name at the start of ``body``."""
    data = bytes(body)
    end = data.find(b"\0")
    return data if end < 0 else data[:end]


# ---- the connection ------------------------------------------------------------------------------------


def mount(mountpoint: str, options: Iterable[str]) -> int:
    """Open /dev/fuse and mount a FUSE filesystem at ``mountpoint`` on it; returns the fd (nonblocking).
    ``options`` are libfuse-style ("ro", "fsname=x", "subtype=y", "allow_other", "default_permissions")."""
    fsname, subtype, flags, data = "fuse", "", mounts.MS_NOSUID | mounts.MS_NODEV, []
    for option in options:
        name, _eq, value = option.partition("=")
        if name == "ro":
            flags |= mounts.MS_RDONLY
        elif name == "fsname":
            fsname = value
        elif name == "subtype":
            subtype = value
        else:
            data.append(option)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = stat.S_IFMT(os.stat(mountpoint).st_mode)
        data = [f"fd={fd}", f"rootmode={mode:o}", f"user_id={os.geteuid()}", f"group_id={os.getegid()}", *data]
        mounts.mount(fsname, mountpoint, f"fuse.{subtype}" if subtype else "fuse", flags, ",".join(data))
    except BaseException:
        os.close(fd)
        raise
    return fd


def connection_alive(fd: int) -> bool:
    """False once the kernel has aborted the connection (unmounted, or aborted through fusectl)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return not any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))


def notify_resend(fd: int) -> None:
    """Ask the kernel to send again the requests read from ``fd`` and not answered (by a daemon that died)."""
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0))


class _Session:
    """One connection being served: reads requests, dispatches them, writes replies."""

    def __init__(self, fs: Filesystem, fd: int, params: SessionParams | None, on_init):
        self.fs = fs
        self.fd = fd
        self.params = params
        self.on_init = on_init
        self.destroyed = False

    def reply(self, unique: int, *parts: bytes) -> None:
        """One writev of two iovecs, the header and ``parts`` joined: the kernel takes a reply in one write,
        and one iovec per part (a READDIR answers with one part per name) fails EINVAL past IOV_MAX
        (1,024). A READ's data, the one reply that can be big (up to MAX_PAGES pages), is one part: it
        goes as it is, not copied. A reply the kernel refuses is answered EIO instead (``_write``)."""
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if not self._write([OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique), body]):
            log.error("the kernel refused a reply of %d bytes to FUSE request %#x: answered EIO", len(body), unique)
            self.reply_error(unique, errno.EIO)

    def reply_error(self, unique: int, err: int) -> None:
        self._write([OUT_HEADER.pack(OUT_HEADER.size, -err, unique)])

    def _write(self, parts: list[bytes]) -> bool:
        """Write one reply (``parts``: the header and at most one body); False if the kernel refused it as
        malformed (EINVAL: bigger than the request allows, say), which must not end the session: the
        request still waits for an answer (if the kernel ended it already, the next answer finds nothing)."""
        try:
            os.writev(self.fd, parts)
        except FileNotFoundError:  # the request was interrupted, or aborted, meanwhile: nobody waits
            pass
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            if exc.errno != errno.ENODEV:  # ENODEV: the connection is gone, which the read loop sees
                raise
        return True

    async def run(self, nursery: trio.Nursery) -> None:
        buffer = bytearray((self.params or SessionParams(FUSE_MINOR, 0, MAX_WRITE, MAX_PAGES)).buffer_size)
        view = memoryview(buffer)
        while not self.destroyed:
            try:
                length = os.readv(self.fd, [buffer])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except (InterruptedError, FileNotFoundError):  # ENOENT: a request interrupted while we read it
                continue
            except OSError as exc:
                if exc.errno == errno.ENODEV:  # unmounted (or aborted): the session is over
                    return
                raise
            if length < IN_HEADER.size:
                raise UnavailableError(f"a FUSE request of {length} bytes", where="/dev/fuse", transient=False)
            self.dispatch(IN_HEADER.unpack_from(buffer), bytes(view[IN_HEADER.size:length]), nursery)
            await trio.lowlevel.checkpoint()  # let the read tasks run between requests

    def dispatch(self, header: tuple, body: bytes, nursery: trio.Nursery) -> None:
        _length, opcode, unique, nodeid, _uid, _gid, _pid, _extlen, _pad = header
        if opcode == READ:
            _fh, offset, size, *_rest = READ_IN.unpack_from(body)
            nursery.start_soon(self._read, unique, nodeid, offset, size)
            return
        handler = _HANDLERS.get(opcode)
        if handler is None:
            if opcode not in (FORGET, BATCH_FORGET):  # stateless: nothing to forget, and no reply
                self.reply_error(unique, errno.ENOSYS)
            return
        try:
            reply = handler(self, nodeid, body)
        except Exception as exc:
            self.reply_error(unique, errno_for(exc, f"FUSE op {opcode} on inode {nodeid}"))
            return
        if reply is not None:
            self.reply(unique, *reply)

    async def _read(self, unique: int, ino: int, offset: int, size: int) -> None:
        try:
            data = await self.fs.read(ino, offset, size)
        except Exception as exc:
            self.reply_error(unique, errno_for(exc, f"FUSE read of inode {ino}"))
        else:
            self.reply(unique, data)

    # -- handlers: (session, nodeid, body) -> reply parts, or None for no reply

    def init(self, nodeid: int, body: bytes):
        major, minor, max_readahead, flags, flags2 = INIT_IN.unpack_from(body + bytes(INIT_IN.size))
        if major != FUSE_MAJOR:
            raise FsError(errno.EPROTO, f"FUSE protocol {major}.{minor}, not 7.x", where="/dev/fuse")
        granted = flags & WANTED_FLAGS
        self.params = SessionParams(min(minor, FUSE_MINOR), granted, MAX_WRITE, MAX_PAGES)
        self.on_init(self.params)
        log.info("FUSE connection: protocol 7.%d, flags %#x, %d KiB requests", self.params.minor, granted,
                 MAX_PAGES * PAGE >> 10)
        return [INIT_OUT.pack(FUSE_MAJOR, FUSE_MINOR, min(max_readahead, MAX_PAGES * PAGE),
                              granted | (flags & FUSE_INIT_EXT), MAX_BACKGROUND, MAX_BACKGROUND * 3 // 4,
                              MAX_WRITE, 1, MAX_PAGES, 0, 0)]

    def lookup(self, nodeid: int, body: bytes):
        names_cached = self.fs.names_immutable(nodeid)
        try:
            attrs = self.fs.lookup(nodeid, _name(body))
        except FsError as exc:
            if exc.errno != errno.ENOENT or not names_cached:
                raise
            return [negative_entry_bytes()]
        return [entry_bytes(attrs, names_cached=names_cached)]

    def getattr(self, nodeid: int, body: bytes):
        attrs = self.fs.getattr(nodeid)
        return [ATTR_OUT.pack(CACHE_SECONDS if attrs.immutable else 0, 0, 0), attr_bytes(attrs)]

    def readlink(self, nodeid: int, body: bytes):
        return [self.fs.readlink(nodeid)]

    def open(self, nodeid: int, body: bytes):
        """ENOSYS, once, when the kernel supports it (it always does since 4.19): it then opens files itself
        (fc->no_open) with FOPEN_KEEP_CACHE, and sends neither OPEN nor RELEASE again, two round trips
        per opened file saved (a Python import opens hundreds). Opens are refused for writing by the
        read-only mount; READs carry fh 0, and files are known by nodeid anyway. It sends FLUSH at each
        close instead, until FLUSH is refused once (``flush``)."""
        if self.params is not None and self.params.flags & FUSE_NO_OPEN_SUPPORT:
            raise FsError(errno.ENOSYS, "the kernel opens files itself", where=f"inode {nodeid}")
        flags, _open_flags = OPEN_IN.unpack_from(body)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise FsError(errno.EROFS, "read-only", where=f"inode {nodeid}")
        if not stat.S_ISREG(self.fs.getattr(nodeid).mode):
            raise FsError(errno.EINVAL, "not a regular file", where=f"inode {nodeid}")
        return [OPEN_OUT.pack(nodeid, FOPEN_KEEP_CACHE | FOPEN_NOFLUSH, 0)]

    def opendir(self, nodeid: int, body: bytes):
        """ENOSYS, once: the kernel then opens directories itself (fc->no_opendir), sends neither OPENDIR
        nor RELEASEDIR again (two round trips per directory a walk saved), and caches every directory's
        listing (FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE). That is right for layer directories, which never
        change; the synthetic ones change, but their mtime moves with every change and is never cached, so
        the kernel (FUSE_AUTO_INVAL_DATA) drops a listing it cached before the change when a listing
        starts again. READDIR requests then carry fh 0: directories are known by nodeid."""
        raise FsError(errno.ENOSYS, "the kernel opens directories itself", where=f"inode {nodeid}")

    def readdir(self, nodeid: int, body: bytes, *, plus: bool = False):
        _fh, offset, size, *_rest = READ_IN.unpack_from(body)
        names_cached = self.fs.names_immutable(nodeid)
        records, used = [], 0
        for entry in self.fs.readdir(nodeid, offset):
            attrs = self.fs.getattr(entry.ino)
            record = dirent_bytes(entry.name, entry.ino, entry.next, attrs.mode)
            if plus:
                record = entry_bytes(attrs, names_cached=names_cached) + record
            if used + len(record) > size:
                break
            records.append(record)
            used += len(record)
        return records

    def readdirplus(self, nodeid: int, body: bytes):
        return self.readdir(nodeid, body, plus=True)

    def statfs(self, nodeid: int, body: bytes):
        return [KSTATFS.pack(0, 0, 0, 0, 0, BLOCK_SIZE, NAME_MAX, BLOCK_SIZE, 0)]

    def getxattr(self, nodeid: int, body: bytes):
        size, _pad = GETXATTR_IN.unpack_from(body)
        return self._sized(self.fs.getxattr(nodeid, _name(body[GETXATTR_IN.size:])), size)

    def listxattr(self, nodeid: int, body: bytes):
        size, _pad = GETXATTR_IN.unpack_from(body)
        return self._sized(b"".join(name + b"\0" for name in self.fs.listxattr(nodeid)), size)

    @staticmethod
    def _sized(value: bytes, size: int):
        """An xattr value (or name list): its size when asked for 0 bytes, ERANGE when it does not fit."""
        if size == 0:
            return [GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise FsError(errno.ERANGE, f"{len(value)} bytes do not fit in {size}", where="xattr")
        return [value]

    def nothing(self, nodeid: int, body: bytes):
        """RELEASE, RELEASEDIR, ACCESS (the kernel checks permissions: default_permissions)."""
        return []

    def flush(self, nodeid: int, body: bytes):
        """FLUSH is synchronous: close(2) waits for the answer, so while no daemon serves (between a crash
        and the next start) every close of a file here would hang, even the ones a fork makes before
        exec. ENOSYS makes the kernel stop sending it on this connection (fc->no_flush), which outlives
        this daemon; files opened through OPEN (kernels without no-open support) are FOPEN_NOFLUSH. The
        daemon has that first FLUSH sent right after it mounts the session, before any layer is mounted,
        by opening and closing the session's flush-probe (layer_mount._refuse_flush)."""
        raise FsError(errno.ENOSYS, "no flush: read-only", where=f"inode {nodeid}")

    def interrupt(self, nodeid: int, body: bytes):
        """Ignored, as libfuse does unless told otherwise: the read goes on and is answered (a fetch is
        bounded by the fetch timeout). Answering EINTR instead fails page faults and exec with EIO, and Go
        programs (runc) are interrupted all the time: the Go runtime preempts its threads with SIGURG."""
        return None

    def destroy(self, nodeid: int, body: bytes):
        self.destroyed = True
        return []


_HANDLERS = {
    INIT: _Session.init, LOOKUP: _Session.lookup, GETATTR: _Session.getattr, READLINK: _Session.readlink,
    OPEN: _Session.open, OPENDIR: _Session.opendir, READDIR: _Session.readdir,
    READDIRPLUS: _Session.readdirplus, STATFS: _Session.statfs, GETXATTR: _Session.getxattr,
    LISTXATTR: _Session.listxattr, RELEASE: _Session.nothing, RELEASEDIR: _Session.nothing,
    FLUSH: _Session.flush, ACCESS: _Session.nothing, INTERRUPT: _Session.interrupt, DESTROY: _Session.destroy,
}


async def serve(fs: Filesystem, fd: int, *, params: SessionParams | None, on_init=lambda params: None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``fs`` on the FUSE connection ``fd`` until the kernel ends it (unmounted: returns) or this
    task is cancelled. ``params`` None: a new connection, whose INIT is still to come (``on_init(params)``
    is called with what it negotiated, before the kernel sends anything else). Otherwise a connection
    taken over from a daemon that died, initialised with ``params``: requests it had read are asked for
    again (FUSE_NOTIFY_RESEND) before serving. ``fd`` stays open (the caller's to close)."""
    session = _Session(fs, fd, params, on_init)
    if params is not None:
        try:
            notify_resend(fd)
        except OSError as exc:
            raise UnavailableError(f"cannot resume the FUSE connection: {os.strerror(exc.errno)}",
                                   where="/dev/fuse", transient=False) from None
    async with trio.open_nursery() as nursery:
        task_status.started()
        try:
            await session.run(nursery)
        finally:
            nursery.cancel_scope.cancel()
