"""The node daemon's API server: HTTP/1.1 (h11) over a unix socket, JSON in and out, a route table others extend.

    api = HttpApi()
    api.route("GET", "/v1/status", status_handler)
    api.route("POST", "/v1/sandboxes/{sandbox}/exec", exec_handler)   # {name}: one path segment
    async with trio.open_nursery() as nursery:
        await nursery.start(api.serve, "/run/dsecfs/daemon.sock")

A handler is ``async def handler(request: Request) -> Response | JSON value``; a JSON value is sent with
status 200. The daemon registers its routes (daemon.py), and packages above lazy_fetch (overlay's
sandboxes) register theirs on the same table before serving starts.

Errors: a handler that raises a DsecError answers ``{"error": kind, "message", "where"}`` (and
``"transient"`` for UnavailableError) with the status ``STATUS_BY_KIND`` gives its kind, so a client can
raise the same class again (dsec_fs/client.py). Anything else a handler raises is a bug: logged with its
traceback and answered 500 ``{"error": "internal"}``. Unknown paths answer 404, known paths with another
method 405, malformed HTTP 400 (then the connection closes).

Access: the socket is the only door, so its permissions are the access control: the socket file is
created 0600 (and chmod 0600 again before listen()), and its directory 0700 when we create it (an
existing one is left as it is: it may be /tmp), so only the owner (root) can connect. A socket file left
by a dead daemon is replaced; one that still answers is refused (ConflictError). Nothing here logs request
bodies or headers.

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
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import h11
import trio

from dsec_fs.errors import ConflictError, DsecError, InputError

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20  # bytes of a request body: the API's requests are small JSON objects
MAX_HEADER = 64 << 10
IDLE_TIMEOUT = 300.0  # seconds a kept-alive connection may sit between requests
RECEIVE_SIZE = 64 << 10
BACKLOG = 128
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes, the last one a NUL

# HTTP status for each DsecError kind; a client maps the kind back to the class.
STATUS_BY_KIND = {
    "input": 400,
    "not-found": 404,
    "conflict": 409,
    "unsupported": 422,
    "corrupt": 500,
    "unavailable": 503,
}
JSON_TYPE = "application/json"


@dataclass
class Request:
    method: str
    path: str  # decoded path, without the query
    query: dict[str, str]  # last value of each query parameter
    headers: dict[str, str]  # lower-case names
    body: bytes
    params: dict[str, str] = field(default_factory=dict)  # {name} segments of the route

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


Handler = Callable[[Request], Awaitable[Any]]


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status, (json.dumps(value, sort_keys=True) + "\n").encode())


def error_response(exc: DsecError) -> Response:
    body: dict[str, Any] = {"error": exc.kind, "message": exc.message, "where": exc.where}
    if hasattr(exc, "transient"):
        body["transient"] = exc.transient
    return json_response(body, STATUS_BY_KIND.get(exc.kind, 500))


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

    def __init__(self):
        self._routes: list[_Route] = []

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        """Answer ``method`` requests for paths matching ``pattern`` with ``handler``; ``{name}`` in the
        pattern matches one path segment, handed over (URL-decoded) in ``request.params[name]``."""
        method = method.upper()
        if any(r.method == method and r.pattern == pattern for r in self._routes):
            raise ConflictError("this route is already registered", where=f"{method} {pattern}")
        self._routes.append(_Route(method, pattern, _compile(pattern), handler))

    def routes(self) -> list[tuple[str, str]]:
        return [(r.method, r.pattern) for r in self._routes]

    async def dispatch(self, request: Request) -> Response:
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
                return json_response({"error": "internal", "message": f"internal error: {exc!r}",
                                      "where": f"{request.method} {request.path}"}, 500)
            return result if isinstance(result, Response) else json_response(result)
        if allowed:
            response = json_response({"error": "input", "message": f"method {request.method} not allowed",
                                      "where": request.path}, 405)
            response.headers.append(("allow", ", ".join(sorted(set(allowed)))))
            return response
        return json_response({"error": "not-found", "message": "no such API path", "where": request.path}, 404)

    async def serve(self, socket_path: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``socket_path`` and answer requests until cancelled; the socket file is removed then."""
        sock = await _listen(socket_path)
        identity = os.stat(socket_path)
        try:
            async with trio.SocketListener(sock) as listener, trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve_connection, stream)
        finally:
            _remove_socket(socket_path, identity)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER)
        try:
            while True:
                try:
                    request = await _receive_request(conn, stream)
                except h11.RemoteProtocolError as exc:
                    if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        await _send(conn, stream, json_response(
                            {"error": "input", "message": f"bad HTTP request: {exc}", "where": "http"},
                            exc.error_status_hint))
                    return
                if request is None:  # the client closed the connection, or stayed idle too long
                    return
                await _send(conn, stream, await self.dispatch(request))
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return  # a body we did not read, or the client asked to close
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        finally:
            await stream.aclose()


async def _receive_request(conn: h11.Connection, stream: trio.SocketStream) -> Request | None:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            with trio.move_on_after(IDLE_TIMEOUT):
                data = await stream.receive_some(RECEIVE_SIZE)
                conn.receive_data(data)
                continue
            return None
        if isinstance(event, h11.ConnectionClosed):
            return None
        if isinstance(event, h11.Request):
            head = event
            declared = dict(event.headers).get(b"content-length")
            if declared is not None and int(declared) > MAX_BODY:
                raise h11.RemoteProtocolError(f"request body over {MAX_BODY} bytes", error_status_hint=413)
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY:
                raise h11.RemoteProtocolError(f"request body over {MAX_BODY} bytes", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            target = urlsplit(head.target.decode("ascii", errors="replace"))
            return Request(method=head.method.decode("ascii", errors="replace").upper(),
                           path=unquote(target.path), query=dict(parse_qsl(target.query)),
                           headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers},
                           body=bytes(body))


async def _send(conn: h11.Connection, stream: trio.SocketStream, response: Response) -> None:
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               *response.headers]
    data = conn.send(h11.Response(status_code=response.status, headers=headers))
    data += conn.send(h11.Data(data=response.body)) if response.body else b""
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)


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
