"""EROFS inodes: compact (32 bytes) and extended (64 bytes), on 32-byte slots addressed by nid.

Which one to write is decided by ``needs_extended``: a compact inode has no mtime of its own (it reads
as the superblock's build_time), 32-bit size and 16-bit uid/gid/nlink.
"""

from __future__ import annotations

import stat
import struct
from dataclasses import dataclass

from dsec_fs.errors import FormatError, UnsupportedError

from . import ISLOTBITS

# i_format bit 0: the inode version; bits 1-3: the data layout.
VERSION_COMPACT = 0
VERSION_EXTENDED = 1
LAYOUT_FLAT_PLAIN = 0  # data in ceil(size/blksz) contiguous blocks from i_u
LAYOUT_FLAT_INLINE = 2  # full blocks from i_u, the tail right after the inode and its xattrs
LAYOUT_CHUNK_BASED = 4  # an array of chunk indexes follows the inode and its xattrs
SUPPORTED_LAYOUTS = (LAYOUT_FLAT_PLAIN, LAYOUT_FLAT_INLINE, LAYOUT_CHUNK_BASED)
LAYOUT_NAMES = {0: "FLAT_PLAIN", 1: "COMPRESSED_FULL", 2: "FLAT_INLINE", 3: "COMPRESSED_COMPACT", 4: "CHUNK_BASED"}

COMPACT = struct.Struct(
    "<"
    "H"  # 0 i_format: version | layout << 1
    "H"  # 2 i_xattr_icount: 0, or xattr body size = 12 + 4 * (icount - 1)
    "H"  # 4 i_mode
    "H"  # 6 i_nlink
    "I"  # 8 i_size
    "I"  # 12 reserved (newer kernels: mtime offset from build_time); we write 0
    "I"  # 16 i_u: start block, chunk format, or rdev, by file type and layout
    "I"  # 20 i_ino: 32-bit inode number for stat on 32-bit systems
    "H"  # 24 i_uid
    "H"  # 26 i_gid
    "I"  # 28 reserved
)
EXTENDED = struct.Struct(
    "<"
    "H"  # 0 i_format
    "H"  # 2 i_xattr_icount
    "H"  # 4 i_mode
    "H"  # 6 reserved (newer layouts: high start-block bits); 0
    "Q"  # 8 i_size
    "I"  # 16 i_u
    "I"  # 20 i_ino
    "I"  # 24 i_uid
    "I"  # 28 i_gid
    "Q"  # 32 i_mtime: seconds
    "I"  # 40 i_mtime_nsec
    "I"  # 44 i_nlink
    "16s"  # 48 reserved
)
assert COMPACT.size == 32 and EXTENDED.size == 64

_FORMAT = struct.Struct("<H")
_KNOWN_TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)


@dataclass(slots=True)
class Inode:
    mode: int
    nlink: int
    size: int
    i_u: int
    ino: int
    uid: int
    gid: int
    mtime: int
    mtime_nsec: int
    layout: int
    xattr_icount: int = 0
    extended: bool = True
    nid: int = 0  # where it was read from (not stored in the inode itself)

    @property
    def header_size(self) -> int:
        return EXTENDED.size if self.extended else COMPACT.size

    @property
    def xattr_size(self) -> int:
        return 0 if self.xattr_icount == 0 else 12 + 4 * (self.xattr_icount - 1)

    def pack(self) -> bytes:
        fmt = (VERSION_EXTENDED if self.extended else VERSION_COMPACT) | (self.layout << 1)
        if self.extended:
            return EXTENDED.pack(fmt, self.xattr_icount, self.mode, 0, self.size, self.i_u, self.ino, self.uid,
                                 self.gid, self.mtime, self.mtime_nsec, self.nlink, bytes(16))
        return COMPACT.pack(fmt, self.xattr_icount, self.mode, self.nlink, self.size, 0, self.i_u, self.ino,
                            self.uid, self.gid, 0)

    @classmethod
    def unpack(cls, image: bytes | memoryview, nid: int, *, meta_offset: int, build_time: int,
               build_time_nsec: int, source: str = "meta.erofs") -> "Inode":
        offset = meta_offset + (nid << ISLOTBITS)
        where = f"inode nid {nid}"
        if offset + COMPACT.size > len(image):
            raise FormatError(where, offset, "inode lies past the end of the image", source=source)
        (i_format,) = _FORMAT.unpack_from(image, offset)
        extended = bool(i_format & 1)
        layout = (i_format >> 1) & 0x7
        if i_format >> 4:
            raise UnsupportedError(f"i_format {i_format:#x} has unknown bits", where=f"{source}: {where}")
        if extended:
            if offset + EXTENDED.size > len(image):
                raise FormatError(where, offset, "extended inode runs past the end of the image", source=source)
            (_, icount, mode, _, size, i_u, ino, uid, gid, mtime, nsec, nlink, _) = EXTENDED.unpack_from(image, offset)
        else:
            (_, icount, mode, nlink, size, _, i_u, ino, uid, gid, _) = COMPACT.unpack_from(image, offset)
            mtime, nsec = build_time, build_time_nsec
        inode = cls(mode=mode, nlink=nlink, size=size, i_u=i_u, ino=ino, uid=uid, gid=gid, mtime=mtime,
                    mtime_nsec=nsec, layout=layout, xattr_icount=icount, extended=extended, nid=nid)
        inode.validate(offset, source)
        return inode

    def validate(self, offset: int, source: str) -> None:
        where = f"inode nid {self.nid}"
        if stat.S_IFMT(self.mode) not in _KNOWN_TYPES:
            raise FormatError(where, offset + 4, f"unknown file type in mode {self.mode:#o}", source=source)
        if self.layout not in SUPPORTED_LAYOUTS:
            name = LAYOUT_NAMES.get(self.layout, f"layout {self.layout}")
            raise UnsupportedError(f"data layout {name} is not supported", where=f"{source}: {where}")
        if self.extended and self.mtime_nsec >= 1_000_000_000:
            raise FormatError(where, offset + 40, f"mtime_nsec {self.mtime_nsec} >= 1e9", source=source)
        if self.layout == LAYOUT_CHUNK_BASED and not stat.S_ISREG(self.mode):
            raise FormatError(where, offset, "CHUNK_BASED layout on a non-regular file", source=source)
        if stat.S_IFMT(self.mode) in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK) and self.size:
            raise FormatError(where, offset + 8, f"special file with size {self.size}", source=source)


def needs_extended(size: int, uid: int, gid: int, nlink: int, mtime: int, mtime_nsec: int,
                   build_time: int, build_time_nsec: int) -> bool:
    """True when the compact form cannot hold these values (see erofs-format-notes §2)."""
    return (size >= 1 << 32 or uid > 0xFFFF or gid > 0xFFFF or nlink > 0xFFFF
            or (mtime, mtime_nsec) != (build_time, build_time_nsec))


def encode_rdev(major: int, minor: int) -> int:
    """The kernel's new_encode_dev, which EROFS stores in i_u of device inodes."""
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def decode_rdev(value: int) -> tuple[int, int]:
    return (value & 0xFFF00) >> 8, (value & 0xFF) | ((value >> 12) & 0xFFF00)

