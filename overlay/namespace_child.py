"""The child of the namespaces runtime (overlay/runtime.py): run as ``python -m overlay.namespace_child
TODO_FD REPORT_FD`` by ``unshare``, it is pid 1 of the new pid namespace until it execs the command.

It reads its instructions (JSON: rootfs, argv, env, cwd, hostname, memory_bytes, readonly_paths, binds)
from TODO_FD, chroots into the rootfs, mounts /proc, /dev, /dev/pts, /dev/shm and sysfs there, applies
the binds and the masked and read-only paths, sets the hostname, drops capabilities and execs. It runs
with every capability in fresh namespaces. On the report pipe (closed by a successful exec) it writes
CHILD_STARTED first, then, if anything fails, {"stage": "setup" | "exec", "message": ...} as JSON.

Threads: a single-threaded program.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import socket
import stat
import sys

from dsec_fs import mounts
from dsec_fs.errors import DsecError

from .runtime import CHILD_STARTED, DEFAULT_CAPABILITIES, MASKED_PATHS, NAMESPACES_WITHHELD

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
O_PATH = getattr(os, "O_PATH", 0o10000000)
MS_NOEXEC, MS_REC = 0x8, 0x4000
MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = mounts.MS_NOSUID, mounts.MS_NODEV, mounts.MS_REMOUNT, mounts.MS_BIND
DEVICE_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}


class _Failure(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def _namespace_child(todo_fd: int, report_fd: int) -> None:
    os.set_inheritable(report_fd, False)
    os.write(report_fd, CHILD_STARTED)
    try:
        with open(todo_fd, "rb") as f:
            todo = json.loads(f.read())
        _enter_sandbox(todo)
        try:
            os.execvpe(todo["argv"][0], todo["argv"], todo["env"])
        except OSError as exc:
            raise _Failure("exec", os.strerror(exc.errno or 0)) from None
    except BaseException as exc:  # the child must report whatever went wrong, then exit
        stage = exc.stage if isinstance(exc, _Failure) else "setup"
        message = str(exc) if isinstance(exc, (_Failure, DsecError)) else f"{type(exc).__name__}: {exc}"
        os.write(report_fd, json.dumps({"stage": stage, "message": message}).encode())
        os._exit(127)


def _enter_sandbox(todo: dict) -> None:
    # Bind sources are host paths: open them before the chroot hides them, mount them through
    # /proc/self/fd once /proc is back. Every other path is resolved inside the chroot, so a symlink in the
    # rootfs cannot point a mount outside it.
    sources = [os.open(source, O_PATH | os.O_CLOEXEC) for source, _dst, _ro in todo["binds"]]
    os.chroot(todo["rootfs"])
    os.chdir("/")
    _mount_at("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount_at("tmpfs", "/dev", "tmpfs", MS_NOSUID, "mode=755,size=65536k")
    for name, (major, minor) in DEVICE_NODES.items():
        os.mknod(f"/dev/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", 0o666)  # mknod obeys the umask
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    _mount_at("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
    _mount_at("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=65536k")
    _mount_at("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | mounts.MS_RDONLY)
    for fd, (_source, destination, readonly) in zip(sources, todo["binds"]):
        _prepare_mountpoint(destination, directory=stat.S_ISDIR(os.fstat(fd).st_mode))
        mounts.mount(f"/proc/self/fd/{fd}", destination, "", MS_BIND | MS_REC)
        mounts.mount("none", destination, "", MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV
                     | (mounts.MS_RDONLY if readonly else 0))
        os.close(fd)
    for path in MASKED_PATHS:
        if os.path.isdir(path):
            mounts.mount("tmpfs", path, "tmpfs", mounts.MS_RDONLY, "size=0")
        elif os.path.exists(path):
            mounts.mount("/dev/null", path, "", MS_BIND)
    for path in todo["readonly_paths"]:
        if os.path.exists(path):
            mounts.mount(path, path, "", MS_BIND | MS_REC)
            mounts.mount("none", path, "", MS_BIND | MS_REMOUNT | mounts.MS_RDONLY)
    socket.sethostname(todo["hostname"])
    if todo["memory_bytes"] is not None:
        resource.setrlimit(resource.RLIMIT_AS, (todo["memory_bytes"], todo["memory_bytes"]))
    try:
        os.chdir(todo["cwd"])
    except OSError as exc:
        raise _Failure("setup", f"cwd {todo['cwd']}: {os.strerror(exc.errno or 0)}") from None
    _drop_privileges()


def _prepare_mountpoint(path: str, *, directory: bool) -> None:
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if directory:
        os.mkdir(path)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _mount_at(source: str, path: str, fstype: str, flags: int, data: str = "") -> None:
    _prepare_mountpoint(path, directory=True)
    mounts.mount(source, path, fstype, flags, data)


def _prctl(option: int, arg: int, what: str) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise _Failure("setup", f"prctl {what}: {os.strerror(err)}")


def _drop_privileges() -> None:
    """Leave only the allowed capabilities in the bounding set (uid 0 gets exactly those on exec)."""
    allowed = {number for name, number in DEFAULT_CAPABILITIES.items() if name not in NAMESPACES_WITHHELD}
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in allowed:
            _prctl(PR_CAPBSET_DROP, cap, f"drop capability {cap}")
    _clear_inheritable()
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear ambient capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _clear_inheritable() -> None:
    """Empty the inheritable set, which exec would otherwise add to the new permitted set for uid 0."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0 or not any(word.inheritable for word in data):
        return
    for word in data:
        word.inheritable = 0
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise _Failure("setup", f"capset: {os.strerror(ctypes.get_errno())}")


if __name__ == "__main__":
    _namespace_child(int(sys.argv[1]), int(sys.argv[2]))
