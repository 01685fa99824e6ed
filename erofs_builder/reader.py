"""The userspace EROFS reader: attributes, directories, xattrs, symlinks and file data of one image.

Used by ``dsecfs extract`` and ``dsecfs fsck`` and by the node daemon's FUSE mode, so lookups must be
cheap: every inode and every directory is parsed and validated once, on first use, and kept. The caches
grow to at most the size of the image's metadata (an image is immutable, nothing is ever invalidated).

What the reader accepts is what the kernel driver accepts, minus features we never write (compression,
shared xattrs, long xattr prefixes, 4-byte chunk block maps): those give UnsupportedError. Everything read
from the image is validated before use, and a failure is a FormatError naming the structure and its byte
offset in the image. A corrupt image never makes the reader raise anything else, recurse without bound,
loop forever or allocate more than the image (or the caller's read length) is big.

Regular-file data comes from the image itself (FLAT_PLAIN, FLAT_INLINE) or, for CHUNK_BASED files, from
the devices named by chunk indexes: device 0 is the image, device 1 is the layer's virtual blob, read
through the ``blob`` given to ErofsImage (blob.Blob: ``size`` and ``read(offset, length) -> bytes``).

Threads: any thread may call any method at the same time. The caches are plain dicts filled idempotently:
two threads that miss on the same inode both parse it and store equal values, so no lock is needed (a
dict get or set is atomic under the GIL). The blob does its own locking.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsec_fs.errors import FormatError, InputError, NotFoundError, UnavailableError, UnsupportedError

from . import ondisk
from .ondisk import chunk_index, dirent, xattr
from .ondisk.device_slot import SLOT_SIZE, DeviceSlot
from .ondisk.inode import (
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    Inode,
    decode_rdev,
)
from .ondisk.superblock import SB_OFFSET, SUPERBLOCK, Superblock

if TYPE_CHECKING:  # blob.py pulls in the store and chunk modules, which the reader itself never needs
    from .blob import Blob

# Linux cannot create a symlink whose target is longer than PATH_MAX - 1 (and none can be empty).
SYMLINK_MAX = 4095
_SB_END = SB_OFFSET + SUPERBLOCK.size  # bytes before this (boot area, superblock) never hold an inode


@dataclass(frozen=True, slots=True)
class Stat:
    """What stat(2) reports for an inode of the image."""

    ino: int  # the nid, as the kernel driver reports st_ino
    mode: int  # file type and permission bits
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int  # atime and ctime read the same on EROFS
    rdev: tuple[int, int]  # (major, minor) of character and block devices, else (0, 0)


@dataclass(frozen=True, slots=True)
class _Node:
    """One inode and what was derived from it, computed and validated once."""

    inode: Inode
    stat: Stat
    offset: int  # image offset of the inode
    xattr_offset: int  # image offset of the xattr body (right after the inode)
    data_offset: int  # image offset of the inline tail, or of the chunk-index array
    chunk_bits: int = 0  # CHUNK_BASED only: log2 of the chunk size
    chunk_count: int = 0  # CHUNK_BASED only: entries in the chunk-index array


@dataclass(frozen=True, slots=True)
class _Directory:
    entries: list[tuple[bytes, int, int]]  # (name, nid, file type), sorted, "." and ".." included
    offsets: list[int]  # image offset of each entry's dirent
    by_name: dict[bytes, int]  # name -> index into entries


def _signed64(seconds: int) -> int:
    """The kernel reads the 64-bit mtime as a signed time64_t: times before 1970 are stored negative."""
    return seconds - (1 << 64) if seconds >= 1 << 63 else seconds


class ErofsImage:
    """One EROFS image (meta.erofs), read-only. ``blob`` serves device 1 (the layer's virtual blob)."""

    def __init__(self, meta: bytes | bytearray | memoryview | mmap.mmap, *, blob: Blob | None = None,
                 source: str = "meta.erofs"):
        self.source = source
        self._image = memoryview(meta).cast("B")
        self.superblock = Superblock.unpack(self._image, source=source)
        self.block_size = self.superblock.block_size
        self._blkszbits = self.superblock.blkszbits
        self._meta_offset = self.superblock.meta_blkaddr * self.block_size
        if self._meta_offset >= len(self._image):
            raise self._error("superblock", SB_OFFSET + 0x28,
                              f"meta_blkaddr {self.superblock.meta_blkaddr} lies past the end of the image")
        self.devices = self._read_device_table()
        # The kernel masks chunk device ids with the smallest all-ones value covering every device.
        self._device_mask = (1 << len(self.devices).bit_length()) - 1
        self.blob = blob
        if blob is not None:
            self._check_blob(blob)
        self._device_blocks = self._device_sizes()
        self._nodes: dict[int, _Node] = {}
        self._dirs: dict[int, _Directory] = {}
        self._xattrs: dict[int, dict[bytes, bytes]] = {}
        self._links: dict[int, bytes] = {}
        self.root_nid = self.superblock.root_nid
        if not stat.S_ISDIR(self._node(self.root_nid).inode.mode):
            raise self._error("superblock", SB_OFFSET + 0x0E, f"root nid {self.root_nid} is not a directory")

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, blob: Blob | None = None) -> "ErofsImage":
        """Map an image file read-only; the mapping lives as long as the ErofsImage."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise FormatError("superblock", SB_OFFSET, "image is empty", source=os.fspath(path))
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        return cls(mapped, blob=blob, source=os.fspath(path))

    # ---- inodes ----------------------------------------------------------------------------------

    def inode(self, nid: int) -> Inode:
        """The on-disk inode ``nid`` (layout, i_u, xattr count, ...), validated; cached."""
        return self._node(nid).inode

    def stat(self, nid: int) -> Stat:
        """Attributes of inode ``nid``, validated; cached."""
        return self._node(nid).stat

    def xattrs(self, nid: int) -> dict[bytes, bytes]:
        """Full xattr names (b"user.x", b"system.posix_acl_access", ...) -> values. The dict is the
        cache's own: do not modify it."""
        found = self._xattrs.get(nid)
        if found is None:
            node = self._node(nid)
            found = xattr.decode(self._image, node.xattr_offset, node.inode.xattr_icount, nid=nid, source=self.source)
            self._xattrs[nid] = found
        return found

    def readlink(self, nid: int) -> bytes:
        """The target of symlink ``nid``, as stored (never resolved)."""
        target = self._links.get(nid)
        if target is None:
            node = self._node(nid)
            if not stat.S_ISLNK(node.inode.mode):
                raise InputError("not a symlink", where=self._where(nid))
            target = self._flat_read(node, 0, node.inode.size)
            if b"\0" in target:
                raise self._error(f"symlink nid {nid}", self._flat_offset(node, target.index(b"\0")),
                                  "target contains a NUL byte")
            self._links[nid] = target
        return target

    # ---- directories -----------------------------------------------------------------------------

    def readdir(self, nid: int) -> list[tuple[bytes, int, int]]:
        """(name, nid, file type) of every entry, "." and ".." included, in byte order, as getdents sees
        them. The list is the cache's own: do not modify it."""
        return self._dir(nid).entries

    def lookup(self, dir_nid: int, name: bytes) -> int | None:
        """The nid ``name`` names in directory ``dir_nid`` (None if absent); the target inode is validated."""
        directory = self._dir(dir_nid)
        index = directory.by_name.get(name)
        if index is None:
            return None
        self._check_entry(directory, index)
        return directory.entries[index][1]

    def resolve(self, path: bytes) -> int:
        """The nid at ``path`` (relative to the root, b"/"-separated; symlinks are not followed)."""
        nid = self.root_nid
        for name in path.split(b"/"):
            if not name:
                continue
            if not stat.S_ISDIR(self._node(nid).inode.mode):
                raise NotFoundError("a component of the path is not a directory", where=f"{self.source}: {path!r}")
            child = self.lookup(nid, name)
            if child is None:
                raise NotFoundError("no such file or directory", where=f"{self.source}: {path!r}")
            nid = child
        return nid

    def walk(self) -> Iterator[tuple[bytes, int]]:
        """(path, nid) of every name in the image, depth first, each directory's entries in byte order (as
        Tree.walk); the root is b"". Every directory is checked on the way: ".." names its parent, it is
        reached only once (no cycles, no directory hard links), and each entry's file type matches its inode.
        """
        visited = {self.root_nid}
        stack: list[tuple[bytes, int, int]] = [(b"", self.root_nid, self.root_nid)]  # (path, nid, parent nid)
        while stack:
            path, nid, parent = stack.pop()
            yield path, nid
            if not stat.S_ISDIR(self._node(nid).inode.mode):
                continue
            directory = self._dir(nid)
            dotdot = directory.by_name[b".."]
            if directory.entries[dotdot][1] != parent:
                raise self._error(f"directory nid {nid} entry '..'", directory.offsets[dotdot],
                                  f"points at nid {directory.entries[dotdot][1]}, the parent is nid {parent}")
            prefix = path + b"/" if path else b""
            children = []
            for index, (name, child, _ftype) in enumerate(directory.entries):
                if name == b"." or name == b"..":
                    continue
                self._check_entry(directory, index)
                if stat.S_ISDIR(self._node(child).inode.mode):
                    if child in visited:
                        raise self._error(f"directory nid {nid} entry {name[:64]!r}", directory.offsets[index],
                                          f"directory nid {child} is reached a second time")
                    visited.add(child)
                children.append((prefix + name, child, nid))
            stack.extend(reversed(children))

    # ---- file data -------------------------------------------------------------------------------

    def read(self, nid: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of regular file ``nid``, cut at its size; holes read as zeros."""
        node = self._node(nid)
        if not stat.S_ISREG(node.inode.mode):
            raise InputError("not a regular file", where=self._where(nid))
        if offset < 0 or length < 0:
            raise InputError(f"negative range offset={offset} length={length}", where=self._where(nid))
        end = min(offset + length, node.inode.size)
        if offset >= end:
            return b""
        if node.inode.layout == LAYOUT_CHUNK_BASED:
            return self._chunk_read(node, offset, end)
        return self._flat_read(node, offset, end - offset)

    def chunk_map(self, nid: int) -> list[tuple[int, int]]:
        """(device id, blkaddr) of every chunk of a CHUNK_BASED file, each validated; blkaddr
        chunk_index.HOLE is a hole (its device id is what the image stores, masked)."""
        node = self._node(nid)
        if node.inode.layout != LAYOUT_CHUNK_BASED:
            raise InputError("not a chunk-based file", where=self._where(nid))
        return [self._chunk(node, k) for k in range(node.chunk_count)]

    def chunk_size(self, nid: int) -> int:
        """Bytes per chunk of a CHUNK_BASED file (the last chunk may be shorter)."""
        node = self._node(nid)
        if node.inode.layout != LAYOUT_CHUNK_BASED:
            raise InputError("not a chunk-based file", where=self._where(nid))
        return 1 << node.chunk_bits

    # ---- internals: inodes -----------------------------------------------------------------------

    def _error(self, structure: str, offset: int | None, message: str) -> FormatError:
        return FormatError(structure, offset, message, source=self.source)

    def _where(self, nid: int) -> str:
        return f"{self.source}: inode nid {nid}"

    def _read_device_table(self) -> list[DeviceSlot]:
        sb = self.superblock
        self._devt_range = (0, 0)
        if not sb.extra_devices:
            return []
        start = sb.devt_slotoff * SLOT_SIZE
        if start < _SB_END:
            raise self._error("superblock", SB_OFFSET + 0x58,
                              f"device table at byte {start} overlaps the superblock")
        self._devt_range = (start, start + sb.extra_devices * SLOT_SIZE)
        return [DeviceSlot.unpack(self._image, start + i * SLOT_SIZE, source=self.source)
                for i in range(sb.extra_devices)]

    def _check_blob(self, blob: Blob) -> None:
        if not self.devices:
            raise self._error("superblock", SB_OFFSET + 0x56, "a blob was given but the image has no extra device")
        need = self.devices[0].blocks * self.block_size
        if blob.size < need:
            raise self._error("device slot 1", self._devt_range[0] + 64,
                              f"device 1 holds {need} bytes, the blob has only {blob.size}")

    def _device_sizes(self) -> list[int | None]:
        """Blocks of device 0 (the image) and of each extra device, None where unknown.

        mkfs.erofs 1.5 leaves a --blobdev slot's block count at 0 (the kernel does not read it there), so
        a slot saying 0 blocks means "unknown": device 1's size is then the blob's, if one was given.
        """
        sizes: list[int | None] = [self.superblock.blocks]
        for number, slot in enumerate(self.devices, start=1):
            if slot.blocks:
                sizes.append(slot.blocks)
            elif number == 1 and self.blob is not None:
                sizes.append(self.blob.size // self.block_size)
            else:
                sizes.append(None)
        return sizes

    def _node(self, nid: int) -> _Node:
        node = self._nodes.get(nid)
        if node is None:
            node = self._load_node(nid)
            self._nodes[nid] = node
        return node

    def _load_node(self, nid: int) -> _Node:
        where = f"inode nid {nid}"
        offset = self._meta_offset + (nid << ondisk.ISLOTBITS)
        if nid < 0 or offset + ondisk.INODE_SLOT_SIZE > len(self._image):
            raise self._error(where, offset, "inode lies past the end of the image")
        if offset < _SB_END or self._overlaps_device_table(offset):
            raise self._error(where, offset, "inode overlaps the superblock or the device table")
        sb = self.superblock
        inode = Inode.unpack(self._image, nid, meta_offset=self._meta_offset, build_time=sb.build_time,
                             build_time_nsec=sb.build_time_nsec, source=self.source)
        if self._overlaps_device_table(offset + inode.header_size - 1):
            raise self._error(where, offset, "inode overlaps the device table")
        xattr_offset = offset + inode.header_size
        data_offset = xattr_offset + inode.xattr_size
        if data_offset > len(self._image):
            raise self._error(where, offset + 2,
                              f"xattr body of {inode.xattr_size} bytes runs past the end of the image")
        mode, size = inode.mode, inode.size
        if stat.S_ISLNK(mode) and not 0 < size <= SYMLINK_MAX:
            raise self._error(where, offset + 8, f"symlink target of {size} bytes")
        if stat.S_ISDIR(mode) and size < 2 * dirent.DIRENT.size:
            raise self._error(where, offset + 8, f"directory of {size} bytes cannot hold '.' and '..'")
        rdev = decode_rdev(inode.i_u) if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else (0, 0)
        node_stat = Stat(ino=nid, mode=mode, nlink=inode.nlink, uid=inode.uid, gid=inode.gid, size=size,
                         mtime_ns=_signed64(inode.mtime) * 1_000_000_000 + inode.mtime_nsec, rdev=rdev)
        if inode.layout == LAYOUT_CHUNK_BASED:
            chunk_bits = chunk_index.parse_format(inode.i_u, self._blkszbits, where=f"{self.source}: {where}")
            count = -(-size >> chunk_bits)
            array = chunk_index.array_offset(data_offset)
            if array + count * chunk_index.CHUNK_INDEX.size > len(self._image):
                raise self._error(f"chunk indexes of nid {nid}", array,
                                  f"{count} entries for {size} bytes run past the end of the image")
            return _Node(inode, node_stat, offset, xattr_offset, array, chunk_bits, count)
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
            self._check_flat_extent(inode, offset, data_offset)
        return _Node(inode, node_stat, offset, xattr_offset, data_offset)

    def _overlaps_device_table(self, offset: int) -> bool:
        return self._devt_range[0] <= offset < self._devt_range[1]

    def _flat_layout(self, inode: Inode) -> tuple[int, int]:
        """(bytes stored in whole blocks from i_u, bytes in the inline tail) of a FLAT_* inode.

        As in the kernel, FLAT_INLINE keeps the last block (full or partial) inline.
        """
        bs = self.block_size
        blocks = -(-inode.size // bs)
        if inode.layout == LAYOUT_FLAT_INLINE and blocks:
            in_blocks = (blocks - 1) * bs
            return in_blocks, inode.size - in_blocks
        return inode.size, 0

    def _check_flat_extent(self, inode: Inode, offset: int, data_offset: int) -> None:
        in_blocks, tail = self._flat_layout(inode)
        blocks = -(-in_blocks // self.block_size)
        if blocks and inode.i_u + blocks > self.superblock.blocks:
            raise self._error(f"inode nid {inode.nid}", offset + 16,
                              f"data blocks [{inode.i_u}, {inode.i_u + blocks}) lie past the end of the image "
                              f"({self.superblock.blocks} blocks)")
        if tail:
            if data_offset % self.block_size + tail > self.block_size:
                raise self._error(f"inode nid {inode.nid}", data_offset,
                                  f"inline data of {tail} bytes crosses a block boundary")
            if data_offset + tail > len(self._image):
                raise self._error(f"inode nid {inode.nid}", data_offset, "inline data runs past the end of the image")

    def _flat_offset(self, node: _Node, pos: int) -> int:
        """Image offset of byte ``pos`` of a FLAT_* inode's data; contiguous up to its block's end."""
        in_blocks, _tail = self._flat_layout(node.inode)
        if pos < in_blocks:
            return node.inode.i_u * self.block_size + pos
        return node.data_offset + (pos - in_blocks)

    def _flat_read(self, node: _Node, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of FLAT_* data, already cut to the inode's size by the caller."""
        in_blocks, _tail = self._flat_layout(node.inode)
        end = offset + length
        pieces = []
        if offset < in_blocks:
            start = self._flat_offset(node, offset)
            pieces.append(self._image[start:start + min(end, in_blocks) - offset])
        if end > in_blocks:
            start = self._flat_offset(node, max(offset, in_blocks))
            pieces.append(self._image[start:start + end - max(offset, in_blocks)])
        return b"".join(pieces)

    # ---- internals: chunk-based data -------------------------------------------------------------

    def _chunk(self, node: _Node, k: int) -> tuple[int, int]:
        """(device, blkaddr) of chunk ``k``, validated against the device it names."""
        entry_offset = node.data_offset + k * chunk_index.CHUNK_INDEX.size
        _advise, device_id, blkaddr = chunk_index.CHUNK_INDEX.unpack_from(self._image, entry_offset)
        device = device_id & self._device_mask
        if blkaddr == chunk_index.HOLE:
            return device, blkaddr
        where = f"chunk index {k} of nid {node.inode.nid}"
        if device > len(self.devices):
            raise self._error(where, entry_offset + 2,
                              f"device id {device_id} names no device ({len(self.devices)} extra devices)")
        device_blocks = self._device_blocks[device]
        chunk_start = k << node.chunk_bits
        chunk_blocks = -(-min(1 << node.chunk_bits, node.inode.size - chunk_start) // self.block_size)
        if device_blocks is not None and blkaddr + chunk_blocks > device_blocks:
            raise self._error(where, entry_offset + 4,
                              f"blocks [{blkaddr}, {blkaddr + chunk_blocks}) lie outside device {device} "
                              f"({device_blocks} blocks)")
        return device, blkaddr

    def _chunk_read(self, node: _Node, offset: int, end: int) -> bytes:
        """Chunk-based data; neighbouring chunks stored back to back on one device are read in one call."""
        bits = node.chunk_bits
        pieces: list[bytes] = []
        run: list = []  # [device, start byte on the device, length] of the read being gathered
        pos = offset
        while pos < end:
            k = pos >> bits
            stop = min(end, (k + 1) << bits)
            device, blkaddr = self._chunk(node, k)
            if blkaddr == chunk_index.HOLE:
                if run:
                    pieces.append(self._device_read(node, *run))
                    run = []
                pieces.append(bytes(stop - pos))
            else:
                device_pos = blkaddr * self.block_size + (pos - (k << bits))
                if run and run[0] == device and run[1] + run[2] == device_pos:
                    run[2] += stop - pos
                else:
                    if run:
                        pieces.append(self._device_read(node, *run))
                    run = [device, device_pos, stop - pos]
            pos = stop
        if run:
            pieces.append(self._device_read(node, *run))
        return b"".join(pieces)

    def _device_read(self, node: _Node, device: int, offset: int, length: int) -> bytes:
        if device == 0:
            return bytes(self._image[offset:offset + length])
        if device != 1:
            raise UnsupportedError(f"data on device {device}: only device 1 (the layer's blob) is read",
                                   where=self._where(node.inode.nid))
        if self.blob is None:
            raise UnavailableError("the file's data is on device 1 and no blob was given",
                                   where=self._where(node.inode.nid), transient=False)
        data = self.blob.read(offset, length)
        if len(data) != length:
            raise UnavailableError(f"blob returned {len(data)} of {length} bytes at offset {offset}",
                                   where=self._where(node.inode.nid), transient=False)
        return data

    # ---- internals: directories ------------------------------------------------------------------

    def _dir(self, nid: int) -> _Directory:
        directory = self._dirs.get(nid)
        if directory is None:
            directory = self._load_dir(nid)
            self._dirs[nid] = directory
        return directory

    def _load_dir(self, nid: int) -> _Directory:
        node = self._node(nid)
        if not stat.S_ISDIR(node.inode.mode):
            raise InputError("not a directory", where=self._where(nid))
        bs, size = self.block_size, node.inode.size
        entries: list[tuple[bytes, int, int]] = []
        offsets: list[int] = []
        for block_start in range(0, size, bs):
            block_offset = self._flat_offset(node, block_start)
            block = self._image[block_offset:block_offset + min(bs, size - block_start)]
            first = len(entries)
            for i, entry in enumerate(dirent.unpack_block(block, offset=block_offset, nid=nid, source=self.source)):
                entries.append(entry)
                offsets.append(block_offset + i * dirent.DIRENT.size)
            # unpack_block checks the order inside a block; the kernel's binary search needs it across blocks.
            if first and entries[first][0] <= entries[first - 1][0]:
                raise self._error(f"directory nid {nid} block", block_offset,
                                  f"first name {entries[first][0][:64]!r} does not sort after the previous block's "
                                  f"last name {entries[first - 1][0][:64]!r}")
        by_name = {name: index for index, (name, _nid, _ftype) in enumerate(entries)}
        for name, must_be in ((b".", nid), (b"..", None)):
            index = by_name.get(name)
            if index is None:
                raise self._error(f"directory nid {nid}", self._flat_offset(node, 0), f"no {name.decode()!r} entry")
            _name, target, ftype = entries[index]
            if ftype != dirent.FT_DIR or (must_be is not None and target != must_be):
                raise self._error(f"directory nid {nid} entry {name.decode()!r}", offsets[index],
                                  f"points at nid {target} with file type {ftype}")
        if nid == self.root_nid and entries[by_name[b".."]][1] != nid:
            raise self._error(f"directory nid {nid} entry '..'", offsets[by_name[b".."]],
                              "the root's '..' must point at the root")
        return _Directory(entries, offsets, by_name)

    def _check_entry(self, directory: _Directory, index: int) -> None:
        """The entry's inode exists, is valid, and has the file type the dirent claims."""
        name, nid, ftype = directory.entries[index]
        mode = self._node(nid).inode.mode
        if ftype != dirent.FT_UNKNOWN and dirent.IFMT_BY_FT[ftype] != stat.S_IFMT(mode):
            raise self._error(f"dirent {name[:64]!r}", directory.offsets[index] + 10,
                              f"file type {ftype} does not match nid {nid}'s mode {mode:#o}")
