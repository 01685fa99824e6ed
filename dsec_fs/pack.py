"""The pack object and its index: many compressed chunks in one store object.

S3 charges per request, so chunks travel in packs of about 16 MiB, and a reader fetches one chunk (or a run
of neighbouring chunks) with a ranged GET. Every chunk is its own zstd frame (see compress.py), so a range
holding one frame decompresses alone.

Pack layout (the pack id is the sha256 hex of all of its bytes)::

    frame 0 | frame 1 | ... | frame n-1 | index | trailer

Index layout: the same bytes are stored inside the pack and as the separate ``index/`` object, so a pack
describes itself and a lost index object can be rebuilt from its pack::

    header (INDEX_HEADER) | n x entry (INDEX_ENTRY) | sha256 of everything before it

The trailing sha256 lets a reader tell a torn or flipped index from a valid one before trusting any offset
in it. Entries are in ascending offset order; frames never overlap.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import NamedTuple

from .blobmap import MAX_CHUNK_BITS
from .compress import frame_bound
from .digest import DIGEST_SIZE, sha256, to_hex
from .errors import ConflictError, FormatError, InputError

INDEX_MAGIC = b"DSECIDX1"
INDEX_VERSION = 1
PACK_MAGIC = b"DSECPAK1"

INDEX_HEADER = struct.Struct(
    "<"
    "8s"  # magic: INDEX_MAGIC, so an index is recognisable on its own
    "I"  # version: INDEX_VERSION; a reader refuses any other
    "I"  # count: number of entries that follow
)

INDEX_ENTRY = struct.Struct(
    "<"
    "32s"  # digest: sha256 of the UNCOMPRESSED chunk, the chunk's identity
    "Q"  # offset: first byte of the chunk's zstd frame in the pack
    "I"  # clen: length of the frame (the size of the ranged GET)
    "I"  # ulen: length of the chunk once decompressed (checked against the frame header)
)

INDEX_CHECKSUM_SIZE = DIGEST_SIZE  # sha256 over header and entries
# More entries than any pack holds (a pack is sealed at ~16 MiB of frames, and the smallest frame is ~9
# bytes): an index object is read only up to this many entries' bytes (~200 MB), so a store writer that
# grows one to any size does not make a reader read all of it.
MAX_INDEX_ENTRIES = 4 << 20

PACK_TRAILER = struct.Struct(
    "<"
    "I"  # index_length: bytes of the index just before the trailer
    "8s"  # magic: PACK_MAGIC; written last, so a torn pack upload lacks it
)


class PackEntry(NamedTuple):
    digest: bytes  # 32 raw bytes
    offset: int
    clen: int
    ulen: int


def index_size(count: int) -> int:
    return INDEX_HEADER.size + count * INDEX_ENTRY.size + INDEX_CHECKSUM_SIZE


MAX_INDEX_BYTES = index_size(MAX_INDEX_ENTRIES)


def encode_index(entries: list[PackEntry]) -> bytes:
    """Encode entries as they are; PackWriter is what guarantees they describe a valid pack."""
    return index_of_records(b"".join(INDEX_ENTRY.pack(*entry) for entry in entries))


def index_of_records(records: bytes | bytearray) -> bytes:
    """The index object whose entries are ``records`` (INDEX_ENTRY records, back to back)."""
    body = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, len(records) // INDEX_ENTRY.size) + records
    return body + sha256(body)


def entries_of_records(records: bytes | bytearray) -> list[PackEntry]:
    return [PackEntry(*fields) for fields in INDEX_ENTRY.iter_unpack(records)]


def decode_index(data: bytes, *, source: str, pack_size: int | None = None) -> list[PackEntry]:
    """Decode and validate an index object; ``source`` (the object key) is named in every FormatError.

    With ``pack_size`` (the size of the pack the index describes), every frame must also lie inside the
    pack's frame area.
    """
    frames_end = None if pack_size is None else pack_size - len(data) - PACK_TRAILER.size
    return _decode_index(data, source=source, frames_end=frames_end, base=0)


def index_from_pack(pack_bytes: bytes, *, source: str) -> list[PackEntry]:
    """The entries of a whole pack, read from its embedded index; offsets in errors are pack offsets."""
    trailer_at = len(pack_bytes) - PACK_TRAILER.size
    if trailer_at < 0:
        raise FormatError("pack trailer", 0, f"pack is {len(pack_bytes)} bytes, shorter than a trailer", source=source)
    index_length, magic = PACK_TRAILER.unpack_from(pack_bytes, trailer_at)
    if magic != PACK_MAGIC:
        raise FormatError("pack trailer", trailer_at, f"bad magic {magic!r}, expected {PACK_MAGIC!r}", source=source)
    index_at = trailer_at - index_length
    if index_at < 0:
        raise FormatError(
            "pack trailer", trailer_at, f"index length {index_length} exceeds the {trailer_at} bytes before it",
            source=source,
        )
    return _decode_index(pack_bytes[index_at:trailer_at], source=source, frames_end=index_at, base=index_at)


def _decode_index(data: bytes, *, source: str, frames_end: int | None, base: int) -> list[PackEntry]:
    def fail(offset: int, message: str) -> FormatError:
        return FormatError("pack index", base + offset, message, source=source)

    if len(data) < index_size(0):
        raise fail(0, f"{len(data)} bytes, shorter than an empty index ({index_size(0)})")
    magic, version, count = INDEX_HEADER.unpack_from(data, 0)
    if magic != INDEX_MAGIC:
        raise fail(0, f"bad magic {magic!r}, expected {INDEX_MAGIC!r}")
    if version != INDEX_VERSION:
        raise fail(8, f"version {version}, this reader knows only {INDEX_VERSION}")
    if len(data) != index_size(count):
        raise fail(12, f"{count} entries need {index_size(count)} bytes, the index has {len(data)}")
    checksum_at = len(data) - INDEX_CHECKSUM_SIZE
    if sha256(data[:checksum_at]) != data[checksum_at:]:
        raise fail(checksum_at, "checksum mismatch: the index is torn or corrupt")

    entries = list(map(PackEntry._make, INDEX_ENTRY.iter_unpack(memoryview(data)[INDEX_HEADER.size:checksum_at])))
    if _entries_valid(entries, frames_end):
        return entries
    _fail_at_first_bad_entry(entries, frames_end, fail)
    raise AssertionError("unreachable: _entries_valid and _fail_at_first_bad_entry disagree")  # pragma: no cover


# No layer has a chunk bigger than this (dsec_fs.blobmap), so no pack holds one: a bigger claim is a
# forger's, and every reader that decompresses to an entry's size (gc's repack has no blob map to check
# it against) would allocate it.
MAX_CHUNK_SIZE = 1 << MAX_CHUNK_BITS


def _entries_valid(entries: list[PackEntry], frames_end: int | None) -> bool:
    """Whether every entry passes _fail_at_first_bad_entry's checks: one pass with no strings made, as a
    layer's first mount decodes thousands of entries (its pack indexes: 60-70 ms of `up` behind its last
    byte, docs/benchmarks.md, issue 13, "mount14")."""
    previous_end = 0
    for _digest, offset, clen, ulen in entries:
        if not 0 < clen <= frame_bound(ulen) or offset < previous_end or ulen > MAX_CHUNK_SIZE:
            return False
        previous_end = offset + clen
    if frames_end is not None and previous_end > frames_end:
        return False
    return len({entry.digest for entry in entries}) == len(entries)


def _fail_at_first_bad_entry(entries: list[PackEntry], frames_end: int | None, fail) -> None:
    """Raise ``fail(offset, message)`` for the first entry that breaks a rule of the index."""
    first_entry_of: dict[bytes, int] = {}
    previous_end = 0
    for number, entry in enumerate(entries):
        at = INDEX_HEADER.size + number * INDEX_ENTRY.size
        what = f"entry {number} (chunk {to_hex(entry.digest)})"
        if entry.clen == 0:
            raise fail(at, f"{what}: empty frame")
        if entry.ulen > MAX_CHUNK_SIZE:
            raise fail(at, f"{what}: a chunk of {entry.ulen} bytes, more than any layer's chunk ({MAX_CHUNK_SIZE})")
        # A reader's ranged GET is clen bytes, whatever the chunk's size: bounded by what zstd can make of it.
        if entry.clen > frame_bound(entry.ulen):
            raise fail(at, f"{what}: a frame of {entry.clen} bytes for {entry.ulen} bytes, longer than zstd makes")
        if entry.digest in first_entry_of:
            raise fail(at, f"{what}: chunk already listed as entry {first_entry_of[entry.digest]}")
        if entry.offset < previous_end:
            raise fail(at, f"{what}: frame at {entry.offset} overlaps the previous frame, which ends at {previous_end}")
        end = entry.offset + entry.clen
        if frames_end is not None and end > frames_end:
            raise fail(at, f"{what}: frame [{entry.offset}, {end}) runs past the frame area ({frames_end} bytes)")
        first_entry_of[entry.digest] = number
        previous_end = end


class PackWriter:
    """Builds one pack in memory. Not thread-safe: one owner adds frames, then calls finish() once.

    Its index entries are kept as packed records (INDEX_ENTRY), the bytes the index is made of, not an
    object per chunk: a pack of small files' chunks holds thousands."""

    def __init__(self) -> None:
        self._frames: list[bytes] | None = []
        self._records = bytearray()
        self._digests: set[bytes] = set()
        self._size = 0

    @property
    def size(self) -> int:
        """Bytes of frames added so far (the pack is this plus its index and trailer)."""
        return self._size

    @property
    def count(self) -> int:
        return len(self._digests)

    @property
    def entries(self) -> list[PackEntry]:
        return entries_of_records(self._records)

    @property
    def records(self) -> bytes:
        """The index entries as INDEX_ENTRY records, in pack order."""
        return bytes(self._records)

    @property
    def digests(self) -> set[bytes]:
        """The digests of the chunks added (the writer's own set: not to be changed)."""
        return self._digests

    def add(self, digest: bytes, frame: bytes, ulen: int) -> None:
        """Append one chunk's zstd frame; ``digest`` is the sha256 of the chunk's ``ulen`` plain bytes."""
        if self._frames is None:
            raise RuntimeError("PackWriter.add after finish")
        if len(digest) != DIGEST_SIZE:
            raise InputError(f"digest is {len(digest)} bytes, expected {DIGEST_SIZE}", where=f"chunk {digest.hex()}")
        if digest in self._digests:
            raise ConflictError("chunk added to the same pack twice", where=f"chunk {to_hex(digest)}")
        self._records += INDEX_ENTRY.pack(digest, self._size, len(frame), ulen)
        self._frames.append(frame)
        self._digests.add(digest)
        self._size += len(frame)

    def add_many(self, digests: Sequence[bytes], frames: Sequence[bytes], ulens: Sequence[int]) -> None:
        """``add`` of each (digest, frame, ulen) in turn, checked and recorded for the batch at once: the loop
        is C's (a tree's many small files' chunks come in batches of a few hundred)."""
        if self._frames is None:
            raise RuntimeError("PackWriter.add after finish")
        fresh = set(digests)
        if (len(fresh) != len(digests) or not self._digests.isdisjoint(fresh)
                or any(len(digest) != DIGEST_SIZE for digest in fresh)):
            for digest, frame, ulen in zip(digests, frames, ulens):  # the one that breaks a rule is named
                self.add(digest, frame, ulen)
            return
        clens = list(map(len, frames))
        offsets = list(itertools.accumulate(clens, initial=self._size))
        self._records += b"".join(map(INDEX_ENTRY.pack, digests, offsets, clens, ulens))
        self._frames += frames
        self._digests |= fresh
        self._size = offsets[-1]

    def finish(self) -> tuple[str, bytes, bytes]:
        """(pack id, pack bytes, index bytes). Releases the frames, so the writer cannot be used again."""
        if self._frames is None:
            raise RuntimeError("PackWriter.finish called twice")
        index = index_of_records(self._records)
        pack = b"".join([*self._frames, index, PACK_TRAILER.pack(len(index), PACK_MAGIC)])
        self._frames = None
        return to_hex(sha256(pack)), pack, index
