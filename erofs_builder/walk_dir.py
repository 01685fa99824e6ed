"""Walk a directory into a Tree: every inode kind, xattrs, hard links, sparse files.

The walk itself reads metadata only (one lstat and one listxattr per entry, a getxattr per name found;
readlink for symlinks); file contents are read later, once, by the chunker through each regular file's
``Node.reader``. ``scan_directory`` is the listing part alone (one lstat per entry, in listing order):
the walk is built on it, and its order is the one a layer's build info records (incremental.py).
Nothing ever follows a symlink below the source: entries are lstat'ed, xattrs read with
follow_symlinks=False and files opened with O_NOFOLLOW. The source itself may be given through a
symlink. The root directory's own metadata becomes the layer root's.

Hard links: non-directories with st_nlink > 1 that share (st_dev, st_ino) become one Node placed at
every path. Links to the same inode from outside the source do not matter; a link count above the names
seen here is normal.

Memory: a Tree of a large source holds every entry, so a node keeps its on-disk path once (``source``),
a file's reader is a small object that takes the path from there when the chunker calls it, nodes
without xattrs share one read-only empty mapping, and the values most entries share (mode, uid, gid,
device) are one object each rather than one per entry.

A file must not change between the walk and the end of its read: the reader compares fstat (device,
inode, size, mtime, ctime) with the walk's lstat after its last read, and, for a file of several pieces,
also before its first, and raises InputError naming the path otherwise. A file of one piece is read with
one pread between open and that fstat: a handful of system calls for each of the many small files of a
root filesystem. A file whose allocated blocks do not cover its size may have holes: the reader skips
them without reading (SEEK_DATA) and yields None for a piece wholly inside one, so a sparse file of many
GiB costs a few lseek calls. Any other file is read whole; a hole it might still have (a filesystem that
counts blocks its own way) reads as zeros, which the chunker stores as a hole all the same.

Errors: InputError naming the path for anything about the input (missing or non-directory source,
unreadable entries, names over 255 bytes, files changed or removed during the build).

Threads: walk_directory, scan_directory and the readers they create are called from one thread at a
time (the chunker reads in its main thread); they share no state.
"""

from __future__ import annotations

import errno
import operator
import os
import stat
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from dsec_fs.errors import InputError

from .tree import Node, Tree

# O_NONBLOCK: a file replaced by a FIFO since the walk must not block the open; the fstat check then
# reports it. Reads of regular files ignore the flag.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_SECTOR = 512  # unit of st_blocks
_NO_XATTRS: Mapping[bytes, bytes] = MappingProxyType({})
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def walk_directory(root: str | bytes | os.PathLike) -> Tree:
    """Return the Tree of everything under ``root`` (a directory); Tree.finish() has been called."""
    shared: dict[int, int] = {}  # one int object for each value of mode, uid, gid and device seen
    links: dict[tuple[int, int], Node] = {}  # (st_dev, st_ino) -> Node, for inodes with several names
    directories: dict[bytes, Node] = {}  # tree path -> node of every directory listed so far
    tree: Tree | None = None
    for directory, names in scan_directory(root):
        for path, source, st in names:
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                node = links.get((st.st_dev, st.st_ino))
                if node is None:
                    node = links[st.st_dev, st.st_ino] = node_of(source, st, shared)
            else:
                node = node_of(source, st, shared)
                if node.children is not None:
                    directories[path] = node
            if directory is None:
                tree = Tree(node)
            else:
                tree.add_child(directories[directory], path.rpartition(b"/")[2], node)
    tree.finish()
    return tree


Listing = Iterator[tuple["bytes | None", list[tuple[bytes, bytes, os.stat_result]]]]


def scan_directory(root: str | bytes | os.PathLike) -> Listing:
    """Every name under the directory ``root`` with its lstat, a directory at a time: metadata only, one
    lstat per name. Yields (tree path of the directory listed, [(tree path, path on disk, lstat) of each
    of its names, in byte order]): first (None, [the root itself: b"", ``root``, its stat (following a
    symlink)]), then the root's names, then those of each directory in turn, depth first (a directory's
    subdirectories right after it, in byte order). That order of names is ``listing_order``'s."""
    root = os.fsencode(root)
    try:
        root_stat = os.stat(root)
    except OSError as exc:
        raise _input_error(exc, root) from None
    if not stat.S_ISDIR(root_stat.st_mode):
        raise InputError("the source is not a directory", where=os.fsdecode(root))
    yield None, [(b"", root, root_stat)]
    pending = [(b"", root)]  # directories still to list, the next one last
    while pending:
        path, directory = pending.pop()
        prefix = path + b"/" if path else b""
        try:
            with os.scandir(directory) as entries:
                names = [(prefix + entry.name, entry.path, entry.stat(follow_symlinks=False)) for entry in entries]
        except OSError as exc:
            raise _input_error(exc, exc.filename or directory) from None
        names.sort()  # tree paths are unique: the stat results are never compared
        yield path, names
        pending += [(name, source) for name, source, st in reversed(names) if stat.S_ISDIR(st.st_mode)]


def listing_order(tree: Tree) -> Iterator[tuple[bytes, Node]]:
    """(path, node) of every name of ``tree`` in the order ``scan_directory`` lists them (a hard-linked
    node once per name)."""
    yield b"", tree.root
    pending = [(b"", tree.root)]
    while pending:
        path, directory = pending.pop()
        prefix = path + b"/" if path else b""
        names = [(prefix + name, directory.children[name]) for name in sorted(directory.children)]
        yield from names
        pending += [(name, node) for name, node in reversed(names) if node.is_dir]


# What identifies a source entry's inode and content, as a tuple (st_dev, st_ino, size, mtime_ns,
# ctime_ns, mode) of an lstat result: ``Node.identity`` of a walked node, and what incremental.py records.
# Any write, chmod, chown or xattr change moves the ctime. An attrgetter: built at C speed, once per name.
stat_identity = operator.attrgetter("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns", "st_mode")


def node_of(path: bytes, st: os.stat_result, shared: dict[int, int]) -> Node:
    """The Node of the entry at ``path`` whose lstat is ``st``: reads its xattrs, and a symlink's target.
    ``shared`` maps each int value seen to one object (see Memory above); pass {} for a lone node."""
    mode = shared.setdefault(st.st_mode, st.st_mode)
    # stat_identity(st), with the shared objects; each st_* read makes a new int object, so the node's
    # mtime and size are the identity's own.
    identity = (shared.setdefault(st.st_dev, st.st_dev), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                mode)
    node = Node(
        mode=mode,
        uid=shared.setdefault(st.st_uid, st.st_uid),
        gid=shared.setdefault(st.st_gid, st.st_gid),
        mtime_ns=identity[3],
        xattrs=_xattrs(path),
        identity=identity,
        source=path.decode(_FS_ENCODING, _FS_ERRORS),  # os.fsdecode, without its checks: once per entry
    )
    if stat.S_ISREG(mode):
        node.size = identity[2]
        node.reader = _FileReader(node.source, identity)
    elif stat.S_ISDIR(mode):
        node.children = {}
    elif stat.S_ISLNK(mode):
        try:
            node.target = os.readlink(path)
        except OSError as exc:
            raise _input_error(exc, path) from None
        node.size = len(node.target)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        node.rdev = st.st_rdev
    elif not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        raise InputError(f"unknown file type {stat.S_IFMT(mode):#o}", where=node.source)
    return node


def _xattrs(path: bytes) -> Mapping[bytes, bytes]:
    """Every extended attribute of ``path`` itself, whatever its namespace; none where xattrs are unsupported."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
        if not names:
            return _NO_XATTRS
        return {os.fsencode(name): os.getxattr(path, name, follow_symlinks=False) for name in names}
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return _NO_XATTRS
        raise _input_error(exc, path) from None


class _FileReader:
    """The ChunkReader of a walked file. It shares its node's path string and identity tuple instead of
    holding copies (the path is encoded again only when the file is read)."""

    __slots__ = ("_source", "_identity")

    def __init__(self, source: str, identity: tuple):
        self._source = source
        self._identity = identity

    def __call__(self, chunk_size: int) -> Iterator[bytes | None]:
        return _read_file(self._source, self._identity, chunk_size)


def _read_file(where: str, identity: tuple, chunk_size: int) -> Iterator[bytes | None]:
    """The file's content in ``chunk_size`` pieces, None for pieces in a hole (see the module docstring)."""
    try:
        fd = os.open(os.fsencode(where), _OPEN_FLAGS)
    except OSError as exc:
        raise _input_error(exc, where) from None
    try:
        size = identity[2]
        if size <= chunk_size:
            try:
                data = _pread_exact(fd, size, 0, where) if size else b""
            finally:  # even when the read failed: a file replaced since the walk is reported as that
                _check_unchanged(fd, identity, where, "since the directory was scanned")
            if size:
                yield data
            return
        st = _check_unchanged(fd, identity, where, "since the directory was scanned")
        sparse = st.st_blocks * _SECTOR < size
        offset = 0
        next_data = -1  # sparse files: first data byte at or after offset, refreshed once offset passes it
        while offset < size:
            length = min(chunk_size, size - offset)
            if sparse and next_data < offset:
                next_data = _seek_data(fd, offset, size, where)
            if sparse and next_data >= offset + length:
                yield None
            else:
                yield _pread_exact(fd, length, offset, where)
            offset += length
        _check_unchanged(fd, identity, where, "while it was read")
    finally:
        os.close(fd)


def _seek_data(fd: int, offset: int, size: int, where: str) -> int:
    """Offset of the first data byte at or after ``offset``: ``size`` if only a hole remains."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data past offset: the rest is a hole
            return size
        if exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # no SEEK_DATA here: read it all
            return offset
        raise _input_error(exc, where) from None


def _pread_exact(fd: int, length: int, offset: int, where: str) -> bytes:
    try:
        data = os.pread(fd, length, offset)
        while len(data) < length:  # a short read is rare (signals, network filesystems): finish it
            more = os.pread(fd, length - len(data), offset + len(data))
            if not more:
                raise InputError(f"file shrank while it was read (end at {offset + len(data)})", where=where)
            data += more
    except OSError as exc:
        raise _input_error(exc, where) from None
    return data


def _check_unchanged(fd: int, identity: tuple, where: str, when: str) -> os.stat_result:
    st = os.fstat(fd)
    now = stat_identity(st)
    if now != identity:
        raise InputError(
            f"file changed {when} (dev, inode, size, mtime ns, ctime ns, mode: {identity} -> {now})", where=where
        )
    return st


def _input_error(exc: OSError, path: bytes | str) -> InputError:
    return InputError(f"{os.strerror(exc.errno or 0)} ({type(exc).__name__})", where=os.fsdecode(path))
