"""The EROFS superblock: 128 bytes at byte 1024 of the primary device (meta.erofs)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from dsec_fs.errors import FormatError, UnsupportedError

from . import BLKSZBITS
from .crc32c import crc32c_raw

SB_OFFSET = 1024
MAGIC = 0xE0F5E1E2

COMPAT_SB_CHKSUM = 0x1  # checksum field is valid: crc32c over the rest of block 0
COMPAT_MTIME = 0x2  # inodes carry their own mtimes (informational)
INCOMPAT_CHUNKED_FILE = 0x4  # some inode is CHUNK_BASED (Linux 5.15)
INCOMPAT_DEVICE_TABLE = 0x8  # extra_devices/devt_slotoff are valid (Linux 5.16)
SUPPORTED_INCOMPAT = INCOMPAT_CHUNKED_FILE | INCOMPAT_DEVICE_TABLE

SUPERBLOCK = struct.Struct(
    "<"
    "I"  # 0x00 magic: MAGIC
    "I"  # 0x04 checksum: crc32c of block 0 from byte 1024, this field zeroed (if COMPAT_SB_CHKSUM)
    "I"  # 0x08 feature_compat: unknown bits are ignored by readers
    "B"  # 0x0C blkszbits: log2 of the block size; we write 12 (4 KiB)
    "B"  # 0x0D sb_extslots: extra 16-byte superblock slots; 0
    "H"  # 0x0E root_nid: nid of the root directory (16 bits in the old layout)
    "Q"  # 0x10 inos: number of inodes, reported by statfs
    "Q"  # 0x18 build_time: seconds; the mtime of every compact inode
    "I"  # 0x20 build_time_nsec: nanoseconds part of build_time
    "I"  # 0x24 blocks: size of the primary device in blocks
    "I"  # 0x28 meta_blkaddr: block where nid 0 lives; we use 0
    "I"  # 0x2C xattr_blkaddr: shared xattr area; 0 (we store xattrs inline only)
    "16s"  # 0x30 uuid
    "16s"  # 0x40 volume_name: NUL-terminated
    "I"  # 0x50 feature_incompat: an unknown bit blocks the mount
    "H"  # 0x54 available_compr_algs: 0, nothing is compressed in the image
    "H"  # 0x56 extra_devices: number of device-table slots (1: the virtual blob)
    "H"  # 0x58 devt_slotoff: device table offset in units of 128 bytes
    "B"  # 0x5A dirblkbits: must be 0
    "B"  # 0x5B xattr_prefix_count: long xattr prefixes; 0
    "I"  # 0x5C xattr_prefix_start
    "Q"  # 0x60 packed_nid: 0 = no packed inode
    "B"  # 0x68 xattr_filter_reserved: 0
    "23s"  # 0x69 reserved
)
assert SUPERBLOCK.size == 128


@dataclass
class Superblock:
    root_nid: int
    inos: int
    blocks: int
    build_time: int = 0
    build_time_nsec: int = 0
    feature_compat: int = COMPAT_SB_CHKSUM
    feature_incompat: int = 0
    extra_devices: int = 0
    devt_slotoff: int = 0
    meta_blkaddr: int = 0
    xattr_blkaddr: int = 0
    blkszbits: int = BLKSZBITS
    uuid: bytes = bytes(16)
    volume_name: bytes = b""
    checksum: int = 0
    extra: dict = field(default_factory=dict)  # fields we read but never write (sb_extslots, ...)

    @property
    def block_size(self) -> int:
        return 1 << self.blkszbits

    def pack(self) -> bytes:
        """128 bytes with checksum 0; ``seal_block0`` fills the checksum once block 0 is complete."""
        return SUPERBLOCK.pack(
            MAGIC, 0, self.feature_compat, self.blkszbits, 0, self.root_nid, self.inos,
            self.build_time, self.build_time_nsec, self.blocks, self.meta_blkaddr, self.xattr_blkaddr,
            self.uuid, self.volume_name[:15], self.feature_incompat, 0, self.extra_devices,
            self.devt_slotoff, 0, 0, 0, 0, 0, bytes(23),
        )

    @classmethod
    def unpack(cls, image: bytes | memoryview, *, source: str = "meta.erofs") -> "Superblock":
        """Parse and validate the superblock of ``image`` (the whole image, or at least its block 0)."""
        if len(image) < SB_OFFSET + SUPERBLOCK.size:
            raise FormatError("superblock", SB_OFFSET, f"image is only {len(image)} bytes", source=source)
        (magic, checksum, compat, blkszbits, extslots, root_nid, inos, build_time, build_time_nsec, blocks,
         meta_blkaddr, xattr_blkaddr, uuid, volume_name, incompat, compr_algs, extra_devices, devt_slotoff,
         dirblkbits, prefix_count, _prefix_start, packed_nid, _filter, _reserved) = SUPERBLOCK.unpack_from(
            image, SB_OFFSET)

        def bad(field_offset: int, message: str) -> FormatError:
            return FormatError("superblock", SB_OFFSET + field_offset, message, source=source)

        if magic != MAGIC:
            raise bad(0, f"bad magic {magic:#010x}, expected {MAGIC:#010x}")
        if not 9 <= blkszbits <= 12:
            raise bad(0x0C, f"block size bits {blkszbits} out of range 9..12")
        if extslots:
            raise UnsupportedError(f"sb_extslots={extslots}", where=f"{source}: superblock")
        if dirblkbits:
            raise bad(0x5A, f"dirblkbits={dirblkbits}, must be 0")
        unknown = incompat & ~SUPPORTED_INCOMPAT
        if unknown:
            raise UnsupportedError(f"incompatible features {unknown:#x} (compression, 48-bit, ...)",
                                   where=f"{source}: superblock")
        if compr_algs or prefix_count or packed_nid:
            raise UnsupportedError("compressed images, long xattr prefixes and packed inodes are not read",
                                   where=f"{source}: superblock")
        block_size = 1 << blkszbits
        if len(image) % block_size or blocks != len(image) // block_size:
            raise bad(0x24, f"superblock says {blocks} blocks, image holds {len(image)} bytes")
        sb = cls(root_nid=root_nid, inos=inos, blocks=blocks, build_time=build_time,
                 build_time_nsec=build_time_nsec, feature_compat=compat, feature_incompat=incompat,
                 extra_devices=extra_devices, devt_slotoff=devt_slotoff, meta_blkaddr=meta_blkaddr,
                 xattr_blkaddr=xattr_blkaddr, blkszbits=blkszbits, uuid=bytes(uuid),
                 volume_name=bytes(volume_name).split(b"\0", 1)[0], checksum=checksum)
        if compat & COMPAT_SB_CHKSUM:
            expected = block0_checksum(image, block_size)
            if checksum != expected:
                raise bad(0x04, f"superblock checksum {checksum:#010x}, computed {expected:#010x}")
        if build_time_nsec >= 1_000_000_000:
            raise bad(0x20, f"build_time_nsec {build_time_nsec} >= 1e9")
        if extra_devices and not incompat & INCOMPAT_DEVICE_TABLE:
            raise bad(0x56, "extra_devices set without the DEVICE_TABLE feature")
        return sb


def block0_checksum(image: bytes | memoryview, block_size: int) -> int:
    """crc32c over [1024, block end) with the checksum field taken as zero."""
    end = block_size if block_size > SB_OFFSET else SB_OFFSET + block_size
    region = bytearray(image[SB_OFFSET:end])
    region[4:8] = bytes(4)
    return crc32c_raw(region)


def seal_block0(image: bytearray, block_size: int) -> None:
    """Write the checksum into a finished image; call last, block 0 holds inodes too."""
    struct.pack_into("<I", image, SB_OFFSET + 4, block0_checksum(image, block_size))
