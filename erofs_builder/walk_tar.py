"""Read a tar stream (plain, gzip or zstd) into Nodes and a Tree, without extracting anything to disk.

Formats: ustar, GNU (long names 'L'/'K', old sparse 'S') and PAX (exact mtime in nanoseconds, long names,
big sizes and ids, xattrs as SCHILY.xattr.* / LIBARCHIVE.xattr.* / RHT.security.selinux, GNU sparse maps
0.0, 0.1 and 1.0). Compression is recognised by its magic bytes. We parse headers ourselves rather than
with ``tarfile``: tarfile ends the archive silently at a bad checksum or a truncated header, keeps every
member in memory, reads a PAX header of any size into memory and rounds PAX mtimes to a float.

Streaming. The input is read once, front to back; memory stays bounded (one header, one chunk). So a
regular file's content can only be read while the stream is on its member. ``tar_nodes`` yields each
member's (path, Node); a new regular file's ``Node.reader`` reads that member's data and is valid only
until the iterator is advanced. Advancing skips whatever was not read, then sets ``node.reader`` to None;
a reader (or a piece iterator it returned) used after that raises RuntimeError, and a reader can be called
once. ``walk_tar`` and ``fill_tree`` call ``on_file(node)`` at exactly the right moment; a build passes the
chunker's per-file function there, and the chunker must not call ``node.reader`` again later (a tar node
whose content was consumed has ``chunks`` set and ``reader`` None). ``on_file=None`` builds a
metadata-only Tree: regular files keep ``chunks`` None and ``reader`` None, which no build may publish.

Hard links ('1') give the very Node of the earlier member they name (same object at both paths), and
carry no reader of their own. GNU tar's path rules: leading '/' and '.' components are dropped, the last
of duplicate members wins (Tree.add).

Hostile input. Everything that breaks the archive's framing is fatal (InputError): bad header checksum,
truncation anywhere ("truncated"), corrupt compression (a compressed input is read to its very end, past
the tar's end marker, so gzip's CRC and zstd's checksums are checked), malformed PAX records, oversized
extension headers, a header-only member (link, device, directory...) that claims data, data after a lone zero
block, decompression beyond ``TarLimits`` (limits.py), a layer beyond its ``LayerLimits`` (with a budget). A bad member whose extent is known raises ``MemberError`` (an
InputError) naming the member and its header offset: '..' or NUL in a name, a hard link to a missing,
directory or outside target, sizes over ``TarLimits.max_file_size``, absurd sparse maps (unsorted,
overlapping, past the end, too many segments, not matching the data), bad ids, device numbers or xattrs,
unknown member types, and overlay-reserved xattrs (trusted.overlay.* / user.overlay.*: in a layer they
would steer OverlayFS). With ``lenient=True`` such members are skipped with a warning; so are members the
Tree refuses (e.g. an entry below a non-directory). Offsets are in the uncompressed tar stream.

The parts, one module each: tar_input.py (decompression, exact reads, TarLimits on the stream),
tar_header.py (one header block, PAX records), tar_members.py (members with their extension headers,
sparse maps and content, MemberError); here, each member made a Node and the Nodes added to a Tree.
Nearly every member of a real tar is plain (a GNU or ustar file, directory, symlink or hard link with
no extension header): ``_plain_entry`` parses its header with one unpack and makes its node in one
step (a regular file's is a ``StreamedFile``, Node's fields in fewer bytes), declining, with nothing
consumed, anything the general rules would read otherwise or refuse, which they then do.

Threads: one thread iterates and calls the readers; nothing here is shared between threads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import stat
import struct
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from types import MappingProxyType
from typing import BinaryIO

from dsec_fs.errors import InputError

from .limits import DEFAULT_LIMITS, LayerBudget, TarLimits
from .tar_header import _POSIX_MAGIC, header_sum
from .tar_input import _open_input
from .tar_members import (MAX_DECIMAL_DIGITS, REGULAR_TYPES, MemberError, _Content, _Member, _pax_decimal, _sparse_map,
                          _TarReader)
from .tree import Node, Tree

log = logging.getLogger(__name__)

MAX_ID = (1 << 32) - 1  # EROFS extended inodes store 32-bit uid/gid
MAX_MAJOR = (1 << 12) - 1  # Linux dev_t (and EROFS's rdev): 12-bit major, 20-bit minor
MAX_MINOR = (1 << 20) - 1
PATH_MAX = 4096  # a symlink target must be shorter (Linux)
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 1 << 16
RESERVED_XATTR_PREFIXES = (b"trusted.overlay.", b"user.overlay.")


# ---------------------------------------------------------------------------------------------------------
# Nodes.


def _normalize(name: bytes, what: str, where: str) -> bytes:
    """GNU tar's reading of a member path: no leading '/', no '.' or empty components, never '..'."""
    if b"\0" in name:
        raise MemberError(f"{what} contains NUL: {name!r}", where=where)
    parts = [part for part in name.split(b"/") if part not in (b"", b".")]
    if b".." in parts:
        raise MemberError(f"{what} has a '..' component: {name!r}", where=where)
    return b"/".join(parts)


def _mtime_ns(member: _Member) -> int:
    """PAX mtime ("-?seconds[.fraction]") exactly, else the header's whole seconds."""
    value = member.pax.get(b"mtime")
    if not value:
        ns = member.header.mtime * 1_000_000_000
    else:
        seconds, _, fraction = value.removeprefix(b"-").partition(b".")
        if not seconds.isdigit() or (fraction and not fraction.isdigit()) or len(seconds) > MAX_DECIMAL_DIGITS:
            raise MemberError(f"PAX mtime is not a decimal number of at most {MAX_DECIMAL_DIGITS} digits: "
                              f"{value[:40]!r}", where=member.where)
        ns = int(seconds) * 1_000_000_000 + int(fraction[:9].ljust(9, b"0"))
        ns = -ns if value.startswith(b"-") else ns
    if not -(1 << 63) <= ns // 1_000_000_000 < 1 << 63:  # EROFS stores 64-bit seconds
        raise MemberError(f"mtime {ns // 1_000_000_000} s is out of range", where=member.where)
    return ns


def _numeric(member: _Member, key: bytes, header_value: int, maximum: int, what: str) -> int:
    """A number of the header that PAX record ``key`` may override, checked against 0..maximum."""
    value = _pax_decimal(member.pax[key], what, member.where) if member.pax.get(key) else header_value
    if not 0 <= value <= maximum:
        raise MemberError(f"{what} {value} is outside 0..{maximum}", where=member.where)
    return value


def _xattrs(member: _Member) -> dict[bytes, bytes]:
    xattrs = {}
    for key, value in member.pax.items():
        if key.startswith(b"SCHILY.xattr."):
            name = key[len(b"SCHILY.xattr.") :]
        elif key.startswith(b"LIBARCHIVE.xattr."):
            # libarchive percent-encodes the name and base64-encodes the value (padding optional).
            name = urllib.parse.unquote_to_bytes(key[len(b"LIBARCHIVE.xattr.") :])
            try:
                value = base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
            except binascii.Error:
                raise MemberError(f"xattr {name!r}: value is not base64", where=member.where) from None
        elif key == b"RHT.security.selinux":  # Red Hat's tar before SCHILY.xattr
            name = b"security.selinux"
        else:
            continue
        if not name or b"\0" in name or len(name) > XATTR_NAME_MAX:
            raise MemberError(f"invalid xattr name {name[:60]!r}", where=member.where)
        if len(value) > XATTR_SIZE_MAX:
            raise MemberError(f"xattr {name!r} value is {len(value)} bytes (max {XATTR_SIZE_MAX})", where=member.where)
        if name.startswith(RESERVED_XATTR_PREFIXES):
            raise MemberError(f"xattr {name!r} is reserved for OverlayFS", where=member.where)
        xattrs[name] = value
    return xattrs


def _node_for(member: _Member, reader: _TarReader, links: dict[bytes, Node]) -> tuple[bytes, Node]:
    """The (path, Node) of a member; for a regular file, its content is attached to the reader."""
    where = member.where
    if member.problem:
        raise MemberError(member.problem, where=where)
    path = _normalize(member.name, "name", where)
    kind = member.header.typeflag
    if kind == b"1":
        target = _normalize(member.linkname, "hard link target", where)
        node = links.get(target)
        if node is None:
            raise MemberError(f"hard link to {member.linkname!r}, which no earlier member is", where=where)
        if node.is_dir:
            raise MemberError(f"hard link to directory {member.linkname!r}", where=where)
        links[path] = node
        return path, node

    header = member.header
    perms = header.mode & 0o7777
    if member.pax:
        node = Node(
            mode=0,
            uid=_numeric(member, b"uid", header.uid, MAX_ID, "uid"),
            gid=_numeric(member, b"gid", header.gid, MAX_ID, "gid"),
            mtime_ns=_mtime_ns(member),
            xattrs=_xattrs(member),
            source=member.source,
        )
    else:  # no PAX records (most members of a GNU tar): the header's numbers, no xattrs
        if not (0 <= header.uid <= MAX_ID and 0 <= header.gid <= MAX_ID):
            _numeric(member, b"uid", header.uid, MAX_ID, "uid")  # raises, naming the one out of range
            _numeric(member, b"gid", header.gid, MAX_ID, "gid")
        node = Node(0, header.uid, header.gid, _mtime_ns(member), 0, 0, {}, source=member.source)
    sparse = None
    if kind == b"\0" and member.name.endswith(b"/"):
        node.mode = stat.S_IFDIR | perms  # pre-POSIX tars mark directories with a trailing '/'
    elif kind in REGULAR_TYPES and not member.pax and not member.sparse_00:  # not sparse
        node.mode = stat.S_IFREG | perms
        node.size = member.size
        limit = reader.stream.limits.max_file_size
        if node.size > limit:
            raise MemberError(f"file of {node.size} bytes (TarLimits.max_file_size {limit})", where=where)
    elif kind in REGULAR_TYPES or kind == b"S":
        sparse = _sparse_map(member, reader)
        node.mode = stat.S_IFREG | perms
        node.size = member.size if sparse is None else sparse[0]
        limit = reader.stream.limits.max_file_size
        if node.size > limit:
            raise MemberError(f"file of {node.size} bytes (TarLimits.max_file_size {limit})", where=where)
    elif kind == b"2":
        target = member.linkname
        if not target or b"\0" in target or len(target) >= PATH_MAX:
            raise MemberError(f"invalid symlink target {target[:60]!r} ({len(target)} bytes)", where=where)
        node.mode = stat.S_IFLNK | 0o777
        node.target = target
        node.size = len(target)
    elif kind in (b"3", b"4"):
        major = _numeric(member, b"SCHILY.devmajor", member.header.devmajor, MAX_MAJOR, "device major")
        minor = _numeric(member, b"SCHILY.devminor", member.header.devminor, MAX_MINOR, "device minor")
        node.mode = (stat.S_IFCHR if kind == b"3" else stat.S_IFBLK) | perms
        node.rdev = os.makedev(major, minor)
    elif kind in (b"5", b"D"):  # 'D': a GNU incremental dump directory; its data (a listing) is skipped
        node.mode = stat.S_IFDIR | perms
    elif kind == b"6":
        node.mode = stat.S_IFIFO | perms
    else:
        raise MemberError(f"unsupported member type {kind!r}", where=where)
    if node.is_dir:
        node.children = {}
    if node.is_reg:
        content = _Content(reader, node, None if sparse is None else sparse[1], member.name, member.offset)
        node.reader = content.read
        reader.attach(content)
    links[path] = node
    return path, node


# ---------------------------------------------------------------------------------------------------------
# Plain members in one step.

# A header's first 265 bytes as plain members have them: name, mode, uid, gid, size, mtime, chksum, typeflag,
# linkname and magic (the fields of tar_header._HEADER; devmajor and devminor are sliced, the rest unused).
_PLAIN_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s8s")
_GNU_MAGIC = b"ustar  \0"
_PLAIN_TYPES = frozenset((b"0", b"5", b"2", b"1"))  # file, directory, symlink, hard link
_OCTAL_DIGITS = b"01234567"
_NO_XATTRS = MappingProxyType({})


class StreamedFile:
    """The node of a plain regular-file member (``_plain_entry``): a Node to everything that reads it (the
    same fields), in 10 slots instead of Node's 14, with no xattrs of its own (one shared empty mapping) and
    its ``source`` (the member's name, for messages) made from the name as archived only when asked for. A
    Node, its own empty dict and its source string were ~230 bytes a file."""

    __slots__ = ("mode", "uid", "gid", "mtime_ns", "size", "xattrs", "nlink", "chunks", "reader", "_name")
    rdev = 0
    target = b""
    children = None
    identity = None
    is_dir, is_reg, is_symlink = Node.is_dir, Node.is_reg, Node.is_symlink

    def __init__(self, mode: int, uid: int, gid: int, mtime_ns: int, size: int, name: bytes):
        self.mode, self.uid, self.gid, self.mtime_ns, self.size = mode, uid, gid, mtime_ns, size
        self.xattrs = _NO_XATTRS
        self.nlink, self.chunks, self.reader = 0, None, None
        self._name = name

    @property
    def source(self) -> str:
        return self._name.decode("utf-8", "backslashreplace")


def _plain_entry(block: bytes, offset: int, reader: _TarReader, links: dict[bytes, Node],
                 shared: dict[int, int]) -> tuple[bytes, Node] | None:
    """The (path, node) of the member whose header is ``block``, made in one step, when the member is plain:
    a file, directory, symlink or hard link of a GNU or POSIX ustar header (no prefix) with no extension
    header before it, every number octal digits then padding, the unsigned checksum right, nothing the
    general rules (``_TarReader.member``, ``_node_for``) would refuse or read otherwise; the member is then
    the reader's current one. None for anything else, with nothing consumed or changed: the general rules
    then read the member from the same block and give the same node, or the error. Nearly every member of
    a tar is plain, and this is the only code most of them meet."""
    name, mode, uid, gid, size, mtime, chksum, kind, linkname, magic = _PLAIN_HEADER.unpack_from(block)
    if kind not in _PLAIN_TYPES or (magic != _GNU_MAGIC and (magic != _POSIX_MAGIC or block[345])):
        return None
    numbers = [field.rstrip(b" \0") for field in (chksum, size, mode, uid, gid, mtime, block[329:337], block[337:345])]
    if not numbers[0] or b"".join(numbers).translate(None, _OCTAL_DIGITS):
        return None
    stored, size, mode, uid, gid, mtime = [int(number, 8) if number else 0 for number in numbers[:6]]
    if stored != header_sum(block):
        return None
    end = name.find(0)
    if end >= 0:
        name = name[:end]
    path = name[2:] if name.startswith(b"./") else name
    if path.endswith(b"/"):
        path = path[:-1]
    if not path or path.startswith((b"/", b".")) or path.endswith(b"/") or b"//" in path or b"/." in path:
        if b".." in name:
            return None  # maybe a '..' component: refused by the general rules
        path = _normalize(name, "name", "")  # '.' components, empty ones, dotfiles: never raises here
    mode = shared.setdefault(mode & 0o7777, mode & 0o7777)
    uid, gid = shared.setdefault(uid, uid), shared.setdefault(gid, gid)  # < 8**8: always within MAX_ID
    mtime_ns = mtime * 1_000_000_000  # < 8**12 s: always within range
    if kind == b"0":
        if size > reader.stream.limits.max_file_size:
            return None
        node = StreamedFile(shared.setdefault(stat.S_IFREG | mode, stat.S_IFREG | mode), uid, gid, mtime_ns, size,
                            name)
        content = _Content(reader, node, None, name, offset)
        node.reader = content.read
        reader.start(name, offset, size, content)
        links[path] = node
        return path, node
    if size:
        return None  # a header-only member that claims data
    end = linkname.find(0)
    if end >= 0:
        linkname = linkname[:end]
    if kind == b"1":
        if b".." in linkname:
            return None
        node = links.get(_normalize(linkname, "hard link target", ""))
        if node is None or node.is_dir:
            return None
    elif kind == b"2":
        if not linkname:
            return None
        node = Node(stat.S_IFLNK | 0o777, uid, gid, mtime_ns, len(linkname), 0, {}, linkname,
                    source=name.decode("utf-8", "backslashreplace"))
    else:
        node = Node(stat.S_IFDIR | mode, uid, gid, mtime_ns, 0, 0, {}, children={},
                    source=name.decode("utf-8", "backslashreplace"))
    reader.start(name, offset, 0, None)
    links[path] = node
    return path, node


# ---------------------------------------------------------------------------------------------------------
# Public API.

OnFile = Callable[[Node], None]


def tar_nodes(
    stream: BinaryIO, *, source: str, lenient: bool = False, limits: TarLimits = DEFAULT_LIMITS
) -> Iterator[tuple[bytes, Node]]:
    """(path, Node) for each member of the tar in ``stream``, in archive order.

    A new regular file's ``node.reader`` reads its content from the stream and works only until the
    iterator is advanced (see the module docstring); a hard link yields the earlier member's Node again,
    with no reader. ``source`` names the archive in errors. Fatal problems raise InputError (or
    UnsupportedError for xz/bzip2); a bad member raises MemberError, or is skipped if ``lenient``.
    """
    reader = _TarReader(_open_input(stream, source, limits))
    links: dict[bytes, Node] = {}  # path -> the Node last placed there, for hard links
    shared: dict[int, int] = {}  # one int object for each mode, uid and gid seen (plain members)
    while True:
        block, offset = reader.next_block()
        entry = _plain_entry(block, offset, reader, links, shared)
        if entry is None:  # anything but a plain member: the general rules
            member = reader.member(block, offset)
            if member is None:
                return
            try:
                entry = _node_for(member, reader, links)
            except MemberError as exc:
                if not lenient:
                    raise
                log.warning("%s: member skipped: %s", exc.where, exc.message)
                continue
        yield entry


def fill_tree(
    tree: Tree, nodes: Iterable[tuple[bytes, Node]], *, on_file: OnFile | None, lenient: bool = False,
    budget: LayerBudget | None = None,
) -> Tree:
    """Add streamed (path, Node) pairs to ``tree``, calling ``on_file(node)`` for each new regular file
    while its content is readable (right after the node is placed, before the stream moves on). With
    ``budget``, every entry is counted first: one beyond the layer's limits stops the walk (InputError)."""
    refused: set[int] = set()  # id() of nodes the tree refused (lenient): their hard links go too
    add = tree.adder()  # nothing else changes the tree in this loop
    for path, node in nodes:
        if budget is not None:  # a hard link carries no reader: its inode is counted already
            budget.add(path.rpartition(b"/")[2], node, new_inode=not node.is_reg or node.reader is not None)
        try:
            if id(node) in refused:
                raise InputError("hard link to a member that was skipped", where=node.source)
            add(path, node)
        except InputError as exc:
            if not lenient:
                raise
            log.warning("%s: member skipped: %s", exc.where, exc.message)
            refused.add(id(node))
            continue
        if node.reader is not None and on_file is not None:
            on_file(node)
    return tree


def walk_tar(
    path_or_stream: str | os.PathLike | BinaryIO,
    *,
    on_file: OnFile | None,
    lenient: bool = False,
    tree: Tree | None = None,
    limits: TarLimits = DEFAULT_LIMITS,
    budget: LayerBudget | None = None,
) -> Tree:
    """The Tree of a tar file or stream (plain, gzip or zstd), added to ``tree`` if given; finished.

    ``on_file`` is required and explicit: a build passes the chunker's per-file function (it must read
    ``node.reader`` and fill ``node.chunks`` before returning); None gives a metadata-only Tree whose
    regular files have no content. ``budget``: see fill_tree.
    """
    tree = tree if tree is not None else Tree()
    if isinstance(path_or_stream, (str, bytes, os.PathLike)):
        source = os.fsdecode(path_or_stream)
        try:
            stream = open(path_or_stream, "rb", buffering=1 << 20)
        except OSError as exc:
            raise InputError(f"cannot open: {exc.strerror}", where=source) from None
        closing = stream
    else:
        stream, closing = path_or_stream, contextlib.nullcontext()
        source = str(getattr(stream, "name", "<tar stream>"))
    with closing:
        nodes = tar_nodes(stream, source=source, lenient=lenient, limits=limits)
        fill_tree(tree, nodes, on_file=on_file, lenient=lenient, budget=budget)
    tree.finish()
    return tree
