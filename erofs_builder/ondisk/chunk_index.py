"""Chunk indexes of CHUNK_BASED inodes: 8-byte entries, one per chunk, after the inode and its xattrs.

A chunk-based inode's i_u holds the chunk format (low 16 bits): chunkbits - blkszbits, and the INDEXES
flag that selects these 8-byte entries (device id + block address) over 4-byte block maps.
"""

from __future__ import annotations

import struct

from dsec_fs.errors import FormatError, UnsupportedError

from . import EROFS_NULL_ADDR

CHUNK_INDEX = struct.Struct(
    "<"
    "H"  # 0 advise: 0 (newer layouts: high start-block bits with 48BIT)
    "H"  # 2 device_id: 0 = the primary device, k = device-table slot k; our chunks live on device 1
    "I"  # 4 blkaddr: first block of the chunk on that device; EROFS_NULL_ADDR = hole (reads as zeros)
)
assert CHUNK_INDEX.size == 8

FORMAT_BLKBITS_MASK = 0x1F  # chunkbits - blkszbits
FORMAT_INDEXES = 0x20  # entries are CHUNK_INDEX (8 bytes), not 4-byte block maps
BLOB_DEVICE_ID = 1
HOLE = EROFS_NULL_ADDR


def chunk_format(chunkbits: int, blkszbits: int) -> int:
    return FORMAT_INDEXES | (chunkbits - blkszbits)


def parse_format(i_u: int, blkszbits: int, *, where: str) -> int:
    """The chunk size bits of a chunk-based inode's i_u; only the INDEXES form is read."""
    fmt = i_u & 0xFFFF
    if fmt & ~(FORMAT_BLKBITS_MASK | FORMAT_INDEXES):
        raise UnsupportedError(f"chunk format {fmt:#x} has unknown bits", where=where)
    if not fmt & FORMAT_INDEXES:
        raise UnsupportedError("4-byte chunk block maps are not read (only chunk indexes)", where=where)
    return blkszbits + (fmt & FORMAT_BLKBITS_MASK)


def array_offset(inode_end: int) -> int:
    """Chunk indexes start 8-byte aligned after the inode and its xattr body."""
    return (inode_end + CHUNK_INDEX.size - 1) & ~(CHUNK_INDEX.size - 1)


def pack(entries: list[int | None]) -> bytes:
    """Entries from blob block addresses; None is a hole."""
    return b"".join(
        CHUNK_INDEX.pack(0, 0, HOLE) if blkaddr is None else CHUNK_INDEX.pack(0, BLOB_DEVICE_ID, blkaddr)
        for blkaddr in entries
    )


def unpack(image: bytes | memoryview, offset: int, count: int, *, nid: int, source: str) -> list[tuple[int, int]]:
    """(device_id, blkaddr) of each chunk of inode ``nid``; blkaddr HOLE means zeros."""
    if offset + count * CHUNK_INDEX.size > len(image):
        raise FormatError(f"chunk indexes of nid {nid}", offset,
                          f"{count} entries run past the end of the image", source=source)
    return [(dev, blkaddr) for _advise, dev, blkaddr in CHUNK_INDEX.iter_unpack(
        image[offset:offset + count * CHUNK_INDEX.size])]
