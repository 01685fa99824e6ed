"""Inline extended attributes: a 12-byte header after the inode, then 4-byte-aligned entries.

An entry stores a prefix index and the name's suffix; only the prefixes below can be stored (POSIX ACLs
are stored as their whole name with an empty suffix). We never use shared xattrs or the name filter.
"""

from __future__ import annotations

import struct

from dsec_fs.errors import FormatError, UnsupportedError

XATTR_HEADER = struct.Struct(
    "<"
    "I"  # 0 h_name_filter: bloom filter of absent names; 0 (the XATTR_FILTER feature is off)
    "B"  # 4 h_shared_count: number of shared xattr ids that follow; 0
    "7s"  # 5 reserved
)
XATTR_ENTRY = struct.Struct(
    "<"
    "B"  # 0 e_name_len: length of the name suffix
    "B"  # 1 e_name_index: which prefix (PREFIXES)
    "H"  # 2 e_value_size
)  # then the suffix and the value, the entry padded to 4 bytes
assert XATTR_HEADER.size == 12 and XATTR_ENTRY.size == 4

PREFIXES = {
    1: b"user.",
    2: b"system.posix_acl_access",
    3: b"system.posix_acl_default",
    4: b"trusted.",
    5: b"lustre.",
    6: b"security.",
}
# Longest first so "system.posix_acl_default" is not taken for a shorter prefix. "lustre." is readable
# but never written: Linux does not expose it through a mounted EROFS, so storing it would lose it silently.
_BY_LENGTH = sorted(((i, p) for i, p in PREFIXES.items() if p != b"lustre."), key=lambda kv: -len(kv[1]))
MAX_VALUE = 0xFFFF


def _split(name: bytes, where: str) -> tuple[int, bytes]:
    for index, prefix in _BY_LENGTH:
        if name.startswith(prefix):
            suffix = name[len(prefix):]
            if index in (2, 3) and suffix:
                continue
            if len(suffix) > 255:
                raise UnsupportedError(f"xattr name {name[:64]!r} is longer than EROFS allows", where=where)
            return index, suffix
    raise UnsupportedError(f"xattr {name[:64]!r} has a prefix EROFS cannot store", where=where)


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def encode(xattrs: dict[bytes, bytes], *, where: str = "") -> bytes:
    """The xattr body (header + entries), or b"" when there are none. Sorted for reproducible images."""
    if not xattrs:
        return b""
    out = bytearray(XATTR_HEADER.pack(0, 0, bytes(7)))
    for name in sorted(xattrs):
        value = xattrs[name]
        index, suffix = _split(name, where)
        if len(value) > MAX_VALUE:
            raise UnsupportedError(f"xattr {name!r} value is {len(value)} bytes (max {MAX_VALUE})", where=where)
        entry = XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
        out += entry + bytes(_pad4(len(entry)) - len(entry))
    return bytes(out)


def icount_for(body: bytes) -> int:
    """i_xattr_icount for a body made by ``encode``: body size = 12 + 4 * (icount - 1)."""
    return 0 if not body else (len(body) - XATTR_HEADER.size) // 4 + 1


def decode(image: bytes | memoryview, offset: int, icount: int, *, nid: int, source: str) -> dict[bytes, bytes]:
    """Parse the inline xattrs of inode ``nid`` whose body starts at ``offset``."""
    if icount == 0:
        return {}
    size = XATTR_HEADER.size + 4 * (icount - 1)
    where = f"xattrs of nid {nid}"
    if offset + size > len(image):
        raise FormatError(where, offset, f"xattr body of {size} bytes runs past the end of the image", source=source)
    _filter, shared, _ = XATTR_HEADER.unpack_from(image, offset)
    if shared:
        raise UnsupportedError("shared xattrs are not read", where=f"{source}: {where}")
    pos, end = offset + XATTR_HEADER.size, offset + size
    result: dict[bytes, bytes] = {}
    while pos < end:
        if pos + XATTR_ENTRY.size > end:
            raise FormatError(where, pos, "truncated xattr entry", source=source)
        name_len, index, value_size = XATTR_ENTRY.unpack_from(image, pos)
        body_end = pos + XATTR_ENTRY.size + name_len + value_size
        if index not in PREFIXES or body_end > end:
            raise FormatError(where, pos, f"xattr entry with prefix {index}, name {name_len} and value "
                              f"{value_size} bytes does not fit", source=source)
        suffix = bytes(image[pos + XATTR_ENTRY.size:pos + XATTR_ENTRY.size + name_len])
        # ACL entries are named by their prefix alone; every other prefix needs a suffix. No name has a NUL.
        if b"\0" in suffix or bool(suffix) == (index in (2, 3)):
            raise FormatError(where, pos, f"invalid name suffix {suffix[:64]!r} for prefix {index}", source=source)
        name = PREFIXES[index] + suffix
        if name in result:
            raise FormatError(where, pos, f"xattr {name[:64]!r} appears twice", source=source)
        result[name] = bytes(image[body_end - value_size:body_end])
        pos = pos + _pad4(body_end - pos)
    return result
