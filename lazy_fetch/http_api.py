"""The node daemon's API server: HTTP/1.1 (h11) over a unix socket, JSON in and out, a route table others extend.

    api = HttpApi()
    api.route("GET", "/v1/status", status_handler)
    api.route("POST", "/v1/sandboxes/{sandbox}/exec", exec_handler)   # {name}: one path segment
    async with trio.open_nursery() as nursery:
        await nursery.start(api.serve, "/run/dsecfs/daemon.sock")

A handler is ``async def handler(request: Request) -> Response | JSON value``; a JSON value is sent with
status 200. The daemon registers its routes (daemon.py), and packages above lazy_fetch (overlay's
sandboxes) register theirs on the same table before serving starts.

Bodies: a handler decodes its request with ``request.decode(RequestType)`` and returns a response type
(both from dsec_fs/api.py, which the SDK client uses too) or any JSON value. Errors: a handler that
raises a DsecError answers the one error format of dsec_fs/api.py (``error_body``), so a client can
raise the same class again. Anything else a handler raises is a bug: logged with its
traceback and answered 500 ``{"error": "internal"}``. Unknown paths answer 404, known paths with another
method 405 (the answer to a HEAD without its body), malformed HTTP 400 (then the connection closes): a
request target ``urlsplit`` refuses too. A connection's task never lets an exception out into the server
(it would end the server, and the daemon): an unexpected one is logged and the connection closed. A handler may answer ``Upgrade`` instead:
the connection of a request that asked for that protocol (``Upgrade:``) switches to it (101) and is the
handler's until it closes (a sandbox's attached command: overlay/attach.py).

Access: the socket is the only door, so its permissions are the access control: the socket file is
created 0600 (and chmod 0600 again before listen()), and its directory 0700 when we create it (an
existing one is left as it is: it may be /tmp), so only the owner (root) can connect. A socket file left
by a dead daemon is replaced; one that still answers is refused (ConflictError). Nothing here logs request
bodies or headers.

Bounds: at most ``max_connections`` connections at once (MAX_CONNECTIONS; the daemon lowers it to a
quarter of its descriptor limit) (when full, the connection idle the longest is
closed for a new one; if none is idle, the new one is answered 503 and closed); a request must arrive
whole within REQUEST_SECONDS of its first byte, and its answer must be taken whole within SEND_SECONDS
(else the connection is closed); bodies and headers are bounded (MAX_BODY, MAX_HEADER).
When accept() fails for want of descriptors (EMFILE, ENFILE) or memory, the server closes the longest
idle connection and tries again after ACCEPT_BACKOFF seconds: it never stops serving for it (the daemon
also raises its RLIMIT_NOFILE to the hard limit at start, ``raise_fd_limit``).

Threads: everything runs in the trio loop that calls ``serve``; each connection is a task, requests on one
connection are answered in order (HTTP/1.1 keep-alive, no pipelining needed). Routes are added before
``serve`` is called, so the table needs no lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import resource
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import h11
import trio

from dsec_fs import api
from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError, UnavailableError

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20  # bytes of a request body: the API's requests are small JSON objects
MAX_HEADER = 64 << 10
IDLE_TIMEOUT = 300.0  # seconds a kept-alive connection may sit between requests
REQUEST_SECONDS = 30.0  # seconds from a request's first byte to its last
# Seconds an answer (or a 101 switch) may take to leave: a client that stops reading while the answer is
# bigger than the socket buffers holds its connection in a request, where it is never closed for a new
# one (only idle ones are); 16 of them took every connection of the TCP metrics page. The biggest answers
# (metrics, the mount and sandbox lists) are a few MiB at most, which a live client takes in
# milliseconds: 30 s leaves a loaded or swapped-out client room, as REQUEST_SECONDS does on the way in.
SEND_SECONDS = 30.0
MAX_CONNECTIONS = 512
ACCEPT_BACKOFF = 0.1  # seconds to wait after accept() found no descriptor or memory
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
RECEIVE_SIZE = 64 << 10
BACKLOG = 128
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes, the last one a NUL

JSON_TYPE = "application/json"


@dataclass
class Request:
    method: str
    path: str  # decoded path, without the query
    query: dict[str, str]  # last value of each query parameter
    headers: dict[str, str]  # lower-case names
    body: bytes
    params: dict[str, str] = field(default_factory=dict)  # {name} segments of the route

    def decode(self, type_: type[T]) -> T:
        """The body as a request type of dsec_fs/api.py; InputError naming the field at fault."""
        return api.decode(self.body, type_, where=f"{self.method} {self.path}")

    def json(self) -> dict[str, Any]:
        """The body as a JSON object ({} when empty); InputError when it is not one."""
        if not self.body:
            return {}
        try:
            value = json.loads(self.body)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"the request body is not JSON: {exc}", where=f"{self.method} {self.path}") from None
        if not isinstance(value, dict):
            raise InputError("the request body must be a JSON object", where=f"{self.method} {self.path}")
        return value


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = JSON_TYPE
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Upgrade:
    """A handler's answer that takes the connection over: ``101 Switching Protocols`` to ``protocol`` (the
    request must have asked for it: ``Upgrade: protocol``), then ``run(stream, early_bytes)`` owns the
    connection until it returns; the connection is closed then."""
    protocol: str
    run: Callable[[trio.SocketStream, bytes], Awaitable[None]]


Handler = Callable[[Request], Awaitable[Any]]
T = TypeVar("T")


def json_response(value: Any, status: int = 200) -> Response:
    """``value`` (a response type of dsec_fs/api.py, or any JSON value) as the body."""
    return Response(status, api.encode(value))


def error_response(exc: DsecError) -> Response:
    return json_response(api.error_body(exc), api.error_status(exc))


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (each API connection, chunk read and mount
    takes descriptors); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft


@dataclass(eq=False)
class _Connection:
    scope: trio.CancelScope
    idle_since: float | None  # monotonic time it went idle between requests; None while in a request
    head_only: bool = False  # the request being answered is a HEAD: its answer goes without the body


@dataclass(frozen=True)
class _Route:
    method: str
    pattern: str
    regex: re.Pattern[str]
    handler: Handler


def _compile(pattern: str) -> re.Pattern[str]:
    if not pattern.startswith("/"):
        raise InputError("a route pattern starts with '/'", where=f"route {pattern!r}")
    parts = re.split(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", pattern)
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts))
    return re.compile(regex + r"\Z")


class HttpApi:
    """A route table and the server that answers from it."""

    def __init__(self, *, max_connections: int = MAX_CONNECTIONS):
        self._routes: list[_Route] = []
        self.max_connections = max_connections
        self._connections: set[_Connection] = set()
        self.refused_connections = 0  # answered 503 because every connection was busy
        self.accept_failures = 0  # accept() calls that found no descriptor or memory

    @property
    def connections(self) -> int:
        return len(self._connections)

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        """Answer ``method`` requests for paths matching ``pattern`` with ``handler``; ``{name}`` in the
        pattern matches one path segment, handed over (URL-decoded) in ``request.params[name]``."""
        method = method.upper()
        if any(r.method == method and r.pattern == pattern for r in self._routes):
            raise ConflictError("this route is already registered", where=f"{method} {pattern}")
        self._routes.append(_Route(method, pattern, _compile(pattern), handler))

    def routes(self) -> list[tuple[str, str]]:
        return [(r.method, r.pattern) for r in self._routes]

    async def dispatch(self, request: Request) -> Response | Upgrade:
        """The response to one request: the route's, or an error response."""
        allowed = []
        for route in self._routes:
            match = route.regex.match(request.path)
            if match is None:
                continue
            if route.method != request.method:
                allowed.append(route.method)
                continue
            request.params = {name: unquote(value) for name, value in match.groupdict().items()}
            try:
                result = await route.handler(request)
            except DsecError as exc:
                return error_response(exc)
            except Exception as exc:  # a bug in a handler: the daemon answers and stays up
                log.error("%s %s failed with an unexpected error: %r", request.method, request.path, exc,
                          exc_info=exc)
                return json_response(api.ErrorBody("internal", f"internal error: {exc!r}",
                                                   f"{request.method} {request.path}"), 500)
            if isinstance(result, Upgrade) and request.headers.get("upgrade", "").lower() != result.protocol.lower():
                return error_response(InputError(f"this path switches protocols: send Connection: Upgrade and "
                                                 f"Upgrade: {result.protocol}", where=request.path))
            return result if isinstance(result, (Response, Upgrade)) else json_response(result)
        if allowed:
            response = json_response(api.error_body(InputError(f"method {request.method} not allowed",
                                                               where=request.path)), 405)
            response.headers.append(("allow", ", ".join(sorted(set(allowed)))))
            return response
        return error_response(NotFoundError("no such API path", where=request.path))

    async def serve(self, socket_path: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``socket_path`` and answer requests until cancelled; the socket file is removed then."""
        sock = await _listen(socket_path)
        identity = os.stat(socket_path)
        try:
            async with trio.SocketListener(sock) as listener:
                await self._accept_on(listener, task_status)
        finally:
            _remove_socket(socket_path, identity)

    async def serve_tcp(self, address: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on TCP ``address`` ("HOST:PORT") and answer until cancelled: for a route table that is
        safe to show whoever reaches the port (the daemon's metrics page, never its API)."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError("a TCP address is HOST:PORT, e.g. 127.0.0.1:9402", where=address)
        try:
            (listener,) = await trio.open_tcp_listeners(int(port), host=host.strip("[]"))
        except OSError as exc:
            raise UnavailableError(f"cannot listen: {exc.strerror or exc}", where=address, transient=False) from None
        async with listener:
            await self._accept_on(listener, task_status)

    async def _accept_on(self, listener: trio.SocketListener, task_status) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRORS:
                        raise
                    self._accept_failed(exc)
                    await trio.sleep(ACCEPT_BACKOFF)
                    continue
                if len(self._connections) >= self.max_connections and not self._close_longest_idle():
                    self.refused_connections += 1
                    nursery.start_soon(self._refuse_connection, stream)
                    continue
                connection = _Connection(trio.CancelScope(), time.monotonic())
                self._connections.add(connection)
                nursery.start_soon(self._serve_connection, stream, connection)

    def _accept_failed(self, exc: OSError) -> None:
        self.accept_failures += 1
        if self.accept_failures == 1 or self.accept_failures % 1000 == 0:
            log.warning("accept() failed (%s, %d times so far; %d connections open): closing the longest idle "
                        "one and waiting %g s", errno.errorcode.get(exc.errno, exc.errno), self.accept_failures,
                        len(self._connections), ACCEPT_BACKOFF)
        self._close_longest_idle()

    def _close_longest_idle(self) -> bool:
        idle = [c for c in self._connections if c.idle_since is not None and not c.scope.cancel_called]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).scope.cancel()
        return True

    async def _refuse_connection(self, stream: trio.SocketStream) -> None:
        """Answer 503 before reading anything, and close (h11 answers only a request it has read)."""
        body = api.encode(api.error_body(UnavailableError(
            f"the daemon has {self.max_connections} connections open, all in requests; try again", where="http",
            transient=True)))
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: {JSON_TYPE}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode()
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(head + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await stream.aclose()

    async def _serve_connection(self, stream: trio.SocketStream, connection: _Connection) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER)
        try:
            with connection.scope:
                while True:
                    connection.idle_since = time.monotonic()
                    try:
                        request = await _receive_request(conn, stream, connection)
                    except h11.RemoteProtocolError as exc:
                        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                            await _send(conn, stream, json_response(
                                api.error_body(InputError(f"bad HTTP request: {exc}", where="http")),
                                exc.error_status_hint), head_only=connection.head_only)
                        return
                    if request is None:  # the client closed the connection, or was too slow
                        return
                    response = await self.dispatch(request)
                    if isinstance(response, Upgrade):
                        await _switch(conn, stream, response)
                        return
                    await _send(conn, stream, response, head_only=connection.head_only)
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return  # a body we did not read, or the client asked to close
                    conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        except trio.TooSlowError:
            log.info("closing an API connection whose client took no answer for %g s", SEND_SECONDS)
        except Exception as exc:  # a bug met by one connection (a request h11 takes that we did not expect)
            # must not leave this task: it would end the server's nursery, and the daemon with it.
            log.error("closing an API connection that failed with an unexpected error: %r", exc, exc_info=exc)
        finally:
            self._connections.discard(connection)
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _receive_request(conn: h11.Connection, stream: trio.SocketStream,
                           connection: _Connection) -> Request | None:
    """The next request, or None when the client closes, stays idle past IDLE_TIMEOUT, or takes more than
    REQUEST_SECONDS to send a request it began."""
    head: h11.Request | None = None
    body = bytearray()
    connection.head_only = False
    deadline = trio.current_time() + IDLE_TIMEOUT
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            with trio.move_on_at(deadline):
                data = await stream.receive_some(RECEIVE_SIZE)
                if connection.idle_since is not None and data:  # a request begins
                    connection.idle_since = None
                    deadline = trio.current_time() + REQUEST_SECONDS
                conn.receive_data(data)
                continue
            return None
        if isinstance(event, h11.ConnectionClosed):
            return None
        if isinstance(event, h11.Request):
            head = event
            connection.idle_since = None
            connection.head_only = event.method == b"HEAD"
            declared = dict(event.headers).get(b"content-length")
            if declared is not None and int(declared) > MAX_BODY:
                raise h11.RemoteProtocolError(f"request body over {MAX_BODY} bytes", error_status_hint=413)
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY:
                raise h11.RemoteProtocolError(f"request body over {MAX_BODY} bytes", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            try:
                target = urlsplit(head.target.decode("ascii", errors="replace"))
            except ValueError as exc:  # "//[x": h11 takes any target without spaces, urlsplit does not
                raise h11.RemoteProtocolError(f"bad request target: {exc}", error_status_hint=400) from None
            return Request(method=head.method.decode("ascii", errors="replace").upper(),
                           path=unquote(target.path), query=dict(parse_qsl(target.query)),
                           headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers},
                           body=bytes(body))


async def _send(conn: h11.Connection, stream: trio.SocketStream, response: Response, *, head_only: bool) -> None:
    """``response`` on the connection; ``head_only`` (the answer to a HEAD) without its body, which h11
    refuses to send (LocalProtocolError), as HTTP has it."""
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               *response.headers]
    data = conn.send(h11.Response(status_code=response.status, headers=headers))
    data += conn.send(h11.Data(data=response.body)) if response.body and not head_only else b""
    data += conn.send(h11.EndOfMessage())
    with trio.fail_after(SEND_SECONDS):  # TooSlowError: the connection closes (_serve_connection)
        await stream.send_all(data)


async def _switch(conn: h11.Connection, stream: trio.SocketStream, upgrade: Upgrade) -> None:
    with trio.fail_after(SEND_SECONDS):
        await stream.send_all(conn.send(h11.InformationalResponse(
            status_code=101, headers=[("connection", "upgrade"), ("upgrade", upgrade.protocol)])))
    early, _closed = conn.trailing_data  # what the client sent after its request
    try:
        await upgrade.run(stream, bytes(early))
    except Exception as exc:  # a bug in the protocol's handler: the daemon stays up
        log.error("the %s connection failed with an unexpected error: %r", upgrade.protocol, exc, exc_info=exc)


async def _listen(path: str) -> trio.socket.SocketType:
    """A listening unix socket at ``path``, created 0600 (its directory 0700 when we make it)."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise InputError(f"a unix socket path holds at most {SOCKET_PATH_MAX} bytes", where=path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700)
        os.chmod(directory, 0o700)  # makedirs' mode passes through the umask
    await _clear_stale_socket(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Linux creates the socket file with the mode of the socket's inode: set it before bind, so the
        # file is never open to others, not even between bind and chmod. Then the file itself, again.
        os.fchmod(sock.fileno(), 0o600)
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


async def _clear_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on; refuse one that answers, or a path that is no socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConflictError("this path exists and is not a socket; not replacing it", where=path)
    probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.info("removing the stale socket %s (nobody listens on it)", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConflictError("another daemon is listening on this socket", where=path)


def _remove_socket(path: str, identity: os.stat_result) -> None:
    """Unlink the socket if it is still the one we made (a successor may have replaced it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == (identity.st_dev, identity.st_ino):
        os.unlink(path)
