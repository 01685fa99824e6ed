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
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass

from dsec_fs.errors import InputError, UnsupportedError

from . import blobmap
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


@dataclass(slots=True, eq=False)
class InodePlan:
    """Everything the writer needs to emit one inode, decided before any byte is written."""

    node: Node
    path: bytes  # first path that reached this node, for error messages
    ino: int  # i_ino: 1..inos in nid order
    extended: bool
    layout: int  # inode.LAYOUT_*
    size: int  # i_size
    mtime: int  # seconds, two's complement in an extended inode (pre-1970 times are negative)
    mtime_nsec: int
    xattr_body: bytes  # xattr.encode() of the node's xattrs, b"" when none
    chunk_count: int = 0  # CHUNK_BASED: number of chunk indexes
    tail_size: int = 0  # FLAT_INLINE: bytes of data right after the header and xattrs
    nid: int = 0
    blkaddr: int = EROFS_NULL_ADDR  # FLAT_*: first full data block in the image; NULL_ADDR when none
    data_blocks: int = 0  # FLAT_*: number of data blocks from blkaddr
    # Directories only: the parent's plan (the root is its own parent) and the sorted names, "." and
    # ".." included, grouped per directory block.
    parent: "InodePlan | None" = None
    dir_blocks: list[list[bytes]] | None = None

    @property
    def head_size(self) -> int:
        """Header and xattr body: where the tail or the chunk-index array starts, from the inode."""
        return (inode.EXTENDED.size if self.extended else inode.COMPACT.size) + len(self.xattr_body)

    @property
    def record_size(self) -> int:
        """Bytes from the inode's slot to the end of everything stored with it."""
        if self.layout == inode.LAYOUT_CHUNK_BASED:
            # The array is 8-byte aligned in the image; inodes start 32-byte aligned, so aligning the
            # offset from the inode is the same thing.
            return chunk_index.array_offset(self.head_size) + self.chunk_count * chunk_index.CHUNK_INDEX.size
        return self.head_size + self.tail_size

    @property
    def offset(self) -> int:
        return self.nid * INODE_SLOT_SIZE


@dataclass(slots=True)
class Layout:
    inodes: list[InodePlan]  # in nid order; inodes[0] is the root
    by_node: dict[int, InodePlan]  # id(node) -> its plan; hard links share one
    build_time: int
    build_time_nsec: int
    chunk_format: int  # i_u of every CHUNK_BASED inode
    chunked: bool  # some inode is CHUNK_BASED (feature CHUNKED_FILE)
    blocks: int  # image size in blocks

    @property
    def root(self) -> InodePlan:
        return self.inodes[0]


def plan_layout(tree: Tree, chunk_size: int) -> Layout:
    """Decide the whole image: nids, inode forms, data layouts, block addresses.

    Regular files must already carry their chunk digests (``node.chunks``); the digests themselves are
    only needed by the writer. Raises InputError for a tree that cannot be right (a missing or wrong chunk
    list, a directory reachable twice) and UnsupportedError for what EROFS cannot store.
    """
    chunk_bits = blobmap.check_chunk_size(chunk_size)
    tree.finish()
    nodes = _breadth_first(tree)
    build_time, build_time_nsec = divmod(_most_common_mtime(node for node, _path, _parent in nodes), NS_PER_S)

    inodes: list[InodePlan] = []
    by_node: dict[int, InodePlan] = {}
    for node, path, parent in nodes:
        plan = _plan_inode(node, path, len(inodes) + 1, chunk_size, build_time, build_time_nsec)
        if node.is_dir:
            plan.parent = by_node[id(parent)] if parent is not None else plan
        inodes.append(plan)
        by_node[id(node)] = plan

    meta_end = _place_inodes(inodes)
    blocks = _place_data(inodes, first_block=-(-meta_end // BLOCK_SIZE))
    return Layout(
        inodes=inodes, by_node=by_node, build_time=build_time, build_time_nsec=build_time_nsec,
        chunk_format=chunk_index.chunk_format(chunk_bits, BLKSZBITS),
        chunked=any(p.layout == inode.LAYOUT_CHUNK_BASED for p in inodes), blocks=blocks,
    )


def _breadth_first(tree: Tree) -> list[tuple[Node, bytes, Node | None]]:
    """(node, path, parent directory) of each distinct inode: the root, then directory by directory."""
    order: list[tuple[Node, bytes, Node | None]] = [(tree.root, b"", None)]
    seen = {id(tree.root)}
    i = 0
    while i < len(order):
        node, path, _parent = order[i]
        i += 1
        if not node.is_dir:
            continue
        prefix = path + b"/" if path else b""
        for name in sorted(node.children):
            child = node.children[name]
            if id(child) in seen:
                if child.is_dir:
                    raise InputError("a directory is reachable by two paths (a hard link to a directory?)",
                                     where=_where(child, prefix + name))
                continue  # a hard link: one inode, several dirents
            seen.add(id(child))
            order.append((child, prefix + name, node))
    return order


def _most_common_mtime(nodes) -> int:
    """The mtime (ns) the most inodes share, so the most inodes can be compact; 0 for an empty count.

    Only times from 1970 on are candidates: build_time is unsigned.
    """
    counts = Counter(node.mtime_ns for node in nodes if node.mtime_ns >= 0)
    return counts.most_common(1)[0][0] if counts else 0


def _where(node: Node, path: bytes) -> str:
    return node.source or "/" + path.decode(errors="backslashreplace")


def _plan_inode(node: Node, path: bytes, ino: int, chunk_size: int, build_time: int,
                build_time_nsec: int) -> InodePlan:
    if stat.S_IFMT(node.mode) not in dirent.IFMT_BY_FT.values():
        raise InputError(f"unknown file type in mode {node.mode:#o}", where=_where(node, path))
    body = xattr.encode(node.xattrs, where=_where(node, path)) if node.xattrs else b""
    if xattr.icount_for(body) > MAX_ICOUNT:
        raise UnsupportedError(f"xattrs take {len(body)} bytes, more than an inode can hold",
                               where=_where(node, path))
    if not 0 <= node.uid <= MAX_UID or not 0 <= node.gid <= MAX_UID:
        raise UnsupportedError(f"uid {node.uid} / gid {node.gid} do not fit in 32 bits", where=_where(node, path))
    mtime, mtime_nsec = divmod(node.mtime_ns, NS_PER_S)  # floor: -1.5 s is -2 s + 0.5 s, as the kernel reads it
    plan = InodePlan(node=node, path=path, ino=ino, extended=False, layout=inode.LAYOUT_FLAT_PLAIN, size=0,
                     mtime=mtime, mtime_nsec=mtime_nsec, xattr_body=body)

    if node.is_dir:
        names = sorted([b".", b"..", *node.children])
        plan.dir_blocks = dirent.split_into_blocks(names, BLOCK_SIZE)
        plan.size = dirent.dir_size(plan.dir_blocks, BLOCK_SIZE)
        _plan_flat(plan)
    elif node.is_symlink:
        plan.size = len(node.target)
        if plan.size < BLOCK_SIZE:  # the kernel's fast-symlink path wants the whole target inline
            _plan_flat(plan)
        else:  # only a tar can hold such a target; the kernel reads its first page
            plan.data_blocks = -(-plan.size // BLOCK_SIZE)
    elif node.is_reg:
        _plan_chunks(plan, node, chunk_size)
    elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
        if os.major(node.rdev) > MAX_MAJOR or os.minor(node.rdev) > MAX_MINOR:
            raise UnsupportedError(f"device {os.major(node.rdev)}:{os.minor(node.rdev)} does not fit in the "
                                   f"kernel's 32-bit encoding", where=_where(node, path))

    plan.extended = inode.needs_extended(plan.size, node.uid, node.gid, node.nlink, mtime, mtime_nsec,
                                         build_time, build_time_nsec)
    return plan


def _plan_flat(plan: InodePlan) -> None:
    """Directories and symlinks: full blocks in the data area, the rest inline if it can be placed."""
    plan.tail_size = plan.size % BLOCK_SIZE
    plan.data_blocks = plan.size // BLOCK_SIZE
    plan.layout = inode.LAYOUT_FLAT_INLINE if plan.tail_size else inode.LAYOUT_FLAT_PLAIN


def _plan_chunks(plan: InodePlan, node: Node, chunk_size: int) -> None:
    plan.size = node.size
    if node.size == 0:
        return  # FLAT_PLAIN without blocks, as erofs-utils writes an empty file
    expected = -(-node.size // chunk_size)
    if node.chunks is None or len(node.chunks) != expected:
        got = "no chunk list" if node.chunks is None else f"{len(node.chunks)} chunks"
        raise InputError(f"{node.size} bytes need {expected} chunks of {chunk_size}, the node has {got}",
                         where=_where(node, plan.path))
    plan.layout = inode.LAYOUT_CHUNK_BASED
    plan.chunk_count = expected


def _place_inodes(inodes: list[InodePlan]) -> int:
    """Give every inode its nid, in order; returns the end of the inode area (bytes)."""
    pos = INODE_AREA_START
    for plan in inodes:
        if plan.tail_size:
            pos = _place_inline(plan, pos)
        plan.nid = pos // INODE_SLOT_SIZE
        pos += -(-plan.record_size // INODE_SLOT_SIZE) * INODE_SLOT_SIZE
    return pos


def _place_inline(plan: InodePlan, pos: int) -> int:
    """Where an inode with an inline tail starts: its record must lie in one block (see the docstring).

    A record bigger than a block gives up the inline tail and stores all its data as FLAT_PLAIN blocks.
    """
    if plan.record_size > BLOCK_SIZE:
        plan.layout = inode.LAYOUT_FLAT_PLAIN
        plan.data_blocks += 1
        plan.tail_size = 0
        return pos
    if pos % BLOCK_SIZE + plan.record_size > BLOCK_SIZE:
        return -(-pos // BLOCK_SIZE) * BLOCK_SIZE
    return pos


def _place_data(inodes: list[InodePlan], first_block: int) -> int:
    """Number the data blocks of FLAT_* inodes from ``first_block``; returns the image size in blocks."""
    block = first_block
    for plan in inodes:
        if plan.data_blocks:
            plan.blkaddr = block
            block += plan.data_blocks
    if block > MAX_BLOCKS:
        raise UnsupportedError(f"the image needs {block} blocks, more than EROFS addresses", where="meta.erofs")
    return block
