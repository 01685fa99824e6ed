"""The SDK client of the node daemon (dsec_fs/client.py).

The first tests run the daemon's HTTP server (lazy_fetch/http_api.py) in this process, on a trio loop in a
thread, with routes of their own: how errors travel, the route table other packages extend, the socket's
permissions, bad requests. The last ones start real ``dsecfs daemon`` processes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time

import pytest
import trio

from dsec_fs.client import CacheInfo, MountInfo, Node, NodeStatus
from dsec_fs.errors import (
    ConflictError,
    CorruptError,
    DsecError,
    InputError,
    IntegrityError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from lazy_fetch.http_api import MAX_BODY, HttpApi, Request, Response

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")


@pytest.fixture
def socket_dir():
    """A short directory for sockets (a unix socket path holds at most 107 bytes)."""
    path = tempfile.mkdtemp(prefix="dsc-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def serving(api: HttpApi, socket_path: str):
    """Serve ``api`` on ``socket_path`` from a trio loop in a thread, for the duration of the block."""
    ready = threading.Event()
    state: dict = {}

    async def main():
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(api.serve, socket_path)
                state["token"], state["scope"] = trio.lowlevel.current_trio_token(), nursery.cancel_scope
                ready.set()
        except ExceptionGroup as group:  # the error goes to the test's thread
            state["error"], = group.exceptions

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not ready.is_set() and "error" not in state and time.monotonic() < deadline:
        time.sleep(0.01)
    if "error" in state:
        thread.join()
        raise state["error"]
    try:
        yield Node(socket_path)
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join()


def _raiser(exc: Exception):
    async def handler(request: Request):
        raise exc

    return handler


def test_daemon_errors_come_back_as_their_own_class(socket_dir):
    api = HttpApi()
    errors = [InputError("bad size", where="request body"), NotFoundError("no such ref", where="ref a:b"),
              ConflictError("taken", where="/mnt"), UnsupportedError("no", where="feature x"),
              IntegrityError("sha256 mismatch", where="chunk ab"),
              UnavailableError("slow store", where="s3://b", transient=True),
              UnavailableError("no bucket", where="s3://b", transient=False)]
    for number, exc in enumerate(errors):
        api.route("GET", f"/fail/{number}", _raiser(exc))
    api.route("GET", "/bug", _raiser(ZeroDivisionError("oops")))
    with serving(api, os.path.join(socket_dir, "api.sock")) as node:
        for number, exc in enumerate(errors):
            expected = CorruptError if isinstance(exc, CorruptError) else type(exc)
            with pytest.raises(expected) as info:
                node.request("GET", f"/fail/{number}")
            assert type(info.value) is expected
            assert (info.value.message, info.value.where) == (exc.message, exc.where)
            if isinstance(exc, UnavailableError):
                assert info.value.transient == exc.transient
        with pytest.raises(DsecError, match="internal error") as info:
            node.request("GET", "/bug")
        assert type(info.value) is DsecError
        with pytest.raises(NotFoundError, match="no such API path"):
            node.request("GET", "/nowhere")
        with pytest.raises(InputError, match="method POST not allowed"):
            node.request("POST", "/bug")


def test_other_packages_add_routes_with_parameters(socket_dir):
    api = HttpApi()

    async def exec_in_sandbox(request: Request):
        body = request.json()
        return {"sandbox": request.params["sandbox"], "argv": body["argv"], "query": request.query}

    async def plain_text(request: Request):
        return Response(200, b"hello\n", "text/plain")

    api.route("POST", "/v1/sandboxes/{sandbox}/exec", exec_in_sandbox)
    api.route("GET", "/text", plain_text)
    with pytest.raises(ConflictError):
        api.route("POST", "/v1/sandboxes/{sandbox}/exec", exec_in_sandbox)
    with serving(api, os.path.join(socket_dir, "api.sock")) as node:
        answer = node.request("POST", "/v1/sandboxes/sb%201/exec?wait=1", {"argv": ["true"]})
        assert answer == {"sandbox": "sb 1", "argv": ["true"], "query": {"wait": "1"}}
        assert node.request("GET", "/text") == "hello\n"
        with pytest.raises(NotFoundError):
            node.request("POST", "/v1/sandboxes/a/b/exec", {})


def test_the_socket_is_private_and_a_live_one_is_not_taken_over(socket_dir):
    path = os.path.join(socket_dir, "private", "api.sock")
    with serving(HttpApi(), path) as node:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with pytest.raises(NotFoundError):
            node.request("GET", "/")
        with pytest.raises(ConflictError, match="another daemon is listening"):
            with serving(HttpApi(), path):
                pass
    assert not os.path.exists(path)
    # A socket file nobody listens on (a daemon killed with SIGKILL leaves one) is replaced.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()
    with serving(HttpApi(), path) as node:
        with pytest.raises(NotFoundError):
            node.request("GET", "/")


def test_bad_requests_get_http_errors_and_connections_are_kept_alive(socket_dir):
    api = HttpApi()

    async def echo(request: Request):
        return request.json()

    api.route("POST", "/echo", echo)
    path = os.path.join(socket_dir, "api.sock")
    with serving(api, path) as node:
        conn = _connection(path)
        conn.request("POST", "/echo", body=b"{not json")
        response = conn.getresponse()
        assert response.status == 400 and json.loads(response.read())["error"] == "input"
        with pytest.raises(InputError, match="JSON object"):
            node.request("POST", "/echo", [1, 2])  # type: ignore[arg-type]
        for request, status in ((b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
                                (b"NOT HTTP AT ALL\r\n\r\n", 400)):
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(path)
                raw.sendall(request)
                assert raw.recv(100).startswith(b"HTTP/1.1 %d" % status)
        conn = _connection(path)  # several requests, one connection
        for number in range(3):
            conn.request("POST", "/echo", body=b'{"n": %d}' % number)
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read()) == {"n": number}


def _connection(path: str) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("localhost", timeout=10)
    conn.sock = socket.socket(socket.AF_UNIX)
    conn.sock.connect(path)
    return conn


def test_no_daemon_is_unavailable_naming_the_socket(socket_dir):
    node = Node(os.path.join(socket_dir, "nobody.sock"))
    assert not node.ping()
    with pytest.raises(UnavailableError, match="no daemon answers") as info:
        node.status()
    assert info.value.where == node.socket_path


# ---- real daemons ------------------------------------------------------------------------------------


def mounts_below(path) -> list[str]:
    path = os.path.realpath(str(path))
    with open("/proc/self/mountinfo") as f:
        targets = [line.split()[4] for line in f]
    return [target for target in targets if target == path or target.startswith(path + "/")]


@pytest.fixture
def daemon_dirs(tmp_path, socket_dir):
    dirs = {"state_dir": str(tmp_path / "state"), "cache_dir": str(tmp_path / "cache"),
            "store": str(tmp_path / "store")}
    os.mkdir(dirs["store"])  # an empty store: opening a store never creates it
    yield os.path.join(socket_dir, "daemon.sock"), dirs


@pytest.mark.root
@pytest.mark.fuse
def test_a_started_daemon_answers_with_typed_results(daemon_dirs, tmp_path):
    socket_path, dirs = daemon_dirs
    daemon = Node.start_daemon(socket_path, **dirs, log_file=str(tmp_path / "log"), command=[DSECFS])
    try:
        node = Node.ensure_running(socket_path)  # answers already: nothing new is started
        status = node.status()
        assert isinstance(status, NodeStatus) and status.pid == daemon.pid
        assert status.mounts == [] and status.cleaned == [] and status.fuse_binding == "raw"
        assert isinstance(status.cache, CacheInfo) and status.cache.directory == dirs["cache_dir"]
        assert node.mounts() == [] and node.prefetches() == []
        assert "dsecfs_cache_hits_total 0.0" in node.metrics_text()
        assert node.cache_evict(0).evicted == 0

        mnt = tmp_path / "mnt"
        mnt.mkdir()
        with pytest.raises(NotFoundError, match="no such ref"):
            node.mount("no/such:layer", str(mnt))
        with pytest.raises(InputError, match="not an existing directory"):
            node.mount("no/such:layer", str(tmp_path / "absent"))
        with pytest.raises(InputError, match="unknown mount mode"):
            node.mount("no/such:layer", str(mnt), mode="magic")
        with pytest.raises(ConflictError, match="serves FUSE with raw"):
            node.mount("no/such:layer", str(mnt), fuse_binding="fusepy")
        with pytest.raises(NotFoundError, match="no layer is mounted here"):
            node.umount(str(mnt))
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    assert mounts_below(tmp_path) == []


@pytest.mark.root
@pytest.mark.fuse
def test_ensure_running_starts_a_daemon_when_none_answers(daemon_dirs, tmp_path):
    socket_path, dirs = daemon_dirs
    node = Node.ensure_running(socket_path, **dirs, command=[DSECFS])
    pid = node.status().pid
    try:
        assert os.path.exists(os.path.join(dirs["state_dir"], "daemon.log"))
        # Made for the log by the client, the state directory is the daemon's all the same: 0700 from the
        # start, nothing for the daemon to narrow.
        assert stat.S_IMODE(os.stat(dirs["state_dir"]).st_mode) == 0o700
        with open(os.path.join(dirs["state_dir"], "daemon.log")) as f:
            assert "narrowed" not in f.read()
        assert Node.ensure_running(socket_path, **dirs, command=[DSECFS]).status().pid == pid
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)  # our child: reap it
    assert not node.ping() and mounts_below(tmp_path) == []


@pytest.mark.root
@pytest.mark.fuse
def test_a_daemon_that_cannot_start_says_why(daemon_dirs, tmp_path):
    socket_path, dirs = daemon_dirs
    with open(dirs["cache_dir"], "w"):  # a file where the cache directory should be
        pass
    with pytest.raises(UnavailableError, match="exited with status") as info:
        Node.start_daemon(socket_path, **dirs, log_file=str(tmp_path / "log"), command=[DSECFS])
    assert "cache" in info.value.message and not os.path.exists(socket_path)


def test_mount_info_ignores_fields_it_does_not_know():
    from dsec_fs import api

    info = api.decode({"mountpoint": "/m", "mode": "fuse", "layer": "ab", "from_the_future": 1}, MountInfo,
                      where="test")
    assert info == MountInfo(mountpoint="/m", mode="fuse", layer="ab")


@contextlib.contextmanager
def one_connection_in_a_request(socket_dir):
    """Serve an HttpApi of one connection at most (routes /slow and /fast), that one held in a request to
    /slow: yields (api, node, release); ``release()`` lets /slow answer and waits until the server has
    seen its connection close (the client has its answer before the server has its slot back)."""
    api = HttpApi(max_connections=1)
    entered, released = threading.Event(), threading.Event()

    async def slow(request: Request):
        entered.set()
        while not released.is_set():
            await trio.sleep(0.01)
        return {"slow": True}

    async def fast(request: Request):
        return {"fast": True}

    api.route("GET", "/slow", slow)
    api.route("GET", "/fast", fast)
    api.route("POST", "/fast", fast)
    path = os.path.join(socket_dir, "api.sock")
    # A refused client's send may meet a closed socket: EPIPE (SIGPIPE is ignored, as Python starts a
    # process; lazy_fetch/fuse_fusepy.py keeps it so).
    with contextlib.ExitStack() as restore:
        node = restore.enter_context(serving(api, path))
        answers = []
        busy = threading.Thread(target=lambda: answers.append(node.request("GET", "/slow")))
        busy.start()

        def release():
            released.set()
            busy.join()
            assert answers == [{"slow": True}]
            deadline = time.monotonic() + 10
            while api.connections and time.monotonic() < deadline:
                time.sleep(0.01)

        try:
            # In its request, not just connected: a connection whose request the server has not read yet
            # is idle, and the longest idle one is closed for a new one.
            assert entered.wait(10)
            yield api, node, release
        finally:
            released.set()
            busy.join()


def test_a_connection_over_the_cap_with_none_idle_is_answered_503_and_the_server_goes_on(socket_dir):
    """With every connection in a request (none idle to close), a new one is answered at once, and the
    server serves again once a slot frees."""
    with one_connection_in_a_request(socket_dir) as (api, node, release):
        with pytest.raises(UnavailableError, match="connections open"):
            node.request("GET", "/fast")
        assert api.refused_connections == 1
        release()
        assert node.request("GET", "/fast") == {"fast": True}


def test_a_request_refused_before_it_is_sent_whole_gets_the_daemons_answer(socket_dir):
    """The server answers 503 and closes without reading: a client still sending its request (here a
    body far bigger than the socket's buffer) meets a broken pipe, and reads the answer all the same."""
    with one_connection_in_a_request(socket_dir) as (api, node, release):
        with pytest.raises(UnavailableError, match="connections open"):
            node.request("POST", "/fast", {"padding": "x" * (8 << 20)})
        assert api.refused_connections == 1
        release()
        assert node.request("POST", "/fast", {}) == {"fast": True}


def test_a_client_that_never_reads_its_answer_is_closed_and_its_slot_freed(socket_dir, monkeypatch):
    """A client that sends a request and never reads held its connection "in a request" for ever once the
    answer filled the socket buffers: never idle, so never closed for a new one, and with the cap reached
    (16 on the TCP metrics page, which other users reach) everyone else was answered 503. An answer must go
    within SEND_SECONDS; the stalled client gets a prefix of the right answer, then the end."""
    from lazy_fetch import http_api

    monkeypatch.setattr(http_api, "SEND_SECONDS", 0.5, raising=False)  # (main had none)
    api = HttpApi(max_connections=1)
    big = os.urandom(8 << 20)  # far beyond both sockets' buffers
    answering = threading.Event()

    async def answer_big(request: Request):
        answering.set()
        return Response(200, big, "application/octet-stream")

    async def fast(request: Request):
        return {"fast": True}

    api.route("GET", "/big", answer_big)
    api.route("GET", "/fast", fast)
    path = os.path.join(socket_dir, "api.sock")
    with serving(api, path) as node, socket.socket(socket.AF_UNIX) as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(path)
        stalled.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        assert answering.wait(10)
        deadline = time.monotonic() + 10
        while api.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert api.connections == 0, "the stalled connection still holds the only slot"
        assert node.request("GET", "/fast") == {"fast": True}
        received = bytearray()
        stalled.settimeout(10)
        try:
            while chunk := stalled.recv(1 << 20):
                received += chunk
        except ConnectionResetError:
            pass
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(body) < len(big) and big.startswith(body)
