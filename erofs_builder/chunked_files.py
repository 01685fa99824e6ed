"""The regular files of an EROFS image with their chunks on the blob device, in one pass over the image's
records at C speed: what the node daemon's miss readahead maps (lazy_fetch/miss_readahead.py
``FileChunks.of_image``), without the reader's objects per inode.

``chunked_files(meta)`` yields, for each chunk-based regular file in walk order (depth first, each
directory's entries in their on-disk order, as ``ErofsImage.walk``; a file reached by several names at
its first one), its nid, the nid of the directory of that name, the name, and the blob block address of
each of its chunks on device 1 in file order (holes and chunks kept in the image itself left out).
Directory blocks are cut into dirents with one ``struct.iter_unpack`` each, an inode is one
``unpack_from``, a file's chunk indexes are read as a column of 32-bit words over the image, and a file
whose indexes all name device 1 (every file of a layer but those with holes) is taken whole by one
comparison of bytes.

What is checked: what the walk relies on. Every record read lies inside the image; the superblock and
the device table are read by ondisk/ as the reader reads them; an inode's format bits and layout are
ones the reader reads (UnsupportedError otherwise), it does not overlap the superblock or the device
table, and its xattr body ends inside the image; a directory is reached once (no cycles, no directory
hard links) and its blocks and inline tail lie where the kernel reads them; a dirent's file type
matches the inode it names; a file's chunk size is ``chunk_bits``; a chunk on a device that is not there
is an error. The chunk indexes of all files add up to at most what the image can hold (8 bytes each), and
the data of all directories likewise, so a hostile image whose inodes share one index array, or whose
directories share their blocks, costs time and memory of the image's size, not its square. (The reader
refuses directories that share blocks by their '.' entries and the order of names across blocks, which
this walk does not check; its walk has no bound on shared index arrays: a 212 KiB image of a thousand
inodes sharing one array of 16,384 ran LayerIndex past 5 s, tests/erofs_builder/test_chunked_files.py.) It is not fsck: names out of order or a '..' pointing elsewhere, which the reader rejects, are
read in the image's own order (the map only steers readahead, and every chunk fetched is verified by its
digest). A failed check is a FormatError naming the structure, its offset and ``source``.

Threads: a pure function of its input; any thread.
"""

from __future__ import annotations

import operator
import stat
import struct
import sys
from array import array
from collections.abc import Iterator
from typing import NamedTuple

from dsec_fs.errors import FormatError, UnsupportedError

from . import ondisk
from .ondisk import chunk_index, dirent
from .ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from .ondisk.device_slot import SLOT_SIZE, DeviceSlot
from .ondisk.inode import COMPACT, EXTENDED, LAYOUT_CHUNK_BASED, LAYOUT_FLAT_INLINE, LAYOUT_NAMES, SUPPORTED_LAYOUTS
from .ondisk.superblock import SB_OFFSET, SUPERBLOCK, Superblock

# A chunk index naming blob device 1 with advise 0, as the builder writes every chunk that is not a hole:
# its first 32-bit word (advise | device id << 16), little-endian.
_BLOB_WORD = (BLOB_DEVICE_ID << 16).to_bytes(4, "little")
_NEEDS_INODE = (dirent.FT_REG, dirent.FT_DIR, dirent.FT_UNKNOWN)  # what else a dirent names holds no chunks
_SB_END = SB_OFFSET + SUPERBLOCK.size
# What is read of every inode, compact or extended: i_format, i_xattr_icount, i_mode, i_size (its high
# word, in an extended inode; a compact inode's reserved word, ignored) and i_u.
_HEAD = struct.Struct("<HHH2xIII")
_IFMT = 0o170000
_IFDIR_BIT = 0o040000  # in a mode of the walked types (regular file, directory), only a directory's has it
_IFMT_BY_FT = dirent.IFMT_BY_FT


class ChunkedFile(NamedTuple):
    nid: int
    directory: int  # nid of the directory its first name is in
    name: bytes  # its first name
    blkaddrs: list[int]  # blob block address of each chunk on device 1, in file order, holes left out


def chunked_files(meta: bytes | memoryview, *, chunk_bits: int, source: str = "meta.erofs") -> Iterator[ChunkedFile]:
    """Every chunk-based regular file of image ``meta`` with chunks on device 1 (see the module docstring);
    ``chunk_bits``: log2 of the chunk size every such file must have (the blob map's)."""
    return _Walk(memoryview(meta).cast("B"), chunk_bits, source).files()


class _Walk:
    """One walk of one image: its superblock's figures, the budgets its records draw on, its 32-bit words."""

    def __init__(self, image: memoryview, chunk_bits: int, source: str):
        self.image, self.chunk_bits, self.source = image, chunk_bits, source
        sb = Superblock.unpack(image, source=source)
        self.blkszbits, self.block_size, self.blocks = sb.blkszbits, sb.block_size, sb.blocks
        self.meta_offset = sb.meta_blkaddr * sb.block_size
        self.root = sb.root_nid
        self.devices = sb.extra_devices
        self.device_table = (0, 0)
        if self.devices:
            start = sb.devt_slotoff * SLOT_SIZE
            if start < _SB_END:
                raise self._error("superblock", SB_OFFSET + 0x58, f"device table at byte {start} overlaps the superblock")
            for i in range(self.devices):
                DeviceSlot.unpack(image, start + i * SLOT_SIZE, source=source)
            self.device_table = (start, start + self.devices * SLOT_SIZE)
        self.device_mask = (1 << self.devices.bit_length()) - 1  # as the kernel masks chunk device ids
        # What a valid image's records can add up to: they do not overlap (see the module docstring).
        self.chunk_index_budget = len(image) // chunk_index.CHUNK_INDEX.size
        self.directory_budget = len(image)
        whole = image[:len(image) // 4 * 4]
        if sys.byteorder == "little":
            self.words = whole.cast("I")
        else:
            swapped = array("I", whole.tobytes())
            swapped.byteswap()
            self.words = memoryview(swapped)

    def _error(self, structure: str, offset: int | None, message: str) -> FormatError:
        return FormatError(structure, offset, message, source=self.source)

    def files(self) -> Iterator[ChunkedFile]:
        root = self._inode(self.root)
        if not stat.S_ISDIR(root[0]):
            raise self._error("superblock", SB_OFFSET + 0x0E, f"root nid {self.root} is not a directory")
        visited = {self.root}
        seen: set[int] = set()  # files walked (a file of several names is walked at its first)
        blkaddrs_of = self._blkaddrs
        # Depth first: the entries of each directory on the way down not walked yet, as an iterator each.
        stack = [iter(self._children(self.root, root, visited))]
        while stack:
            for nid, inode, parent, name in stack[-1]:
                if inode[0] & _IFDIR_BIT:
                    stack.append(iter(self._children(nid, inode, visited)))
                    break
                if nid in seen:
                    continue
                seen.add(nid)
                blkaddrs = blkaddrs_of(nid, inode)
                if blkaddrs:
                    yield ChunkedFile(nid, parent, name, blkaddrs)
            else:
                stack.pop()

    def _children(self, nid: int, inode: tuple, visited: set[int]) -> list[tuple]:
        """(nid, inode, ``nid``, name) of each entry of directory ``nid`` that is a directory or a chunk-based
        file, in on-disk order."""
        children = []
        inode_of = self._inode
        for child, ftype, name, at in self._entries(nid, inode):
            if ftype not in _NEEDS_INODE:
                continue
            found = inode_of(child)
            mode = found[0]
            if ftype != dirent.FT_UNKNOWN and _IFMT_BY_FT[ftype] != mode & _IFMT:
                raise self._error(f"dirent {name[:64]!r}", at + 10,
                                  f"file type {ftype} does not match nid {child}'s mode {mode:#o}")
            if mode & _IFMT == stat.S_IFDIR:
                if child in visited:
                    raise self._error(f"directory nid {nid} entry {name[:64]!r}", at,
                                      f"directory nid {child} is reached a second time")
                visited.add(child)
            elif found[2] != LAYOUT_CHUNK_BASED:
                continue  # no chunks: not a regular file, or its data in the image
            children.append((child, found, nid, name))
        return children

    def _inode(self, nid: int) -> tuple[int, int, int, int, int, int]:
        """(mode, size, layout, i_u, inode offset, data offset: where the inline tail or the chunk-index array
        starts) of inode ``nid``, checked (see the module docstring)."""
        image = self.image
        offset = self.meta_offset + (nid << ondisk.ISLOTBITS)
        if offset + COMPACT.size > len(image):
            raise self._error(f"inode nid {nid}", offset, "inode lies past the end of the image")
        i_format, icount, mode, size, high, i_u = _HEAD.unpack_from(image, offset)
        if i_format & 1:
            header = EXTENDED.size
            size |= high << 32
        else:
            header = COMPACT.size
        layout = (i_format >> 1) & 0x7
        data = offset + header + (12 + 4 * (icount - 1) if icount else 0)
        if (i_format >> 4 or layout not in SUPPORTED_LAYOUTS or offset < _SB_END or data > len(image)
                or offset < self.device_table[1] and self.device_table[0] < offset + header):
            self._bad_inode(nid, offset, i_format, header, data)
        if layout == LAYOUT_CHUNK_BASED:
            if mode & _IFMT != stat.S_IFREG:
                raise self._error(f"inode nid {nid}", offset, "CHUNK_BASED layout on a non-regular file")
            data = (data + 7) & ~7  # chunk_index.array_offset
        elif mode & _IFMT == stat.S_IFDIR and size < 2 * dirent.DIRENT.size:
            raise self._error(f"inode nid {nid}", offset + 8, f"directory of {size} bytes cannot hold '.' and '..'")
        return mode, size, layout, i_u, offset, data

    def _bad_inode(self, nid: int, offset: int, i_format: int, header: int, data: int) -> None:
        """Raise what is wrong with inode ``nid`` (``_inode`` found something)."""
        where = f"inode nid {nid}"
        if i_format >> 4:
            raise UnsupportedError(f"i_format {i_format:#x} has unknown bits", where=f"{self.source}: {where}")
        layout = (i_format >> 1) & 0x7
        if layout not in SUPPORTED_LAYOUTS:
            raise UnsupportedError(f"data layout {LAYOUT_NAMES.get(layout, f'layout {layout}')} is not supported",
                                   where=f"{self.source}: {where}")
        if offset + header > len(self.image):
            raise self._error(where, offset, "extended inode runs past the end of the image")
        if data > len(self.image):
            raise self._error(where, offset + 2, "xattr body runs past the end of the image")
        raise self._error(where, offset, "inode overlaps the superblock or the device table")

    def _entries(self, nid: int, inode: tuple) -> list[tuple[int, int, bytes, int]]:
        """(nid, file type, name, dirent offset) of each entry of directory ``nid`` but '.' and '..'."""
        image, bs = self.image, self.block_size
        _mode, size, layout, i_u, offset, data = inode
        self.directory_budget -= size
        if self.directory_budget < 0:
            raise self._error(f"inode nid {nid}", offset + 8, "the directories' data add up to more than the "
                              f"image's {len(image)} bytes: their blocks overlap")
        in_blocks = (-(-size // bs) - 1) * bs if layout == LAYOUT_FLAT_INLINE else size
        if in_blocks and i_u + -(-in_blocks // bs) > self.blocks:
            raise self._error(f"inode nid {nid}", offset + 16, f"data blocks [{i_u}, {i_u + -(-in_blocks // bs)}) "
                              f"lie past the end of the image ({self.blocks} blocks)")
        tail = size - in_blocks
        if tail and (data % bs + tail > bs or data + tail > len(image)):
            raise self._error(f"inode nid {nid}", data, f"inline data of {tail} bytes crosses a block boundary or "
                              "runs past the end of the image")
        entries = []
        for block_start in range(0, size, bs):
            start = i_u * bs + block_start if block_start < in_blocks else data
            entries += self._block_entries(nid, bytes(image[start:start + min(bs, size - block_start)]), start)
        return entries

    def _block_entries(self, nid: int, block: bytes, offset: int) -> list[tuple[int, int, bytes, int]]:
        where = f"directory nid {nid} block"
        if len(block) < dirent.DIRENT.size:
            raise self._error(where, offset, f"block of {len(block)} bytes holds no dirent")
        first = dirent.DIRENT.unpack_from(block)[1]
        if first < dirent.DIRENT.size or first % dirent.DIRENT.size or first > len(block):
            raise self._error(where, offset + 8, f"first nameoff {first} is not a valid dirent count")
        nids, starts, ftypes, _ = zip(*dirent.DIRENT.iter_unpack(block[:first]))
        nul = block.find(b"\0", starts[-1])
        ends = starts[1:] + (len(block) if nul < 0 else nul,)
        if not all(map(operator.lt, starts, ends)) or starts[0] < first or max(ftypes) > dirent.FT_SYMLINK:
            for i, (start, end, ftype) in enumerate(zip(starts, ends, ftypes)):
                if not first <= start < end:
                    raise self._error(where, offset + 12 * i + 8, f"name range [{start}, {end}) is invalid")
                if ftype > dirent.FT_SYMLINK:
                    raise self._error(where, offset + 12 * i + 10, f"file type {ftype}")
        names = list(map(block.__getitem__, map(slice, starts, ends)))
        return [entry for entry in zip(nids, ftypes, names, range(offset, offset + first, dirent.DIRENT.size))
                if entry[2] != b"." and entry[2] != b".."]

    def _blkaddrs(self, nid: int, inode: tuple) -> list[int]:
        """The blob block addresses of chunk-based file ``nid``'s chunks on device 1, holes left out."""
        _mode, size, _layout, i_u, _offset, start = inode
        bits = chunk_index.parse_format(i_u, self.blkszbits, where=f"{self.source}: inode nid {nid}")
        if bits != self.chunk_bits:
            raise self._error(f"inode nid {nid}", None, f"chunk size {1 << bits}, the blob map's is "
                              f"{1 << self.chunk_bits}")
        count = -(-size >> bits)
        end = start + count * chunk_index.CHUNK_INDEX.size
        if end > len(self.image):
            raise self._error(f"chunk indexes of nid {nid}", start,
                              f"{count} entries for {size} bytes run past the end of the image")
        self.chunk_index_budget -= count
        if self.chunk_index_budget < 0:
            raise self._error(f"chunk indexes of nid {nid}", start, "the files' chunk indexes add up to more than "
                              f"the image's {len(self.image)} bytes hold: their arrays overlap")
        words = self.words[start // 4:end // 4]
        if words[0::2].tobytes() == _BLOB_WORD * count:  # every chunk on device 1, none a hole
            return words[1::2].tolist()
        found = []
        for k, (head, blkaddr) in enumerate(zip(words[0::2], words[1::2])):
            if blkaddr == HOLE:
                continue
            device = (head >> 16) & self.device_mask
            if device > self.devices:
                raise self._error(f"chunk index {k} of nid {nid}", start + 8 * k + 2,
                                  f"device id {head >> 16} names no device ({self.devices} extra devices)")
            if device == BLOB_DEVICE_ID:
                found.append(blkaddr)
        return found
