"""A threaded HTTP server that bounds its connections: what a service every local user can reach (the
scheduler's, sched_service.py, on TCP) needs so that idle or dripping connections cannot take its threads
and memory, nor keep an honest client out.

    server = BoundedHTTPServer((host, port), Handler, ConnectionBounds())   # Handler a BoundedHandler

Bounds (ConnectionBounds): at most ``max_connections`` connections at once, a thread each. A kept-alive
connection may wait ``idle_seconds`` for its next request; a request must be read and answered within
``request_seconds`` of its first byte (a client sending a byte a second is cut off there, as one that
stops reading its answer is); past either the connection is shut down. When one connection more comes,
the one that has waited longest for an answer since it came or was last answered (idle or in a request)
is shut down for it, if it has waited ``evictable_after`` seconds: an honest client's request takes
milliseconds, so hostile connections go first; when none has, the new one is answered 503 (the error
body of dsec_fs/api.py) and closed. A client whose idle connection was closed opens another.

Shutting a connection down (``socket.shutdown``, from another thread) wakes its handler's blocked read or
write, which then ends, and with it its thread.

Threads: the serving thread accepts (``process_request``: the table, an eviction or a refusal); each
connection's thread runs its handler; one reaper thread (``start_reaper``, stopped by ``server_close``)
shuts down the connections past their deadlines every REAP_SECONDS. ``_lock`` guards ``_open`` and each
_Open's fields.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dsec_fs import api
from dsec_fs.errors import UnavailableError

log = logging.getLogger(__name__)

REAP_SECONDS = 0.25  # how often the reaper looks: deadlines are kept to within this


@dataclass(frozen=True)
class ConnectionBounds:
    # Connections (a thread each, about 100 KiB of memory): kube-scheduler keeps one or two, node daemons
    # report now and then; 256 leaves room for a cluster's burst of registrations.
    max_connections: int = 256
    # Seconds a kept-alive connection may sit between requests: past Go's IdleConnTimeout (90 s), so
    # kube-scheduler's client closes its idle connections before the server does.
    idle_seconds: float = 300.0
    # Seconds from a request's first byte to the end of its answer: a request is at most MAX_BODY (64
    # MiB), read in well under a second on any link the scheduler is reached by.
    request_seconds: float = 30.0
    # Seconds a connection must have waited for an answer before a new one may take its place.
    evictable_after: float = 1.0


@dataclass
class _Open:
    sock: socket.socket
    since: float  # monotonic: when it came, or its last answer was sent
    request_started: float | None = None  # monotonic: the first byte of the request being answered
    shut: bool = False


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # listen()'s backlog (socketserver's default is 5): a burst of connections past it waits for SYN
    # retransmits, seconds each, before the server even sees it.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler], bounds: ConnectionBounds):
        super().__init__(address, handler)
        self.bounds = bounds
        self.refused_connections = 0  # answered 503: every connection was new
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Open] = {}
        self._closing = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def start_reaper(self) -> None:
        self._reaper = threading.Thread(target=self._reap, name="http-reaper", daemon=True)
        self._reaper.start()

    def server_close(self) -> None:
        self._closing.set()
        with self._lock:
            for conn in self._open.values():
                _shut(conn)
        super().server_close()
        if self._reaper is not None:
            self._reaper.join()

    def process_request(self, request: socket.socket, client_address) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._open) >= self.bounds.max_connections and not self._evict_one(now):
                self.refused_connections += 1
                full = True
            else:
                self._open[request] = _Open(request, now)
                full = False
        if full:
            _refuse(request, self.bounds.max_connections)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def request_begins(self, request: socket.socket) -> None:
        """The first byte of a request came (the handler's thread; an evicted connection is gone from the
        table)."""
        with self._lock:
            conn = self._open.get(request)
            if conn is not None:
                conn.request_started = time.monotonic()

    def request_answered(self, request: socket.socket) -> None:
        with self._lock:
            conn = self._open.get(request)
            if conn is not None:
                conn.request_started, conn.since = None, time.monotonic()

    def handle_error(self, request: socket.socket, client_address) -> None:
        """A handler's read or write failed: mostly a connection shut down at its deadline, or a client
        gone; logged, without the traceback socketserver would print."""
        log.debug("a connection from %s ended in an error", client_address[0], exc_info=True)

    def _evict_one(self, now: float) -> bool:
        """Shut down the connection waiting longest for an answer, if it waited ``evictable_after`` (``_lock``
        held); whether one was."""
        waiting = [conn for conn in self._open.values() if not conn.shut]
        oldest = min(waiting, key=lambda conn: conn.since, default=None)
        if oldest is None or now - oldest.since < self.bounds.evictable_after:
            return False
        _shut(oldest)
        del self._open[oldest.sock]  # its thread ends soon; it no longer holds a place
        return True

    def _reap(self) -> None:
        bounds = self.bounds
        while not self._closing.wait(REAP_SECONDS):
            now = time.monotonic()
            with self._lock:
                for conn in self._open.values():
                    if conn.request_started is None:
                        late = now - conn.since > bounds.idle_seconds
                    else:
                        late = now - conn.request_started > bounds.request_seconds
                    if late:
                        _shut(conn)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler whose requests the server's bounds time (see the module docstring)."""

    server: BoundedHTTPServer

    def handle_one_request(self) -> None:
        try:
            first = self.rfile.peek(1)  # waits for the request's first byte (or the reaper's shutdown)
        except OSError:
            first = b""
        if not first:
            self.close_connection = True
            return
        self.server.request_begins(self.request)
        super().handle_one_request()
        self.server.request_answered(self.request)


def _shut(conn: _Open) -> None:
    if not conn.shut:
        conn.shut = True
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer has gone already


def _refuse(sock: socket.socket, max_connections: int) -> None:
    """Answer 503 without waiting for the client (the accepting thread must not block), and close."""
    error = UnavailableError(f"the server has {max_connections} connections open, all of them new; try again",
                             where="connection")
    body = json.dumps(api.error_body(error)).encode()
    status = HTTPStatus.SERVICE_UNAVAILABLE
    head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.setblocking(False)
    try:
        sock.recv(1 << 16)  # what came of its request already: closing with it unread would reset the answer
    except OSError:
        pass
    try:
        sock.send(head + body)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the client is gone, or its buffer full: it learns of the refusal by the close
    sock.close()
