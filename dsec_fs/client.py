"""The SDK client of the node daemon (``dsecfs daemon``): its HTTP API over a unix socket.

    node = Node()                                   # $DSECFS_SOCKET, else /run/dsecfs/daemon.sock
    info = node.mount("base/debian:12", "/mnt/debian", mode="kernel")
    node.status().cache.hits
    node.umount("/mnt/debian")
    node = Node.ensure_running(store="s3://bucket/prefix")   # start a daemon if none answers
    with node.sandbox(base="base/debian:12", workspace="ws/task:1") as sb:   # see sandbox_client.py
        sb.exec(["/bin/sh", "-c", "ls /workspace"]).stdout

Every call is one HTTP request with a JSON body; requests and results are the types of api.py, which the
daemon uses too (fields the daemon adds later are ignored, so an older client keeps working). An error the daemon reports is raised
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
from typing import Any, TypeVar

from . import api
from .api import CacheInfo, LayerStatus, MountInfo, NodeStatus, PrefetchInfo  # noqa: F401 (the SDK's types)
from .errors import ConflictError, UnavailableError
from .files import private_dir
from .sandbox_client import Sandbox, SandboxInfo

# Where a node daemon lives unless told otherwise (lazy_fetch/daemon.py uses these too).
DEFAULT_SOCKET = "/run/dsecfs/daemon.sock"
# On disk, not in /run: a systemd machine's /run is tmpfs, where the kernel refuses the EROFS images of
# kernel-mode mounts (lazy_fetch/layer_mount.py).
DEFAULT_STATE_DIR = "/var/lib/dsecfs/state"
DEFAULT_CACHE_DIR = "/var/cache/dsecfs/chunks"
SOCKET_ENV = "DSECFS_SOCKET"
STATE_DIR_ENV = "DSECFS_STATE_DIR"  # the CLI's --state-dir and --cache-dir read these too
CACHE_DIR_ENV = "DSECFS_CACHE_DIR"
DEFAULT_TIMEOUT = 120.0  # seconds for one call: a mount may wait for a slow store
START_TIMEOUT = 30.0  # seconds for a daemon we started to answer
LOG_TAIL = 4096  # bytes of a failed daemon's log quoted in the error
CONNECT_RETRY_SECONDS = 0.01
T = TypeVar("T")

class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        """Connect; a full listen backlog (EAGAIN: a unix socket never waits for room, whatever the
        timeout) is tried again until the timeout, since the daemon drains it as it accepts."""
        deadline = time.monotonic() + (self.timeout if self.timeout is not None else DEFAULT_TIMEOUT)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self._path)
            except BlockingIOError:
                sock.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(CONNECT_RETRY_SECONDS)
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return


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
        return self.call("GET", "/v1/status", answer=NodeStatus)

    def mounts(self) -> list[MountInfo]:
        return self.call("GET", "/v1/mounts", answer=api.MountList).mounts

    def mount(self, layer: str, mountpoint: str, *, mode: str = "kernel", store: str | None = None,
              prefetch_list: str | None = None, fuse_binding: str | None = None, profile: bool = True,
              name: str | None = None, fill: str | None = None) -> MountInfo:
        """Mount ``layer`` (a ref or a digest) at the existing directory ``mountpoint``. ``store``: the
        store to read it from (default: the daemon's); ``prefetch_list``: a list to fetch in the
        background, instead of the layer's access profile (``profile`` False: neither); ``name``: the
        layer's ref name when ``layer`` is a digest (whose profile to use); ``fill``: none, profile or
        layer (default: the daemon's); ``fuse_binding``: fail (ConflictError) unless the daemon serves
        FUSE with it."""
        body = api.MountRequest(layer=layer, mountpoint=os.path.abspath(mountpoint), mode=mode,
                                store=api.absolute_store(store), fuse_binding=fuse_binding,
                                prefetch=os.path.abspath(prefetch_list) if prefetch_list else None,
                                profile=profile, name=name, fill=fill)
        return self.call("POST", "/v1/mounts", body, answer=MountInfo)

    def umount(self, mountpoint: str, *, lazy: bool = False) -> None:
        """Unmount; a busy mount is UnavailableError (transient) unless ``lazy`` detaches it."""
        self.call("POST", "/v1/umount", api.UmountRequest(os.path.abspath(mountpoint), lazy=lazy), answer=api.UmountInfo)

    def prefetch(self, mountpoint: str, prefetch_list: str) -> PrefetchInfo:
        """Fetch ``prefetch_list`` in the background for the layer mounted at ``mountpoint``."""
        body = api.PrefetchRequest(os.path.abspath(mountpoint), os.path.abspath(prefetch_list))
        return self.call("POST", "/v1/prefetch", body, answer=PrefetchInfo)

    def prefetches(self) -> list[PrefetchInfo]:
        return self.call("GET", "/v1/prefetch", answer=api.PrefetchList).prefetches

    def cache_stats(self) -> CacheInfo:
        return self.call("GET", "/v1/cache", answer=CacheInfo)

    def cache_evict(self, to_bytes: int = 0) -> CacheInfo:
        """Evict least recently used chunks until at most ``to_bytes`` stay cached (disk and memory)."""
        return self.call("POST", "/v1/cache/evict", api.EvictRequest(to_bytes), answer=CacheInfo)

    def metrics_text(self) -> str:
        """The Prometheus exposition text of ``/metrics``."""
        return self.request("GET", "/metrics")

    # -- sandboxes (sandbox_client.py: the Sandbox handle and the result types)

    def sandbox_up(self, base: str | None = None, workspace: str | None = None, toolkit: str | Sequence[str] = (),
                   *, name: str | None = None, store: str | None = None, profile: bool = True,
                   fill: str | None = None) -> SandboxInfo:
        """Start a sandbox of these layers (refs or digests; any may be left out, not all; ``toolkit`` one or
        a list, the first on top) named ``name`` (default: its id). ``store`` must be the daemon's own
        store if given (ConflictError otherwise). ``profile`` False: layers it mounts first do not
        prefetch by their access profiles; ``fill``: none, profile or layer (default: the daemon's)."""
        toolkits = [toolkit] if isinstance(toolkit, str) else list(toolkit)
        body = api.SandboxUpRequest(base=base, workspace=workspace, toolkits=toolkits, name=name,
                                    store=api.absolute_store(store), profile=profile, fill=fill)
        return self.call("POST", "/v1/sandboxes", body, answer=SandboxInfo)

    def sandbox(self, base: str | None = None, workspace: str | None = None, toolkit: str | Sequence[str] = (),
                *, name: str | None = None, store: str | None = None, profile: bool = True,
                fill: str | None = None) -> Sandbox:
        """``sandbox_up``, as a handle to use the sandbox with; a with-block on it ends with ``down()``."""
        info = self.sandbox_up(base, workspace, toolkit, name=name, store=store, profile=profile, fill=fill)
        return Sandbox(self, info.id, info=info)

    def sandboxes(self) -> list[SandboxInfo]:
        return self.call("GET", "/v1/sandboxes", answer=api.SandboxList).sandboxes

    # -- HTTP

    def call(self, method: str, path: str, body: Any = None, *, answer: type[T], timeout: float | None = None) -> T:
        """``request`` with a request type of api.py as the body, the answer decoded as ``answer``."""
        value = self.request(method, path, None if body is None else api.to_builtins(body), timeout=timeout)
        return api.decode(value, answer, where=f"{method} {path} on {self.socket_path}")

    def connect(self, timeout: float | None = None) -> socket.socket:
        """A socket connected to the daemon, for a route that switches protocols (sandbox_client's attach);
        UnavailableError when no daemon answers."""
        connection = _UnixConnection(self.socket_path, self.timeout if timeout is None else timeout)
        try:
            connection.connect()
        except OSError as exc:
            raise _unanswered(exc, self.socket_path) from None
        return connection.sock

    def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> Any:
        """One request to any route of the daemon's API (those other packages add too): the parsed JSON
        answer (the text, for other content types); an error answer raises its DsecError class."""
        connection = _UnixConnection(self.socket_path, self.timeout if timeout is None else timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if payload is not None else {}
        try:
            try:
                connection.request(method, path, body=payload, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon answered before reading it all (503: over its connection cap) and closed
            response = connection.getresponse()
            data = response.read()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise _unanswered(exc, self.socket_path) from None
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
            raise api.error_from_body(value, response.status, f"{method} {path}")
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
                              ("--store", api.absolute_store(store)), ("--fuse-binding", fuse_binding),
                              ("--latency", latency_ms),
                              ("--bandwidth", None if bandwidth_mbps is None else f"{bandwidth_mbps}MB"),
                              ("--fetch-timeout", fetch_timeout)):
            if value is not None:
                args += [option, os.path.abspath(value) if option.endswith("-dir") else str(value)]
        args += list(extra_args)
        if log_file:
            log_dir = os.path.dirname(os.path.abspath(log_file))
            if log_dir == os.path.abspath(state_dir or DEFAULT_STATE_DIR):
                private_dir(log_dir)  # made here first, it is still the daemon's: 0700 (dsec_fs.files)
            else:
                os.makedirs(log_dir, exist_ok=True)
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


def _unanswered(exc: OSError, socket_path: str) -> UnavailableError:
    if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
        return UnavailableError(f"no daemon answers on this socket ({exc.strerror}); start one with `dsecfs daemon`",
                                where=socket_path, transient=True)
    return UnavailableError(f"cannot connect: {exc.strerror or exc}", where=socket_path, transient=True)


def _dsecfs_command() -> list[str]:
    """The ``dsecfs`` command beside this Python (a virtualenv's bin), else on PATH."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("dsecfs", path=search)
    if found is None:
        raise UnavailableError("cannot find the dsecfs command to start a daemon", where=search, transient=False)
    return [found]
