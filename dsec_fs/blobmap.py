"""The blob map: the layout of a layer's virtual blob (EROFS device 1).

The virtual blob is every distinct chunk of a layer, in build order, each starting on a block boundary
and zero-padded to a whole block. Nothing stores the blob itself: the EROFS image addresses chunks by
block number on device 1, and the node daemon answers a read of blob block N by finding the chunk that
covers N here and fetching that chunk by digest. A chunk shared by many layers sits at a different block
in each layer's blob but is stored, fetched and cached once.

Binary format (all integers little-endian), stored as ``layers/<layer>/blobmap``:

    header   24 bytes   (``HEADER``)
    entries  40 bytes each, ``count`` of them, in blob order (``ENTRY``)

Nothing may follow the last entry. ``decode`` validates everything it can without the chunks: a blob map
that decodes is internally consistent (contiguous, block aligned, no chunk twice, lengths in range). The
blob id of a layer is the sha256 of these bytes, so a map that decodes but was tampered with is caught
by the manifest's ``blobmap_sha256`` and the device tag in meta.erofs. ``EncodedBlobMap`` reads a few
entries of an encoded map in place, without decoding the rest (a rebuild's patch).

Threads: a BlobMap is built by one thread (the chunker's main thread); once built, it is read-only and
any thread may read it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import struct
from collections.abc import Callable

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
_BLKADDR = struct.Struct("<I")  # an entry's first field


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
    expected_size = HEADER.size + count * ENTRY.size
    if len(data) != expected_size:
        raise fail("blob map header", 16, f"{count} entries need {expected_size} bytes, the map has {len(data)}")
    return chunkbits, count, blocks


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
    """The chunks of one layer's virtual blob, in blob order."""

    block_size = BLOCK_SIZE

    def __init__(self, chunk_size: int):
        self.chunk_bits = check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.entries: list[tuple[int, bytes, int]] = []  # (blkaddr, digest, length), in blob order
        self.blocks = 0  # total blocks of the blob; also where the next chunk goes
        self._starts: list[int] = []  # blkaddr of each entry, for bisect in locate()
        # digest -> its entry: the entry itself, not its index, so that a map of many chunks holds no int
        # object per entry besides its blkaddr (``_index_of`` finds the index again)
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
        self._starts.append(blkaddr)
        self.blocks = end
        return blkaddr

    def _index_of(self, blkaddr: int) -> int:
        """The index of the entry that starts at ``blkaddr``."""
        return bisect.bisect_left(self._starts, blkaddr)

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

    def locate(self, blkaddr: int) -> int:
        """Index of the entry whose blocks include ``blkaddr`` (a block past a chunk's end is its padding)."""
        if not 0 <= blkaddr < self.blocks:
            raise InputError(f"block {blkaddr} is outside the blob ({self.blocks} blocks)", where="blob map")
        return bisect.bisect_right(self._starts, blkaddr) - 1

    def entries_in(self, offset: int, end: int) -> range:
        """The indexes of the entries whose data overlaps bytes [offset, end) of the blob, in blob order;
        ``end`` is cut to the blob's end, and a range only in padding or past the end has none. A reader's
        hot path: two bisects and no test per entry (docs/benchmarks.md, "tidy9": 0.1-0.3 us more per
        read than the loops it replaced, on a walk of 1.5-2 us)."""
        end = min(end, self.blocks << BLOCK_SIZE_BITS)
        if offset >= end:
            return range(0)
        first = bisect.bisect_right(self._starts, offset >> BLOCK_SIZE_BITS) - 1
        blkaddr, _digest, length = self.entries[first]
        if (blkaddr << BLOCK_SIZE_BITS) + length <= offset:  # the range starts in this chunk's padding
            first += 1
        return range(first, bisect.bisect_left(self._starts, -(-end >> BLOCK_SIZE_BITS), first))

    def _take_valid(self, entries: list[tuple[int, int, bytes]]) -> bool:
        """Fill an empty map with decoded (blkaddr, length, digest) entries if they are all valid: checked
        and taken at C speed, not an add() per entry (a layer's map has an entry per distinct chunk)."""
        if not entries:
            return True
        blkaddrs, lengths, digests = zip(*entries)
        # _blocks_for of each length, as map()s of C functions
        blocks = map(operator.rshift, map(operator.add, lengths, itertools.repeat(BLOCK_SIZE - 1)),
                     itertools.repeat(BLOCK_SIZE_BITS))
        ends = list(itertools.accumulate(blocks))
        if (min(lengths) < 1 or max(lengths) > self.chunk_size or ends[-1] > MAX_BLOCKS
                or blkaddrs[0] != 0 or blkaddrs[1:] != tuple(ends[:-1]) or len(set(digests)) != len(digests)):
            return False
        self.entries = list(zip(blkaddrs, digests, lengths))
        self._starts = list(blkaddrs)
        self._by_digest = dict(zip(digests, self.entries))
        self.blocks = ends[-1]
        return True

    def encode(self) -> bytes:
        return header(self.chunk_bits, len(self.entries), self.blocks) + b"".join(
            ENTRY.pack(blkaddr, length, digest) for blkaddr, digest, length in self.entries)

    @property
    def blob_id(self) -> str:
        """sha256 hex of encode(): names the blob in the EROFS device table. Hashes the whole map each time."""
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, data: bytes | memoryview, *, source: str) -> BlobMap:
        """Parse and validate a blob map; FormatError(source=...) names the field or entry and its offset."""

        def fail(structure: str, offset: int, message: str) -> FormatError:
            return FormatError(structure, offset, message, source=source)

        data = memoryview(data)
        chunkbits, count, blocks = _checked_header(data, fail)

        blob_map = cls(1 << chunkbits)
        entries = list(ENTRY.iter_unpack(data[HEADER.size:]))
        if blob_map._take_valid(entries):
            entries = []  # all taken; else the loop below finds the first bad entry, or adds them one by one
        for i, (blkaddr, length, digest) in enumerate(entries):
            offset = HEADER.size + i * ENTRY.size
            if blkaddr != blob_map.blocks:
                raise fail(f"blob map entry {i}", offset, f"blkaddr {blkaddr}, expected {blob_map.blocks}")
            if not 1 <= length <= blob_map.chunk_size:
                raise fail(f"blob map entry {i}", offset + 4, f"length {length} outside 1..{blob_map.chunk_size}")
            if digest in blob_map:
                first = blob_map._index_of(blob_map._by_digest[digest][0])
                raise fail(f"blob map entry {i}", offset + 8, f"chunk {short(digest)} already at entry {first}")
            if blkaddr + _blocks_for(length) > MAX_BLOCKS:
                raise fail(f"blob map entry {i}", offset + 4, f"blob runs past block {MAX_BLOCKS}")
            blob_map.add(digest, length)
        if blocks != blob_map.blocks:
            raise fail("blob map header", 20, f"header says {blocks} blocks, the entries fill {blob_map.blocks}")
        return blob_map


class EncodedBlobMap:
    """A blob map read in place from its encoding, for a caller that needs a few of its thousands of
    entries: a rebuild's patch (erofs_builder/patch.py) looks up the old chunks of the files it changed
    and writes their replacements over them. Decoding the Debian rootfs's map (6,281 entries) costs
    ~2 ms, an object per entry; this checks the header and the length when made (FormatError, as
    ``BlobMap.decode``) and unpacks an entry when asked for. The entries are not checked against each
    other: a lookup finds only an entry that starts exactly where asked (``starting_at``) or holds the
    digest asked for (``index_of``), so a map that would not decode gives answers no caller can take
    for a sound map's (the patch then takes the full path), or, where the map is wrong in a way no
    lookup shows, a patched map that does not decode either.

    Threads: read-only once made; any thread may read it."""

    block_size = BLOCK_SIZE

    def __init__(self, data: bytes, *, source: str):
        def fail(structure: str, offset: int, message: str) -> FormatError:
            return FormatError(structure, offset, message, source=source)

        self.data = data
        self.chunk_bits, self._count, self.blocks = _checked_header(memoryview(data), fail)
        self.chunk_size = 1 << self.chunk_bits

    def __len__(self) -> int:
        return self._count

    def __contains__(self, digest: bytes) -> bool:
        return self.index_of(digest) is not None

    def entry(self, index: int) -> tuple[int, bytes, int]:
        """(blkaddr, digest, length) of entry ``index``, as ``BlobMap.entries`` holds it."""
        blkaddr, length, digest = ENTRY.unpack_from(self.data, HEADER.size + index * ENTRY.size)
        return blkaddr, digest, length

    def index_of(self, digest: bytes) -> int | None:
        """The index of the entry of chunk ``digest``, or None: a search of the encoding for the digest's
        bytes, taken only where they are an entry's digest field."""
        if len(digest) != DIGEST_SIZE:
            return None
        at = self.data.find(digest, HEADER.size)
        while at >= 0:
            index, field = divmod(at - HEADER.size, ENTRY.size)
            if field == ENTRY.size - DIGEST_SIZE:
                return index
            at = self.data.find(digest, at + 1)
        return None

    def starting_at(self, blkaddr: int) -> tuple[int, bytes, int] | None:
        """The entry (blkaddr, digest, length) whose chunk starts at block ``blkaddr``, or None: a binary
        search over the entries' blkaddrs, which a sound map holds ascending."""
        low, high = 0, self._count
        while low < high:
            middle = (low + high) // 2
            (found,) = _BLKADDR.unpack_from(self.data, HEADER.size + middle * ENTRY.size)
            if found < blkaddr:
                low = middle + 1
            elif found > blkaddr:
                high = middle
            else:
                return self.entry(middle)
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
