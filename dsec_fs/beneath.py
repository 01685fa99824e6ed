"""Opening a path beneath a directory without following any symlink (openat2), and the xattrs of an entry
named relative to a directory fd (listxattrat, getxattrat), through libc's syscall().

``open_beneath(dir_fd, relpath, flags)`` resolves ``relpath`` relative to ``dir_fd`` with
RESOLVE_BENEATH (no component may leave the directory, not even with ".." or an absolute path),
RESOLVE_NO_SYMLINKS (a symlink in any component fails with ELOOP, the last one included) and
RESOLVE_NO_MAGICLINKS (no /proc/<pid>/fd style jumps). What another process does to the tree meanwhile
(a directory swapped for a symlink with renameat2 RENAME_EXCHANGE) can make the open fail, never land
outside the directory: the kernel checks every component as it walks it. Python 3.11 has no os.openat2,
hence the syscall (Linux 5.6 and later).

``list_xattrs_at(dir_fd, name)`` and ``get_xattr_at(dir_fd, name, attr)`` read the xattrs of the entry
``name`` of the directory ``dir_fd`` without following it (Python's xattr functions take no dir_fd).
They use Linux 6.13's listxattrat/getxattrat, and on an older kernel the path
/proc/self/fd/<dir_fd>/<name>, which resolves through the directory fd just as well but costs a procfs
lookup per call (about 9 us against 1).

Any thread may call these functions; each thread has its own buffer for the xattr calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

# The same numbers on x86_64 and on the architectures of the unified table (aarch64).
_SYS_OPENAT2 = 437
_SYS_GETXATTRAT = 464
_SYS_LISTXATTRAT = 465
AT_SYMLINK_NOFOLLOW = 0x100
XATTR_SIZE_MAX = 1 << 16  # the kernel's bound on a value, and on a list of names


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _XattrArgs(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint64), ("size", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


# dlopen(NULL): the C library the interpreter runs on (ctypes.util.find_library runs ldconfig, ~4 ms a call)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_beneath(dir_fd: int, relpath: bytes, flags: int, *, mode: int = 0, resolve: int = STRICT) -> int:
    """The fd of ``relpath`` opened beneath ``dir_fd`` (see the module docstring); OSError as os.open raises.

    ``flags`` are os.open's; O_CLOEXEC is added."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, relpath, ctypes.byref(how), _HOW_SIZE)
    if fd < 0:
        _raise(relpath)
    return fd


def list_xattrs_at(dir_fd: int, name: bytes) -> list[bytes]:
    """The xattr names of entry ``name`` of directory ``dir_fd`` (not followed); OSError as os.listxattr."""
    if _have_xattr_at:
        buffer = _buffer()
        got = _libc.syscall(_SYS_LISTXATTRAT, dir_fd, name, AT_SYMLINK_NOFOLLOW, buffer, _BUFFER_SIZE)
        if got >= 0:
            return ctypes.string_at(buffer, got).split(b"\0")[:-1] if got else []
        _failed(name)
    return [os.fsencode(item) for item in os.listxattr(_proc_path(dir_fd, name), follow_symlinks=False)]


def get_xattr_at(dir_fd: int, name: bytes, attribute: bytes) -> bytes:
    """The value of xattr ``attribute`` of entry ``name`` of directory ``dir_fd`` (not followed)."""
    if _have_xattr_at:
        buffer = _buffer()
        args = _XattrArgs(ctypes.addressof(buffer), XATTR_SIZE_MAX, 0)
        got = _libc.syscall(_SYS_GETXATTRAT, dir_fd, name, AT_SYMLINK_NOFOLLOW, attribute, ctypes.byref(args),
                            _ARGS_SIZE)
        if got >= 0:
            return ctypes.string_at(buffer, got)
        _failed(name)
    return os.getxattr(_proc_path(dir_fd, name), attribute, follow_symlinks=False)


_have_xattr_at = True  # whether the kernel has listxattrat/getxattrat (False after the first ENOSYS)
# The size_t arguments, made once (ints would be passed as C ints: dir_fd and the flags are ints).
_BUFFER_SIZE = ctypes.c_size_t(XATTR_SIZE_MAX)
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
_ARGS_SIZE = ctypes.c_size_t(ctypes.sizeof(_XattrArgs))
_buffers = threading.local()  # .buffer: XATTR_SIZE_MAX bytes for this thread's calls


def _buffer() -> ctypes.Array:
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = ctypes.create_string_buffer(XATTR_SIZE_MAX)
    return buffer


def _failed(name: bytes) -> None:
    """After a failed *xattrat call: remember ENOSYS (the caller falls back to /proc), raise anything else."""
    global _have_xattr_at
    if ctypes.get_errno() != errno.ENOSYS:
        _raise(name)
    _have_xattr_at = False


def _proc_path(dir_fd: int, name: bytes) -> bytes:
    return b"/proc/self/fd/%d/%s" % (dir_fd, name)


def _raise(name: bytes):
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), os.fsdecode(name))
