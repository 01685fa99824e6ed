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
    """The uncompressed tar bytes: exact reads, the current offset, and the decompression limits."""

    def __init__(self, data, counting: _CountingInput | None, source: str, limits: TarLimits):
        self._data = data  # anything with read(n): the decompressor, or the raw input for a plain tar
        self._counting = counting  # the compressed input, for the expansion ratio; None for a plain tar
        self.source = source
        self.limits = limits
        self.offset = 0  # uncompressed bytes consumed
        self.zero_bytes = 0  # of them, in file pieces that were all zeros (holes of the layer)

    def read(self, n: int, what: str, where: str, *, piece: bool = False) -> bytes:
        """Exactly ``n`` bytes; the input ending first means the archive is truncated. ``piece``: a whole
        piece of a file, which the expansion limit does not count if it is all zeros."""
        data = self.read_some(n, where, piece=piece)
        if len(data) < n:
            raise InputError(f"truncated: the input ends at offset {self.offset} inside {what}", where=where)
        return data

    def read_some(self, n: int, where: str, *, piece: bool = False) -> bytes:
        """``n`` bytes, or fewer at the end of the input."""
        data = self._read(n, 0, where)
        got = len(data)
        if got < n and data:  # a short read (a decompressor's, or a pipe's): read on to n or the end
            parts = [data]
            while got < n:
                more = self._read(n - got, got, where)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self.offset += got
        if piece and got and not data[0] and data.count(0) == got:
            self.zero_bytes += got
        self._check_limits(where)
        return data

    def _read(self, n: int, got: int, where: str) -> bytes:
        """One read of the input, ``got`` bytes past the current offset."""
        try:
            return self._data.read(n)
        except EOFError:  # gzip's way of saying the compressed stream stops early
            raise InputError(
                f"truncated: the compressed input ends at uncompressed offset {self.offset + got}", where=where
            ) from None
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

    def _check_limits(self, where: str) -> None:
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
