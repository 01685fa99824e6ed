"""The input of a tar walk (walk_tar.py): the raw bytes, decompressed (gzip or zstd, recognised by their
magic bytes; xz and bzip2 refused as unsupported), read exactly, and counted against ``TarLimits``
(limits.py): the tar stream's size and the decompression ratio.

``_open_input(raw, source, limits)`` gives the ``_TarStream`` the member reader (tar_members.py) reads.
A compressed input is read to its very end (``drain``), past the tar's end marker, so gzip's CRC and
zstd's checksums are checked; a short read anywhere is "truncated" (InputError). Offsets are in the
uncompressed tar stream.

Threads: one thread reads a stream; nothing here is shared between threads.
"""

from __future__ import annotations

import gzip
import zlib
from typing import BinaryIO

import zstandard

from dsec_fs.errors import InputError, UnsupportedError

from .limits import TarLimits

_SKIP_PIECE = 1 << 20  # bytes per read when skipping data
_BLOCK_READ = 1 << 20  # bytes read ahead from the input at a time (_TarStream)


class _CountingInput:
    """The raw input as handed to the decompressor: counts bytes read and replays the sniffed magic."""

    def __init__(self, raw: BinaryIO):
        self._raw = raw
        self._head = b""
        self.count = 0

    def sniff(self, n: int) -> bytes:
        """Up to ``n`` first bytes, which read() then returns again."""
        while len(self._head) < n:
            piece = self._raw.read(n - len(self._head))
            if not piece:
                break
            self._head += piece
            self.count += len(piece)
        return self._head

    def read(self, n: int = -1) -> bytes:
        if self._head:
            head = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(head) :]
            return head
        data = self._raw.read(n)
        self.count += len(data)
        return data


class _TarStream:
    """The uncompressed tar bytes: exact reads, the current offset, and the decompression limits.

    The input is read in blocks of ``_BLOCK_READ`` bytes into a buffer, from which headers and the data
    of small members are sliced: one read of the input (and its decompressor) for many members, not two
    a member. A read of more than the buffer holds takes the rest of it and reads the remainder straight
    from the input. ``offset`` counts the bytes handed out (consumed), which is what the limits and
    messages speak of; the read-ahead is at most one block beyond it."""

    def __init__(self, data, counting: _CountingInput | None, source: str, limits: TarLimits):
        # Anything with read(n): the decompressor, or the raw input for a plain tar. gzip's read1, not read:
        # read drops what it decompressed when the compressed input ends early (EOFError), read1 hands it
        # over first, so a truncation is reported by the read that needs the missing bytes, at its offset
        # (not by a read-ahead that began before it).
        self._read_input = data.read1 if isinstance(data, gzip.GzipFile) else data.read
        self._counting = counting  # the compressed input, for the expansion ratio; None for a plain tar
        self.source = source
        self.limits = limits
        self.buffer = b""  # input read ahead; bytes before ``pos`` are consumed
        self.pos = 0
        self._buffer_offset = 0  # stream offset of buffer[0]
        self.zero_bytes = 0  # of the bytes consumed, those in file pieces that were all zeros (holes of the layer)

    @property
    def offset(self) -> int:
        """Uncompressed bytes consumed."""
        return self._buffer_offset + self.pos

    def read(self, n: int, what: str, where: str, *, piece: bool = False) -> bytes:
        """Exactly ``n`` bytes; the input ending first means the archive is truncated. ``piece``: a whole
        piece of a file, which the expansion limit does not count if it is all zeros."""
        data = self.read_some(n, where, piece=piece)
        if len(data) < n:
            raise InputError(f"truncated: the input ends at offset {self.offset} inside {what}", where=where)
        return data

    def read_some(self, n: int, where: str, *, piece: bool = False) -> bytes:
        """``n`` bytes, or fewer at the end of the input."""
        pos = self.pos
        end = pos + n
        if end <= len(self.buffer):
            data = self.buffer[pos:end]
            self.pos = end
        else:
            data = self._read_beyond(n, where)
        if piece and data and not data[0] and data.count(0) == len(data):
            self.zero_bytes += len(data)
        if not self.within_limits(self._buffer_offset + self.pos, self.zero_bytes):
            self.check_limits(where)
        return data

    def take(self, n: int, *, skip: int = 0, piece: bool = False) -> bytes | None:
        """``skip`` bytes passed over and the ``n`` after them, as ``read`` would give them, when the
        read-ahead holds them all and the limits still hold after them; else None, and nothing consumed
        (the caller then reads them with ``read``, which reads on, or raises naming where: no message is
        made here, as this is called for each header and small file)."""
        pos = self.pos + skip
        end = pos + n
        if end > len(self.buffer):
            return None
        data = self.buffer[pos:end]
        zeros = n if piece and n and not data[0] and data.count(0) == n else 0
        if not self.within_limits(self._buffer_offset + end, self.zero_bytes + zeros):
            return None
        self.pos = end
        self.zero_bytes += zeros
        return data

    def fill(self, n: int, where: str) -> bool:
        """Make ``buffer[pos:pos + n]`` hold ``n`` bytes, reading ahead; False if the input ends first."""
        buffer, pos = self.buffer, self.pos
        if pos + n <= len(buffer):
            return True
        parts = [buffer[pos:]]
        got = len(buffer) - pos
        while got < n:
            more = self._read(max(_BLOCK_READ, n - got), self.offset + got, where)
            if not more:
                break
            parts.append(more)
            got += len(more)
        self._buffer_offset += pos
        self.buffer, self.pos = b"".join(parts), 0
        return got >= n

    def _read_beyond(self, n: int, where: str) -> bytes:
        """read_some of more than the buffer holds: its rest, then the input read to ``n`` or its end."""
        parts = [self.buffer[self.pos:]]
        got = len(parts[0])
        self._buffer_offset += len(self.buffer)
        self.buffer, self.pos = b"", 0
        while got < n:
            more = self._read(n - got, self._buffer_offset, where)
            if not more:
                break
            parts.append(more)
            got += len(more)
            self._buffer_offset += len(more)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read(self, n: int, at: int, where: str) -> bytes:
        """One read of the input, which is at uncompressed offset ``at``."""
        try:
            return self._read_input(n)
        except EOFError:  # gzip's way of saying the compressed stream stops early
            raise InputError(f"truncated: the compressed input ends at uncompressed offset {at}", where=where) from None
        except (OSError, zlib.error, zstandard.ZstdError) as exc:
            raise InputError(f"cannot read or decompress the input: {exc}", where=where) from None

    def drain(self, where: str) -> None:
        """Decompress to the end of a compressed input, so gzip's CRC and zstd's checksums are verified
        (the tar's end-of-archive marker comes before them). A plain input is left alone."""
        if self._counting is not None:
            while self.read_some(_SKIP_PIECE, where):
                pass

    def skip(self, n: int, what: str, where: str) -> None:
        while n > 0:
            step = min(n, _SKIP_PIECE)
            self.read(step, what, where)
            n -= step

    def within_limits(self, offset: int, zero_bytes: int) -> bool:
        """Whether ``offset`` bytes consumed, ``zero_bytes`` of them in all-zero file pieces, are within
        TarLimits.max_tar_bytes and the expansion ratio."""
        limits = self.limits
        if offset > limits.max_tar_bytes:
            return False
        counting = self._counting
        return counting is None or offset - zero_bytes <= limits.expansion_allowance + limits.max_expansion * counting.count

    def check_limits(self, where: str) -> None:
        """InputError if the bytes consumed exceed TarLimits.max_tar_bytes or the expansion ratio."""
        limits = self.limits
        if self.offset > limits.max_tar_bytes:
            raise InputError(
                f"the tar stream exceeds {limits.max_tar_bytes} bytes (TarLimits.max_tar_bytes)", where=where
            )
        if self._counting is not None:
            allowed = limits.expansion_allowance + limits.max_expansion * self._counting.count
            if self.offset - self.zero_bytes > allowed:
                raise InputError(
                    f"decompression bomb: {self.offset - self.zero_bytes} bytes besides all-zero file pieces from "
                    f"{self._counting.count} compressed bytes (TarLimits.max_expansion {limits.max_expansion}:1 "
                    f"beyond {limits.expansion_allowance}; raise it with --tar-limit max_expansion=N)",
                    where=where,
                )


def _open_input(raw: BinaryIO, source: str, limits: TarLimits) -> _TarStream:
    """Wrap ``raw`` in the decompressor its magic bytes call for."""
    counting = _CountingInput(raw)
    try:
        head = counting.sniff(10)
    except OSError as exc:
        raise InputError(f"cannot read the input: {exc}", where=source) from None
    if head.startswith(b"\x1f\x8b"):
        return _TarStream(gzip.GzipFile(fileobj=counting, mode="rb"), counting, source, limits)
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        # Memory is bounded by zstd's default window limit (128 MiB); frames asking for more are refused.
        reader = zstandard.ZstdDecompressor().stream_reader(counting, read_across_frames=True, closefd=False)
        return _TarStream(reader, counting, source, limits)
    if head.startswith(b"\xfd7zXZ\x00"):
        raise UnsupportedError("xz-compressed tar: use plain, gzip or zstd", where=source)
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY":
        raise UnsupportedError("bzip2-compressed tar: use plain, gzip or zstd", where=source)
    return _TarStream(counting, None, source, limits)
