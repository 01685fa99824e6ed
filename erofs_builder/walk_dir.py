"""Walk a directory into a Tree: every inode kind, xattrs, hard links, sparse files.

The walk itself reads metadata only (one lstat and one listxattr per entry; readlink for symlinks);
file contents are read later, once, by the chunker through each regular file's ``Node.reader``. Nothing
ever follows a symlink below the source: entries are lstat'ed, xattrs read with follow_symlinks=False and
files opened with O_NOFOLLOW. The source itself may be given through a symlink. The root directory's own
metadata becomes the layer root's.

Hard links: non-directories with st_nlink > 1 that share (st_dev, st_ino) become one Node placed at
every path. Links to the same inode from outside the source do not matter; a link count above the names
seen here is normal.

The reader skips holes without reading them (SEEK_DATA): a piece wholly inside a hole is yielded as None,
so a sparse file of many GiB costs a few lseek calls. A file must not change between the walk and the
end of its read: the reader compares fstat (inode, size, mtime, ctime) with the walk's lstat both when
it opens the file and after its last read, and raises InputError naming the path otherwise.

Errors: InputError naming the path for anything about the input (missing or non-directory source,
unreadable entries, names over 255 bytes, files changed or removed during the build).

Threads: walk_directory and the readers it creates are called from one thread at a time (the chunker
reads in its main thread); they share no state.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Iterator

from dsec_fs.errors import InputError

from .tree import Node, Tree


def walk_directory(root: str | bytes | os.PathLike) -> Tree:
    """Return the Tree of everything under ``root`` (a directory); Tree.finish() has been called."""
    root = os.fsencode(root)
    try:
        root_stat = os.stat(root)
    except OSError as exc:
        raise _input_error(exc, root) from None
    if not stat.S_ISDIR(root_stat.st_mode):
        raise InputError("the source is not a directory", where=os.fsdecode(root))

    tree = Tree(_node(root, root_stat, {}))
    links: dict[tuple[int, int], Node] = {}  # (st_dev, st_ino) -> Node, for inodes with several names
    pending = [(root, b"")]  # directories still to list: (path on disk, path in the tree)
    while pending:
        directory, tree_dir = pending.pop()
        for name, st in _list_directory(directory):
            path = os.path.join(directory, name)
            tree_path = tree_dir + b"/" + name if tree_dir else name
            key = (st.st_dev, st.st_ino)
            node = links.get(key)
            if node is None:
                node = _node(path, st, {} if stat.S_ISDIR(st.st_mode) else None)
                if st.st_nlink > 1 and not node.is_dir:
                    links[key] = node
            tree.add(tree_path, node)
            if node.is_dir:
                pending.append((path, tree_path))
    tree.finish()
    return tree


def _list_directory(directory: bytes) -> list[tuple[bytes, os.stat_result]]:
    try:
        with os.scandir(directory) as it:
            return [(entry.name, entry.stat(follow_symlinks=False)) for entry in it]
    except OSError as exc:
        raise _input_error(exc, exc.filename or directory) from None


def _node(path: bytes, st: os.stat_result, children: dict | None) -> Node:
    mode = st.st_mode
    node = Node(
        mode=mode,
        uid=st.st_uid,
        gid=st.st_gid,
        mtime_ns=st.st_mtime_ns,
        xattrs=_xattrs(path),
        children=children,
        identity=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
        source=os.fsdecode(path),
    )
    if stat.S_ISREG(mode):
        node.size = st.st_size
        node.reader = functools.partial(_read_file, path, node.identity)
    elif stat.S_ISLNK(mode):
        try:
            node.target = os.readlink(path)
        except OSError as exc:
            raise _input_error(exc, path) from None
        node.size = len(node.target)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        node.rdev = st.st_rdev
    elif not (stat.S_ISDIR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        raise InputError(f"unknown file type {stat.S_IFMT(mode):#o}", where=node.source)
    return node


def _xattrs(path: bytes) -> dict[bytes, bytes]:
    """Every extended attribute of ``path`` itself, whatever its namespace; {} where xattrs are unsupported."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
        return {os.fsencode(name): os.getxattr(path, name, follow_symlinks=False) for name in names}
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise _input_error(exc, path) from None


def _read_file(path: bytes, identity: tuple, chunk_size: int) -> Iterator[bytes | None]:
    """The ChunkReader of a walked file: its content in ``chunk_size`` pieces, None for pieces in a hole."""
    where = os.fsdecode(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _input_error(exc, path) from None
    try:
        _check_unchanged(fd, identity, where, "since the directory was scanned")
        size = identity[2]
        offset = 0
        next_data = -1  # first data byte at or after offset, refreshed once offset passes it
        while offset < size:
            length = min(chunk_size, size - offset)
            if next_data < offset:
                next_data = _seek_data(fd, offset, size, where)
            if next_data >= offset + length:
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


def _check_unchanged(fd: int, identity: tuple, where: str, when: str) -> None:
    st = os.fstat(fd)
    now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if now != identity:
        raise InputError(
            f"file changed {when} (dev, inode, size, mtime ns, ctime ns: {identity} -> {now})", where=where
        )


def _input_error(exc: OSError, path: bytes | str) -> InputError:
    return InputError(f"{os.strerror(exc.errno or 0)} ({type(exc).__name__})", where=os.fsdecode(path))
