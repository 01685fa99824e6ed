"""Read a tar stream (plain, gzip or zstd) into Nodes and a Tree, without extracting anything to disk.

Formats: ustar, GNU (long names 'L'/'K', old sparse 'S') and PAX (exact mtime in nanoseconds, long names,
big sizes and ids, xattrs as SCHILY.xattr.* / LIBARCHIVE.xattr.* / RHT.security.selinux, GNU sparse maps
0.0, 0.1 and 1.0). Compression is recognised by its magic bytes. We parse headers ourselves rather than
with ``tarfile``: tarfile ends the archive silently at a bad checksum or a truncated header, keeps every
member in memory, reads a PAX header of any size into memory and rounds PAX mtimes to a float.

Streaming. The input is read once, front to back; memory stays bounded (one header, one chunk). So a
regular file's content can only be read while the stream is on its member. ``tar_nodes`` yields each
member's (path, Node); a new regular file's ``Node.reader`` reads that member's data and is valid only
until the iterator is advanced. Advancing skips whatever was not read, then sets ``node.reader`` to None;
a reader (or a piece iterator it returned) used after that raises RuntimeError, and a reader can be called
once. ``walk_tar`` and ``fill_tree`` call ``on_file(node)`` at exactly the right moment; a build passes the
chunker's per-file function there, and the chunker must not call ``node.reader`` again later (a tar node
whose content was consumed has ``chunks`` set and ``reader`` None). ``on_file=None`` builds a
metadata-only Tree: regular files keep ``chunks`` None and ``reader`` None, which no build may publish.

Hard links ('1') give the very Node of the earlier member they name (same object at both paths), and
carry no reader of their own. GNU tar's path rules: leading '/' and '.' components are dropped, the last
of duplicate members wins (Tree.add).

Hostile input. Everything that breaks the archive's framing is fatal (InputError): bad header checksum,
truncation anywhere ("truncated"), corrupt compression (a compressed input is read to its very end, past
the tar's end marker, so gzip's CRC and zstd's checksums are checked), malformed PAX records, oversized
extension headers, a header-only member (link, device, directory...) that claims data, data after a lone zero
block, decompression beyond ``TarLimits`` (limits.py), a layer beyond its ``LayerLimits`` (with a budget). A bad member whose extent is known raises ``MemberError`` (an
InputError) naming the member and its header offset: '..' or NUL in a name, a hard link to a missing,
directory or outside target, sizes over ``TarLimits.max_file_size``, absurd sparse maps (unsorted,
overlapping, past the end, too many segments, not matching the data), bad ids, device numbers or xattrs,
unknown member types, and overlay-reserved xattrs (trusted.overlay.* / user.overlay.*: in a layer they
would steer OverlayFS). With ``lenient=True`` such members are skipped with a warning; so are members the
Tree refuses (e.g. an entry below a non-directory). Offsets are in the uncompressed tar stream.

Threads: one thread iterates and calls the readers; nothing here is shared between threads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gzip
import logging
import os
import stat
import struct
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from dsec_fs.errors import InputError, UnsupportedError

from .limits import DEFAULT_LIMITS, LayerBudget, TarLimits
from .tree import Node, Tree

log = logging.getLogger(__name__)

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_ID = (1 << 32) - 1  # EROFS extended inodes store 32-bit uid/gid
MAX_MAJOR = (1 << 12) - 1  # Linux dev_t (and EROFS's rdev): 12-bit major, 20-bit minor
MAX_MINOR = (1 << 20) - 1
PATH_MAX = 4096  # a symlink target must be shorter (Linux)
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 1 << 16
RESERVED_XATTR_PREFIXES = (b"trusted.overlay.", b"user.overlay.")
_SKIP_PIECE = 1 << 20  # bytes per read when skipping data
# PAX numbers are decimal text of any length; every field we read fits in 20 digits. Longer text is refused
# before int() sees it (Python refuses over 4300 digits with ValueError, and converting is quadratic).
MAX_DECIMAL_DIGITS = 40

REGULAR_TYPES = (b"0", b"\0", b"7")  # '7' (contiguous file) is a regular file everywhere
HEADER_ONLY_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # their size field must be 0 (see _read_member)


class MemberError(InputError):
    """One member is unusable but the archive's framing is intact, so ``lenient=True`` can skip it."""


# ---------------------------------------------------------------------------------------------------------
# The input: decompression, exact reads, limits.


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


# ---------------------------------------------------------------------------------------------------------
# The header block.

# One 512-byte header: POSIX ustar layout; numbers are octal text (or GNU base-256), strings NUL-padded.
_HEADER = struct.Struct(
    "100s"  # name: path (ustar: the part after prefix)
    "8s"  # mode: permission bits; any file type bits here are ignored, typeflag says the type
    "8s"  # uid
    "8s"  # gid
    "12s"  # size: bytes of data following the header (for sparse members: the stored data)
    "12s"  # mtime: seconds since the epoch
    "8s"  # chksum: sum of the header's bytes, this field counted as spaces
    "c"  # typeflag: '0' file, '1' hard link, '2' symlink, '3' char, '4' block, '5' dir, '6' fifo, ...
    "100s"  # linkname: hard link or symlink target
    "8s"  # magic + version: b"ustar\x0000" (POSIX), b"ustar  \x00" (GNU), zeros (v7)
    "32s"  # uname (ignored: ids are numeric)
    "32s"  # gname
    "8s"  # devmajor
    "8s"  # devminor
    "155s"  # prefix (POSIX ustar); GNU uses this area for atime, ctime and the old sparse map
    "12x"  # padding
)
_CHKSUM = slice(148, 156)
_POSIX_MAGIC = b"ustar\x0000"
# Old GNU sparse ('S'): four (offset, numbytes) pairs of 12 octal bytes at 386, isextended at 482, the
# real file size at 483; each extension block holds 21 pairs and its own isextended at 504.
_GNU_SPARSE_PAIRS = 386
_GNU_IS_EXTENDED = 482
_GNU_REALSIZE = slice(483, 495)
_GNU_EXT_IS_EXTENDED = 504


_OCTAL_DIGITS = b"01234567"


def _cstring(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _number(field: bytes, what: str, where: str) -> int:
    """A numeric field: octal text padded with NULs or spaces, or GNU base-256 when byte 0 has its top bit."""
    digits = field.rstrip(b" \0")
    if digits and not digits.translate(None, _OCTAL_DIGITS):  # the common case: digits, then padding
        return int(digits, 8)
    if field and field[0] & 0x80:
        # Two's complement over the remaining 8n-1 bits; bit 0x40 of byte 0 is the sign.
        value = int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
        return value - (1 << (8 * len(field) - 1)) if field[0] & 0x40 else value
    text = _cstring(field.strip(b" \0")).strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise InputError(f"header field {what} is not an octal number: {field!r}", where=where)
    return int(text, 8)


def header_sum(block: bytes) -> int:
    """The unsigned checksum of a 512-byte header block: the sum of its bytes with the chksum field counted
    as spaces. At C speed: the low 16 bits of Adler-32 are 1 plus the sum of the bytes modulo 65,521, and
    256 bytes sum to at most 65,280, so each half's sum is exact (``sum(block)`` costs ~1 us a header)."""
    return ((zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2
            - sum(block[_CHKSUM]) + 8 * 32)


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[_CHKSUM], "chksum", "")
    except InputError:  # not even a number
        return False
    unsigned = header_sum(block)
    if stored == unsigned:
        return True
    # Some old tars summed signed chars.
    signed = unsigned - 256 * sum(1 for b in block if b >= 128) + 256 * sum(1 for b in block[_CHKSUM] if b >= 128)
    return stored == signed


@dataclass(slots=True)
class _Header:
    name: bytes
    mode: int
    uid: int
    gid: int
    size: int
    mtime: int
    typeflag: bytes
    linkname: bytes
    devmajor: int
    devminor: int
    block: bytes  # the raw block, for the GNU sparse fields

    @classmethod
    def unpack(cls, block: bytes, where: str) -> _Header:
        (name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic,
         _uname, _gname, devmajor, devminor, prefix) = _HEADER.unpack(block)  # fmt: skip
        name = _cstring(name)
        if magic == _POSIX_MAGIC and prefix[0]:
            name = _cstring(prefix) + b"/" + name
        # The common case at C speed: every number is octal digits then padding (or padding alone: 0), and
        # the checksum the unsigned sum. Anything else takes _number's and _checksum_ok's general rules.
        numbers = [field.rstrip(b" \0") for field in (chksum, size, mode, uid, gid, mtime, devmajor, devminor)]
        if numbers[0] and not b"".join(numbers).translate(None, _OCTAL_DIGITS):
            stored, data_size, mode, uid, gid, mtime, devmajor, devminor = [int(n, 8) if n else 0 for n in numbers]
            if stored != header_sum(block) and not _checksum_ok(block):
                raise InputError("bad header checksum (not a tar archive, or a corrupt one)", where=where)
            return cls(name, mode, uid, gid, data_size, mtime, typeflag, _cstring(linkname), devmajor, devminor,
                       block)
        if not _checksum_ok(block):
            raise InputError("bad header checksum (not a tar archive, or a corrupt one)", where=where)
        data_size = _number(size, "size", where)
        if data_size < 0:
            raise InputError(f"negative size {data_size}", where=where)
        return cls(
            name=name,
            mode=_number(mode, "mode", where),
            uid=_number(uid, "uid", where),
            gid=_number(gid, "gid", where),
            size=data_size,
            mtime=_number(mtime, "mtime", where),
            typeflag=typeflag,
            linkname=_cstring(linkname),
            devmajor=_number(devmajor, "devmajor", where),
            devminor=_number(devminor, "devminor", where),
            block=block,
        )


def _parse_pax(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """PAX extended header records: each is b"<length> <key>=<value>\\n", length counting the whole record."""
    records = []
    pos = 0
    while pos < len(data):
        if data[pos] == 0 and not data[pos:].strip(b"\0"):  # NUL padding after the last record
            break
        space = data.find(b" ", pos, pos + 21)
        length = data[pos:space] if space > pos else b""
        if not length.isdigit():
            raise InputError(f"malformed PAX record at byte {pos}", where=where)
        end = pos + int(length)
        if end <= space + 1 or end > len(data) or data[end - 1] != 0x0A:
            raise InputError(f"malformed PAX record at byte {pos}: bad length", where=where)
        key, equals, value = data[space + 1 : end - 1].partition(b"=")
        if not equals or not key:
            raise InputError(f"malformed PAX record at byte {pos}: no key=value", where=where)
        records.append((key, value))
        pos = end
    return records


# ---------------------------------------------------------------------------------------------------------
# Members: a header plus the extension headers before it.


@dataclass(slots=True, eq=False)
class _Member:
    name: bytes  # as archived, after GNU long names and PAX path
    source: str  # the name for people (Node.source)
    where: str  # the archive, the member and the offset of its first header: errors name it
    header: _Header
    linkname: bytes
    size: int  # bytes of data after the header (sparse: the stored segments, plus the 1.0 map)
    data_left: int  # of those, not yet consumed
    pax: dict[bytes, bytes]  # the member's PAX records, the last of a repeated key winning
    sparse_00: list[tuple[bytes, bytes]]  # PAX 0.0 sparse records in order (their keys repeat)
    old_sparse: list[tuple[int, int]] | None = None  # the map of an old GNU 'S' member
    old_realsize: int = 0
    problem: str | None = None  # found while framing, reported (or skipped) with the member


@dataclass(slots=True)
class _Extensions:
    """Extension headers ('x', 'L', 'K') collected for the next member."""

    pax: dict[bytes, bytes] = field(default_factory=dict)
    sparse_00: list[tuple[bytes, bytes]] = field(default_factory=list)
    long_name: bytes | None = None
    long_link: bytes | None = None
    size: int = 0  # bytes of extension data, bounded by TarLimits.max_header_size
    offset: int | None = None  # of the first extension header


# A member without extension headers (most of them): read only, never added to.
_NO_EXTENSIONS = _Extensions(pax={}, sparse_00=[])


class _TarReader:
    """Walks the archive member by member; ``next_member`` first skips what is left of the previous one."""

    def __init__(self, stream: _TarStream):
        self.stream = stream
        self._member: _Member | None = None
        self._content: _Content | None = None
        self._ended = False
        self._warned_keys: set[bytes] = set()

    def next_member(self) -> _Member | None:
        padding, member_where = self._finish_member()
        if self._ended:
            return None
        stream = self.stream
        ext = _NO_EXTENSIONS  # until an extension header comes
        while True:
            offset = stream.offset + padding
            where = f"{stream.source}: header at offset {offset}"
            if padding:  # the last member's padding and the next header in one read
                data = stream.read_some(padding + BLOCK, where)
                if len(data) < padding:
                    raise InputError(f"truncated: the input ends at offset {stream.offset} inside member data",
                                     where=member_where)
                block, padding = data[padding:], 0
                if len(block) < BLOCK:
                    raise InputError(f"truncated: the input ends at offset {stream.offset} inside a header (or "
                                     "the end-of-archive marker)", where=where)
            else:
                block = stream.read(BLOCK, "a header (or the end-of-archive marker)", where)
            if block == ZERO_BLOCK:
                if ext.offset is not None:
                    raise InputError("extension header not followed by a member", where=where)
                self._end_of_archive(where)
                return None
            header = _Header.unpack(block, where)
            kind = header.typeflag
            if kind in (b"x", b"g", b"L", b"K"):
                if ext is _NO_EXTENSIONS:
                    ext = _Extensions()
                self._read_extension(header, offset, ext, where)
            elif kind == b"V":  # a volume label names the archive, not a file
                stream.skip(header.size + _padding(header.size), "a volume label", where)
            else:
                self._member = self._read_member(header, offset, ext)
                return self._member

    def attach(self, content: _Content) -> None:
        """The content reader of the current member, to be closed when the reader moves on."""
        self._content = content

    def _finish_member(self) -> tuple[int, str | None]:
        """Close the current member: skip what is left of its data; its padding is left to the caller, to
        be read with the next header (and where to say the member was truncated)."""
        if self._content is not None:
            self._content.close()
            self._content = None
        member, self._member = self._member, None
        if member is None:
            return 0, None
        if member.data_left:
            self.stream.skip(member.data_left, "member data", member.where)
            member.data_left = 0
        return _padding(member.size), member.where

    def _end_of_archive(self, where: str) -> None:
        # The marker is two zero blocks; GNU tar accepts a lone one at the very end. A non-zero block
        # after a zero block is data most readers never see: refuse it rather than guess.
        self._ended = True
        rest = self.stream.read_some(BLOCK, where)
        if rest.strip(b"\0"):
            raise InputError("data after a zero block (a hidden second archive?)", where=where)
        self.stream.drain(where)

    def _read_extension(self, header: _Header, offset: int, ext: _Extensions, where: str) -> None:
        kind = header.typeflag
        limit = self.stream.limits.max_header_size
        if ext.size + header.size > limit:
            raise InputError(
                f"extension header of {header.size} bytes (TarLimits.max_header_size {limit})", where=where
            )
        data = self.stream.read(header.size, "an extension header", where)
        self.stream.skip(_padding(header.size), "an extension header", where)
        if kind == b"g":
            # Global PAX headers are rare (git archive writes a comment); their records are not applied.
            ignored = {key for key, _ in _parse_pax(data, where)} - {b"comment"} - self._warned_keys
            if ignored:
                self._warned_keys |= ignored
                log.warning("%s: global PAX header records ignored: %s", where, sorted(ignored))
            return
        ext.size += header.size
        if ext.offset is None:
            ext.offset = offset
        if kind == b"x":
            for key, value in _parse_pax(data, where):
                if key in (b"GNU.sparse.offset", b"GNU.sparse.numbytes"):
                    ext.sparse_00.append((key, value))
                else:
                    ext.pax[key] = value
        elif kind == b"L":
            ext.long_name = _cstring(data)
        else:
            ext.long_link = _cstring(data)

    def _read_member(self, header: _Header, offset: int, ext: _Extensions) -> _Member:
        pax = ext.pax
        # An empty PAX value means "no override".
        name = pax.get(b"GNU.sparse.name") or pax.get(b"path") or ext.long_name or header.name
        source = name.decode("utf-8", "backslashreplace")
        where = f"{self.stream.source}: member {source} at offset {offset if ext.offset is None else ext.offset}"
        size = header.size
        if pax.get(b"size"):
            size = _pax_decimal(pax[b"size"], "size", where, InputError)  # framing: fatal
        if header.typeflag in HEADER_ONLY_TYPES and size != 0:
            # tarfile and Go skip no data for these types, GNU tar does: readers would disagree on
            # where the next header is.
            raise InputError(f"a member of type {header.typeflag!r} claims {size} bytes of data", where=where)
        member = _Member(
            name=name,
            source=source,
            where=where,
            header=header,
            linkname=pax.get(b"linkpath") or ext.long_link or header.linkname,
            size=size,
            data_left=size,
            pax=pax,
            sparse_00=ext.sparse_00,
        )
        if header.typeflag == b"S":
            self._read_old_sparse(member)
        return member

    def _read_old_sparse(self, member: _Member) -> None:
        """The old GNU sparse map: in the header, then in extension blocks that precede the data."""
        block = member.header.block
        limit = self.stream.limits.max_sparse_segments
        segments: list[tuple[int, int]] = []
        count = 0
        pairs, more = block[_GNU_SPARSE_PAIRS:_GNU_IS_EXTENDED], block[_GNU_IS_EXTENDED]
        while True:
            for i in range(0, len(pairs), 24):
                pair = pairs[i : i + 24]
                if not pair.strip(b"\0"):
                    break
                count += 1
                if count <= limit:
                    segments.append((_number(pair[:12], "sparse offset", member.where),
                                     _number(pair[12:], "sparse numbytes", member.where)))  # fmt: skip
            if not more:
                break
            ext_block = self.stream.read(BLOCK, "a sparse extension block", member.where)
            pairs, more = ext_block[:_GNU_EXT_IS_EXTENDED], ext_block[_GNU_EXT_IS_EXTENDED]
        if count > limit:  # the blocks had to be read anyway: they come before the data
            member.problem = f"sparse map has {count} segments (TarLimits.max_sparse_segments {limit})"
        member.old_sparse = segments
        member.old_realsize = _number(block[_GNU_REALSIZE], "realsize", member.where)


def _padding(size: int) -> int:
    return -size % BLOCK


def _pax_decimal(value: bytes, what: str, where: str, error: type[InputError] = MemberError) -> int:
    if not value.isdigit() or len(value) > MAX_DECIMAL_DIGITS:
        raise error(f"PAX {what} is not a decimal number of at most {MAX_DECIMAL_DIGITS} digits: {value[:40]!r}",
                    where=where)
    return int(value)


# ---------------------------------------------------------------------------------------------------------
# Sparse maps.


def _sparse_map(member: _Member, reader: _TarReader) -> tuple[int, list[tuple[int, int]]] | None:
    """(real size, data segments) of a sparse member, validated; None if the member is not sparse."""
    pax = member.pax
    where = member.where
    limit = reader.stream.limits.max_sparse_segments
    version = (pax.get(b"GNU.sparse.major"), pax.get(b"GNU.sparse.minor"))
    if member.header.typeflag == b"S":
        realsize, segments = member.old_realsize, member.old_sparse
    elif version != (None, None):
        if version != (b"1", b"0"):
            raise MemberError(f"unsupported GNU sparse format {version}", where=where)
        realsize = _pax_decimal(pax.get(b"GNU.sparse.realsize", b""), "GNU.sparse.realsize", where)
        segments = _read_sparse_map_1_0(member, reader)
    elif b"GNU.sparse.map" in pax:  # format 0.1: "offset,numbytes,offset,numbytes,..."
        numbers = pax[b"GNU.sparse.map"].split(b",")
        _check_segment_count(len(numbers) // 2, limit, where)
        segments = _pairs([_pax_decimal(n, "GNU.sparse.map", where) for n in numbers], where)
        realsize = _sparse_size(pax, where)
    elif member.sparse_00 or b"GNU.sparse.numblocks" in pax:  # format 0.0: repeated offset, numbytes records
        _check_segment_count(len(member.sparse_00) // 2, limit, where)
        expected = [b"GNU.sparse.offset", b"GNU.sparse.numbytes"] * (len(member.sparse_00) // 2)
        if [key for key, _ in member.sparse_00] != expected or len(member.sparse_00) % 2:
            raise MemberError("GNU.sparse.offset and GNU.sparse.numbytes records do not alternate", where=where)
        segments = _pairs([_pax_decimal(v, "sparse record", where) for _, v in member.sparse_00], where)
        realsize = _sparse_size(pax, where)
    else:
        return None
    if b"GNU.sparse.numblocks" in pax:
        count = _pax_decimal(pax[b"GNU.sparse.numblocks"], "GNU.sparse.numblocks", where)
        if count != len(segments):
            raise MemberError(f"GNU.sparse.numblocks is {count} but the map has {len(segments)} segments", where=where)
    return realsize, _checked_segments(segments, realsize, member.data_left, limit, where)


def _check_segment_count(count: int, limit: int, where: str) -> None:
    if count > limit:
        raise MemberError(f"sparse map has {count} segments (TarLimits.max_sparse_segments {limit})", where=where)


def _sparse_size(pax: dict[bytes, bytes], where: str) -> int:
    value = pax.get(b"GNU.sparse.size") or pax.get(b"GNU.sparse.realsize") or b""
    return _pax_decimal(value, "GNU.sparse.size", where)


def _pairs(numbers: list[int], where: str) -> list[tuple[int, int]]:
    if len(numbers) % 2:
        raise MemberError("sparse map has an odd count of numbers", where=where)
    return list(zip(numbers[::2], numbers[1::2]))


def _read_sparse_map_1_0(member: _Member, reader: _TarReader) -> list[tuple[int, int]]:
    """Format 1.0 keeps the map at the start of the data: decimal lines (count, then offset/numbytes pairs),
    padded to a block boundary."""
    where = member.where
    limit = reader.stream.limits.max_sparse_segments
    numbers: list[int] = []
    wanted = None  # count of numbers after the first line, once known
    pending = b""
    while wanted is None or len(numbers) < wanted:
        line, newline, rest = pending.partition(b"\n")
        if newline:
            pending = rest
            if not line.isdigit() or len(line) > 20:
                raise MemberError(f"malformed sparse map line {line[:40]!r}", where=where)
            if wanted is None:
                _check_segment_count(int(line), limit, where)
                wanted = 2 * int(line)
            else:
                numbers.append(int(line))
            continue
        if len(pending) > 20:
            raise MemberError("malformed sparse map: a line longer than a number", where=where)
        if member.data_left < BLOCK:
            raise MemberError("sparse map runs past the member's data", where=where)
        pending += reader.stream.read(BLOCK, "the sparse map", where)
        member.data_left -= BLOCK
    return _pairs(numbers, where)


def _checked_segments(
    segments: list[tuple[int, int]], realsize: int, stored: int, limit: int, where: str
) -> list[tuple[int, int]]:
    """The map's non-empty segments, after checking they are sorted, disjoint, inside the file and account
    for exactly the stored data. (GNU tar ends a map with an empty segment at the file's size.)"""
    _check_segment_count(len(segments), limit, where)
    end = 0
    total = 0
    for i, (offset, length) in enumerate(segments):
        if offset < end:
            raise MemberError(f"sparse segment {i} at {offset} is unsorted or overlaps the previous one", where=where)
        end = offset + length
        if end > realsize:
            raise MemberError(f"sparse segment {i} ends at {end}, past the file's size {realsize}", where=where)
        total += length
    if total != stored:
        raise MemberError(f"sparse map covers {total} bytes but the member stores {stored}", where=where)
    return [(offset, length) for offset, length in segments if length]


# ---------------------------------------------------------------------------------------------------------
# Content.


class _Content:
    """The data of the member the stream is on: readable once, in order, until the reader moves on."""

    def __init__(self, reader: _TarReader, member: _Member, node: Node, segments: list[tuple[int, int]] | None):
        self._stream = reader.stream
        self._member = member
        self._node = node
        self._segments = segments  # None: the data is the whole file
        self._started = False
        self._closed = False

    def read(self, chunk_size: int) -> Iterator[bytes | None]:
        """Node.reader: pieces of ``chunk_size`` bytes (the last shorter), None for a piece that is all hole."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self._member.where}: the content of a tar member can be read only once")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {chunk_size}")
        self._started = True
        if self._segments is not None:
            return self._sparse_pieces(chunk_size)
        size = self._node.size
        if size <= chunk_size:  # one piece (most files): read now, without a generator
            return iter((self._take(size, piece=True),) if size else ())
        return self._pieces(chunk_size)

    def close(self) -> None:
        self._closed = True
        self._node.reader = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"{self._member.where}: content read after the tar stream moved past the member "
                "(read it before advancing the iterator)"
            )

    def _take(self, n: int, *, piece: bool = False) -> bytes:
        self._check_open()
        data = self._stream.read(n, "the member's data", self._member.where, piece=piece)
        self._member.data_left -= n
        return data

    def _pieces(self, chunk_size: int) -> Iterator[bytes]:
        size = self._node.size
        for start in range(0, size, chunk_size):
            yield self._take(min(chunk_size, size - start), piece=True)

    def _sparse_pieces(self, chunk_size: int) -> Iterator[bytes | None]:
        # The stored data is the segments' bytes back to back, in map order: read them as pieces need them.
        spans = [(offset, offset + length) for offset, length in self._segments]
        size = self._node.size
        first = 0  # first span not wholly before the current piece
        for start in range(0, size, chunk_size):
            self._check_open()
            end = min(start + chunk_size, size)
            while first < len(spans) and spans[first][1] <= start:
                first += 1
            if first == len(spans) or spans[first][0] >= end:
                yield None
                continue
            piece = bytearray(end - start)
            i = first
            while i < len(spans) and spans[i][0] < end:
                lo, hi = max(spans[i][0], start), min(spans[i][1], end)
                piece[lo - start : hi - start] = self._take(hi - lo)
                i += 1
            yield bytes(piece)


# ---------------------------------------------------------------------------------------------------------
# Nodes.


def _normalize(name: bytes, what: str, where: str) -> bytes:
    """GNU tar's reading of a member path: no leading '/', no '.' or empty components, never '..'."""
    if b"\0" in name:
        raise MemberError(f"{what} contains NUL: {name!r}", where=where)
    parts = [part for part in name.split(b"/") if part not in (b"", b".")]
    if b".." in parts:
        raise MemberError(f"{what} has a '..' component: {name!r}", where=where)
    return b"/".join(parts)


def _mtime_ns(member: _Member) -> int:
    """PAX mtime ("-?seconds[.fraction]") exactly, else the header's whole seconds."""
    value = member.pax.get(b"mtime")
    if not value:
        ns = member.header.mtime * 1_000_000_000
    else:
        seconds, _, fraction = value.removeprefix(b"-").partition(b".")
        if not seconds.isdigit() or (fraction and not fraction.isdigit()) or len(seconds) > MAX_DECIMAL_DIGITS:
            raise MemberError(f"PAX mtime is not a decimal number of at most {MAX_DECIMAL_DIGITS} digits: "
                              f"{value[:40]!r}", where=member.where)
        ns = int(seconds) * 1_000_000_000 + int(fraction[:9].ljust(9, b"0"))
        ns = -ns if value.startswith(b"-") else ns
    if not -(1 << 63) <= ns // 1_000_000_000 < 1 << 63:  # EROFS stores 64-bit seconds
        raise MemberError(f"mtime {ns // 1_000_000_000} s is out of range", where=member.where)
    return ns


def _numeric(member: _Member, key: bytes, header_value: int, maximum: int, what: str) -> int:
    """A number of the header that PAX record ``key`` may override, checked against 0..maximum."""
    value = _pax_decimal(member.pax[key], what, member.where) if member.pax.get(key) else header_value
    if not 0 <= value <= maximum:
        raise MemberError(f"{what} {value} is outside 0..{maximum}", where=member.where)
    return value


def _xattrs(member: _Member) -> dict[bytes, bytes]:
    xattrs = {}
    for key, value in member.pax.items():
        if key.startswith(b"SCHILY.xattr."):
            name = key[len(b"SCHILY.xattr.") :]
        elif key.startswith(b"LIBARCHIVE.xattr."):
            # libarchive percent-encodes the name and base64-encodes the value (padding optional).
            name = urllib.parse.unquote_to_bytes(key[len(b"LIBARCHIVE.xattr.") :])
            try:
                value = base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
            except binascii.Error:
                raise MemberError(f"xattr {name!r}: value is not base64", where=member.where) from None
        elif key == b"RHT.security.selinux":  # Red Hat's tar before SCHILY.xattr
            name = b"security.selinux"
        else:
            continue
        if not name or b"\0" in name or len(name) > XATTR_NAME_MAX:
            raise MemberError(f"invalid xattr name {name[:60]!r}", where=member.where)
        if len(value) > XATTR_SIZE_MAX:
            raise MemberError(f"xattr {name!r} value is {len(value)} bytes (max {XATTR_SIZE_MAX})", where=member.where)
        if name.startswith(RESERVED_XATTR_PREFIXES):
            raise MemberError(f"xattr {name!r} is reserved for OverlayFS", where=member.where)
        xattrs[name] = value
    return xattrs


def _node_for(member: _Member, reader: _TarReader, links: dict[bytes, Node]) -> tuple[bytes, Node]:
    """The (path, Node) of a member; for a regular file, its content is attached to the reader."""
    where = member.where
    if member.problem:
        raise MemberError(member.problem, where=where)
    path = _normalize(member.name, "name", where)
    kind = member.header.typeflag
    if kind == b"1":
        target = _normalize(member.linkname, "hard link target", where)
        node = links.get(target)
        if node is None:
            raise MemberError(f"hard link to {member.linkname!r}, which no earlier member is", where=where)
        if node.is_dir:
            raise MemberError(f"hard link to directory {member.linkname!r}", where=where)
        links[path] = node
        return path, node

    header = member.header
    perms = header.mode & 0o7777
    if member.pax:
        node = Node(
            mode=0,
            uid=_numeric(member, b"uid", header.uid, MAX_ID, "uid"),
            gid=_numeric(member, b"gid", header.gid, MAX_ID, "gid"),
            mtime_ns=_mtime_ns(member),
            xattrs=_xattrs(member),
            source=member.source,
        )
    else:  # no PAX records (most members of a GNU tar): the header's numbers, no xattrs
        if not (0 <= header.uid <= MAX_ID and 0 <= header.gid <= MAX_ID):
            _numeric(member, b"uid", header.uid, MAX_ID, "uid")  # raises, naming the one out of range
            _numeric(member, b"gid", header.gid, MAX_ID, "gid")
        node = Node(0, header.uid, header.gid, _mtime_ns(member), 0, 0, {}, source=member.source)
    sparse = None
    if kind == b"\0" and member.name.endswith(b"/"):
        node.mode = stat.S_IFDIR | perms  # pre-POSIX tars mark directories with a trailing '/'
    elif kind in REGULAR_TYPES and not member.pax and not member.sparse_00:  # not sparse
        node.mode = stat.S_IFREG | perms
        node.size = member.size
        limit = reader.stream.limits.max_file_size
        if node.size > limit:
            raise MemberError(f"file of {node.size} bytes (TarLimits.max_file_size {limit})", where=where)
    elif kind in REGULAR_TYPES or kind == b"S":
        sparse = _sparse_map(member, reader)
        node.mode = stat.S_IFREG | perms
        node.size = member.size if sparse is None else sparse[0]
        limit = reader.stream.limits.max_file_size
        if node.size > limit:
            raise MemberError(f"file of {node.size} bytes (TarLimits.max_file_size {limit})", where=where)
    elif kind == b"2":
        target = member.linkname
        if not target or b"\0" in target or len(target) >= PATH_MAX:
            raise MemberError(f"invalid symlink target {target[:60]!r} ({len(target)} bytes)", where=where)
        node.mode = stat.S_IFLNK | 0o777
        node.target = target
        node.size = len(target)
    elif kind in (b"3", b"4"):
        major = _numeric(member, b"SCHILY.devmajor", member.header.devmajor, MAX_MAJOR, "device major")
        minor = _numeric(member, b"SCHILY.devminor", member.header.devminor, MAX_MINOR, "device minor")
        node.mode = (stat.S_IFCHR if kind == b"3" else stat.S_IFBLK) | perms
        node.rdev = os.makedev(major, minor)
    elif kind in (b"5", b"D"):  # 'D': a GNU incremental dump directory; its data (a listing) is skipped
        node.mode = stat.S_IFDIR | perms
    elif kind == b"6":
        node.mode = stat.S_IFIFO | perms
    else:
        raise MemberError(f"unsupported member type {kind!r}", where=where)
    if node.is_dir:
        node.children = {}
    if node.is_reg:
        content = _Content(reader, member, node, None if sparse is None else sparse[1])
        node.reader = content.read
        reader.attach(content)
    links[path] = node
    return path, node


# ---------------------------------------------------------------------------------------------------------
# Public API.

OnFile = Callable[[Node], None]


def tar_nodes(
    stream: BinaryIO, *, source: str, lenient: bool = False, limits: TarLimits = DEFAULT_LIMITS
) -> Iterator[tuple[bytes, Node]]:
    """(path, Node) for each member of the tar in ``stream``, in archive order.

    A new regular file's ``node.reader`` reads its content from the stream and works only until the
    iterator is advanced (see the module docstring); a hard link yields the earlier member's Node again,
    with no reader. ``source`` names the archive in errors. Fatal problems raise InputError (or
    UnsupportedError for xz/bzip2); a bad member raises MemberError, or is skipped if ``lenient``.
    """
    reader = _TarReader(_open_input(stream, source, limits))
    links: dict[bytes, Node] = {}  # path -> the Node last placed there, for hard links
    while (member := reader.next_member()) is not None:
        try:
            path, node = _node_for(member, reader, links)
        except MemberError as exc:
            if not lenient:
                raise
            log.warning("%s: member skipped: %s", exc.where, exc.message)
            continue
        yield path, node


def fill_tree(
    tree: Tree, nodes: Iterable[tuple[bytes, Node]], *, on_file: OnFile | None, lenient: bool = False,
    budget: LayerBudget | None = None,
) -> Tree:
    """Add streamed (path, Node) pairs to ``tree``, calling ``on_file(node)`` for each new regular file
    while its content is readable (right after the node is placed, before the stream moves on). With
    ``budget``, every entry is counted first: one beyond the layer's limits stops the walk (InputError)."""
    refused: set[int] = set()  # id() of nodes the tree refused (lenient): their hard links go too
    add = tree.adder()  # nothing else changes the tree in this loop
    for path, node in nodes:
        if budget is not None:  # a hard link carries no reader: its inode is counted already
            budget.add(path.rpartition(b"/")[2], node, new_inode=not node.is_reg or node.reader is not None)
        try:
            if id(node) in refused:
                raise InputError("hard link to a member that was skipped", where=node.source)
            add(path, node)
        except InputError as exc:
            if not lenient:
                raise
            log.warning("%s: member skipped: %s", exc.where, exc.message)
            refused.add(id(node))
            continue
        if node.reader is not None and on_file is not None:
            on_file(node)
    return tree


def walk_tar(
    path_or_stream: str | os.PathLike | BinaryIO,
    *,
    on_file: OnFile | None,
    lenient: bool = False,
    tree: Tree | None = None,
    limits: TarLimits = DEFAULT_LIMITS,
    budget: LayerBudget | None = None,
) -> Tree:
    """The Tree of a tar file or stream (plain, gzip or zstd), added to ``tree`` if given; finished.

    ``on_file`` is required and explicit: a build passes the chunker's per-file function (it must read
    ``node.reader`` and fill ``node.chunks`` before returning); None gives a metadata-only Tree whose
    regular files have no content. ``budget``: see fill_tree.
    """
    tree = tree if tree is not None else Tree()
    if isinstance(path_or_stream, (str, bytes, os.PathLike)):
        source = os.fsdecode(path_or_stream)
        try:
            stream = open(path_or_stream, "rb", buffering=1 << 20)
        except OSError as exc:
            raise InputError(f"cannot open: {exc.strerror}", where=source) from None
        closing = stream
    else:
        stream, closing = path_or_stream, contextlib.nullcontext()
        source = str(getattr(stream, "name", "<tar stream>"))
    with closing:
        nodes = tar_nodes(stream, source=source, lenient=lenient, limits=limits)
        fill_tree(tree, nodes, on_file=on_file, lenient=lenient, budget=budget)
    tree.finish()
    return tree
