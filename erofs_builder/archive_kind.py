"""Whether a file is an image archive (OCI or docker-archive tar) rather than a tar of a root filesystem.

The rule (build.source_kind): an image archive is an uncompressed tar whose top level holds
``manifest.json`` or ``oci-layout`` (how `docker save` and `skopeo copy` write them), the names as
Python's tarfile reports them with leading "./" and "/" stripped. Deciding it means reading every
header of the archive, and tarfile spends ~40-60 us on each (every field parsed in Python): for a tar of
100,000 small files that is seconds, more than building the layer of the same tree from a directory.
So the headers are first scanned here with one pread and one checksum a member, looking at nothing
but the name, the type and the size; an archive with anything this scan does not read itself (GNU
long names or base-256 numbers, global or sparse PAX records, a header that does not check out,
trailing-slash names of other types) is scanned by tarfile instead, so the answer is always
tarfile's.

Threads: any thread; nothing is shared.
"""

from __future__ import annotations

import os
import tarfile

from .tar_header import header_sum

BLOCK = 512
_ZEROS = bytes(BLOCK)
_DIGITS = b"01234567"
_MARKERS = frozenset({b"manifest.json", b"oci-layout"})
# Types whose name, size and data framing the scan reads as tarfile does: files, links, devices,
# directories, FIFOs, contiguous files; and the PAX extended header of the next member.
_PLAIN_TYPES = frozenset(b"\x00" b"0123456" b"7")
_DATA_TYPES = frozenset(b"\x00" b"0" b"7")  # the regular files, whose data follows the header
_DIRECTORY = ord("5")
_PAX = ord("x")
_MAX_PAX = 1 << 20  # a bigger PAX header is read by tarfile


class _Unusual(Exception):
    """The archive has something only tarfile reads exactly."""


def is_image_archive(path: str) -> bool:
    """True when the file at ``path`` is an image archive (see the module docstring); a file that is no
    tar at all (compressed, or anything else) is not."""
    try:
        names = _scan_names(path)
    except _Unusual:
        names = _names_by_tarfile(path)
    except OSError:
        return False
    return any(name.lstrip(b"./") in _MARKERS for name in names)


def _names_by_tarfile(path: str) -> list[bytes]:
    try:
        with tarfile.open(path, "r:") as archive:  # uncompressed only: image archives are not compressed
            return [os.fsencode(name) for name in archive.getnames()]
    except (tarfile.TarError, OSError):
        return []


def _scan_names(path: str) -> list[bytes]:
    """Every member's name, reading headers only, as tarfile names them; _Unusual where tarfile may read
    the archive otherwise."""
    names = []
    append = names.append
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        offset = 0
        pax: bytes | None = None  # the data of a PAX header that applies to the next member
        while True:
            block = os.pread(fd, BLOCK, offset)
            if len(block) < BLOCK or block == _ZEROS:
                if offset == 0 or pax is not None:
                    raise _Unusual  # tarfile: not a tar at all, or a PAX header with no member
                return names  # the end-of-archive marker (or a truncated archive, which tarfile ends too)
            # The checksum, unsigned, as tarfile checks it first; then the size. Written out here, not in
            # calls: this loop runs once a member (100,000 times for a tar of a node_modules tree).
            field = block[148:156].rstrip(b" \0")
            stored = int(field, 8) if field and not field.translate(None, _DIGITS) else _octal(block[148:156])
            if block[124] & 0x80 or stored != header_sum(block):
                raise _Unusual  # base-256, or a checksum tarfile might still accept (signed) or refuse
            field = block[124:136].rstrip(b" \0")
            size = int(field, 8) if field and not field.translate(None, _DIGITS) else _octal(block[124:136])
            kind = block[156]
            if kind == _PAX:
                if pax is not None or size > _MAX_PAX:
                    raise _Unusual
                pax = os.pread(fd, size, offset + BLOCK)
                if len(pax) != size:
                    raise _Unusual
            elif kind in _PLAIN_TYPES:
                # tarfile's frombuf: an old-style directory, slashes off a directory's name, then the prefix
                end = block.find(0, 0, 100)
                name = block[:end if end >= 0 else 100]
                if kind == 0 and name.endswith(b"/"):
                    kind = _DIRECTORY
                if kind == _DIRECTORY:
                    name = name.rstrip(b"/")
                if block[345]:  # a prefix
                    name = block[345:500].split(b"\0", 1)[0] + b"/" + name
                if pax is not None:
                    path = _pax_path(pax)
                    name = name if path is None else path
                    pax = None
                append(name)
                if kind not in _DATA_TYPES:
                    size = 0  # tarfile skips no data for links, devices, directories and FIFOs
            else:
                raise _Unusual
            offset += BLOCK + -(-size // BLOCK) * BLOCK


def _octal(field: bytes) -> int:
    digits = field.rstrip(b" \0")
    if digits and not digits.translate(None, _DIGITS):  # the common case: digits, then padding
        return int(digits, 8)
    text = field.split(b"\0", 1)[0].strip(b" ")
    if text.strip(b"01234567"):
        raise _Unusual
    return int(text, 8) if text else 0


def _pax_path(data: bytes) -> bytes | None:
    """The ``path`` record of a PAX extended header, trailing slashes off as tarfile takes them (None: no
    such record); _Unusual for one that sets other names or sizes, or that tarfile might parse otherwise."""
    path = None
    pos, size = 0, len(data)
    while pos < size:
        space = data.find(b" ", pos, pos + 21)
        length = data[pos:space]
        if space < 0 or not length.isdigit():
            raise _Unusual
        end = pos + int(length)
        key, equals, value = data[space + 1:end - 1].partition(b"=")
        if end > size or data[end - 1] != 0x0A or not equals or key.startswith(b"GNU.sparse") or key in (
                b"size", b"hdrcharset"):
            raise _Unusual
        if key == b"path":
            path = value.rstrip(b"/")
        pos = end
    return path
