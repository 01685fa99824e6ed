"""The members of a tar stream (walk_tar.py): each header with the extension headers before it (GNU long
names 'L'/'K', PAX 'x' and 'g'), its sparse map (old GNU 'S', GNU PAX sparse 0.0, 0.1 and 1.0), and its
content, readable once, in order, while the stream is on it.

``_TarReader.next_block`` and ``member`` walk the archive member by member, first skipping what is left of the
previous one, and ends at the end marker (data after a lone zero block is refused). Everything that
breaks the archive's framing is fatal (InputError): truncation, oversized extension headers, a
header-only member (link, device, directory...) that claims data. A bad member whose extent is known
raises ``MemberError`` (an InputError) naming the member and its header offset, so ``lenient=True`` can
skip it: absurd sparse maps (unsorted, overlapping, past the end, too many segments, not matching the
data), malformed PAX numbers (decimals of more than MAX_DECIMAL_DIGITS digits are refused before int()
sees them).

Threads: one thread iterates and calls the readers; nothing here is shared between threads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsec_fs.errors import InputError

from .tar_header import (_GNU_EXT_IS_EXTENDED, _GNU_IS_EXTENDED, _GNU_REALSIZE, _GNU_SPARSE_PAIRS, _cstring, _Header,
                         _number, _parse_pax)
from .tar_input import _TarStream
from .tree import Node

log = logging.getLogger(__name__)

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
# PAX numbers are decimal text of any length; every field we read fits in 20 digits. Longer text is refused
# before int() sees it (Python refuses over 4300 digits with ValueError, and converting is quadratic).
MAX_DECIMAL_DIGITS = 40

REGULAR_TYPES = (b"0", b"\0", b"7")  # '7' (contiguous file) is a regular file everywhere
HEADER_ONLY_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # their size field must be 0 (see _read_member)


class MemberError(InputError):
    """One member is unusable but the archive's framing is intact, so ``lenient=True`` can skip it."""


@dataclass(slots=True, eq=False)
class _Member:
    name: bytes  # as archived, after GNU long names and PAX path
    source: str  # the name for people (Node.source)
    where: str  # the archive, the member and the offset of its first header: errors name it
    header: _Header
    linkname: bytes
    offset: int  # of its first header (an extension header's, if any)
    size: int  # bytes of data after the header (sparse: the stored segments, plus the 1.0 map)
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
    """Walks the archive member by member: ``next_block`` finishes the current member (skips what is left
    of its data) and gives the next header block, ``member`` reads the member that block starts (with its
    extension headers); a caller that reads a plain member itself (walk_tar._plain_entry) says so with
    ``start``. The current member's unread data is ``data_left``."""

    def __init__(self, stream: _TarStream):
        self.stream = stream
        self.data_left = 0  # bytes of the current member's data not yet consumed
        self._padding = 0  # after the current member's data, up to the next header
        self._current: tuple[bytes, int] | None = None  # the current member's name and offset, for messages
        self._content: _Content | None = None
        self._warned_keys: set[bytes] = set()

    def start(self, name: bytes, offset: int, size: int, content: _Content | None) -> None:
        """The member at ``offset`` named ``name`` with ``size`` bytes of data is the current one; its
        ``content`` reader, if any, is closed when the reader moves on."""
        self._current = (name, offset)
        self.data_left = size
        self._padding = -size % BLOCK
        self._content = content

    def where(self) -> str:
        """The current member, for messages (member_where's form)."""
        name, offset = self._current
        return member_where(self.stream.source, name, offset)

    def next_block(self) -> tuple[bytes, int]:
        """Finish the current member, then the next header block, consumed, and its offset. The member's
        padding is read with the block (and a truncation inside it names the member)."""
        if self._content is not None:
            self._content.close()
            self._content = None
        stream = self.stream
        if self.data_left:
            stream.skip(self.data_left, "member data", self.where())
            self.data_left = 0
        padding, self._padding = self._padding, 0
        block = stream.take(BLOCK, skip=padding)
        if block is None and stream.fill(padding + BLOCK, f"{stream.source}: header at offset {stream.offset + padding}"):
            block = stream.take(BLOCK, skip=padding)
        if block is not None:
            return block, stream.offset - BLOCK
        # The input ends within the padding or the header, or a limit is reached: as a plain read says it.
        offset = stream.offset + padding
        where = f"{stream.source}: header at offset {offset}"
        data = stream.read_some(padding + BLOCK, where)
        if len(data) < padding:
            raise InputError(f"truncated: the input ends at offset {stream.offset} inside member data",
                             where=self.where())
        if len(data) < padding + BLOCK:
            raise InputError(f"truncated: the input ends at offset {stream.offset} inside a header (or "
                             "the end-of-archive marker)", where=where)
        return data[padding:], offset

    def member(self, block: bytes, offset: int) -> _Member | None:
        """The member whose first header (an extension header, or its own) is ``block`` at ``offset``, now
        the current one; None at the end of the archive."""
        stream = self.stream
        ext = _NO_EXTENSIONS  # until an extension header comes
        while True:
            where = f"{stream.source}: header at offset {offset}"
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
                member = self._read_member(header, offset, ext)
                if header.typeflag == b"S":
                    self._read_old_sparse(member)
                return member
            offset = stream.offset
            block = stream.read(BLOCK, "a header (or the end-of-archive marker)", f"{stream.source}: header at "
                                f"offset {offset}")

    def attach(self, content: _Content) -> None:
        """The content reader of the current member, to be closed when the reader moves on."""
        self._content = content

    def _end_of_archive(self, where: str) -> None:
        # The marker is two zero blocks; GNU tar accepts a lone one at the very end. A non-zero block
        # after a zero block is data most readers never see: refuse it rather than guess.
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
        if ext.offset is not None:
            offset = ext.offset
        where = member_where(self.stream.source, name, offset)
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
            offset=offset,
            size=size,
            pax=pax,
            sparse_00=ext.sparse_00,
        )
        self.start(name, offset, size, None)
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


def member_where(source: str, name: bytes, offset: int) -> str:
    """How errors name a member: the archive, the member's name and the offset of its first header."""
    return f"{source}: member {name.decode('utf-8', 'backslashreplace')} at offset {offset}"


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
    return realsize, _checked_segments(segments, realsize, reader.data_left, limit, where)


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
        if reader.data_left < BLOCK:
            raise MemberError("sparse map runs past the member's data", where=where)
        pending += reader.stream.read(BLOCK, "the sparse map", where)
        reader.data_left -= BLOCK
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

    __slots__ = ("_reader", "_node", "_segments", "_name", "_offset", "_started", "_closed")

    def __init__(self, reader: _TarReader, node: Node, segments: list[tuple[int, int]] | None, name: bytes,
                 offset: int):
        self._reader = reader
        self._node = node
        self._segments = segments  # None: the data is the whole file
        self._name, self._offset = name, offset  # the member's, for messages (made only for one)
        self._started = False
        self._closed = False

    @property
    def where(self) -> str:
        return member_where(self._reader.stream.source, self._name, self._offset)

    def read(self, chunk_size: int) -> Iterator[bytes | None] | tuple[bytes, ...]:
        """Node.reader: pieces of ``chunk_size`` bytes (the last shorter), None for a piece that is all hole;
        a member of one piece is read now, its piece in a tuple (tree.ChunkReader)."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self.where}: the content of a tar member can be read only once")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {chunk_size}")
        self._started = True
        if self._segments is not None:
            return self._sparse_pieces(chunk_size)
        size = self._node.size
        if size <= chunk_size:  # one piece (most files): read now, without a generator
            if not size:
                return ()
            data = self._reader.stream.take(size, piece=True)
            if data is None:
                return (self._take(size, piece=True),)
            self._reader.data_left -= size
            return (data,)
        return self._pieces(chunk_size)

    def close(self) -> None:
        self._closed = True
        self._node.reader = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"{self.where}: content read after the tar stream moved past the member "
                "(read it before advancing the iterator)"
            )

    def _take(self, n: int, *, piece: bool = False) -> bytes:
        self._check_open()
        data = self._reader.stream.read(n, "the member's data", self.where, piece=piece)
        self._reader.data_left -= n
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
