"""Helpers of the reliability tests (fault matrix, soak, isolation); the fixtures are in conftest.py.

- ``Daemons``: real node daemons (``dsecfs daemon`` subprocesses, driven through dsec_fs.client) on real
  S3 (a moto server over HTTP), in one test's directories.
- ``read_checked``: a reader that compares every byte it gets with the source, so a test can tell
  "correct bytes", "an error" (which errno) and "wrong bytes" apart.
- ``DaemonLayers``: overlay.sandbox's LayerProvider over a daemon, so sandboxes (SandboxManager) run on
  layers the daemon fetches lazily, with its faults.
- ``make_shell_tree``: a small base image made of Debian binaries (dash, coreutils, setpriv and their
  libraries, copied out of the cached rootfs), enough for commands in runc sandboxes.
- ``proc_figures``: a process's open file descriptors, threads and resident memory, from /proc.

Import it as ``tests.reliability.support`` (not through conftest: pytest loads every directory's
conftest under the one name "conftest").

Credentials. Daemons and builds here use SECRET_ENV: fake credentials whose values are random and appear
nowhere else, so finding one of them in a log, trace, report or answer is a leak and nothing else. moto
accepts any credentials.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from treecmp import write_files

from dsec_fs.client import DaemonProcess, Node
from dsec_fs.errors import UnavailableError
from dsec_fs.store import open_store
from erofs_builder import build_layer
from lazy_fetch.trace_holders import Holder
from overlay.sandbox import LayerHandle

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
CHUNK = 64 * 1024

SECRET_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDREL" + secrets.token_hex(8).upper(),
    "AWS_SECRET_ACCESS_KEY": "relsecret-" + secrets.token_hex(16),
    "AWS_SESSION_TOKEN": "reltoken-" + secrets.token_hex(24),
}
SECRETS = tuple(SECRET_ENV.values())


def find_secrets(text: str | bytes) -> list[str]:
    """The fake credential values that ``text`` contains (the names of their variables)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return [name for name, value in SECRET_ENV.items() if value in text]


# ---- S3 ---------------------------------------------------------------------------------------------------


def s3_environment(server) -> dict[str, str]:
    """What a process needs to reach ``server`` (a MotoServer) with the fake credentials."""
    return {**server.env(), **SECRET_ENV}


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in os.environ for the block (boto3 in this process reads it when a store is opened)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        yield


def publish(url: str, env: dict[str, str], source: str, **options):
    """Build the directory ``source`` into the store at ``url`` (build_layer's ``options``)."""
    options.setdefault("chunk_size", CHUNK)
    with environment(env), open_store(url) as store:
        return build_layer(source, store, **options)


# ---- reading and checking -------------------------------------------------------------------------------

PIECE = 64 * 1024
DATA = "data"


def read_checked(path: str, expected: bytes, *, piece: int = PIECE) -> str:
    """Read ``path`` whole, piece by piece, comparing each piece with ``expected``: "data" when all of it
    came back right, the errno name ("EIO", "ENOTCONN", ...) of the error that stopped the read (or of a
    failed close after a good read), or "WRONG at N" when bytes came back that differ from the source (or
    a size that does). The file's page cache is dropped first, so the bytes come from the layer, not from
    an earlier read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return _errno_name(exc)
    try:
        outcome = _compare(fd, expected, piece)
    except OSError as exc:
        outcome = _errno_name(exc)
    try:
        os.close(fd)
    except OSError as exc:  # FUSE flushes on close: a dead daemon fails it
        outcome = _errno_name(exc) if outcome == DATA else outcome
    return outcome


def _compare(fd: int, expected: bytes, piece: int) -> str:
    drop_page_cache(fd)
    offset = 0
    while True:
        data = os.pread(fd, piece, offset)
        if data != expected[offset:offset + len(data)]:
            return f"WRONG at {offset}"
        if not data:
            return DATA if offset == len(expected) else f"WRONG at {offset} (short)"
        offset += len(data)


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, str(exc.errno))


def read_until_correct(path: str, expected: bytes, attempts: int) -> list[str]:
    """``read_checked`` again and again until it reads the data, at most ``attempts`` times; the outcomes."""
    outcomes = []
    for _ in range(attempts):
        outcomes.append(read_checked(path, expected))
        if outcomes[-1] == DATA:
            break
    return outcomes


def drop_page_cache(fd: int) -> None:
    """Forget the cached pages of one file (of an OverlayFS file: of the layer file under it)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ---- processes and mounts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcFigures:
    fds: int
    threads: int
    rss_bytes: int


def proc_figures(pid: int) -> ProcFigures:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    rss_kib = int(status["VmRSS"].split()[0])
    return ProcFigures(fds=len(os.listdir(f"/proc/{pid}/fd")), threads=len(os.listdir(f"/proc/{pid}/task")),
                       rss_bytes=rss_kib * 1024)


@dataclass(frozen=True)
class MountEntry:
    target: str
    fstype: str
    options: frozenset[str]  # per-mount options (ro, nosuid, nodev, ...)
    super_options: str  # the filesystem's own options


def mount_table() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            target = fields[4].encode().decode("unicode_escape")
            entries.append(MountEntry(target, fields[separator + 1], frozenset(fields[5].split(",")),
                                      fields[separator + 3] if len(fields) > separator + 3 else ""))
    return entries


# ---- daemons ------------------------------------------------------------------------------------------------


class Daemons:
    """Real daemon processes working in one test's directories: state, cache and log under tmp_path, the
    socket in a short directory of its own under /tmp (a unix socket path holds at most 107 bytes)."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.socket_dir = tempfile.mkdtemp(prefix="dsr-", dir="/tmp")
        self.socket = os.path.join(self.socket_dir, "run", "daemon.sock")  # the daemon makes "run"
        self.state_dir = str(tmp_path / "state")
        self.cache_dir = str(tmp_path / "cache")
        self.log_file = str(tmp_path / "daemon.log")
        self.started: list[DaemonProcess] = []

    def start(self, store: str, env: dict[str, str], *, faults: str | None = None, **options) -> DaemonProcess:
        """Start a daemon on ``store`` with ``env`` added to ours and FaultStore rules ``faults``; ``options``
        are Node.start_daemon's (the previous daemon must have stopped: they share the directories). Access
        profiles are off: the tests share stores, and one test's profile would make another's reads hits."""
        options.setdefault("fetch_timeout", 5)
        options["extra_args"] = [*options.get("extra_args", ()), "--no-profiles"]
        options.setdefault("cache_dir", self.cache_dir)
        options.setdefault("state_dir", self.state_dir)
        full_env = {**os.environ, **env}
        full_env.pop("DSECFS_FAULTS", None)
        if faults:
            full_env["DSECFS_FAULTS"] = faults
        daemon = Node.start_daemon(self.socket, store=store, log_file=self.log_file, command=[DSECFS], env=full_env,
                                   **options)
        self.started.append(daemon)
        return daemon

    def log(self) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop_all(self) -> None:
        failed = [daemon.pid for daemon in self.started if daemon.stop() not in (0, -signal.SIGKILL)]
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        assert not failed, f"daemons {failed} failed; the log ends:\n{self.log()[-3000:]}"


# ---- sandboxes on the daemon ----------------------------------------------------------------------------------


class DaemonLayers:
    """overlay.sandbox's LayerProvider over a node daemon: the first user of a layer has the daemon mount
    it (``mode``) at ``directory/l<n>``, the last one has it unmounted. ``_lock`` guards the tables and is
    held across the daemon calls (simple and serial, like ExportedLayers)."""

    def __init__(self, node: Node, directory: str, *, mode: str = "kernel"):
        self.node = node
        self.directory = directory
        self.mode = mode
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._users: dict[str, int] = {}  # digest -> holders
        self._mountpoints: dict[str, str] = {}  # digest -> where the daemon mounted it
        self._digests: dict[str, str] = {}  # ref -> digest, as the daemon resolved it
        os.makedirs(directory, exist_ok=True)

    def resolve(self, layer_ref: str) -> str:
        """The ref itself: the daemon resolves it at the mount, and this provider labels no trace with
        the combination the sandbox names from these."""
        return layer_ref

    def acquire(self, layer_ref: str, *, digest: str | None = None, holder: Holder | None = None,
                profile: bool = True, fill: str | None = None) -> LayerHandle:
        """``digest`` (the ref, from ``resolve``) and ``holder`` are not used: the daemon's mounts are bare."""
        with self._lock:
            digest = self._digests.get(layer_ref)
            if digest not in self._users:
                mountpoint = os.path.join(self.directory, f"l{next(self._numbers)}")
                os.mkdir(mountpoint)
                digest = self._digests[layer_ref] = self.node.mount(layer_ref, mountpoint, mode=self.mode,
                                                                    profile=profile, fill=fill).layer
                if digest in self._users:  # held under another name
                    self._unmount(mountpoint)
                else:
                    self._users[digest], self._mountpoints[digest] = 0, mountpoint
            self._users[digest] += 1
            return LayerHandle(digest, self._mountpoints[digest])

    def release(self, digest: str, *, holder: Holder | None = None) -> None:
        with self._lock:
            self._users[digest] -= 1
            if not self._users[digest]:
                del self._users[digest]
                self._unmount(self._mountpoints.pop(digest))

    def adopt(self, handle: LayerHandle, *, holder: Holder | None = None) -> None:
        with self._lock:
            self._mountpoints.setdefault(handle.digest, handle.mountpoint)
            self._users[handle.digest] = self._users.get(handle.digest, 0) + 1

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._users)

    def mountpoints(self) -> list[str]:
        with self._lock:
            return list(self._mountpoints.values())

    def _unmount(self, mountpoint: str) -> None:
        try:
            self.node.umount(mountpoint)
        except UnavailableError as exc:
            if not exc.transient:
                raise
            self.node.umount(mountpoint, lazy=True)
        os.rmdir(mountpoint)


# ---- a small base image of Debian binaries --------------------------------------------------------------------

SHELL_BINARIES = ("dash", "cat", "id", "ls", "stat", "sha256sum", "head", "sleep", "dd", "mknod", "mkdir", "rm",
                  "setpriv")
USER_UID = 1000  # a user of the image (etc/passwd), to run commands as non-root


def _from_rootfs(rootfs: str, path: str) -> bytes:
    """A file of the rootfs, its symlinks resolved inside the rootfs (chroot), not on the host."""
    return subprocess.run(["chroot", rootfs, "/usr/bin/cat", path], check=True, capture_output=True).stdout


def _libraries(rootfs: str, binary: str) -> set[str]:
    listed = subprocess.run(["chroot", rootfs, "/usr/bin/ldd", binary], check=True, capture_output=True, text=True)
    return {word for line in listed.stdout.splitlines() for word in line.split() if word.startswith("/")}


def make_shell_tree(root: str, rootfs: str) -> str:
    """Write at ``root`` a tree with SHELL_BINARIES (``/bin/sh`` is dash) and their libraries from the Debian
    ``rootfs``, /etc/passwd with root, a user (USER_UID) and nobody, and a world-writable /tmp."""
    binaries = [f"/usr/bin/{name}" for name in SHELL_BINARIES]
    files = {path: 0o755 for path in binaries}
    for binary in binaries:
        files.update(dict.fromkeys(_libraries(rootfs, binary), 0o755))
    for path, mode in files.items():
        image_path = os.path.join(root, "usr" + path if not path.startswith("/usr/") else path[1:])
        os.makedirs(os.path.dirname(image_path), exist_ok=True)
        with open(image_path, "wb") as f:
            f.write(_from_rootfs(rootfs, path))
        os.chmod(image_path, mode)
    for name in ("bin", "lib", "lib64"):
        os.symlink(f"usr/{name}", os.path.join(root, name))
    os.symlink("dash", os.path.join(root, "usr/bin/sh"))
    write_files(root, {
        "etc/os-release": b"ID=reliability\n",
        "etc/passwd": f"root:x:0:0:root:/root:/bin/sh\nuser:x:{USER_UID}:{USER_UID}::/tmp:/bin/sh\n"
                      "nobody:x:65534:65534::/nonexistent:/bin/sh\n".encode(),
        "etc/group": f"root:x:0:\nuser:x:{USER_UID}:\nnogroup:x:65534:\n".encode(),
    })
    for name in ("tmp", "root", "proc", "dev", "sys"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    return root
