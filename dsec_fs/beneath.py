"""Opening a path beneath a directory without following any symlink: openat2(2) through libc's syscall.

``open_beneath(dir_fd, relpath, flags)`` resolves ``relpath`` relative to ``dir_fd`` with
RESOLVE_BENEATH (no component may leave the directory, not even with ".." or an absolute path),
RESOLVE_NO_SYMLINKS (a symlink in any component fails with ELOOP, the last one included) and
RESOLVE_NO_MAGICLINKS (no /proc/<pid>/fd style jumps). What another process does to the tree meanwhile
(a directory swapped for a symlink with renameat2 RENAME_EXCHANGE) can make the open fail, never land
outside the directory: the kernel checks every component as it walks it. Python 3.11 has no os.openat2,
hence the syscall (Linux 5.6 and later).

Any thread may call it; nothing is shared.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

_SYS_OPENAT2 = 437  # the same number on x86_64 and on the architectures of the unified table (aarch64)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_beneath(dir_fd: int, relpath: bytes, flags: int, *, mode: int = 0, resolve: int = STRICT) -> int:
    """The fd of ``relpath`` opened beneath ``dir_fd`` (see the module docstring); OSError as os.open raises.

    ``flags`` are os.open's; O_CLOEXEC is added."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), ctypes.c_char_p(relpath), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(relpath))
    return fd
