"""One tar header block (POSIX ustar layout, GNU base-256 numbers and old GNU sparse fields) and the
records of a PAX extended header, parsed and checked: a bad checksum, a field that is not a number, a
malformed PAX record are InputError (the archive's framing is broken). ``header_sum`` is also how
archive_kind.py tells a tar from other inputs.

Threads: plain functions over bytes; nothing is shared.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from dsec_fs.errors import InputError


# One 512-byte header: POSIX ustar layout; numbers are octal text (or GNU base-256), strings NUL-padded.
_HEADER = struct.Struct(
    "100s"  # name: path (ustar: the part after prefix)
    "8s"  # mode: permission bits; any file type bits here are ignored, typeflag says the type
    "8s"  # uid
    "8s"  # gid
    "12s"  # size: bytes of data following the header (for sparse members: the stored data)
    "12s"  # mtime: seconds since the epoch
    "8s"  # chksum: sum of the header's bytes, this field counted as spaces
    "c"  # typeflag: '0' file, '1' hard link, '2' symlink, '3' char, '4' block, '5' dir, '6' fifo, ...
    "100s"  # linkname: hard link or symlink target
    "8s"  # magic + version: b"ustar\x0000" (POSIX), b"ustar  \x00" (GNU), zeros (v7)
    "32s"  # uname (ignored: ids are numeric)
    "32s"  # gname
    "8s"  # devmajor
    "8s"  # devminor
    "155s"  # prefix (POSIX ustar); GNU uses this area for atime, ctime and the old sparse map
    "12x"  # padding
)
_CHKSUM = slice(148, 156)
_POSIX_MAGIC = b"ustar\x0000"
# Old GNU sparse ('S'): four (offset, numbytes) pairs of 12 octal bytes at 386, isextended at 482, the
# real file size at 483; each extension block holds 21 pairs and its own isextended at 504.
_GNU_SPARSE_PAIRS = 386
_GNU_IS_EXTENDED = 482
_GNU_REALSIZE = slice(483, 495)
_GNU_EXT_IS_EXTENDED = 504


_OCTAL_DIGITS = b"01234567"


def _cstring(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _number(field: bytes, what: str, where: str) -> int:
    """A numeric field: octal text padded with NULs or spaces, or GNU base-256 when byte 0 has its top bit."""
    digits = field.rstrip(b" \0")
    if digits and not digits.translate(None, _OCTAL_DIGITS):  # the common case: digits, then padding
        return int(digits, 8)
    if field and field[0] & 0x80:
        # Two's complement over the remaining 8n-1 bits; bit 0x40 of byte 0 is the sign.
        value = int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
        return value - (1 << (8 * len(field) - 1)) if field[0] & 0x40 else value
    text = _cstring(field.strip(b" \0")).strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise InputError(f"header field {what} is not an octal number: {field!r}", where=where)
    return int(text, 8)


def header_sum(block: bytes) -> int:
    """The unsigned checksum of a 512-byte header block: the sum of its bytes with the chksum field counted
    as spaces. At C speed: the low 16 bits of Adler-32 are 1 plus the sum of the bytes modulo 65,521, and
    256 bytes sum to at most 65,280, so each half's sum is exact (``sum(block)`` costs ~1 us a header)."""
    return ((zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2
            - sum(block[_CHKSUM]) + 8 * 32)


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[_CHKSUM], "chksum", "")
    except InputError:  # not even a number
        return False
    unsigned = header_sum(block)
    if stored == unsigned:
        return True
    # Some old tars summed signed chars.
    signed = unsigned - 256 * sum(1 for b in block if b >= 128) + 256 * sum(1 for b in block[_CHKSUM] if b >= 128)
    return stored == signed


@dataclass(slots=True)
class _Header:
    name: bytes
    mode: int
    uid: int
    gid: int
    size: int
    mtime: int
    typeflag: bytes
    linkname: bytes
    devmajor: int
    devminor: int
    block: bytes  # the raw block, for the GNU sparse fields

    @classmethod
    def unpack(cls, block: bytes, where: str) -> _Header:
        (name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic,
         _uname, _gname, devmajor, devminor, prefix) = _HEADER.unpack(block)  # fmt: skip
        name = _cstring(name)
        if magic == _POSIX_MAGIC and prefix[0]:
            name = _cstring(prefix) + b"/" + name
        # The common case at C speed: every number is octal digits then padding (or padding alone: 0), and
        # the checksum the unsigned sum. Anything else takes _number's and _checksum_ok's general rules.
        numbers = [field.rstrip(b" \0") for field in (chksum, size, mode, uid, gid, mtime, devmajor, devminor)]
        if numbers[0] and not b"".join(numbers).translate(None, _OCTAL_DIGITS):
            stored, data_size, mode, uid, gid, mtime, devmajor, devminor = [int(n, 8) if n else 0 for n in numbers]
            if stored != header_sum(block) and not _checksum_ok(block):
                raise InputError("bad header checksum (not a tar archive, or a corrupt one)", where=where)
            return cls(name, mode, uid, gid, data_size, mtime, typeflag, _cstring(linkname), devmajor, devminor,
                       block)
        if not _checksum_ok(block):
            raise InputError("bad header checksum (not a tar archive, or a corrupt one)", where=where)
        data_size = _number(size, "size", where)
        if data_size < 0:
            raise InputError(f"negative size {data_size}", where=where)
        return cls(
            name=name,
            mode=_number(mode, "mode", where),
            uid=_number(uid, "uid", where),
            gid=_number(gid, "gid", where),
            size=data_size,
            mtime=_number(mtime, "mtime", where),
            typeflag=typeflag,
            linkname=_cstring(linkname),
            devmajor=_number(devmajor, "devmajor", where),
            devminor=_number(devminor, "devminor", where),
            block=block,
        )


def _parse_pax(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """PAX extended header records: each is b"<length> <key>=<value>\\n", length counting the whole record."""
    records = []
    pos = 0
    while pos < len(data):
        if data[pos] == 0 and not data[pos:].strip(b"\0"):  # NUL padding after the last record
            break
        space = data.find(b" ", pos, pos + 21)
        length = data[pos:space] if space > pos else b""
        if not length.isdigit():
            raise InputError(f"malformed PAX record at byte {pos}", where=where)
        end = pos + int(length)
        if end <= space + 1 or end > len(data) or data[end - 1] != 0x0A:
            raise InputError(f"malformed PAX record at byte {pos}: bad length", where=where)
        key, equals, value = data[space + 1 : end - 1].partition(b"=")
        if not equals or not key:
            raise InputError(f"malformed PAX record at byte {pos}: no key=value", where=where)
        records.append((key, value))
        pos = end
    return records
