"""A device-table slot: 128 bytes describing one extra device (our layer's virtual blob)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from dsec_fs.errors import FormatError

DEVICE_SLOT = struct.Struct(
    "<"
    "64s"  # 0 tag: the blob id (64 hex characters, no NUL); the kernel only uses it without device=
    "I"  # 64 blocks: size of the device in blocks
    "I"  # 68 mapped_blkaddr: start in the unified block space (flatdev mode); 0, we always pass device=
    "56s"  # 72 reserved
)
assert DEVICE_SLOT.size == 128
SLOT_SIZE = DEVICE_SLOT.size


@dataclass
class DeviceSlot:
    tag: bytes
    blocks: int
    mapped_blkaddr: int = 0

    def pack(self) -> bytes:
        return DEVICE_SLOT.pack(self.tag, self.blocks, self.mapped_blkaddr, bytes(56))

    @classmethod
    def unpack(cls, image: bytes | memoryview, offset: int, *, source: str = "meta.erofs") -> "DeviceSlot":
        if offset + SLOT_SIZE > len(image):
            raise FormatError("device slot", offset, "device table runs past the end of the image", source=source)
        tag, blocks, mapped, _ = DEVICE_SLOT.unpack_from(image, offset)
        return cls(tag=bytes(tag).rstrip(b"\0"), blocks=blocks, mapped_blkaddr=mapped)
