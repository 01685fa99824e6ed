"""The frames of an attached command (``POST /v1/sandboxes/{sandbox}/attach``), defined once for both sides.

The client sends an AttachRequest (dsec_fs/api.py) with ``Connection: Upgrade`` and ``Upgrade: PROTOCOL``;
the daemon answers ``101 Switching Protocols`` once the command is about to start (an error before that is
an ordinary JSON error answer), and from then on both sides send frames on the connection::

    kind: 1 byte | length: 4 bytes, big-endian | payload: length bytes (at most MAX_PAYLOAD)

client -> daemon: STDIN (bytes for the command's stdin, or typed at its terminal), STDIN_EOF (empty: the
command's stdin is closed; with a terminal, type ^D instead), RESIZE (rows, columns: two big-endian u16).
daemon -> client: STDOUT, STDERR (bytes as the command wrote them; with a terminal everything is STDOUT),
then exactly one of EXIT (an api.ExecExit as JSON) or ERROR (an api.ErrorBody as JSON: the command could
not be run), after which the daemon closes the connection.

A frame of an unknown kind, or longer than MAX_PAYLOAD, is refused (InputError): the side that reads it
stops. A client that closes its connection has left: the daemon kills the command. (A client never
half-closes; the end of stdin is STDIN_EOF.)

Threads: pure functions and a parser object owned by one reader; any thread.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from .errors import InputError

PROTOCOL = "dsecfs-exec/1"  # the Upgrade header's value
MAX_PAYLOAD = 64 << 10  # bytes: more is refused, so neither side buffers more than one frame from the other
CHUNK = 32 << 10  # bytes a sender reads and frames at once (< MAX_PAYLOAD)

STDIN, STDIN_EOF, RESIZE = 1, 2, 3  # client -> daemon
STDOUT, STDERR, EXIT, ERROR = 16, 17, 18, 19  # daemon -> client
KINDS = {STDIN, STDIN_EOF, RESIZE, STDOUT, STDERR, EXIT, ERROR}

_HEADER = struct.Struct(">BI")
_SIZE = struct.Struct(">HH")


def frame(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise InputError(f"a frame holds at most {MAX_PAYLOAD} bytes, not {len(payload)}", where=PROTOCOL)
    return _HEADER.pack(kind, len(payload)) + payload


def resize_frame(rows: int, cols: int) -> bytes:
    return frame(RESIZE, _SIZE.pack(min(max(rows, 0), 0xFFFF), min(max(cols, 0), 0xFFFF)))


def parse_size(payload: bytes) -> tuple[int, int]:
    """(rows, columns) of a RESIZE frame; InputError if it is not two u16."""
    if len(payload) != _SIZE.size:
        raise InputError(f"a RESIZE frame holds {_SIZE.size} bytes, not {len(payload)}", where=PROTOCOL)
    return _SIZE.unpack(payload)


class FrameParser:
    """Frames from the bytes of a connection, fed as they arrive; holds at most one frame's bytes."""

    def __init__(self, accept: set[int]):
        self.accept = accept  # the kinds the other side may send
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """The (kind, payload) of every frame ``data`` completes; InputError at a refused header."""
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            kind, length = _HEADER.unpack_from(self._buffer)
            if kind not in self.accept:
                raise InputError(f"frame of unknown kind {kind}", where=PROTOCOL)
            if length > MAX_PAYLOAD:
                raise InputError(f"frame of {length} bytes; at most {MAX_PAYLOAD}", where=PROTOCOL)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_HEADER.size:end])
            del self._buffer[:end]
            yield kind, payload

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._buffer)
