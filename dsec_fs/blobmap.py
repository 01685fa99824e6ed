"""The blob map: the layout of a layer's virtual blob (EROFS device 1).

The virtual blob is every distinct chunk of a layer, in build order, each starting on a block boundary
and zero-padded to a whole block. Nothing stores the blob itself: the EROFS image addresses chunks by
block number on device 1, and the node daemon answers a read of blob block N by finding the chunk that
covers N here and fetching that chunk by digest. A chunk shared by many layers sits at a different block
in each layer's blob but is stored, fetched and cached once.

Binary format (all integers little-endian), stored as ``layers/<layer>/blobmap``:

    header   24 bytes   (``HEADER``)
    entries  40 bytes each, ``count`` of them, in blob order (``ENTRY``)

Nothing may follow the last entry. Two types, one per side:

- ``BlobMap`` builds a map (the chunker: ``add`` a chunk at the blob's end) and encodes it;
- ``EncodedBlobMap`` reads an encoded map in place: every reader (the node daemon, gc, fsck, diff, a
  rebuild). It holds the encoding itself and one column of 4 bytes per entry (the blkaddrs, as an
  array for bisect), no object per entry: about 1.1x the encoding (docs/benchmarks.md, "blobmap13"),
  where a decode into tuples held 6x and took 6 to 17 times as long. An entry is unpacked when asked for.

Making an EncodedBlobMap validates everything the layout needs, at C speed: a map that is accepted is
contiguous, block aligned, every length in range and its header's count and blocks agree with the entries
(FormatError naming the source, the entry and its offset otherwise). It does not look for a chunk named by
two entries: that takes a set of every digest (2.5x the map, per mount), and such a map still serves
every byte right (entries are read by number, every chunk is verified by its digest); the builder never
writes one and fsck reports one. The blob id of a layer is the sha256 of these bytes, so a map that is
accepted but was tampered with is caught by the manifest's ``blobmap_sha256`` and the device tag in
meta.erofs. ``max_entries`` bounds a layer's map by its meta.erofs before the map is read (layer.py).

Threads: a BlobMap is built by one thread (the chunker's main thread); once built, it is read-only and
any thread may read it. An EncodedBlobMap is read-only once made; any thread may read it.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
import operator
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

from .aligned_search import field_matches
from .digest import DIGEST_SIZE, short
from .errors import FormatError, InputError, NotFoundError, UnsupportedError

MAGIC = b"DSECBMAP"
VERSION = 1
BLOCK_SIZE_BITS = 12
BLOCK_SIZE = 1 << BLOCK_SIZE_BITS
MIN_CHUNK_BITS = 12  # 4 KiB: a chunk is at least one block
MAX_CHUNK_BITS = 24  # 16 MiB: keeps one chunk fetch (and its memory) bounded on the node
# EROFS block addresses are 32-bit and 0xFFFFFFFF means "hole", so the blob ends before it (16 TiB).
MAX_BLOCKS = 0xFFFFFFFF

HEADER = struct.Struct(
    "<"
    "8s"  # magic: b"DSECBMAP"
    "I"  # version: VERSION
    "B"  # blkszbits: log2 of the blob's block size; 12
    "B"  # chunkbits: log2 of the layer's chunk size; every entry's length is 1..chunk size
    "H"  # reserved: 0
    "I"  # count: number of entries
    "I"  # blocks: size of the virtual blob in blocks, the sum of every entry's block count
)

ENTRY = struct.Struct(
    "<"
    "I"  # blkaddr: first block of the chunk in the blob; the running sum of the previous block counts
    "I"  # length: bytes of the chunk (uncompressed); it fills ceil(length / block size) blocks
    f"{DIGEST_SIZE}s"  # digest: sha256 of the chunk's bytes, its name in the chunk store
)
WORDS_PER_ENTRY = ENTRY.size // 4  # an entry as 32-bit words: blkaddr, length, then the digest's 8
# An EROFS chunk index (struct erofs_inode_chunk_index: advise, device id, blkaddr) is 8 bytes, and every
# entry of a layer's map is the chunk of at least one of them in its meta.erofs: what max_entries counts.
CHUNK_INDEX_SIZE = 8


def check_chunk_size(chunk_size: int) -> int:
    """Return log2(chunk_size); InputError unless it is a power of two from 4 KiB to 16 MiB."""
    bits = chunk_size.bit_length() - 1
    if chunk_size <= 0 or chunk_size != 1 << bits or not MIN_CHUNK_BITS <= bits <= MAX_CHUNK_BITS:
        raise InputError(
            f"chunk size must be a power of two from {1 << MIN_CHUNK_BITS} to {1 << MAX_CHUNK_BITS}, "
            f"got {chunk_size}",
            where="chunk size",
        )
    return bits


def blob_map_chunk_size(data: bytes | memoryview) -> int | None:
    """The chunk size an encoded blob map's header gives, without decoding its entries; None if the
    header is not a blob map's (``BlobMap.decode`` says what is wrong)."""
    if len(data) < HEADER.size:
        return None
    magic, version, blkszbits, chunkbits, _reserved, _count, _blocks = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or blkszbits != BLOCK_SIZE_BITS or not (
            MIN_CHUNK_BITS <= chunkbits <= MAX_CHUNK_BITS):
        return None
    return 1 << chunkbits


def _checked_header(data: memoryview, fail: Callable[[str, int, str], FormatError]) -> tuple[int, int, int]:
    """(chunkbits, count, blocks) of an encoded map's header, checked with its length; ``fail(structure,
    offset, message)`` makes the FormatError raised otherwise."""
    if len(data) < HEADER.size:
        raise fail("blob map header", 0, f"{len(data)} bytes, the header alone is {HEADER.size}")
    magic, version, blkszbits, chunkbits, reserved, count, blocks = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise fail("blob map header", 0, f"bad magic {magic!r}")
    if version != VERSION:
        raise fail("blob map header", 8, f"unknown version {version}")
    if blkszbits != BLOCK_SIZE_BITS:
        raise fail("blob map header", 12, f"block size bits {blkszbits}, expected {BLOCK_SIZE_BITS}")
    if not MIN_CHUNK_BITS <= chunkbits <= MAX_CHUNK_BITS:
        raise fail("blob map header", 13, f"chunk size bits {chunkbits} outside {MIN_CHUNK_BITS}..{MAX_CHUNK_BITS}")
    if reserved:
        raise fail("blob map header", 14, f"reserved field is {reserved:#x}, expected 0")
    expected_size = encoded_size(count)
    if len(data) != expected_size:
        raise fail("blob map header", 16, f"{count} entries need {expected_size} bytes, the map has {len(data)}")
    if count > blocks:
        raise fail("blob map header", 16, f"{count} entries cannot fit in {blocks} blocks (each fills one or more)")
    return chunkbits, count, blocks


def encoded_size(count: int) -> int:
    """Bytes of the encoding of a map of ``count`` entries."""
    return HEADER.size + count * ENTRY.size


def max_entries(meta_size: int, blob_blocks: int) -> int:
    """The most entries the map of a layer can need whose meta.erofs is ``meta_size`` bytes and whose blob
    is ``blob_blocks`` blocks: each entry fills a block at least, and is named by a chunk index of the
    image. A map beyond it is corrupt however its entries read (dsec_fs.layer refuses it unread)."""
    return min(blob_blocks, meta_size // CHUNK_INDEX_SIZE)


def _blocks_for(length: int) -> int:
    return -(-length // BLOCK_SIZE)


def chunk_end(blkaddr: int, digest: bytes, length: int, chunk_size: int) -> int:
    """The block after a chunk of ``length`` bytes placed at ``blkaddr``: where the next one starts.
    InputError for a chunk no map may hold, UnsupportedError past the blob's MAX_BLOCKS."""
    if len(digest) != DIGEST_SIZE or not 1 <= length <= chunk_size:
        raise InputError(f"bad chunk: {len(digest)}-byte digest, {length} bytes", where=f"chunk {digest.hex()}")
    end = blkaddr + _blocks_for(length)
    if end > MAX_BLOCKS:
        raise UnsupportedError(f"the layer's distinct data exceeds {MAX_BLOCKS} blocks of {BLOCK_SIZE} bytes",
                               where=f"chunk {short(digest)}")
    return end


def header(chunk_bits: int, count: int, blocks: int) -> bytes:
    """The encoded header of a map of ``count`` entries over ``blocks`` blocks."""
    return HEADER.pack(MAGIC, VERSION, BLOCK_SIZE_BITS, chunk_bits, 0, count, blocks)


class BlobMap:
    """The chunks of one layer's virtual blob, in blob order, as the chunker places them (``add``); what
    reads a map reads its encoding (``EncodedBlobMap``)."""

    block_size = BLOCK_SIZE

    def __init__(self, chunk_size: int):
        self.chunk_bits = check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.entries: list[tuple[int, bytes, int]] = []  # (blkaddr, digest, length), in blob order
        self.blocks = 0  # total blocks of the blob; also where the next chunk goes
        # digest -> its entry: the entry itself, not its index, so that a map of many chunks holds no int
        # object per entry besides its blkaddr
        self._by_digest: dict[bytes, tuple[int, bytes, int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._by_digest

    def add(self, digest: bytes, length: int) -> int:
        """Place a chunk at the end of the blob and return its blkaddr; a chunk already here keeps its place."""
        entry = self._by_digest.get(digest)
        if entry is not None:
            return entry[0]
        blkaddr = self.blocks
        end = chunk_end(blkaddr, digest, length, self.chunk_size)
        entry = (blkaddr, digest, length)
        self._by_digest[digest] = entry
        self.entries.append(entry)
        self.blocks = end
        return blkaddr

    def blkaddr_of(self, digest: bytes) -> int:
        entry = self._by_digest.get(digest)
        if entry is None:
            raise NotFoundError("chunk is not in the blob map", where=f"chunk {digest.hex()}")
        return entry[0]

    def blkaddrs(self, digests: list[bytes | None]) -> list[int | None]:
        """The blob block of each chunk of a chunk list (None, a hole, stays None); NotFoundError for a
        chunk not in the map. What the EROFS writer asks of a blob map for a file's chunk indexes."""
        blkaddr_of = self.blkaddr_of
        return [None if digest is None else blkaddr_of(digest) for digest in digests]

    def encode(self) -> bytes:
        return header(self.chunk_bits, len(self.entries), self.blocks) + b"".join(
            ENTRY.pack(blkaddr, length, digest) for blkaddr, digest, length in self.entries)

    @property
    def blob_id(self) -> str:
        """sha256 hex of encode(): names the blob in the EROFS device table. Hashes the whole map each time."""
        return hashlib.sha256(self.encode()).hexdigest()


def _words(body: memoryview) -> memoryview:
    """The entries as 32-bit words (WORDS_PER_ENTRY per entry), little-endian as encoded, read in place
    on a little-endian machine (a copy, byte-swapped, on another)."""
    if sys.byteorder == "little":
        return body.cast("I")
    words = array.array("I")
    words.frombytes(body)
    words.byteswap()
    return memoryview(words)


class EncodedBlobMap:
    """A layer's blob map read in place from its encoding: the encoding and the blkaddr column, validated
    when made (see the module docstring). ``entry(i)`` and ``entries`` (a sequence view) unpack entries
    when asked for; ``lengths`` is a column over the encoding; ``locate`` and ``entries_in`` bisect the
    blkaddr column; a digest is looked up by a search of the encoding (``index_of``, ``indexes_of``).

    Threads: read-only once made; any thread may read it."""

    block_size = BLOCK_SIZE

    def __init__(self, data: bytes | bytearray | memoryview, *, source: str):
        def fail(structure: str, offset: int, message: str) -> FormatError:
            return FormatError(structure, offset, message, source=source)

        self.data = data if isinstance(data, bytes) else bytes(data)  # immutable: it was validated
        self.chunk_bits, self._count, self.blocks = _checked_header(memoryview(self.data), fail)
        self.chunk_size = 1 << self.chunk_bits
        words = _words(memoryview(self.data)[HEADER.size:])
        # zero-copy columns over the encoding: each entry's blkaddr and length
        blkaddrs, self.lengths = words[0::WORDS_PER_ENTRY], words[1::WORDS_PER_ENTRY]
        _check_layout(blkaddrs, self.lengths, self.blocks, self.chunk_size, fail)
        # the blkaddrs again, contiguous: bisect over an array is twice as fast as over the strided column
        self._starts = array.array("I")
        self._starts.frombytes(blkaddrs.tobytes())
        self.entries = EntriesView(self, 0, self._count)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, digest: bytes) -> bool:
        return self.index_of(digest) is not None

    def entry(self, index: int) -> tuple[int, bytes, int]:
        """(blkaddr, digest, length) of entry ``index`` (0 <= index < len: IndexError otherwise)."""
        if not 0 <= index < self._count:
            raise IndexError(f"blob map entry {index} of {self._count}")
        blkaddr, length, digest = ENTRY.unpack_from(self.data, HEADER.size + index * ENTRY.size)
        return blkaddr, digest, length

    def digest(self, index: int) -> bytes:
        """The digest of entry ``index``."""
        if not 0 <= index < self._count:
            raise IndexError(f"blob map entry {index} of {self._count}")
        at = HEADER.size + index * ENTRY.size + ENTRY.size - DIGEST_SIZE
        return self.data[at:at + DIGEST_SIZE]

    def _unpacked(self, start: int, stop: int) -> Iterator[tuple[int, bytes, int]]:
        """Entries start..stop-1 as (blkaddr, digest, length), unpacked at C speed one at a time."""
        body = memoryview(self.data)[HEADER.size + start * ENTRY.size:HEADER.size + stop * ENTRY.size]
        return map(_AS_ENTRY, ENTRY.iter_unpack(body))

    def digests(self, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
        """The digests of entries start..stop-1 (to the last by default), in blob order, at C speed."""
        stop = self._count if stop is None else stop
        body = memoryview(self.data)[HEADER.size + start * ENTRY.size:HEADER.size + stop * ENTRY.size]
        return map(operator.itemgetter(0), _DIGEST_FIELD.iter_unpack(body))

    def encode(self) -> bytes:
        return self.data

    @property
    def blob_id(self) -> str:
        """sha256 hex of the encoding: names the blob in the EROFS device table."""
        return hashlib.sha256(self.data).hexdigest()

    def locate(self, blkaddr: int) -> int:
        """Index of the entry whose blocks include ``blkaddr`` (a block past a chunk's end is its padding)."""
        if not 0 <= blkaddr < self.blocks:
            raise InputError(f"block {blkaddr} is outside the blob ({self.blocks} blocks)", where="blob map")
        return bisect.bisect_right(self._starts, blkaddr) - 1

    def entries_in(self, offset: int, end: int) -> range:
        """The indexes of the entries whose data overlaps bytes [offset, end) of the blob, in blob order;
        ``end`` is cut to the blob's end, and a range only in padding or past the end has none. A reader's
        hot path: two bisects over the blkaddr column and no test per entry."""
        end = min(end, self.blocks << BLOCK_SIZE_BITS)
        if offset >= end:
            return range(0)
        first = bisect.bisect_right(self._starts, offset >> BLOCK_SIZE_BITS) - 1
        if (self._starts[first] << BLOCK_SIZE_BITS) + self.lengths[first] <= offset:  # starts in padding
            first += 1
        return range(first, bisect.bisect_left(self._starts, -(-end >> BLOCK_SIZE_BITS), first))

    def index_of(self, digest: bytes, start: int = 0) -> int | None:
        """The index of the first entry from entry ``start`` on of chunk ``digest``, or None: a search of
        the encoding for the digest's bytes, taken only where they are an entry's digest field. For a few
        digests; many at once: ``indexes_of``."""
        if len(digest) != DIGEST_SIZE:
            return None
        for at in field_matches(self.data, digest, origin=HEADER.size, stride=ENTRY.size,
                                phase=ENTRY.size - DIGEST_SIZE, start=HEADER.size + max(0, start) * ENTRY.size):
            return (at - HEADER.size) // ENTRY.size
        return None

    def indexes_of(self, digests: Iterable[bytes]) -> dict[bytes, int]:
        """digest -> the index of its (first) entry, for each of ``digests`` the map holds: one pass over
        the entries, holding nothing per entry but the answers."""
        wanted = set(digests)
        found: dict[bytes, int] = {}
        for index, digest in enumerate(self.digests()):
            if digest in wanted and digest not in found:
                found[digest] = index
        return found

    def entries_by_start(self) -> dict[int, int]:
        """blkaddr -> index of the entry whose chunk starts there, for every entry, made at C speed: for a
        caller that maps every chunk index of an image (a dict of the whole map, made for the call)."""
        return dict(zip(self._starts, range(self._count)))

    def starting_at(self, blkaddr: int) -> tuple[int, bytes, int] | None:
        """The entry (blkaddr, digest, length) whose chunk starts at block ``blkaddr``, or None."""
        index = bisect.bisect_left(self._starts, blkaddr)
        if index < self._count and self._starts[index] == blkaddr:
            return self.entry(index)
        return None

    def replaced(self, replacements: dict[bytes, tuple[bytes, int]]) -> bytearray:
        """The encoding of this map with each chunk ``old`` of ``replacements`` giving its place to (digest,
        length): a chunk not in the map that fills as many blocks, so no other chunk moves (an incremental
        rebuild's patch, erofs_builder/patch.py). A copy of the encoding, patched at the replaced entries;
        InputError for a replacement that would move a chunk."""
        out = bytearray(self.data)
        new = {digest for digest, _length in replacements.values()}
        if len(new) != len(replacements):
            raise InputError("two chunks cannot take one chunk's place", where="blob map")
        for old, (digest, length) in replacements.items():
            index = self.index_of(old)
            blkaddr, _old, old_length = (None, None, 0) if index is None else self.entry(index)
            if (blkaddr is None or digest in self or not 1 <= length <= self.chunk_size
                    or _blocks_for(length) != _blocks_for(old_length)):
                raise InputError(f"chunk {short(digest)} of {length} bytes cannot take the place of chunk "
                                 f"{short(old)} of {old_length}", where="blob map")
            ENTRY.pack_into(out, HEADER.size + index * ENTRY.size, blkaddr, length, digest)
        return out


_DIGEST_FIELD = struct.Struct(f"<{ENTRY.size - DIGEST_SIZE}x{DIGEST_SIZE}s")  # an entry's digest alone
_AS_ENTRY = operator.itemgetter(0, 2, 1)  # ENTRY's (blkaddr, length, digest) -> (blkaddr, digest, length)


def _check_layout(blkaddrs: memoryview, lengths: memoryview, blocks: int, chunk_size: int,
                  fail: Callable[[str, int, str], FormatError]) -> None:
    """FormatError unless every length is 1..chunk_size and each entry starts where the one before ends
    (the first at 0), the last ending at ``blocks``. Checked by C loops over the columns (min, max, an
    accumulate compared with map); only a map that fails is walked again, to say where."""
    if not len(lengths):
        if blocks:
            raise fail("blob map header", 20, f"header says {blocks} blocks, the map has no entries")
        return
    if min(lengths) < 1 or max(lengths) > chunk_size:
        index = next(i for i, length in enumerate(lengths) if not 1 <= length <= chunk_size)
        raise fail(f"blob map entry {index}", HEADER.size + index * ENTRY.size + 4,
                   f"length {lengths[index]} outside 1..{chunk_size}")
    # the block after each entry, a running sum of ceil(length / block size): where the next one starts
    ends = itertools.accumulate(map(operator.rshift, map(operator.add, lengths, itertools.repeat(BLOCK_SIZE - 1)),
                                    itertools.repeat(BLOCK_SIZE_BITS)))
    if all(map(operator.eq, itertools.chain(blkaddrs, (blocks,)), itertools.chain((0,), ends))):
        return
    ends = itertools.accumulate(map(_blocks_for, lengths))
    for index, (found, expected) in enumerate(zip(itertools.chain(blkaddrs, (blocks,)), itertools.chain((0,), ends))):
        if found != expected:
            break
    if index == len(lengths):
        raise fail("blob map header", 20, f"header says {blocks} blocks, the entries fill {expected}")
    raise fail(f"blob map entry {index}", HEADER.size + index * ENTRY.size, f"blkaddr {found}, expected {expected}")


class EntriesView(Sequence):
    """Entries start..stop-1 of an EncodedBlobMap as a sequence of (blkaddr, digest, length), unpacked when
    read: what ``BlobMap.entries`` is for a map being built. A slice is a view too (step 1 only)."""

    __slots__ = ("_map", "_start", "_stop")

    def __init__(self, blob_map: EncodedBlobMap, start: int, stop: int):
        self._map, self._start, self._stop = blob_map, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("a blob map's entries are sliced in blob order, step 1")
            return EntriesView(self._map, self._start + start, self._start + max(start, stop))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"entry {index} of {len(self)}")
        return self._map.entry(self._start + index)

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]:
        return self._map._unpacked(self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (EntriesView, list, tuple)) and len(self) == len(other) and all(
            map(operator.eq, self, other))

    __hash__ = None
