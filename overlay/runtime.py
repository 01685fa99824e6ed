"""The runtime shim: run one command in a root filesystem, isolated, and collect its exit code and output.

``run_in_rootfs(rootfs, argv, ...)`` runs ``argv`` as root (uid 0, gid 0) in ``rootfs`` (usually a
sandbox's OverlayFS stack) with its own pid, mount, ipc and uts namespaces, and a new empty network
namespace (only a loopback interface, down) unless ``network=True``. stdout and stderr are captured
separately (no terminal), the first MAX_OUTPUT bytes of each (``truncated`` says more were written and
dropped; the command is never blocked for it); the exit code passes through, 128 + N for a command killed
by signal N.

Two runtimes:

- ``"runc"`` (default). An OCI bundle (config.json, OCI runtime spec 1.0) is written to a temporary
  directory outside the rootfs, and ``runc run`` runs it in the foreground; ``runc delete --force``
  always follows. The config is close to ``runc spec``: /proc, a tmpfs /dev (runc adds the standard
  nodes and lets only them through the devices cgroup), /dev/pts, /dev/shm, /dev/mqueue, sysfs and
  cgroupfs read-only, runc's masked and read-only paths, ``noNewPrivileges``, and Docker's default
  capabilities (DEFAULT_CAPABILITIES) in the bounding, effective and permitted sets. Limits go to cgroups
  (memory limit, CFS quota over a 100 ms period, pids.max); the container's cgroup is created below
  runc's own, so a limit set on the caller's cgroup still applies. Not set: seccomp, AppArmor/SELinux,
  user namespaces (root in the sandbox is root on the host, held back by the capabilities, the devices
  cgroup and the masked paths). runc's state lives in ``runc_root`` (default: a directory in the
  temporary bundle dir); ``reap_containers`` deletes containers a crashed caller left behind there.
- ``"namespaces"``, for machines without runc. util-linux ``unshare`` makes the namespaces and forks;
  the child is overlay/namespace_child.py run as a program (``python -m overlay.namespace_child``), which reads its
  instructions from a pipe, chroots into the rootfs, mounts /proc, /dev (tmpfs with null, zero, full,
  random, urandom, tty), /dev/pts, /dev/shm and sysfs (read-only) there, applies the binds and the masked
  and read-only paths, sets the hostname, drops capabilities to DEFAULT_CAPABILITIES minus CAP_SYS_CHROOT
  and CAP_MKNOD, sets no_new_privs, and execs the command. What it does not enforce: no cgroups, so no
  CPU quota and no pids limit (RLIMIT_NPROC does not bind uid 0): asking for ``cpus`` or ``pids_limit``
  is an UnsupportedError; ``memory_bytes`` becomes RLIMIT_AS, which limits address space (virtual
  memory), not resident memory, and may stop programs that reserve large address ranges. No devices
  cgroup and no seccomp. It is a chroot, not a pivot_root: the two capabilities it withholds close the
  known ways out (chroot again, make a disk's device node), but this runtime is for development
  machines, not for untrusted code.

Errors: InputError for bad arguments and for a command that cannot be executed (runc's "exec:" failure,
or the namespaces child's execvpe); NotFoundError for a missing rootfs or bind source; UnavailableError
(transient=False) when runc or unshare is missing or the runtime fails to set the sandbox up, with the
runtime's own message; UnsupportedError for a limit the runtime cannot enforce.

Threads: run_in_rootfs keeps no shared state; any number of threads may run commands at once (each has
its own bundle, container id and pipes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dsec_fs.errors import DsecError, InputError, NotFoundError, UnavailableError, UnsupportedError

RUNTIMES = ("runc", "namespaces")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_HOSTNAME = "sandbox"
CPU_PERIOD_US = 100_000
SIGNAL_EXIT_BASE = 128  # a command killed by signal N exits 128 + N, as shells and runc report it
# Bytes of each of a command's streams kept (RunResult.truncated past it). Its output was gathered whole in
# the caller's memory, which is the daemon's for a sandbox's exec (then 4/3 of it again as base64 in the
# answer): a sandbox's process writing without end took the daemon to the OOM killer. Output meant to be
# big goes through attach (overlay/attach.py), which streams it; 4 MiB is far more than a command's answer
# needs. What all of a node's execs keep at once is bounded too (``output_share``, overlay/output_budget.py).
MAX_OUTPUT = 4 << 20
OUTPUT_READ = 64 << 10  # bytes read from (or written to) a command's pipe at once

# Docker's default capability set (linux/capability.h numbers).
DEFAULT_CAPABILITIES = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6,
    "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_RAW": 13, "CAP_SYS_CHROOT": 18,
    "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31,
}
# Without runc's devices cgroup and pivot_root, these two are ways out of a chroot.
NAMESPACES_WITHHELD = ("CAP_SYS_CHROOT", "CAP_MKNOD")

# runc spec's defaults: hidden (an empty read-only tmpfs on a directory, /dev/null on a file) ...
MASKED_PATHS = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware")
# ... and read-only.
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,62})")


class Bind(NamedTuple):
    """A host path made visible in the sandbox; plain (source, destination, readonly) tuples work too."""

    source: str  # on the host
    destination: str  # absolute, inside the sandbox
    readonly: bool = True


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # the command's status; 128 + N if signal N killed it (137 after a timeout)
    stdout: bytes
    stderr: bytes
    timed_out: bool = False  # ``timeout`` passed and the sandbox's processes were killed
    # stdout or stderr passed MAX_OUTPUT bytes, or what the options' output_share granted: each holds its first
    # bytes, the rest was dropped
    truncated: bool = False


@dataclass(frozen=True)
class RunOptions:
    """What run_in_rootfs takes besides rootfs and argv; checked by ``checked()``."""

    env: Mapping[str, str] | None = None  # added to PATH=DEFAULT_PATH and HOME=/root, may override them
    cwd: str = "/"
    hostname: str = DEFAULT_HOSTNAME
    network: bool = False  # True: share the host's network namespace
    memory_bytes: int | None = None
    cpus: float | None = None  # CPU time per wall second, e.g. 0.5 or 2
    pids_limit: int | None = None
    readonly_paths: Sequence[str] = ()  # sandbox paths made read-only, besides READONLY_PATHS
    extra_binds: Sequence[Bind | tuple[str, str, bool]] = ()
    stdin: bytes | None = None  # None: /dev/null
    timeout: float | None = None  # seconds
    # keep(n) -> bytes of n output bytes that may be kept (OutputBudget.share: a node's bound over all its
    # commands); None: MAX_OUTPUT per stream alone
    output_share: Callable[[int], int] | None = None

    def checked(self) -> "RunOptions":
        """These options with binds as Bind tuples and sources absolute; InputError/NotFoundError if unusable."""
        where = "run options"
        env = dict(self.env or {})
        for name, value in env.items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise InputError(f"bad environment variable name {name!r}", where=where)
            if not isinstance(value, str) or "\0" in value:
                raise InputError(f"environment variable {name} must be a string without NUL", where=where)
        for path in (self.cwd, *self.readonly_paths):
            _check_sandbox_path(path, where)
        if not _HOSTNAME.fullmatch(self.hostname):
            raise InputError(f"bad hostname {self.hostname!r}", where=where)
        for name in ("memory_bytes", "cpus", "pids_limit", "timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise InputError(f"{name} must be a positive number, not {value!r}", where=where)
        binds = []
        for bind in self.extra_binds:
            source, destination, readonly = Bind(*bind)
            source = os.path.abspath(source)
            if not os.path.exists(source):
                raise NotFoundError("bind source does not exist", where=source)
            _check_sandbox_path(destination, where)
            binds.append(Bind(source, destination, bool(readonly)))
        return dataclasses.replace(self, env=env, readonly_paths=tuple(self.readonly_paths), extra_binds=tuple(binds))

    def environment(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, "HOME": "/root", **(self.env or {})}


def run_in_rootfs(rootfs: str | os.PathLike, argv: Sequence[str], *, runtime: str = "runc",
                  runc_root: str | None = None, env: Mapping[str, str] | None = None, cwd: str = "/",
                  hostname: str = DEFAULT_HOSTNAME, network: bool = False, memory_bytes: int | None = None,
                  cpus: float | None = None, pids_limit: int | None = None, readonly_paths: Sequence[str] = (),
                  extra_binds: Sequence[Bind | tuple[str, str, bool]] = (), stdin: bytes | None = None,
                  timeout: float | None = None, output_share: Callable[[int], int] | None = None) -> RunResult:
    """Run ``argv`` (argv[0] looked up in the sandbox's PATH) in ``rootfs``; see the module docstring."""
    rootfs, argv = checked_command(rootfs, argv)
    options = RunOptions(env=env, cwd=cwd, hostname=hostname, network=network, memory_bytes=memory_bytes,
                         cpus=cpus, pids_limit=pids_limit, readonly_paths=readonly_paths,
                         extra_binds=extra_binds, stdin=stdin, timeout=timeout, output_share=output_share).checked()
    if runtime == "runc":
        return _run_runc(rootfs, argv, options, runc_root)
    if runtime == "namespaces":
        return _run_namespaces(rootfs, argv, options)
    raise InputError(f"unknown runtime {runtime!r}, expected one of {', '.join(RUNTIMES)}", where=rootfs)


def checked_command(rootfs: str | os.PathLike, argv: Sequence[str]) -> tuple[str, list[str]]:
    """``rootfs`` made absolute and ``argv`` as a list; NotFoundError/InputError if they cannot be run."""
    rootfs = os.path.abspath(os.fsdecode(rootfs))
    if not os.path.isdir(rootfs):
        raise NotFoundError("root filesystem does not exist or is not a directory", where=rootfs)
    argv = list(argv)
    if not argv or not all(isinstance(arg, str) and "\0" not in arg for arg in argv):
        raise InputError(f"argv must be a non-empty list of strings without NUL, not {argv!r}", where=rootfs)
    return rootfs, argv


def exit_code(returncode: int) -> int:
    """A process's exit code as shells and runc report it: 128 + N for a process killed by signal N."""
    return SIGNAL_EXIT_BASE - returncode if returncode < 0 else returncode


def _check_sandbox_path(path: str, where: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InputError(f"a path in the sandbox must be absolute: {path!r}", where=where)


def _require(program: str, runtime: str) -> str:
    path = shutil.which(program)
    if path is None:
        hint = (" (apt-get install runc, or use the namespaces runtime: `dsecfs sandbox exec --runtime namespaces`, "
                "runtime=\"namespaces\" in the SDK)") if runtime == "runc" else ""
        raise UnavailableError(f"{program} is not installed or not on PATH{hint}", where=f"runtime {runtime}",
                               transient=False)
    return path


def _communicate(process: subprocess.Popen, options: RunOptions, stop: Callable[[], None]) -> RunResult:
    """Feed stdin and collect output, the first MAX_OUTPUT bytes of each stream, as far as the options'
    ``output_share`` grants them (the rest is read and dropped, so the command is not blocked on a full
    pipe); after ``timeout``, ``stop()`` kills the sandbox, and what it wrote is kept."""
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    stdout, stderr = bytearray(), bytearray()
    kept = {process.stdout.fileno(): stdout, process.stderr.fileno(): stderr}
    stdin = memoryview(options.stdin or b"")
    timed_out = truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        if process.stdin is not None:
            if stdin:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                process.stdin.close()
        while selector.get_map():
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                stop()
                timed_out, deadline = True, None
                if process.stdin is not None and not process.stdin.closed:
                    with contextlib.suppress(KeyError):
                        selector.unregister(process.stdin.fileno())
                    process.stdin.close()
                continue
            for key, _events in selector.select(wait):
                if key.fd in kept:
                    data = os.read(key.fd, OUTPUT_READ)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    buffer = kept[key.fd]
                    room = min(len(data), MAX_OUTPUT - len(buffer))
                    if room and options.output_share is not None:
                        room = options.output_share(room)
                    buffer += data[:room]
                    truncated = truncated or len(data) > room
                    continue
                try:
                    stdin = stdin[os.write(key.fd, stdin[:OUTPUT_READ]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # the command closed its stdin, or ended
                    stdin = stdin[:0]
                if not stdin:
                    selector.unregister(key.fd)
                    process.stdin.close()
    while True:  # the output ended; the command may still run (it closed its stdout and stderr)
        try:
            process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            stop()
            timed_out, deadline = True, None
    process.stdout.close()
    process.stderr.close()
    returncode = -signal.SIGKILL if timed_out else process.returncode
    return RunResult(exit_code=exit_code(returncode), stdout=bytes(stdout), stderr=bytes(stderr),
                     timed_out=timed_out, truncated=truncated)


# --- runc -------------------------------------------------------------------------------------------------

def oci_config(rootfs: str, argv: Sequence[str], options: RunOptions,
               terminal: tuple[int, int] | None = None) -> dict:
    """The OCI runtime spec (1.0) config.json of one run (``options`` as returned by RunOptions.checked);
    ``terminal``: (rows, columns) of the terminal runc gives the command (0, 0: its default size)."""
    capabilities = sorted(DEFAULT_CAPABILITIES)
    mounts_ = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]
    for bind in options.extra_binds:
        mounts_.append({"destination": bind.destination, "type": "bind", "source": bind.source,
                        "options": ["rbind", "nosuid", "nodev", "ro" if bind.readonly else "rw"]})
    namespaces = ["pid", "mount", "ipc", "uts"] + ([] if options.network else ["network"])
    resources: dict = {"devices": [{"allow": False, "access": "rwm"}]}  # runc allows its standard nodes
    if options.memory_bytes is not None:
        resources["memory"] = {"limit": int(options.memory_bytes)}
    if options.cpus is not None:
        resources["cpu"] = {"quota": max(1000, round(options.cpus * CPU_PERIOD_US)), "period": CPU_PERIOD_US}
    if options.pids_limit is not None:
        resources["pids"] = {"limit": int(options.pids_limit)}
    process: dict = {"terminal": terminal is not None}
    if terminal is not None and all(terminal):
        process["consoleSize"] = {"height": terminal[0], "width": terminal[1]}
    return {
        "ociVersion": "1.0.2",
        "process": {
            **process,
            "user": {"uid": 0, "gid": 0},
            "args": list(argv),
            "env": [f"{name}={value}" for name, value in options.environment().items()],
            "cwd": options.cwd,
            "capabilities": {kind: capabilities for kind in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": options.hostname,
        "mounts": mounts_,
        "linux": {
            "namespaces": [{"type": kind} for kind in namespaces],
            "resources": resources,
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS) + list(options.readonly_paths),
        },
    }


@dataclass(frozen=True)
class RuncContainer:
    """One container's bundle (config.json, runc's log) in a temporary directory, and the runc commands
    for it; ``remove()`` deletes the bundle (after ``delete_command`` ran)."""

    runc: str
    bundle: str
    state_root: str
    id: str

    @classmethod
    def create(cls, rootfs: str, argv: Sequence[str], options: RunOptions, runc_root: str | None, *,
               terminal: tuple[int, int] | None = None) -> "RuncContainer":
        runc = _require("runc", "runc")
        bundle = tempfile.mkdtemp(prefix="dsecfs-run-")
        container = cls(runc, bundle, os.path.abspath(runc_root) if runc_root else os.path.join(bundle, "state"),
                        "dsecfs-" + secrets.token_hex(8))
        try:
            with open(os.path.join(bundle, "config.json"), "w") as f:
                json.dump(oci_config(rootfs, argv, options, terminal), f)
        except BaseException:
            container.remove()
            raise
        return container

    def run_command(self) -> list[str]:
        """``runc run`` in the foreground: it exits with the command's status, 128 + N after signal N."""
        return [self.runc, "--root", self.state_root, "--log", os.path.join(self.bundle, "runc.log"),
                "--log-format", "json", "run", "--bundle", self.bundle, self.id]

    def delete_command(self) -> list[str]:
        """Kill whatever still runs in the container and remove its state and cgroups."""
        return [self.runc, "--root", self.state_root, "delete", "--force", self.id]

    def failure(self, argv: Sequence[str], rootfs: str) -> DsecError | None:
        """The error runc logged when it could not start the command, or None."""
        failure = _runc_error(os.path.join(self.bundle, "runc.log"))
        if failure is None:
            return None
        where = f"runc container {self.id} in {rootfs}"
        if "unable to start container process: exec:" in failure:
            return InputError(f"cannot execute {argv[0]!r}: {failure}", where=where)
        return UnavailableError(failure, where=where, transient=False)

    def remove(self) -> None:
        shutil.rmtree(self.bundle, ignore_errors=True)


def _run_runc(rootfs: str, argv: list[str], options: RunOptions, runc_root: str | None) -> RunResult:
    container = RuncContainer.create(rootfs, argv, options, runc_root)

    def delete() -> None:
        subprocess.run(container.delete_command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    try:
        process = subprocess.Popen(
            container.run_command(), stdin=subprocess.DEVNULL if options.stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        # A killed `runc run` leaves the container running (and holding our pipes): delete it first.
        result = _communicate(process, options, stop=lambda: (delete(), process.kill()))
        failure = None if result.timed_out else container.failure(argv, rootfs)
        if failure is not None:
            raise failure
        return result
    finally:
        delete()
        container.remove()


def _runc_error(log_path: str) -> str | None:
    """The error runc logged (it failed to create or start the container), or None."""
    errors = []
    try:
        with open(log_path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("level") in ("error", "fatal"):
                    errors.append(str(entry.get("msg", "")))
    except FileNotFoundError:
        return None
    return "; ".join(errors) or None


def reap_containers(runc_root: str) -> list[str]:
    """Delete (killing their processes) every container in ``runc_root``: what a crashed caller left behind.

    Only for a state root no live caller is using. Returns the container ids deleted.
    """
    runc = shutil.which("runc")
    if runc is None or not os.path.isdir(runc_root):
        return []
    ids = [entry["id"] for entry in _list_containers(runc, runc_root)]
    for container in ids:
        subprocess.run([runc, "--root", runc_root, "delete", "--force", container], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ids


@contextlib.contextmanager
def containers_frozen(runc_root: str, rootfs: str) -> Iterator[list[str]]:
    """Freeze (``runc pause``: the cgroup freezer) every running container of ``runc_root`` whose root is
    ``rootfs`` for the duration of the block, and thaw them after; yields their ids.

    A container started meanwhile, and commands of the namespaces runtime (no cgroup), are not frozen:
    this keeps processes from changing the tree while it is read, it is not what makes reading it safe.
    """
    runc = shutil.which("runc")
    if runc is None or not os.path.isdir(runc_root):
        yield []
        return
    frozen = []
    try:
        for entry in _list_containers(runc, runc_root):
            if entry.get("status") != "running" or _container_root(entry.get("bundle", "")) != rootfs:
                continue
            paused = subprocess.run([runc, "--root", runc_root, "pause", entry["id"]], stdin=subprocess.DEVNULL,
                                    capture_output=True)
            if paused.returncode == 0:  # else it ended meanwhile
                frozen.append(entry["id"])
        yield frozen
    finally:
        for container in frozen:
            subprocess.run([runc, "--root", runc_root, "resume", container], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _list_containers(runc: str, runc_root: str) -> list[dict]:
    listed = subprocess.run([runc, "--root", runc_root, "list", "--format", "json"], stdin=subprocess.DEVNULL,
                            capture_output=True)
    if listed.returncode != 0:
        raise UnavailableError(f"runc list failed: {listed.stderr.decode(errors='replace').strip()}",
                               where=runc_root, transient=False)
    return json.loads(listed.stdout or b"null") or []


def _container_root(bundle: str) -> str | None:
    """The root path of the container whose bundle (written by _run_runc) is ``bundle``."""
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            return json.load(f)["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the run ended and its bundle is gone


# --- namespaces -------------------------------------------------------------------------------------------

CHILD_STARTED = b"+"  # the first byte the child (namespace_child.py) writes on its report pipe


def _run_namespaces(rootfs: str, argv: list[str], options: RunOptions) -> RunResult:
    for limit in ("cpus", "pids_limit"):
        if getattr(options, limit) is not None:
            raise UnsupportedError(f"{limit} needs cgroups: use runtime='runc'", where="runtime namespaces")
    unshare = _require("unshare", "namespaces")
    todo = json.dumps({
        "rootfs": rootfs, "argv": argv, "env": options.environment(), "cwd": options.cwd,
        "hostname": options.hostname, "memory_bytes": options.memory_bytes,
        "readonly_paths": list(READONLY_PATHS) + list(options.readonly_paths),
        "binds": [list(bind) for bind in options.extra_binds],
    }).encode()
    command = [unshare, "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--ipc", "--uts"]
    if not options.network:
        command.append("--net")
    project_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    todo_r, todo_w = os.pipe()
    report_r, report_w = os.pipe()
    with open(todo_w, "wb") as to_child, open(report_r, "rb") as from_child:
        try:
            process = subprocess.Popen(
                command + ["--", sys.executable, "-s", "-m", "overlay.namespace_child", str(todo_r), str(report_w)],
                stdin=subprocess.DEVNULL if options.stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(todo_r, report_w),
                env={"PATH": os.environ.get("PATH", DEFAULT_PATH), "PYTHONPATH": project_root},
                start_new_session=True)
        finally:
            os.close(todo_r)
            os.close(report_w)
        try:
            to_child.write(todo)
            to_child.close()
        except BrokenPipeError:
            pass  # the child is gone already; the report and the status say why
        # unshare --kill-child takes the whole pid namespace down with it.
        result = _communicate(process, options, stop=process.kill)
        report = from_child.read()
    where = f"runtime namespaces in {rootfs}"
    if not report.startswith(CHILD_STARTED) and not result.timed_out:
        raise UnavailableError(f"unshare failed: {result.stderr.decode(errors='replace').strip()}", where=where,
                               transient=False)
    if report[len(CHILD_STARTED):]:
        failure = json.loads(report[len(CHILD_STARTED):])
        if failure["stage"] == "exec":
            raise InputError(f"cannot execute {argv[0]!r}: {failure['message']}", where=where)
        raise UnavailableError(f"sandbox setup failed: {failure['message']}", where=where, transient=False)
    return result
