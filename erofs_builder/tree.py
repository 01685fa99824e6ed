"""The in-memory tree a layer is built from, independent of where it came from.

Walkers (a directory, a tar stream, an OCI image) produce ``Node`` objects (or, for a directory's
regular files, walk_dir.WalkedFile: Node's fields in fewer bytes); ``Tree`` assembles them
with the rules every input shares (missing parents are implied, a later entry replaces an earlier one,
hard links share one inode); the chunker fills in each regular file's chunk digests; the EROFS writer
lays the finished tree out. Nothing here knows EROFS or any input format.

Paths are bytes (names need not be UTF-8), relative to the layer root, components joined by b"/"; the
root is b"". Memory per node is a few hundred bytes, so a 100,000-entry tree stays in the tens of MB.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dsec_fs.errors import InputError

NAME_MAX = 255

# Content of a regular file, read once, in order: an iterator of chunk-size pieces (the last may be
# shorter); None stands for a piece known to be a hole (SEEK_HOLE, a tar sparse map) without reading it.
# A reader that has read a file of one piece whole gives the tuple of that piece (or an empty tuple for an
# empty file) instead, which the chunker takes without the iterator calls (most files of a tree).
ChunkReader = Callable[[int], "Iterator[bytes | None] | tuple[bytes, ...]"]


@dataclass(eq=False, slots=True)
class Node:
    """One inode of the tree. Hard links are several names pointing at the same Node."""

    mode: int  # st_mode: file type and permission bits, including setuid/setgid/sticky
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0  # nanoseconds since the epoch
    size: int = 0  # regular file: bytes; symlink: len(target); others: 0
    rdev: int = 0  # character and block devices: os.makedev(major, minor)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)  # full names, e.g. b"user.comment"
    target: bytes = b""  # symlink target, stored as is
    children: dict[bytes, "Node"] | None = None  # directories only: name -> node
    nlink: int = 0  # names that point at this node within the tree (set by Tree.finish)
    # Filled by the chunker for regular files: one entry per chunk, the sha256 of its bytes or None
    # for an all-zero chunk (a hole); a tuple once complete where the chunker can tell cheaply. A build
    # replaces each digest with its chunk's block on the blob once it has laid that out (blob_layout.py).
    chunks: list[bytes | None] | tuple[bytes | None, ...] | None = None
    # For the walker: how to read the content (regular files) and what identifies the source file
    # for incremental rebuilds (e.g. (st_dev, st_ino, size, mtime_ns, ctime_ns)).
    reader: ChunkReader | None = None
    identity: tuple | None = None
    source: str = ""  # where this came from, for error messages: a path or tar member name

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


def make_dir(mode: int = 0o755, mtime_ns: int = 0, **kw) -> Node:
    return Node(mode=stat.S_IFDIR | (mode & 0o7777), mtime_ns=mtime_ns, children={}, **kw)


def check_name(name: bytes, where: str) -> None:
    problem = name_problem(name)
    if problem is not None:
        raise InputError(problem, where=where)


def name_problem(name: bytes) -> str | None:
    """What makes ``name`` no name of a directory entry, or None."""
    if not name or name in (b".", b".."):
        return f"invalid name {name!r}"
    if len(name) > NAME_MAX:
        return f"name is {len(name)} bytes, EROFS allows at most {NAME_MAX}"
    if b"/" in name or b"\0" in name:
        return f"name contains '/' or NUL: {name!r}"
    return None


def split_path(path: bytes) -> list[bytes]:
    return [p for p in path.split(b"/") if p]


class Tree:
    """A directory hierarchy of Nodes rooted at ``root``.

    ``add`` follows the rules tar users expect: a leading '/' means nothing, missing parent directories
    are created (0755, root-owned, mtime 0) and replaced by a real entry if one arrives later, and a later
    entry for a path replaces the earlier one (a directory replacing a directory keeps its children).
    """

    def __init__(self, root: Node | None = None):
        self.root = root or make_dir()
        self._implied: set[int] = set()  # id() of directories created only because a child needed them

    def lookup(self, path: bytes) -> Node | None:
        node = self.root
        for name in split_path(path):
            if node.children is None:
                return None
            node = node.children.get(name)
            if node is None:
                return None
        return node

    def _parent_for(self, parts: list[bytes], where: str) -> Node:
        node = self.root
        for name in parts:
            child = node.children.get(name)
            if child is None:
                check_name(name, where)
                child = make_dir()
                self._implied.add(id(child))
                node.children[name] = child
            elif child.children is None:
                raise InputError(f"{name!r} is not a directory but has entries below it", where=where)
            node = child
        return node

    def add(self, path: bytes, node: Node) -> None:
        """Place ``node`` at ``path``; ``node`` may already be elsewhere in the tree (a hard link)."""
        self._add(path, node, [None])

    def adder(self) -> Callable[[bytes, Node], None]:
        """``add`` for a stream of entries while nothing else changes the tree (walk_tar.fill_tree): it
        remembers the last parent directory, as a streamed input comes a directory at a time (the path
        before the last "/" and its node; an add that replaces an entry forgets it)."""
        last: list = [None]
        return lambda path, node: self._add(path, node, last)

    def _add(self, path: bytes, node: Node, last: list) -> None:
        prefix, _, name = path.rpartition(b"/")
        if last[0] is not None and last[0][0] == prefix and name and name_problem(name) is None:
            parent = last[0][1]
        else:
            where = node.source or path.decode(errors="backslashreplace")
            parts = split_path(path)
            if not parts:
                if not node.is_dir:
                    raise InputError("the layer root must be a directory", where=where)
                node.children = self.root.children
                self.root = node
                last[0] = None
                return
            name = parts[-1]
            check_name(name, where)
            parent = self._parent_for(parts[:-1], where)
            last[0] = (prefix, parent) if path.endswith(name) else None
        old = parent.children.get(name)
        if old is not None:
            last[0] = None
            if old.is_dir and node.is_dir and node is not old:
                # A directory entry that arrives after its children (or a duplicate) keeps the children.
                node.children = old.children
                self._implied.discard(id(old))
        parent.children[name] = node

    def add_child(self, directory: Node, name: bytes, node: Node) -> None:
        """Place ``node`` as ``name`` in ``directory``, a directory of this tree: what ``add`` does, for a
        walker that builds the tree from the top down and holds each parent, without looking up a path.
        A name already there is replaced outright."""
        problem = name_problem(name)
        if problem is not None:  # node.source only then: a walked file makes its path when asked
            raise InputError(problem, where=node.source or name.decode(errors="backslashreplace"))
        directory.children[name] = node

    def remove(self, path: bytes) -> bool:
        """Delete ``path`` and everything below it; True if something was there."""
        parts = split_path(path)
        if not parts:
            raise InputError("cannot remove the layer root", where=path.decode(errors="backslashreplace"))
        parent = self.lookup(b"/".join(parts[:-1]))
        if parent is None or parent.children is None:
            return False
        return parent.children.pop(parts[-1], None) is not None

    def walk(self) -> Iterator[tuple[bytes, Node]]:
        """(path, node) for every name in the tree, parents before children, names in byte order."""
        stack: list[tuple[bytes, Node]] = [(b"", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.children:
                prefix = path + b"/" if path else b""
                for name in sorted(node.children, reverse=True):
                    stack.append((prefix + name, node.children[name]))

    def finish(self) -> None:
        """Count names per node (nlink) once the tree is complete. Directories: 2 + subdirectories."""
        for node in self.nodes():
            node.nlink = 0
        for node in self.nodes():
            if node.is_dir:
                node.nlink = 2 + sum(1 for child in node.children.values() if child.is_dir)
            else:
                node.nlink += 1

    def nodes(self) -> Iterator[Node]:
        """The node of every name in the tree (a hard-linked node once per name), parents before children,
        in no particular order: cheaper than ``walk`` where neither order nor paths matter."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            if node.children:
                stack.extend(node.children.values())
