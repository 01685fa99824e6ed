"""Walk a directory into a Tree: every inode kind, xattrs, hard links, sparse files.

The walk itself reads metadata only (one lstat and one listxattr per entry, a getxattr per name found;
readlink for symlinks); file contents are read later, once, by the chunker through each regular file's
``Node.reader``. ``scan_directory`` is the listing part alone (one lstat per entry, in listing order):
the walk is built on it, and its order is the one a layer's build info records (incremental.py).
Nothing ever follows a symlink below the source, even while another process renames entries in it (a
sandbox's upper dir during ``sandbox commit``): the root is opened once, each directory is opened
beneath it with openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS (dsec_fs.beneath)
and must still be the inode the listing of its parent saw, its entries are lstat'ed, their xattrs and
symlink targets read, through that directory's fd without following the name (dsec_fs.beneath), and
a file is opened by its name (O_NOFOLLOW) in its directory, opened beneath the root the same way (the
walk's readers share the O_PATH fds of the root and of the directory being read). A
directory swapped for a symlink (renameat2 RENAME_EXCHANGE) makes the walk fail with InputError, never
read outside the source. The source itself may be given through a symlink. The root directory's own
metadata becomes the layer root's.

Hard links: non-directories with st_nlink > 1 that share (st_dev, st_ino) become one Node placed at
every path. Links to the same inode from outside the source do not matter; a link count above the names
seen here is normal.

Memory: a Tree of a large source holds every entry (a walk given a LayerBudget stops at its bound, see
limits.py), so a node keeps its on-disk path once (``source``), a regular file's node (``WalkedFile``)
only its name (its directory's path is one ``SourceDir`` for all its files) and makes its path, identity
tuple and reader only when asked for, nodes without xattrs share one read-only empty mapping, and the
values most entries share (mode, uid, gid, device) are one object each rather than one per entry.

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
import itertools
import operator
import os
import stat
import sys
import weakref
from array import array
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from dsec_fs.beneath import get_xattr_at, list_xattrs_at, open_beneath
from dsec_fs.errors import InputError

from .limits import LayerBudget
from .tree import Node, Tree

# O_NONBLOCK: a file replaced by a FIFO since the walk must not block the open; the fstat check then
# reports it. Reads of regular files ignore the flag.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_SECTOR = 512  # unit of st_blocks
_NO_XATTRS: Mapping[bytes, bytes] = MappingProxyType({})
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
LISTING_BATCH = 4096  # names of a directory listed between two checks of the walk's budget
_first = operator.itemgetter(0)


def walk_directory(root: str | bytes | os.PathLike, budget: LayerBudget | None = None) -> Tree:
    """Return the Tree of everything under ``root`` (a directory); Tree.finish() has been called.
    ``budget`` counts each name as it is placed, and each directory's listing as it is read: InputError
    once past its limits (see Memory in the module docstring)."""
    shared: dict[int, int] = {}  # one int object for each value of mode, uid, gid and device seen
    links: dict[tuple[int, int], Node] = {}  # (st_dev, st_ino) -> Node, for inodes with several names
    directories: dict[bytes, Node] = {}  # tree path -> node of every directory listed so far
    tree: Tree | None = None
    source_root = SourceRoot(root)
    for directory, dir_fd, names in scan_directory(root, budget):
        files_dir = None  # the SourceDir of this directory's regular files, made for the first of them
        for path, source, st in names:
            name = path.rpartition(b"/")[2]  # one object: the node's name and its key in the directory
            at = None if dir_fd is None else (dir_fd, name)
            if stat.S_ISREG(st.st_mode) and files_dir is None:
                files_dir = SourceDir(source[:len(source) - len(name)], source_root)
            new_inode = True
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                node = links.get((st.st_dev, st.st_ino))
                if node is None:
                    node = links[st.st_dev, st.st_ino] = node_of(source, st, shared, at=at, directory=files_dir)
                else:
                    new_inode = False
            else:
                node = node_of(source, st, shared, at=at, directory=files_dir)
                if node.children is not None:
                    directories[path] = node
            if budget is not None:
                budget.add(name, node, new_inode=new_inode)
            if directory is None:
                tree = Tree(node)
            else:
                tree.add_child(directories[directory], name, node)
    tree.finish()
    return tree


Listing = Iterator[tuple["bytes | None", "int | None", list[tuple[bytes, bytes, os.stat_result]]]]


def scan_directory(root: str | bytes | os.PathLike, budget: LayerBudget | None = None) -> Listing:
    """Every name under the directory ``root`` with its lstat, a directory at a time: metadata only, one
    lstat per name. Yields (tree path of the directory listed, its fd, [(tree path, path on disk, lstat)
    of each of its names, in byte order]): first (None, None, [the root itself: b"", ``root``, its stat
    (following a symlink)]), then the root's names, then those of each directory in turn, depth first (a
    directory's subdirectories right after it, in byte order). That order of names is ``listing_order``'s.
    The directory fd (see the module docstring) is valid until the generator resumes. ``budget``: a
    listing is checked every LISTING_BATCH names (LayerBudget.check_listing), so a directory of millions
    of names is refused before it is held whole."""
    root = os.fsencode(root)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise InputError("the source is not a directory", where=os.fsdecode(root)) from None
    except OSError as exc:
        raise _input_error(exc, root) from None
    try:
        root_stat = os.fstat(root_fd)
        yield None, None, [(b"", root, root_stat)]
        pending = [(b"", root, root_stat)]  # directories still to list, the next one last
        while pending:
            path, directory, listed = pending.pop()
            fd = _open_listed_directory(root_fd, path, directory, listed)
            try:
                prefix = path + b"/" if path else b""
                on_disk = directory if directory.endswith(b"/") else directory + b"/"
                try:
                    with os.scandir(fd) as entries:  # names are str for an fd: fsencode undoes it exactly
                        names, name_bytes = [], 0
                        while batch := [(prefix + name, on_disk + name, entry.stat(follow_symlinks=False))
                                        for entry in itertools.islice(entries, LISTING_BATCH)
                                        for name in (os.fsencode(entry.name),)]:
                            names += batch
                            if budget is not None:
                                name_bytes += sum(map(len, map(_first, batch))) - len(prefix) * len(batch)
                                budget.check_listing(len(names), name_bytes, os.fsdecode(directory))
                except OSError as exc:
                    raise _input_error(exc, exc.filename or directory) from None
                names.sort()  # tree paths are unique: the stat results are never compared
                yield path, fd, names
            finally:
                os.close(fd)
            pending += [entry for entry in reversed(names) if stat.S_ISDIR(entry[2].st_mode)]
    finally:
        os.close(root_fd)


def _open_listed_directory(root_fd: int, path: bytes, where: bytes, listed: os.stat_result) -> int:
    """An fd of the directory at tree path ``path``, which must be the inode its parent's listing saw."""
    try:
        fd = os.dup(root_fd) if not path else open_beneath(root_fd, path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR, errno.ENOENT):
            raise InputError("directory replaced or removed while the source was scanned "
                             f"({os.strerror(exc.errno)})", where=os.fsdecode(where)) from None
        raise _input_error(exc, where) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
        os.close(fd)
        raise InputError("directory replaced while the source was scanned", where=os.fsdecode(where))
    return fd


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


def node_of(path: bytes, st: os.stat_result, shared: dict[int, int], *, at: tuple[int, bytes] | None = None,
            directory: SourceDir | None = None) -> Node:
    """The Node of the entry at ``path`` whose lstat is ``st``: reads its xattrs, and a symlink's target.
    ``shared`` maps each int value seen to one object (see Memory above); pass {} for a lone node.
    From a walk: ``at`` (its directory's fd, its name) is how the entry is reached (scan_directory), and
    a regular file's ``directory`` (the on-disk path of its directory, whose last component is not
    followed, and the source it is opened beneath, see the module docstring) is how its reader opens it.
    Without them ``path`` is used as it is (its last component not followed)."""
    mode = shared.setdefault(st.st_mode, st.st_mode)
    uid = shared.setdefault(st.st_uid, st.st_uid)
    gid = shared.setdefault(st.st_gid, st.st_gid)
    if stat.S_ISREG(mode):
        name = path.rpartition(b"/")[2] if at is None else at[1]
        if directory is None:
            directory = SourceDir(path[:len(path) - len(name)], None)
        return WalkedFile(mode, uid, gid, st, shared, _xattrs(at, path), directory, name)
    source = path.decode(_FS_ENCODING, _FS_ERRORS)  # os.fsdecode, without its checks: once per entry
    # stat_identity(st), with the shared objects
    identity = (shared.setdefault(st.st_dev, st.st_dev), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                mode)
    node = Node(mode=mode, uid=uid, gid=gid, mtime_ns=identity[3], xattrs=_xattrs(at, path), identity=identity,
                source=source)
    if stat.S_ISDIR(mode):
        node.children = {}
    elif stat.S_ISLNK(mode):
        try:
            node.target = os.readlink(path) if at is None else os.readlink(at[1], dir_fd=at[0])
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink (any more)
                raise InputError("symlink replaced while the source was scanned", where=node.source) from None
            raise _input_error(exc, path) from None
        node.size = len(node.target)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        node.rdev = st.st_rdev
    elif not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        raise InputError(f"unknown file type {stat.S_IFMT(mode):#o}", where=node.source)
    return node


def _xattrs(at: tuple[int, bytes] | None, path: bytes) -> Mapping[bytes, bytes]:
    """Every extended attribute of the entry (reached through ``at`` if given, else ``path``; not followed),
    whatever its namespace; none where xattrs are unsupported. Errors name ``path``."""
    try:
        if at is None:
            names = [os.fsencode(name) for name in os.listxattr(path, follow_symlinks=False)]
            return {name: os.getxattr(path, name, follow_symlinks=False) for name in names} if names else _NO_XATTRS
        names = list_xattrs_at(*at)
        return {name: get_xattr_at(*at, name) for name in names} if names else _NO_XATTRS
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return _NO_XATTRS
        raise _input_error(exc, path) from None


class SourceRoot:
    """The source directory of a walk, opened once (O_PATH) for all its file readers, and the directory
    whose files are being read, opened beneath it (O_PATH): files are read directory by directory, so a
    file is one openat of its name (O_NOFOLLOW) in that directory, not an openat2 of its whole path (a
    ctypes call, ~1 us more a file). The fds are closed when the last reader is gone."""

    __slots__ = ("path", "fd", "_current", "__weakref__")

    def __init__(self, path: str | bytes | os.PathLike):
        self.path = os.fsencode(path)
        try:
            self.fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _input_error(exc, self.path) from None
        self._current: list = [None, None]  # the SourceDir last opened and its fd
        weakref.finalize(self, _close_fds, self.fd, self._current)

    def directory_fd(self, directory: SourceDir) -> int:
        """An fd of ``directory`` (a SourceDir of this root) opened beneath the root, without following any
        symlink; valid until the next call (OSError as open_beneath raises)."""
        current = self._current
        if current[0] is directory:
            return current[1]
        if not directory.beneath:
            return self.fd
        fd = open_beneath(self.fd, directory.beneath, os.O_PATH | os.O_DIRECTORY)
        if current[1] is not None:
            os.close(current[1])
        current[:] = directory, fd
        return fd


def _close_fds(root_fd: int, current: list) -> None:
    os.close(root_fd)
    if current[1] is not None:
        os.close(current[1])


class SourceDir:
    """A directory of the source as its regular files' readers reach it, and the columns of its files'
    lstat numbers: one object for all of them, so that a file's node holds its name and its row here, not
    its path and four int objects (``WalkedFile``)."""

    __slots__ = ("prefix", "root", "beneath", "names", "sizes", "mtimes", "inos", "ctimes", "blocks")

    def __init__(self, prefix: bytes, root: SourceRoot | None):
        self.prefix = prefix  # the directory's path on disk, up to and including the "/" before a name
        self.root = root  # the walk's source, shared by every file of the walk; None: open the path as is
        # the directory's path relative to the root, what a file is opened beneath it with, then its name
        self.beneath = prefix[len(root.path):].strip(b"/") if root is not None else b""
        # row k: the name and lstat fields of the directory's k-th regular file
        self.names: list[bytes] = []  # the same objects as the names in its Tree directory
        self.sizes, self.mtimes, self.inos, self.ctimes = array("Q"), array("q"), array("Q"), array("q")
        # the blob block of a file whose chunk list is one block address (WalkedFile.chunks); else unused
        self.blocks = array("Q")

    def add(self, name: bytes, st: os.stat_result) -> int:
        """Row of a new file of this directory."""
        self.names.append(name)
        self.sizes.append(st.st_size)
        self.mtimes.append(st.st_mtime_ns)
        self.inos.append(st.st_ino)
        self.ctimes.append(st.st_ctime_ns)
        self.blocks.append(0)
        return len(self.names) - 1


# WalkedFile._chunks of a file whose chunk list is the one block address in its row of SourceDir.blocks.
_ONE_BLOCK = object()


class WalkedFile:
    """The node of a regular file of a walk: a Node to everything that reads it (the same fields), in 10
    slots instead of Node's 19. A regular file's device number, symlink target and children are
    constants; its size and mtime are read from its row of its directory's columns (``SourceDir``); its
    ``identity``, ``reader`` and ``source`` (its path, for messages) are made when asked for, from its
    row and the slots. An identity tuple, a reader object, a path string and four int objects per file were
    ~380 bytes of the ~630 a large tree held per entry. Nothing assigns size, mtime_ns, identity, reader or
    source after the walk (mode, owner and xattrs may change: sandbox commit drops setuid bits).

    ``chunks`` is Node's, with one difference of storage: once a build has laid out its blob map
    (blob_layout.py), a small file's chunk list is the tuple of one block address, and that address is
    kept in its row of the directory's ``blocks`` column rather than as a tuple and an int (80 bytes a
    file, alive while meta.erofs is written); reading ``chunks`` gives the same tuple back."""

    __slots__ = ("mode", "uid", "gid", "xattrs", "nlink", "_chunks", "_dev", "_st_mode", "_dir", "_row")
    rdev = 0
    target = b""
    children = None
    is_dir, is_reg, is_symlink = Node.is_dir, Node.is_reg, Node.is_symlink

    def __init__(self, mode: int, uid: int, gid: int, st: os.stat_result, shared: dict[int, int],
                 xattrs: Mapping[bytes, bytes], directory: SourceDir, name: bytes):
        self.mode = self._st_mode = mode  # _st_mode stays the lstat's even if the build drops mode bits
        self.uid, self.gid = uid, gid
        self.nlink, self._chunks = 0, None
        self.xattrs = xattrs
        self._dev = shared.setdefault(st.st_dev, st.st_dev)
        self._dir = directory
        row = directory.add(name, st)
        self._row = shared.setdefault(row, row)  # rows repeat in every directory: one int object each

    @property
    def chunks(self) -> list | tuple | None:
        chunks = self._chunks
        return (self._dir.blocks[self._row],) if chunks is _ONE_BLOCK else chunks

    @chunks.setter
    def chunks(self, chunks: list | tuple | None) -> None:
        if type(chunks) is tuple and len(chunks) == 1 and type(chunks[0]) is int:
            self._dir.blocks[self._row] = chunks[0]
            self._chunks = _ONE_BLOCK
        else:
            self._chunks = chunks

    @property
    def size(self) -> int:
        return self._dir.sizes[self._row]

    @property
    def mtime_ns(self) -> int:
        return self._dir.mtimes[self._row]

    @property
    def source(self) -> str:
        """The file's path on disk, as the walk reached it."""
        return (self._dir.prefix + self._dir.names[self._row]).decode(_FS_ENCODING, _FS_ERRORS)

    @property
    def identity(self) -> tuple:
        """stat_identity of the walk's lstat."""
        directory, row = self._dir, self._row
        return (self._dev, directory.inos[row], directory.sizes[row], directory.mtimes[row], directory.ctimes[row],
                self._st_mode)

    @property
    def reader(self) -> Callable[[int], Iterator[bytes | None]]:
        return self._pieces

    def _pieces(self, chunk_size: int) -> Iterator[bytes | None] | tuple[bytes, ...]:
        return _read_file(self._dir, self._dir.names[self._row], self.identity, chunk_size)


def _open_file(directory: SourceDir, name: bytes) -> int:
    path = directory.prefix + name
    if directory.root is None:
        return os.open(path, _OPEN_FLAGS)
    sys.audit("open", path, None, _OPEN_FLAGS)  # audit hooks see every file read by its whole path
    return os.open(name, _OPEN_FLAGS, dir_fd=directory.root.directory_fd(directory))


def _where(directory: SourceDir, name: bytes) -> str:
    """A file's path for messages (made only for one)."""
    return (directory.prefix + name).decode(_FS_ENCODING, _FS_ERRORS)


def _read_file(directory: SourceDir, name: bytes, identity: tuple,
               chunk_size: int) -> Iterator[bytes | None] | tuple[bytes, ...]:
    """The file's content in ``chunk_size`` pieces, None for pieces in a hole (see the module docstring).
    A file of one piece (most files of a tree) is read at once, without a generator: the tuple of its
    piece (tree.ChunkReader)."""
    if identity[2] > chunk_size:
        return _read_pieces(directory, name, identity, chunk_size)
    try:
        fd = _open_file(directory, name)
    except OSError as exc:
        raise _input_error(exc, _where(directory, name)) from None
    try:
        size = identity[2]
        try:
            data = os.pread(fd, size, 0) if size else b""
            if len(data) < size:
                data += _pread_exact(fd, size - len(data), len(data), _where(directory, name))
        except OSError as exc:
            data = exc
        if stat_identity(os.fstat(fd)) != identity:  # even when the read failed: a file replaced since the
            _check_unchanged(fd, identity, _where(directory, name), "since the directory was scanned")  # walk
        if isinstance(data, OSError):
            raise _input_error(data, _where(directory, name))
    finally:
        os.close(fd)
    return (data,) if size else ()


def _read_pieces(directory: SourceDir, name: bytes, identity: tuple, chunk_size: int) -> Iterator[bytes | None]:
    """_read_file of a file of several pieces."""
    where = _where(directory, name)
    try:
        fd = _open_file(directory, name)
    except OSError as exc:
        raise _input_error(exc, where) from None
    try:
        size = identity[2]
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
