"""EROFS directory blocks: 12-byte dirents, then the names, per block; entries sorted byte-wise.

A directory's data is a stream cut into blocks. Each block holds its dirent array followed by the names
(no NULs); nameoff is relative to the block; de[0].nameoff / 12 is the number of entries in the block.
Entries, "." and ".." included, are sorted by memcmp order across the whole directory and never split
between blocks; the kernel binary-searches blocks by their first name.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Iterator

from dsec_fs.errors import FormatError

DIRENT = struct.Struct(
    "<"
    "Q"  # 0 nid: the target inode
    "H"  # 8 nameoff: offset of the name from the start of this block
    "B"  # 10 file_type: FT_* below
    "B"  # 11 reserved
)
assert DIRENT.size == 12

FT_UNKNOWN, FT_REG, FT_DIR, FT_CHR, FT_BLK, FT_FIFO, FT_SOCK, FT_SYMLINK = range(8)
_FT_BY_IFMT = {
    stat.S_IFREG: FT_REG, stat.S_IFDIR: FT_DIR, stat.S_IFCHR: FT_CHR, stat.S_IFBLK: FT_BLK,
    stat.S_IFIFO: FT_FIFO, stat.S_IFSOCK: FT_SOCK, stat.S_IFLNK: FT_SYMLINK,
}
IFMT_BY_FT = {ft: ifmt for ifmt, ft in _FT_BY_IFMT.items()}


def file_type(mode: int) -> int:
    return _FT_BY_IFMT[stat.S_IFMT(mode)]


def split_into_blocks(names: list[bytes], block_size: int) -> list[list[bytes]]:
    """Group sorted names into blocks the way erofs-utils does; the layout depends on names only."""
    blocks: list[list[bytes]] = [[]]
    used = 0
    for name in names:
        need = DIRENT.size + len(name)
        if used + need > block_size:
            blocks.append([])
            used = 0
        blocks[-1].append(name)
        used += need
    return blocks


def dir_size(blocks: list[list[bytes]], block_size: int) -> int:
    """i_size of a directory: full blocks, then the used part of the last one."""
    last = blocks[-1]
    return (len(blocks) - 1) * block_size + sum(DIRENT.size + len(n) for n in last)


def pack_block(entries: list[tuple[bytes, int, int]]) -> bytes:
    """One block's bytes (unpadded) from sorted (name, nid, file_type) entries."""
    nameoff = DIRENT.size * len(entries)
    heads, names = [], []
    for name, nid, ftype in entries:
        heads.append(DIRENT.pack(nid, nameoff, ftype, 0))
        names.append(name)
        nameoff += len(name)
    return b"".join(heads) + b"".join(names)


def unpack_block(block: bytes | memoryview, *, offset: int, nid: int, source: str) -> Iterator[tuple[bytes, int, int]]:
    """(name, nid, file_type) of each entry in one directory block (already cut to the directory's size).

    ``offset`` is the block's position in the image, for errors; ``nid`` is the directory's.
    """
    where = f"directory nid {nid} block"
    if len(block) < DIRENT.size:
        raise FormatError(where, offset, f"block of {len(block)} bytes holds no dirent", source=source)
    first_nameoff = DIRENT.unpack_from(block, 0)[1]
    if first_nameoff < DIRENT.size or first_nameoff % DIRENT.size or first_nameoff > len(block):
        raise FormatError(where, offset + 8, f"first nameoff {first_nameoff} is not a valid dirent count",
                          source=source)
    count = first_nameoff // DIRENT.size
    previous = None
    for i in range(count):
        entry_nid, nameoff, ftype, _ = DIRENT.unpack_from(block, i * DIRENT.size)
        if i + 1 < count:
            end = DIRENT.unpack_from(block, (i + 1) * DIRENT.size)[1]
        else:
            end = len(block)
            nul = bytes(block[nameoff:end]).find(b"\0")
            if nul >= 0:
                end = nameoff + nul
        if not first_nameoff <= nameoff < end <= len(block):
            raise FormatError(where, offset + i * DIRENT.size + 8,
                              f"entry {i}: name range [{nameoff}, {end}) is invalid", source=source)
        name = bytes(block[nameoff:end])
        if len(name) > 255 or b"/" in name or b"\0" in name:
            raise FormatError(where, offset + nameoff, f"entry {i}: invalid name {name[:64]!r}", source=source)
        if ftype > FT_SYMLINK:
            raise FormatError(where, offset + i * DIRENT.size + 10, f"entry {i}: file type {ftype}", source=source)
        if previous is not None and name <= previous:
            raise FormatError(where, offset + nameoff, f"entry {i}: {name[:64]!r} is not sorted after "
                              f"{previous[:64]!r}", source=source)
        previous = name
        yield name, entry_nid, ftype
