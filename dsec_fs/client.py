"""The SDK client of the node daemon (``dsecfs daemon``): its HTTP API over a unix socket, standard library only.

    node = Node()                                   # $DSECFS_SOCKET, else /run/dsecfs/daemon.sock
    info = node.mount("base/debian:12", "/mnt/debian", mode="kernel")
    node.status().cache.hits
    node.umount("/mnt/debian")
    node = Node.ensure_running(store="s3://bucket/prefix")   # start a daemon if none answers
    with node.sandbox(base="base/debian:12", workspace="ws/task:1") as sb:   # see sandbox_client.py
        sb.exec(["/bin/sh", "-c", "ls /workspace"]).stdout

Every call is one HTTP request with a JSON body; results come back as the dataclasses below (fields the
daemon adds later are ignored, so an older client keeps working). An error the daemon reports is raised
again as the DsecError class of its kind (the classes the CLI maps to exit codes), with the daemon's
message and where; a daemon that does not answer is UnavailableError naming the socket. Paths (mount
points, local stores, prefetch lists) are made absolute here, since the daemon's working directory is
not the caller's.

``Node.start_daemon`` spawns ``dsecfs daemon`` (the command installed beside this Python, else on PATH)
and waits until its socket answers; ``ensure_running`` does that only when nothing answers yet.

Threads: a Node opens a connection per call and keeps no other state, so any thread may use it.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .errors import (
    ConflictError,
    CorruptError,
    DsecError,
    InputError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from .sandbox_client import Sandbox, SandboxInfo

# Where a node daemon lives unless told otherwise (lazy_fetch/daemon.py uses these too).
DEFAULT_SOCKET = "/run/dsecfs/daemon.sock"
DEFAULT_STATE_DIR = "/run/dsecfs/state"
DEFAULT_CACHE_DIR = "/var/cache/dsecfs/chunks"
SOCKET_ENV = "DSECFS_SOCKET"
STATE_DIR_ENV = "DSECFS_STATE_DIR"  # the CLI's --state-dir and --cache-dir read these too
CACHE_DIR_ENV = "DSECFS_CACHE_DIR"
DEFAULT_TIMEOUT = 120.0  # seconds for one call: a mount may wait for a slow store
START_TIMEOUT = 30.0  # seconds for a daemon we started to answer
LOG_TAIL = 4096  # bytes of a failed daemon's log quoted in the error

_ERROR_CLASSES: dict[str, type[DsecError]] = {
    cls.kind: cls for cls in (InputError, NotFoundError, ConflictError, UnsupportedError, UnavailableError,
                              CorruptError)
}


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    mode: str  # kernel | fuse
    layer: str  # layer digest
    ref: str = ""  # how the mount named the layer (a ref or the digest)
    store: str = ""
    blob_id: str = ""
    trace: str = ""  # the mount's access trace file ("" when tracing is off)
    prefetch: str = ""  # the prefetch list it was mounted with, if any
    created: str = ""
    chunks: int = 0  # distinct chunks of the layer
    data_bytes: int = 0  # their bytes


@dataclass(frozen=True)
class LayerStatus:
    layer: str
    mounts: int = 0
    data_bytes: int = 0
    used_bytes: int = 0  # of data_bytes, bytes served to readers since the daemon started
    fetched_ratio: float = 0.0  # used_bytes / data_bytes
    reads: int = 0
    read_errors: int = 0
    chunks_fetched: int = 0  # from the store
    bytes_fetched: int = 0
    cache_hits: int = 0  # chunk lookups the disk cache answered
    cache_misses: int = 0
    fetch_errors: int = 0
    corrupt: int = 0
    timeouts: int = 0


@dataclass(frozen=True)
class PrefetchInfo:
    layer: str
    list: str
    chunks: int = 0
    bytes: int = 0
    state: str = ""  # running | done | cancelled | failed
    done_chunks: int = 0
    done_bytes: int = 0
    failed_chunks: int = 0
    started: str = ""
    finished: str = ""


@dataclass(frozen=True)
class CacheInfo:
    directory: str = ""
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rotten: int = 0
    reconciled: int = 0
    memory_entries: int = 0
    memory_bytes: int = 0
    memory_max_bytes: int = 0
    memory_hits: int = 0
    memory_misses: int = 0
    evicted: int = 0  # chunks the call that returned this evicted (cache_evict)


@dataclass(frozen=True)
class NodeStatus:
    pid: int
    version: str = ""
    started: str = ""
    socket: str = ""
    state_dir: str = ""
    cache_dir: str = ""
    store: str = ""  # the daemon's default store
    fuse_binding: str = ""
    mounts: list[MountInfo] = field(default_factory=list)
    layers: list[LayerStatus] = field(default_factory=list)
    prefetches: list[PrefetchInfo] = field(default_factory=list)
    cache: CacheInfo = field(default_factory=CacheInfo)
    cleaned: list[str] = field(default_factory=list)  # stale mountpoints detached when the daemon started


def _typed(cls, obj: dict):
    """``cls`` from a JSON object, ignoring fields this client does not know."""
    if not isinstance(obj, dict):
        raise UnavailableError(f"the daemon answered {type(obj).__name__} where an object was expected",
                               where=cls.__name__, transient=False)
    names = {f.name for f in fields(cls)}
    return cls(**{name: value for name, value in obj.items() if name in names})


def _status(obj: dict) -> NodeStatus:
    status = _typed(NodeStatus, obj)
    return NodeStatus(**{
        **{f.name: getattr(status, f.name) for f in fields(NodeStatus)},
        "mounts": [_typed(MountInfo, m) for m in status.mounts],
        "layers": [_typed(LayerStatus, layer) for layer in status.layers],
        "prefetches": [_typed(PrefetchInfo, p) for p in status.prefetches],
        "cache": _typed(CacheInfo, status.cache) if isinstance(status.cache, dict) else status.cache,
    })


def _absolute_store(url: str | None) -> str | None:
    return url if url is None or "://" in url else os.path.abspath(url)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Node:
    """A node daemon, reached through its socket."""

    def __init__(self, socket_path: str | None = None, *, timeout: float = DEFAULT_TIMEOUT):
        self.socket_path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Node({self.socket_path!r})"

    # -- the API

    def ping(self) -> bool:
        """Whether a daemon answers on the socket."""
        try:
            self.request("GET", "/v1/status", timeout=5.0)
        except UnavailableError:
            return False
        return True

    def status(self) -> NodeStatus:
        return _status(self.request("GET", "/v1/status"))

    def mounts(self) -> list[MountInfo]:
        return [_typed(MountInfo, m) for m in self.request("GET", "/v1/mounts")["mounts"]]

    def mount(self, layer: str, mountpoint: str, *, mode: str = "kernel", store: str | None = None,
              prefetch_list: str | None = None, fuse_binding: str | None = None) -> MountInfo:
        """Mount ``layer`` (a ref or a digest) at the existing directory ``mountpoint``. ``store``: the
        store to read it from (default: the daemon's); ``prefetch_list``: a list to fetch in the
        background; ``fuse_binding``: fail (ConflictError) unless the daemon serves FUSE with it."""
        body = {"layer": layer, "mountpoint": os.path.abspath(mountpoint), "mode": mode,
                "store": _absolute_store(store), "fuse_binding": fuse_binding,
                "prefetch": os.path.abspath(prefetch_list) if prefetch_list else None}
        return _typed(MountInfo, self.request("POST", "/v1/mounts", body))

    def umount(self, mountpoint: str, *, lazy: bool = False) -> None:
        """Unmount; a busy mount is UnavailableError (transient) unless ``lazy`` detaches it."""
        self.request("POST", "/v1/umount", {"mountpoint": os.path.abspath(mountpoint), "lazy": lazy})

    def prefetch(self, mountpoint: str, prefetch_list: str) -> PrefetchInfo:
        """Fetch ``prefetch_list`` in the background for the layer mounted at ``mountpoint``."""
        body = {"mountpoint": os.path.abspath(mountpoint), "list": os.path.abspath(prefetch_list)}
        return _typed(PrefetchInfo, self.request("POST", "/v1/prefetch", body))

    def prefetches(self) -> list[PrefetchInfo]:
        return [_typed(PrefetchInfo, p) for p in self.request("GET", "/v1/prefetch")["prefetches"]]

    def cache_stats(self) -> CacheInfo:
        return _typed(CacheInfo, self.request("GET", "/v1/cache"))

    def cache_evict(self, to_bytes: int = 0) -> CacheInfo:
        """Evict least recently used chunks until at most ``to_bytes`` stay cached (disk and memory)."""
        return _typed(CacheInfo, self.request("POST", "/v1/cache/evict", {"to": to_bytes}))

    def metrics_text(self) -> str:
        """The Prometheus exposition text of ``/metrics``."""
        return self.request("GET", "/metrics")

    # -- sandboxes (sandbox_client.py: the Sandbox handle and the result types; imported here when used,
    # since it imports this module)

    def sandbox_up(self, base: str | None = None, workspace: str | None = None, toolkit: str | Sequence[str] = (),
                   *, name: str | None = None, store: str | None = None) -> SandboxInfo:
        """Start a sandbox of these layers (refs or digests; any may be left out, not all; ``toolkit`` one or
        a list, the first on top) named ``name`` (default: its id). ``store`` must be the daemon's own
        store if given (ConflictError otherwise)."""
        from .sandbox_client import SandboxInfo

        toolkits = [toolkit] if isinstance(toolkit, str) else list(toolkit)
        body = {"base": base, "workspace": workspace, "toolkits": toolkits, "name": name,
                "store": _absolute_store(store)}
        return SandboxInfo.from_json(self.request("POST", "/v1/sandboxes", body))

    def sandbox(self, base: str | None = None, workspace: str | None = None, toolkit: str | Sequence[str] = (),
                *, name: str | None = None, store: str | None = None) -> Sandbox:
        """``sandbox_up``, as a handle to use the sandbox with; a with-block on it ends with ``down()``."""
        from .sandbox_client import Sandbox

        info = self.sandbox_up(base, workspace, toolkit, name=name, store=store)
        return Sandbox(self, info.id, info=info)

    def sandboxes(self) -> list[SandboxInfo]:
        from .sandbox_client import SandboxInfo

        return [SandboxInfo.from_json(s) for s in self.request("GET", "/v1/sandboxes")["sandboxes"]]

    # -- HTTP

    def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> Any:
        """One request to any route of the daemon's API (those other packages add too): the parsed JSON
        answer (the text, for other content types); an error answer raises its DsecError class."""
        connection = _UnixConnection(self.socket_path, self.timeout if timeout is None else timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if payload is not None else {}
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise UnavailableError(f"no daemon answers on this socket ({exc.strerror}); start one with "
                                   "`dsecfs daemon`", where=self.socket_path, transient=True) from None
        except (OSError, http.client.HTTPException) as exc:
            raise UnavailableError(f"{method} {path} failed: {exc or type(exc).__name__}", where=self.socket_path,
                                   transient=True) from None
        finally:
            connection.close()
        is_json = response.getheader("content-type", "").startswith("application/json")
        try:
            value = json.loads(data) if is_json else data.decode()
        except (ValueError, UnicodeDecodeError) as exc:
            raise UnavailableError(f"{method} {path}: the daemon answered HTTP {response.status} that is not "
                                   f"valid: {exc}", where=self.socket_path, transient=False) from None
        if response.status >= 400:
            raise _error(value, response.status, f"{method} {path}")
        return value

    # -- starting a daemon

    @staticmethod
    def start_daemon(socket_path: str | None = None, *, state_dir: str | None = None, cache_dir: str | None = None,
                     cache_size: str | None = None, store: str | None = None, fuse_binding: str | None = None,
                     latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                     fetch_timeout: float | None = None, log_file: str | None = None,
                     extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                     command: Sequence[str] | None = None, wait: float = START_TIMEOUT) -> DaemonProcess:
        """Spawn ``dsecfs daemon`` in a session of its own (it outlives the caller) and return once its
        socket answers. Its output goes to ``log_file`` (appended; none when not given). A daemon that
        exits or does not answer within ``wait`` seconds is stopped and UnavailableError raised, quoting
        the end of its log."""
        socket_path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        args = [*(command or _dsecfs_command()), "daemon", "--socket", socket_path]
        for option, value in (("--state-dir", state_dir), ("--cache-dir", cache_dir), ("--cache-size", cache_size),
                              ("--store", _absolute_store(store)), ("--fuse-binding", fuse_binding),
                              ("--latency", latency_ms),
                              ("--bandwidth", None if bandwidth_mbps is None else f"{bandwidth_mbps}MB"),
                              ("--fetch-timeout", fetch_timeout)):
            if value is not None:
                args += [option, os.path.abspath(value) if option.endswith("-dir") else str(value)]
        args += list(extra_args)
        if log_file:
            os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
            output = open(log_file, "ab")
        else:
            output = subprocess.DEVNULL
        try:
            process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        finally:
            if output is not subprocess.DEVNULL:
                output.close()
        daemon = DaemonProcess(process, Node(socket_path), log_file)
        daemon.wait_until_answering(wait)
        return daemon

    @classmethod
    def ensure_running(cls, socket_path: str | None = None, **start_options) -> Node:
        """A Node whose daemon answers: the one on the socket, else one started with ``start_options``
        (those of ``start_daemon``; ``state_dir`` and ``cache_dir`` default to $DSECFS_STATE_DIR and
        $DSECFS_CACHE_DIR, ``log_file`` to daemon.log in its state directory)."""
        node = cls(socket_path)
        if node.ping():
            return node
        for option, env in (("state_dir", STATE_DIR_ENV), ("cache_dir", CACHE_DIR_ENV)):
            if not start_options.get(option) and os.environ.get(env):
                start_options[option] = os.environ[env]
        start_options.setdefault("log_file", os.path.join(start_options.get("state_dir") or DEFAULT_STATE_DIR,
                                                          "daemon.log"))
        try:
            cls.start_daemon(node.socket_path, **start_options)
        except (UnavailableError, ConflictError):
            if not node.ping():  # another caller may have started one at the same time
                raise
        return node


class DaemonProcess:
    """A daemon this process started (Node.start_daemon)."""

    def __init__(self, process: subprocess.Popen, node: Node, log_file: str | None):
        self.process = process
        self.node = node
        self.log_file = log_file

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_until_answering(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.node.ping():
            if not self.alive():
                raise UnavailableError(f"the daemon exited with status {self.process.returncode} before answering"
                                       f"{self._log_tail()}", where=self.node.socket_path, transient=False)
            if time.monotonic() > deadline:
                self.kill()
                raise UnavailableError(f"the daemon did not answer within {timeout:g} s{self._log_tail()}",
                                       where=self.node.socket_path, transient=True)
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a clean shutdown: everything unmounted), then SIGKILL after ``timeout`` seconds;
        returns the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.wait()

    def kill(self) -> int:
        """SIGKILL, as a crash would; its mounts stay behind until the next daemon cleans them."""
        if self.alive():
            self.process.kill()
        return self.process.wait()

    def _log_tail(self) -> str:
        if not self.log_file:
            return ""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_file) - LOG_TAIL))
                return "; its log ends:\n" + f.read().decode(errors="replace")
        except OSError:
            return ""


def _error(value: Any, status: int, request: str) -> DsecError:
    """The DsecError a daemon's error answer stands for."""
    if not isinstance(value, dict):
        return UnavailableError(f"{request}: HTTP {status}: {str(value)[:200]}", where="daemon", transient=False)
    kind, message, where = value.get("error"), str(value.get("message", "")), value.get("where")
    cls = _ERROR_CLASSES.get(kind)
    if cls is UnavailableError:
        return UnavailableError(message, where=where, transient=bool(value.get("transient", True)))
    if cls is None:
        return DsecError(f"{message} (daemon error {kind!r}, HTTP {status})", where=where)
    return cls(message, where=where)


def _dsecfs_command() -> list[str]:
    """The ``dsecfs`` command beside this Python (a virtualenv's bin), else on PATH."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("dsecfs", path=search)
    if found is None:
        raise UnavailableError("cannot find the dsecfs command to start a daemon", where=search, transient=False)
    return [found]
