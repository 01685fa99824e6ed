"""mount(2) and umount2(2) through libc, and file-backed EROFS mounts.

util-linux mount(8) puts an EROFS image that is a regular file on a loop device, and the kernel then
refuses a regular file as ``device=``. Calling mount(2) ourselves with the image path as the source makes
the kernel open the image and the blobs as files (CONFIG_EROFS_FS_BACKED_BY_FILE, Linux 6.12 and later):
no loop devices, and a blob may be a file served by the node daemon over FUSE.

Errors carry the errno text and the paths. By errno: an fs type or a mode the kernel lacks (ENODEV,
ENOTBLK, EOPNOTSUPP) is UnsupportedError; EFSCORRUPTED (EUCLEAN) and EFSBADCRC (EBADMSG) are
CorruptError; anything else is UnavailableError, transient only for EBUSY, EAGAIN, EINTR and ENOMEM.
The kernel says EINVAL when the number of device= options differs from the image's extra devices.

Needs CAP_SYS_ADMIN. Any thread may call these functions; they keep no state.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dsec_fs.errors import CorruptError, DsecError, InputError, UnavailableError, UnsupportedError

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000  # attach an existing directory tree at a second place
# Layers are mounted read-only, and an image's setuid bits and device nodes give nobody anything: not a
# user of the host who can reach the mountpoint, not a sandbox (its overlay root is nosuid,nodev too).
LAYER_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV
MNT_DETACH = 0x2  # umount2: detach now, finish when the last user goes away
UMOUNT_NOFOLLOW = 0x8  # umount2: a symlink as the last component is refused (EINVAL), not followed

PathLike = str | bytes | os.PathLike

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.umount2.restype = ctypes.c_int
_libc.statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
_libc.statx.restype = ctypes.c_int

# statx(2): the parts of struct statx read here, and the flags asked with.
_AT_EMPTY_PATH, _AT_STATX_DONT_SYNC = 0x1000, 0x4000  # the fd itself; no request to a FUSE daemon
_STATX_MNT_ID, _STATX_MNT_ID_UNIQUE = 0x1000, 0x4000  # Linux 5.8; 6.8 (never reused while the system runs)
_STATX_ATTR_MOUNT_ROOT = 0x2000
_STATX_SIZE = 256
_STX_ATTRIBUTES, _STX_MNT_ID = slice(8, 16), slice(144, 152)

_UNSUPPORTED = {errno.ENODEV, errno.ENOTBLK, errno.EOPNOTSUPP}
_CORRUPT = {errno.EUCLEAN, errno.EBADMSG}  # the kernel's EFSCORRUPTED and EFSBADCRC (a bad checksum)
_TRANSIENT = {errno.EBUSY, errno.EAGAIN, errno.EINTR, errno.ENOMEM}


def _error(call: str, err: int, where: str) -> DsecError:
    message = f"{call}: {os.strerror(err)} ({errno.errorcode.get(err, err)})"
    if err in _UNSUPPORTED:
        return UnsupportedError(message, where=where)
    if err in _CORRUPT:
        return CorruptError(message, where=where)
    return UnavailableError(message, where=where, transient=err in _TRANSIENT)


def _show(path: PathLike) -> str:
    return os.fsdecode(path)


def mount(source: PathLike, target: PathLike, fstype: str, flags: int = 0, data: str | bytes = "") -> None:
    """mount(2): attach ``source`` (a device, an image file, or a name like "overlay") at ``target``."""
    data_b = os.fsencode(data)
    if _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags, data_b or None) != 0:
        where = f"{_show(source)} on {_show(target)} (type {fstype}, options {os.fsdecode(data_b) or '-'})"
        raise _error("mount", ctypes.get_errno(), where)


def umount(target: PathLike, lazy: bool = False) -> None:
    """umount2(2); ``lazy`` detaches now even if files are open (MNT_DETACH)."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        raise _error("umount", ctypes.get_errno(), _show(target))


def _statx_mount(fd: int, mask: int) -> tuple[int | None, bool]:
    """The mount id of the file ``fd`` (None if the kernel does not give the id ``mask`` asks for) and
    whether that file is the root of its mount. AT_STATX_DONT_SYNC: a FUSE file's attributes are taken as
    cached, so no request goes to its daemon (which may be this process, or nobody)."""
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if _libc.statx(fd, b"", _AT_EMPTY_PATH | _AT_STATX_DONT_SYNC, mask, buffer) != 0:
        raise _error("statx", ctypes.get_errno(), f"/proc/self/fd/{fd}")
    raw = buffer.raw
    attributes = int.from_bytes(raw[_STX_ATTRIBUTES], "little")
    got = int.from_bytes(raw[0:4], "little") & mask
    return (int.from_bytes(raw[_STX_MNT_ID], "little") if got else None), bool(attributes & _STATX_ATTR_MOUNT_ROOT)


@dataclass(frozen=True)
class MountIdentity:
    """Which mount a mountpoint held when it was mounted (or checked): what an unmount goes by, not the
    path, whose directories may have been renamed or swapped for symlinks since (umount_identified)."""

    mount_id: int  # /proc/self/mountinfo's first field; the kernel reuses it once the mount is gone
    unique_id: int | None = None  # STATX_MNT_ID_UNIQUE, never reused; None where not known (from mountinfo)

    def matches(self, fd: int) -> bool:
        """The file ``fd`` is the root of this mount."""
        if self.unique_id is not None:
            found, root = _statx_mount(fd, _STATX_MNT_ID_UNIQUE)
            if found is not None:
                return root and found == self.unique_id
        found, root = _statx_mount(fd, _STATX_MNT_ID)
        return root and found == self.mount_id


def mount_identity(target: PathLike) -> MountIdentity:
    """The identity of the mount at ``target`` now (its last component not followed if a symlink): call it
    right after mount(2). UnavailableError if ``target`` is not the root of a mount."""
    fd = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mount_id, root = _statx_mount(fd, _STATX_MNT_ID)
        unique_id, _root = _statx_mount(fd, _STATX_MNT_ID_UNIQUE)
    finally:
        os.close(fd)
    if not root or mount_id is None:
        raise UnavailableError("nothing is mounted here", where=_show(target), transient=False)
    return MountIdentity(mount_id, unique_id)


def new_mount_identity(target: PathLike) -> MountIdentity:
    """mount_identity of the mount just made at ``target``; if it cannot be taken, that mount is detached
    (nothing could unmount it by what it is)."""
    try:
        return mount_identity(target)
    except BaseException:
        umount(target, lazy=True)
        raise


def umount_identified(identity: MountIdentity, target: PathLike, lazy: bool = False) -> bool:
    """umount2(2) of the mount ``identity`` names, at ``target`` or wherever /proc/self/mountinfo shows it
    now (a directory on the way renamed), never of another mount the path leads to meanwhile (a directory
    on the way swapped for a symlink, another mount over it). False if it is gone (unmounted by someone
    else); UnavailableError if it is there but not reachable as itself (covered by another mount).

    Each place is checked through its parent directory, opened (O_PATH) and kept: the mountpoint is
    opened in it (O_NOFOLLOW) and its mount compared, then unmounted as /proc/self/fd/PARENT/NAME with
    UMOUNT_NOFOLLOW, so no lookup by name happens between the check and umount2 but of NAME in that very
    directory. In the mount namespace of the mount a mountpoint cannot be renamed or removed (EBUSY); a
    process in another one (a sandbox) can swap NAME there for a symlink, which UMOUNT_NOFOLLOW refuses,
    or for a directory holding another mount of this namespace that lies in its tree, the one race left."""
    places = [os.fsdecode(target)]
    places += [entry.mountpoint for entry in mount_table() if entry.mount_id == identity.mount_id]
    present = len(places) > 1
    for place in dict.fromkeys(places):
        parent_path, name = os.path.split(os.path.normpath(place))
        try:
            parent = os.open(parent_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            except OSError:
                continue
            try:
                ours = identity.matches(fd)
            finally:
                os.close(fd)  # an open file would keep the mount busy
            if ours:
                flags = (MNT_DETACH if lazy else 0) | UMOUNT_NOFOLLOW
                if _libc.umount2(f"/proc/self/fd/{parent}/{name}".encode(), flags) != 0:
                    raise _error("umount", ctypes.get_errno(), place)
                return True
        finally:
            os.close(parent)
    if present:
        raise UnavailableError("the mount made here cannot be reached as itself (another mount covers it?); "
                               "left mounted", where=", ".join(dict.fromkeys(places)), transient=False)
    return False


def identity_of(entry: MountEntry) -> MountIdentity:
    """The identity of a mount as /proc/self/mountinfo shows it (for a mount this process did not make)."""
    return MountIdentity(entry.mount_id)


def identity_at(path: PathLike) -> MountIdentity | None:
    """identity_of the topmost mount exactly at ``path``, or None; from /proc/self/mountinfo alone, so no
    request goes to the filesystem there (a FUSE session nobody serves yet)."""
    entry = top_mount(path)
    return None if entry is None else identity_of(entry)


def erofs_options(blob_paths: Sequence[PathLike]) -> str:
    """The mount data for EROFS extra devices, in device-table order: "device=/a,device=/b"."""
    options = []
    for path in blob_paths:
        path = os.path.abspath(os.fsdecode(path))
        if "," in path:
            raise InputError("the kernel splits mount options at ',', so a blob path cannot contain one",
                             where=path)
        options.append(f"device={path}")
    return ",".join(options)


def mount_erofs(meta_path: PathLike, mountpoint: PathLike, blob_paths: Sequence[PathLike]) -> None:
    """Mount the EROFS image file ``meta_path`` read-only, nosuid, nodev, its extra devices backed by
    ``blob_paths``.

    The number of blobs must equal the image's extra_devices (else the kernel says EINVAL).
    """
    mount(os.path.abspath(os.fsdecode(meta_path)), mountpoint, "erofs", LAYER_FLAGS, erofs_options(blob_paths))


# ioctl FS_IOC_GETFSSYSFSPATH (Linux 6.10): _IOR(0x15, 1, struct fs_sysfs_path { __u8 len; __u8 name[128]; })
_FS_IOC_GETFSSYSFSPATH = (2 << 30) | (129 << 16) | (0x15 << 8) | 1


def set_read_ahead(mountpoint: PathLike, size: int) -> bool:
    """Make the kernel read ahead ``size`` bytes (rounded down to KiB) at most in files of the EROFS
    mounted at ``mountpoint``: the read_ahead_kb of its backing device info, which a file-backed EROFS
    mount has of its own, named as its sysfs directory (FS_IOC_GETFSSYSFSPATH says which: "erofs/NAME").
    False where the kernel cannot say (before 6.10) or the filesystem has no such device info of its own.
    Not for FUSE mounts (set_fuse_read_ahead): the ioctl would go to their daemon."""
    buffer = bytearray(129)
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFSSYSFSPATH, buffer)
    except OSError:
        return False
    finally:
        os.close(fd)
    return _write_read_ahead(os.path.basename(bytes(buffer[1:1 + buffer[0]]).decode(errors="replace")), size)


def set_fuse_read_ahead(mountpoint: PathLike, size: int) -> bool:
    """set_read_ahead for the FUSE filesystem mounted at ``mountpoint``, whose device info is named after
    its device number ("MAJOR:MINOR"); False if there is none of that name."""
    device = os.stat(mountpoint).st_dev
    return _write_read_ahead(f"{os.major(device)}:{os.minor(device)}", size)


def _write_read_ahead(device_info: str, size: int) -> bool:
    try:
        with open(f"/sys/class/bdi/{device_info}/read_ahead_kb", "w") as f:
            f.write(str(size // 1024))
    except FileNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5)), its paths unescaped."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor" (st_dev of files on it)
    root: str  # the directory of the filesystem mounted here (not "/" for a bind mount of a subtree)
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: bytes) -> str:
    """/proc/self/mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field))


def mount_table() -> list[MountEntry]:
    """Every mount this process sees, in /proc/self/mountinfo order (parents before what is mounted on
    them, and at one mountpoint the topmost last). The only parser of mountinfo in dsecfs. It reads
    /proc alone: it sends no request to any filesystem (a FUSE session nobody serves would hang a stat)."""
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    entries = []
    for line in lines:
        fields = line.split(b" ")
        separator = fields.index(b"-", 6)  # optional fields end with a lone "-"
        entries.append(MountEntry(mount_id=int(fields[0]), parent_id=int(fields[1]), device=fields[2].decode(),
                                  root=_unescape(fields[3]), mountpoint=_unescape(fields[4]),
                                  fstype=_unescape(fields[separator + 1]), source=_unescape(fields[separator + 2])))
    return entries


def top_mount(path: PathLike) -> MountEntry | None:
    """The topmost mount exactly at ``path`` (taken as it is: no symlinks resolved), or None."""
    path = os.fsdecode(path)
    found = None
    for entry in mount_table():
        if entry.mountpoint == path:
            found = entry
    return found


def is_mountpoint(path: PathLike) -> bool:
    """True if something is mounted exactly at ``path`` (symlinks resolved), per /proc/self/mountinfo."""
    return top_mount(os.path.realpath(os.fsdecode(path))) is not None


def mount_device(path: PathLike) -> str | None:
    """"major:minor" of the topmost mount exactly at ``path``, or None, per /proc/self/mountinfo. Only
    the parent directory is resolved (symlinks), never ``path`` itself, so this sends no request to the
    filesystem mounted there (a FUSE session nobody serves would hang a stat)."""
    path = os.fsdecode(path)
    entry = top_mount(os.path.join(os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path)))
    return None if entry is None else entry.device


def mounts_below(path: PathLike) -> list[str]:
    """The mount points strictly below ``path`` (symlinks resolved), in /proc/self/mountinfo order (the
    order they were mounted in). For checks that a test or a benchmark left nothing mounted."""
    prefix = os.path.realpath(os.fsdecode(path)) + "/"
    return [entry.mountpoint for entry in mount_table() if entry.mountpoint.startswith(prefix)]


def filesystem_of(path: PathLike) -> MountEntry:
    """The mount ``path`` (taken as it is) lies on: the one at its longest mountpoint prefix, topmost."""
    path = os.fsdecode(path)
    found = None
    for entry in mount_table():
        if is_below(path, entry.mountpoint) and (found is None or len(entry.mountpoint) >= len(found.mountpoint)):
            found = entry
    assert found is not None  # "/" holds every path
    return found


def is_below(path: str, directory: str) -> bool:
    """``path`` is ``directory`` or inside it, comparing normalised absolute paths (nothing resolved)."""
    path, directory = os.path.normpath(path), os.path.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def umount_or_detach(target: PathLike, identity: MountIdentity | None = None) -> bool:
    """Unmount the mount ``identity`` names (umount_identified; default: the topmost at ``target`` now); if
    something still holds it (EBUSY), detach it lazily instead of leaving it. False if it was gone."""
    identity = identity or identity_at(os.path.realpath(os.fsdecode(target)))
    if identity is None:
        return False
    try:
        return umount_identified(identity, target)
    except UnavailableError as e:
        if not e.transient:
            raise
        return umount_identified(identity, target, lazy=True)


@contextlib.contextmanager
def mounted(source: PathLike, target: PathLike, fstype: str, flags: int = 0,
            data: str | bytes = "") -> Iterator[str]:
    """``mount(...)`` for the duration of a with-block; yields the target; always unmounts what it
    mounted, wherever that went meanwhile (umount_identified)."""
    mount(source, target, fstype, flags, data)
    identity = new_mount_identity(target)
    try:
        yield os.fsdecode(target)
    finally:
        umount_or_detach(target, identity)


def mounted_erofs(meta_path: PathLike, mountpoint: PathLike,
                  blob_paths: Sequence[PathLike]) -> contextlib.AbstractContextManager[str]:
    """``mount_erofs(...)`` for the duration of a with-block; yields the mountpoint; always unmounts."""
    return mounted(os.path.abspath(os.fsdecode(meta_path)), mountpoint, "erofs", LAYER_FLAGS,
                   erofs_options(blob_paths))
