"""CRC32C (Castagnoli), as the EROFS superblock checksum uses it.

The kernel computes crc32c with seed 0xFFFFFFFF and no final inversion over the rest of block 0, so the
stored value is the raw register. The block is at most 4 KiB, so a table-driven loop in Python is fast
enough (tens of microseconds) and saves a C dependency.
"""

from __future__ import annotations

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _make_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_POLY if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c_raw(data: bytes | memoryview, seed: int = 0xFFFFFFFF) -> int:
    """The CRC register after ``data``, without the final XOR (what EROFS stores)."""
    crc = seed
    table = _TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc
