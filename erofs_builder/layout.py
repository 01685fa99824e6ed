"""Where every inode and data block of a meta.erofs image goes; the writer then only emits bytes.

The image, in order (byte offsets; blocks of 4 KiB):

    0       zeros (room for a boot sector)
    1024    superblock (128 bytes)
    1152    device table: one slot, the layer's virtual blob (device 1); devt_slotoff = 9
    1280    inode area: nid = offset / 32 (meta_blkaddr = 0), the root first (nid 40), then the other
            inodes breadth-first, each directory's entries in name order, so ``ls -l`` reads few blocks.
            An inode record is its header (32 or 64 bytes), its inline xattr body, then either its
            inline tail (directories, symlinks) or its chunk-index array (regular files).
    ...     data area, block aligned: the full blocks of directories and long symlinks.

Nothing here depends on a nid before it is known: every record's size is fixed first (a directory's
blocks depend on its names only), then records are placed one after another, then data blocks are
numbered. The only placement rule with a choice is the inline tail: the kernel rejects a tail that
crosses a block boundary, and its fast-symlink path needs the header, xattrs and target in one block.
So an inode with a tail starts where its whole record fits in one block, skipping to the next block
boundary when it does not (at most one block of padding; composefs does the same), or, when the record
is bigger than a block, stores its data as FLAT_PLAIN blocks instead (what erofs-utils does).

Compact inodes have no mtime of their own (they read as the superblock's build_time), so build_time is
the most common mtime in the tree and every inode with that mtime, 32-bit size and 16-bit uid, gid and
nlink is compact.

Memory: a Layout keeps, per inode, only what cannot be worked out again cheaply: its node, nid, i_format
and the position of its parent directory, in flat arrays (about 25 bytes an inode), plus a FlatData for
each directory and symlink. The writer asks for one InodePlan at a time (``Layout.plans``), made from
those; paths, which only error messages need, are found again through the parents. The entries a
directory reaches first are placed one after another, in name order, from its ``first_child``; only an
inode with several names may sit elsewhere, and ``Layout.links`` has those.
"""

from __future__ import annotations

import os
import stat
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from dsec_fs.errors import InputError, UnsupportedError

from dsec_fs import blobmap
from .ondisk import BLKSZBITS, BLOCK_SIZE, EROFS_NULL_ADDR, INODE_SLOT_SIZE, chunk_index, dirent, inode, xattr
from .ondisk.device_slot import SLOT_SIZE
from .ondisk.superblock import SB_OFFSET, SUPERBLOCK
from .tree import Node, Tree

DEVT_OFFSET = SB_OFFSET + SUPERBLOCK.size  # the device table follows the superblock
DEVT_SLOTOFF = DEVT_OFFSET // SLOT_SIZE
INODE_AREA_START = DEVT_OFFSET + SLOT_SIZE  # one device slot: the virtual blob
MAX_ICOUNT = 0xFFFF  # i_xattr_icount is 16 bits
MAX_BLOCKS = 0xFFFFFFFF  # superblock.blocks and start blocks are 32 bits
MAX_UID = 0xFFFFFFFF
MAX_MAJOR, MAX_MINOR = 0xFFF, 0xFFFFF  # what the kernel's 32-bit dev_t encoding can hold
NS_PER_S = 1_000_000_000
_FILE_TYPES = frozenset(dirent.IFMT_BY_FT.values())


@dataclass(slots=True, eq=False)
class FlatData:
    """Where a directory's or symlink's data goes: full blocks in the data area, then maybe a tail kept
    inline, right after the inode's header and xattrs."""

    size: int  # i_size: the data's length
    tail_size: int  # FLAT_INLINE: bytes of the data kept inline
    data_blocks: int  # bytes before the tail, in whole blocks from blkaddr
    blkaddr: int = EROFS_NULL_ADDR  # first data block in the image; NULL_ADDR when none
    # Directories only: the sorted names, "." and ".." included, grouped per directory block, and where in
    # Layout order the entries first reached through this directory start.
    dir_blocks: list[list[bytes]] | None = None
    first_child: int = 0


@dataclass(slots=True, eq=False)
class InodePlan:
    """Everything the writer needs to emit one inode; made on demand from a Layout."""

    node: Node
    position: int  # in nid order; i_ino is position + 1
    nid: int
    extended: bool
    layout: int  # inode.LAYOUT_*
    size: int  # i_size
    xattr_body: bytes  # xattr.encode() of the node's xattrs, b"" when none
    chunk_count: int  # CHUNK_BASED: number of chunk indexes
    flat: FlatData | None  # directories and symlinks
    parent: int  # position of the directory through which the inode was first reached (root: itself)
    _layout: "Layout"

    @property
    def path(self) -> bytes:
        """The first path that reached this inode (b"" for the root), for messages."""
        return self._layout.path(self.position)

    @property
    def head_size(self) -> int:
        """Header and xattr body: where the tail or the chunk-index array starts, from the inode."""
        return (inode.EXTENDED.size if self.extended else inode.COMPACT.size) + len(self.xattr_body)

    @property
    def offset(self) -> int:
        return self.nid * INODE_SLOT_SIZE


@dataclass(slots=True)
class Layout:
    nodes: list[Node]  # each distinct inode once, in nid order; nodes[0] is the root
    nids: array  # nids[p]: the nid of nodes[p]
    formats: bytearray  # formats[p]: i_format of nodes[p], the extended bit | data layout << 1
    parents: array  # parents[p]: position of the directory through which nodes[p] was first reached
    flat: dict[int, FlatData]  # position -> its FlatData, for every directory and symlink
    links: dict[int, int]  # id(node) -> position, for the non-directories with several names
    chunk_size: int
    chunk_format: int  # i_u of every CHUNK_BASED inode
    build_time: int
    build_time_nsec: int
    chunked: bool  # some inode is CHUNK_BASED (feature CHUNKED_FILE)
    blocks: int  # image size in blocks

    @property
    def inodes(self) -> list[InodePlan]:
        """Every inode's plan, in nid order (for inspection: the writer takes them one at a time)."""
        return list(self.plans())

    def plans(self) -> Iterator[InodePlan]:
        for position in range(len(self.nodes)):
            yield self.plan(position)

    def plan(self, position: int) -> InodePlan:
        node = self.nodes[position]
        i_format = self.formats[position]
        layout = i_format >> 1
        flat = self.flat.get(position)
        if flat is not None:
            size = flat.size
        elif stat.S_ISREG(node.mode):
            size = node.size
        else:
            size = 0
        # Positional, in field order: one of these is made for every inode the writer emits.
        return InodePlan(
            node, position, self.nids[position], bool(i_format & 1), layout, size,
            _xattr_body(node, self, position) if node.xattrs else b"",
            -(-size // self.chunk_size) if layout == inode.LAYOUT_CHUNK_BASED else 0,
            flat, self.parents[position], self,
        )

    def path(self, position: int) -> bytes:
        """The first path that reached inode ``position``: through its parents, each time the lowest of
        its names in the parent (the one the breadth-first walk met first). For messages only."""
        if position == 0:
            return b""
        parent = self.parents[position]
        node = self.nodes[position]
        name = min(name for name, child in self.nodes[parent].children.items() if child is node)
        parent_path = self.path(parent)
        return parent_path + b"/" + name if parent_path else name


def plan_layout(tree: Tree, chunk_size: int) -> Layout:
    """Decide the whole image: nids, inode forms, data layouts, block addresses.

    Regular files must already carry their chunk digests (``node.chunks``); the digests themselves are
    only needed by the writer. Raises InputError for a tree that cannot be right (a missing or wrong chunk
    list, a directory reachable twice) and UnsupportedError for what EROFS cannot store.
    """
    chunk_bits = blobmap.check_chunk_size(chunk_size)
    tree.finish()
    layout = Layout(
        nodes=[], nids=array("Q"), formats=bytearray(), parents=array("Q"), flat={}, links={},
        chunk_size=chunk_size, chunk_format=chunk_index.chunk_format(chunk_bits, BLKSZBITS), build_time=0,
        build_time_nsec=0, chunked=False, blocks=0,
    )
    _breadth_first(tree, layout)
    layout.build_time, layout.build_time_nsec = divmod(_most_common_mtime(layout.nodes), NS_PER_S)
    meta_end = _place_inodes(layout)
    layout.blocks = _place_data(layout, first_block=-(-meta_end // BLOCK_SIZE))
    return layout


def _breadth_first(tree: Tree, layout: Layout) -> None:
    """Fill the layout's nodes and parents in nid order: the root, then directory by directory, each
    directory's entries in name order; make each directory's FlatData with its first_child; fill links."""
    nodes, parents = layout.nodes, layout.parents
    nodes.append(tree.root)
    parents.append(0)
    # The inodes a second name can reach: hard links, and directories (an error). Only they are looked
    # up: nlink counts names (Tree.finish has just counted them), and a directory's is at least 2.
    several_names: dict[int, int] = {id(tree.root): 0}
    for position, directory in enumerate(nodes):  # nodes grows while it is read: the breadth-first queue
        if not directory.is_dir:
            continue
        names = sorted(directory.children)
        dir_blocks = dirent.split_into_blocks(sorted([b".", b"..", *names]), BLOCK_SIZE)
        layout.flat[position] = FlatData(size=dirent.dir_size(dir_blocks, BLOCK_SIZE), tail_size=0, data_blocks=0,
                                         dir_blocks=dir_blocks, first_child=len(nodes))
        for name in names:
            child = directory.children[name]
            if child.nlink > 1:
                if id(child) in several_names:
                    if child.is_dir:
                        raise InputError("a directory is reachable by two paths (a hard link to a directory?)",
                                         where=child.source or "/" + _join(layout.path(position), name).decode(
                                             errors="backslashreplace"))
                    continue
                several_names[id(child)] = len(nodes)
            nodes.append(child)
            parents.append(position)
    layout.links = {key: position for key, position in several_names.items() if not nodes[position].is_dir}


def _join(directory: bytes, name: bytes) -> bytes:
    return directory + b"/" + name if directory else name


def _most_common_mtime(nodes: list[Node]) -> int:
    """The mtime (ns) the most inodes share, so the most inodes can be compact; 0 for an empty count.

    Only times from 1970 on are candidates: build_time is unsigned.
    """
    counts = Counter(node.mtime_ns for node in nodes if node.mtime_ns >= 0)
    return counts.most_common(1)[0][0] if counts else 0


def _where(node: Node, layout: Layout, position: int) -> str:
    return node.source or "/" + layout.path(position).decode(errors="backslashreplace")


def _xattr_body(node: Node, layout: Layout, position: int) -> bytes:
    if not node.xattrs:
        return b""
    body = xattr.encode(node.xattrs, where=_where(node, layout, position))
    if xattr.icount_for(body) > MAX_ICOUNT:
        raise UnsupportedError(f"xattrs take {len(body)} bytes, more than an inode can hold",
                               where=_where(node, layout, position))
    return body


# The largest uid, gid and nlink a compact inode holds (16 bits).
_COMPACT_FIELD_MAX = 0xFFFF
# i_format of a regular file of one chunk without xattrs, and its record's slots: the header, then one
# chunk index (8 bytes; the header keeps it 8-byte aligned), rounded up to whole 32-byte inode slots.
_ONE_CHUNK_FILE = {
    extended: ((inode.VERSION_EXTENDED if extended else inode.VERSION_COMPACT) | inode.LAYOUT_CHUNK_BASED << 1,
               -(-((inode.EXTENDED.size if extended else inode.COMPACT.size) + chunk_index.CHUNK_INDEX.size)
                 // INODE_SLOT_SIZE))
    for extended in (False, True)
}


def _place_inodes(layout: Layout) -> int:
    """Decide every inode's form and give it its nid, in order; returns the end of the inode area (bytes).

    A regular file of one chunk without xattrs (most inodes of a large tree) is decided here, inline:
    what ``_inode_form`` decides for it, without its calls and its checks of other kinds of inode."""
    pos = INODE_AREA_START
    nids, formats = layout.nids, layout.formats
    one_chunk_file = _ONE_CHUNK_FILE
    chunk_size = layout.chunk_size
    build_time_ns = layout.build_time * NS_PER_S + layout.build_time_nsec
    field_max = _COMPACT_FIELD_MAX
    for position, node in enumerate(layout.nodes):
        if (node.children is None and not node.xattrs and stat.S_ISREG(node.mode) and 0 < node.size <= chunk_size
                and 0 <= node.uid <= field_max and 0 <= node.gid <= field_max and node.nlink <= field_max):
            chunks = node.chunks
            if chunks is not None and len(chunks) == 1:
                # needs_extended of a size under 4 GiB and 16-bit ids: the mtime (its divmod is one-to-one)
                i_format, slots = one_chunk_file[node.mtime_ns != build_time_ns]
                layout.chunked = True
                nids.append(pos // INODE_SLOT_SIZE)
                formats.append(i_format)
                pos += slots * INODE_SLOT_SIZE
                continue
        extended, data_layout, record_size = _inode_form(layout, position, node)
        if data_layout == inode.LAYOUT_FLAT_INLINE:
            data_layout, record_size, pos = _place_inline(layout.flat[position], record_size, pos)
        nids.append(pos // INODE_SLOT_SIZE)
        formats.append((inode.VERSION_EXTENDED if extended else inode.VERSION_COMPACT) | data_layout << 1)
        pos += -(-record_size // INODE_SLOT_SIZE) * INODE_SLOT_SIZE
    return pos


def _inode_form(layout: Layout, position: int, node: Node) -> tuple[bool, int, int]:
    """(extended, data layout, record size) of an inode, where the record is its header, xattr body, then
    its inline tail or its chunk-index array; a directory's or symlink's FlatData is filled in. Raises
    for what cannot be stored."""
    mode = node.mode
    if stat.S_IFMT(mode) not in _FILE_TYPES:
        raise InputError(f"unknown file type in mode {mode:#o}", where=_where(node, layout, position))
    record_size = len(_xattr_body(node, layout, position)) if node.xattrs else 0
    if not 0 <= node.uid <= MAX_UID or not 0 <= node.gid <= MAX_UID:
        raise UnsupportedError(f"uid {node.uid} / gid {node.gid} do not fit in 32 bits",
                               where=_where(node, layout, position))
    data_layout = inode.LAYOUT_FLAT_PLAIN
    size = chunk_count = 0
    flat = None
    if stat.S_ISREG(mode):
        size = node.size
        if size:  # else FLAT_PLAIN without blocks, as erofs-utils writes an empty file
            chunk_count = _chunk_count(node, layout.chunk_size, layout, position)
            data_layout = inode.LAYOUT_CHUNK_BASED
            layout.chunked = True
    elif stat.S_ISDIR(mode):
        flat = layout.flat[position]
    elif stat.S_ISLNK(mode):
        flat = layout.flat[position] = FlatData(size=len(node.target), tail_size=0, data_blocks=0)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        if os.major(node.rdev) > MAX_MAJOR or os.minor(node.rdev) > MAX_MINOR:
            raise UnsupportedError(f"device {os.major(node.rdev)}:{os.minor(node.rdev)} does not fit in "
                                   f"the kernel's 32-bit encoding", where=_where(node, layout, position))
    if flat is not None:
        size = flat.size
        if stat.S_ISLNK(mode) and size >= BLOCK_SIZE:
            # Only a tar can hold such a target: all of it in blocks, of which the kernel reads the first.
            flat.data_blocks = -(-size // BLOCK_SIZE)
        else:  # the rest inline; the kernel's fast-symlink path wants the whole target inline
            flat.tail_size, flat.data_blocks = size % BLOCK_SIZE, size // BLOCK_SIZE
            if flat.tail_size:
                data_layout = inode.LAYOUT_FLAT_INLINE
                record_size += flat.tail_size

    mtime, mtime_nsec = divmod(node.mtime_ns, NS_PER_S)  # floor: -1.5 s is -2 s + 0.5 s, as the kernel reads it
    extended = inode.needs_extended(size, node.uid, node.gid, node.nlink, mtime, mtime_nsec,
                                    layout.build_time, layout.build_time_nsec)
    record_size += inode.EXTENDED.size if extended else inode.COMPACT.size
    if data_layout == inode.LAYOUT_CHUNK_BASED:
        # The array is 8-byte aligned in the image; inodes start 32-byte aligned, so aligning the
        # offset from the inode is the same thing.
        record_size = chunk_index.array_offset(record_size) + chunk_count * chunk_index.CHUNK_INDEX.size
    return extended, data_layout, record_size


def _place_inline(flat: FlatData, record_size: int, pos: int) -> tuple[int, int, int]:
    """(data layout, record size, position) of an inode with an inline tail that would start at ``pos``:
    its record must lie in one block (see the module docstring). A record bigger than a block gives up the
    inline tail and stores all its data as FLAT_PLAIN blocks."""
    if record_size > BLOCK_SIZE:
        record_size -= flat.tail_size
        flat.data_blocks += 1
        flat.tail_size = 0
        return inode.LAYOUT_FLAT_PLAIN, record_size, pos
    if pos % BLOCK_SIZE + record_size > BLOCK_SIZE:
        pos = -(-pos // BLOCK_SIZE) * BLOCK_SIZE
    return inode.LAYOUT_FLAT_INLINE, record_size, pos


def _chunk_count(node: Node, chunk_size: int, layout: Layout, position: int) -> int:
    expected = -(-node.size // chunk_size)
    if node.chunks is None or len(node.chunks) != expected:
        got = "no chunk list" if node.chunks is None else f"{len(node.chunks)} chunks"
        raise InputError(f"{node.size} bytes need {expected} chunks of {chunk_size}, the node has {got}",
                         where=_where(node, layout, position))
    return expected


def _place_data(layout: Layout, first_block: int) -> int:
    """Number the data blocks of FLAT_* inodes from ``first_block``, in nid order; returns the image size
    in blocks."""
    block = first_block
    for position in sorted(layout.flat):
        flat = layout.flat[position]
        if flat.data_blocks:
            flat.blkaddr = block
            block += flat.data_blocks
    if block > MAX_BLOCKS:
        raise UnsupportedError(f"the image needs {block} blocks, more than EROFS addresses", where="meta.erofs")
    return block
