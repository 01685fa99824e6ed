"""The client end of an attached command (``Sandbox.attach``): one connection to the daemon, switched to
the frames of exec_frames.py after the request.

    with sandbox.attach(["/bin/sh", "-c", "make test"]) as command:
        for stream, data in command.output():     # "stdout" | "stderr", bytes as the command wrote them
            print(stream, data)
        command.result.exit_code

``output()`` yields as the daemon relays, and ends at the command's exit, with ``result`` (an ExecExit)
set; a command that could not run raises its DsecError (as exec does); a connection that ends without an
exit is UnavailableError. While ``output()`` runs, other threads may ``write`` stdin (``stdin=True``),
``close_stdin`` and ``resize`` (``tty=True``). Closing the connection before the exit (``close()``, or
leaving the with-block) kills the command.

Threads: ``output`` in one thread; ``write``, ``close_stdin``, ``resize`` and ``close`` from any (a lock
keeps their frames whole; ``close`` also ends a ``write`` blocked in another thread).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import h11

from . import api, exec_frames
from .errors import UnavailableError

if TYPE_CHECKING:
    from .client import Node

HANDSHAKE_SECONDS = 60.0  # for the daemon's answer to the request (it checks the sandbox and the command)
STREAMS = {exec_frames.STDOUT: "stdout", exec_frames.STDERR: "stderr"}


class AttachedCommand:
    def __init__(self, sock: socket.socket, early: bytes, where: str):
        self._sock = sock
        self._early = early
        self._where = where
        self._send_lock = threading.Lock()
        self.result: api.ExecExit | None = None

    @classmethod
    def open(cls, node: Node, path: str, body: api.AttachRequest) -> "AttachedCommand":
        """Send the attach request; once the daemon switched protocols, the command runs."""
        where = f"POST {path} on {node.socket_path}"
        sock = node.connect(HANDSHAKE_SECONDS)
        try:
            early = _handshake(sock, path, api.encode(body), where)
            sock.settimeout(None)  # a command may run, and be silent, as long as it likes
        except BaseException:
            sock.close()
            raise
        return cls(sock, early, where)

    def __enter__(self) -> "AttachedCommand":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def output(self) -> Iterator[tuple[str, bytes]]:
        parser = exec_frames.FrameParser(set(STREAMS) | {exec_frames.EXIT, exec_frames.ERROR})
        data, self._early = self._early, b""
        while True:
            for kind, payload in parser.feed(data):
                if kind in STREAMS:
                    yield STREAMS[kind], payload
                elif kind == exec_frames.EXIT:
                    self.result = api.decode(payload, api.ExecExit, where=self._where)
                    return
                else:
                    raise api.error_from_body(api.decode(payload, dict, where=self._where), 0, self._where)
            try:
                data = self._sock.recv(exec_frames.CHUNK)
            except OSError as exc:
                raise UnavailableError(f"the connection broke before the command's exit: {exc}", where=self._where,
                                       transient=True) from None
            if not data:
                raise UnavailableError("the daemon closed the connection before the command's exit",
                                       where=self._where, transient=True)

    def write(self, data: bytes) -> None:
        """Feed the command's stdin (or type at its terminal)."""
        for start in range(0, len(data), exec_frames.CHUNK):
            self._send(exec_frames.frame(exec_frames.STDIN, data[start:start + exec_frames.CHUNK]))

    def close_stdin(self) -> None:
        self._send(exec_frames.frame(exec_frames.STDIN_EOF))

    def resize(self, rows: int, cols: int) -> None:
        self._send(exec_frames.resize_frame(rows, cols))

    def close(self) -> None:
        """Leave (the daemon kills the command if it runs); a write blocked in another thread fails."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # now, even while another thread's sendall holds the socket
        except OSError:
            pass  # closed or broken already
        self._sock.close()

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            raise UnavailableError(f"cannot send to the command: {exc}", where=self._where, transient=True) from None


def _handshake(sock: socket.socket, path: str, payload: bytes, where: str) -> bytes:
    """Send the request and read the answer: the bytes after a 101, or the error an answer stands for."""
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", "localhost"), ("content-type", "application/json"), ("content-length", str(len(payload))),
               ("connection", "upgrade"), ("upgrade", exec_frames.PROTOCOL)]
    try:
        sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=headers)) + conn.send(h11.Data(payload))
                     + conn.send(h11.EndOfMessage()))
        status, body = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(exec_frames.CHUNK))
            elif isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                return bytes(conn.trailing_data[0])
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except (OSError, h11.ProtocolError) as exc:
        raise UnavailableError(f"attach failed: {exc or type(exc).__name__}", where=where, transient=True) from None
    try:
        value = api.decode(bytes(body), dict, where=where)
    except UnavailableError:
        value = bytes(body).decode(errors="replace")
    raise api.error_from_body(value, status, where)
