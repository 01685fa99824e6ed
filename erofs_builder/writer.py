"""Write a layer's meta.erofs: the EROFS metadata image whose regular files point into the virtual blob.

``write_image(tree, blobmap, chunk_size)`` returns the whole image (a bytearray); ``spill_image`` writes
the same bytes into a SpillFile (dsec_fs.spill), what a fresh build publishes: an image of 1,000,000
inodes is ~96 MB, which then never is in the process's memory as a whole. Every decision (nids, compact
or extended inodes, inline tails, block numbers) is made by ``layout.plan_layout``; this module only
turns that plan into bytes, then seals block 0 with the superblock checksum, which covers the first
inodes too.

Inodes are written in nid order, so their offsets only grow: while a SpillFile is written, the pages
behind the inode being written are handed back every RELEASE_EVERY inodes (the data area, a
directory's full blocks, lies beyond the inodes and is a small part of the image).

The image is old-style EROFS (no 48-bit or metabox features), so Linux 5.16 and later mount it. Its only
extra device is the layer's virtual blob: chunk indexes say device 1, and the device slot carries the
blob id and size. Images are reproducible: the same tree and blob map give the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import stat

from dsec_fs.errors import InputError, NotFoundError
from dsec_fs.heap import release_free_memory
from dsec_fs.spill import SpillFile

from .layout import DEVT_OFFSET, DEVT_SLOTOFF, NS_PER_S, InodePlan, Layout, plan_layout
from .ondisk import BLOCK_SIZE, EROFS_NULL_ADDR, INODE_SLOT_SIZE, chunk_index, dirent, xattr
from .ondisk.device_slot import DeviceSlot
from .ondisk.inode import (
    COMPACT, EXTENDED, LAYOUT_CHUNK_BASED, LAYOUT_FLAT_INLINE, VERSION_COMPACT, VERSION_EXTENDED, Inode, encode_rdev,
)
from .ondisk.superblock import (
    COMPAT_SB_CHKSUM, INCOMPAT_CHUNKED_FILE, INCOMPAT_DEVICE_TABLE, SB_OFFSET, Superblock, seal_block0,
)
from .tree import Tree

_U64 = (1 << 64) - 1
BLOB_ID_LENGTH = 64  # hex sha256: fills the 64-byte device tag exactly
UUID_OFFSET = SB_OFFSET + 0x30  # the superblock's uuid field
CHECKSUM_OFFSET = SB_OFFSET + 0x04  # the superblock's checksum field
_COMPACT_CHUNK_BASED = VERSION_COMPACT | LAYOUT_CHUNK_BASED << 1  # i_format of most regular files
_EXTENDED_CHUNK_BASED = VERSION_EXTENDED | LAYOUT_CHUNK_BASED << 1  # a file whose mtime is not build_time
_PLAIN_FILE_FORMATS = (_COMPACT_CHUNK_BASED, _EXTENDED_CHUNK_BASED)
RELEASE_EVERY = 1 << 16  # inodes written between two hand-backs of a SpillFile's pages (4 MB or more)


def write_image(tree: Tree, blobmap, chunk_size: int, *, blob_id: str | None = None) -> bytearray:
    """The meta.erofs image of ``tree``, a whole number of 4 KiB blocks: the buffer it was written into
    (a bytes copy would briefly double the memory an image of many inodes takes).

    Regular files need ``node.chunks`` (one entry per chunk of ``chunk_size``); ``blobmap`` gives the
    blob block of each chunk of such a list (``blkaddrs``: a BlobMap maps sha256 digests, None for an
    all-zero chunk; a build's BlobLayout has put the blocks in the list already), the blob's size in
    blocks (``blocks``) and its id (``blob_id``, 64 hex characters), unless the caller, who has encoded
    the map already, passes ``blob_id``. Calls ``tree.finish()``.
    """
    layout = plan_layout(tree, chunk_size)
    release_free_memory()  # planning's own tables (a count of every mtime): gone before the image is made
    image = bytearray(layout.blocks * BLOCK_SIZE)
    _write_layout(image, layout, blobmap, blob_id)
    seal_image(image)
    return image


def spill_image(tree: Tree, blobmap, chunk_size: int, *, blob_id: str | None = None) -> SpillFile:
    """``write_image``'s image in a SpillFile (dsec_fs.spill) the caller closes, written through a mapping
    whose pages are handed back as the inodes move on (see the module docstring)."""
    layout = plan_layout(tree, chunk_size)
    release_free_memory()
    spill = SpillFile(layout.blocks * BLOCK_SIZE, prefix="dsecfs-meta-")
    try:
        with spill.mapped() as image:
            _write_layout(image, layout, blobmap, blob_id, release=spill.release)
            _clear_seal(image)
        uuid = spill.sha256()[:16]  # seal_image's, hashed from the file: the mapping is not read
        with spill.mapped() as image:
            image[UUID_OFFSET:UUID_OFFSET + 16] = uuid
            seal_block0(image, BLOCK_SIZE)
    except BaseException:
        spill.close()
        raise
    return spill


def _write_layout(image, layout: Layout, blobmap, blob_id: str | None, release=None) -> None:
    """Every inode, its data and the superblock into ``image`` (a bytearray or a SpillFile's mapping, whose
    pages ``release(image, offset)`` hands back up to ``offset``); not sealed."""
    formats, plain_formats = layout.formats, _PLAIN_FILE_FORMATS
    for position, node in enumerate(layout.nodes):
        if formats[position] in plain_formats and not node.xattrs:
            _write_plain_file(image, layout, position, node, blobmap)
        else:
            _write_inode(image, layout, layout.plan(position), blobmap)
        if release is not None and position % RELEASE_EVERY == RELEASE_EVERY - 1:
            release(image, layout.nids[position] * INODE_SLOT_SIZE)
    _write_superblock(image, layout, blobmap, blobmap.blob_id if blob_id is None else blob_id)


def seal_image(image: bytearray) -> None:
    """Give a finished image, or one patched since (patch.py), its uuid and superblock checksum: the last
    step, as both cover bytes everything else writes.

    OverlayFS turns xino off over a lower layer with a null uuid; a uuid derived from the image itself
    (sha256 of the image with the uuid and checksum fields zero) keeps it on, and keeps the same tree
    giving the same image."""
    _clear_seal(image)
    image[UUID_OFFSET:UUID_OFFSET + 16] = hashlib.sha256(image).digest()[:16]
    seal_block0(image, BLOCK_SIZE)


def _clear_seal(image) -> None:
    """Zero the uuid and checksum fields: the image they are derived from has them zero."""
    image[UUID_OFFSET:UUID_OFFSET + 16] = bytes(16)
    image[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 4] = bytes(4)


def _write_superblock(image: bytearray, layout: Layout, blobmap, blob_id: str) -> None:
    if len(blob_id) != BLOB_ID_LENGTH:
        raise InputError(f"blob id {blob_id!r} is not {BLOB_ID_LENGTH} hex characters", where="blob map")
    incompat = INCOMPAT_DEVICE_TABLE | (INCOMPAT_CHUNKED_FILE if layout.chunked else 0)
    superblock = Superblock(
        root_nid=layout.nids[0], inos=len(layout.nodes), blocks=layout.blocks,
        build_time=layout.build_time, build_time_nsec=layout.build_time_nsec,
        feature_compat=COMPAT_SB_CHKSUM, feature_incompat=incompat, extra_devices=1, devt_slotoff=DEVT_SLOTOFF,
    )
    image[SB_OFFSET:SB_OFFSET + len(superblock.pack())] = superblock.pack()
    slot = DeviceSlot(tag=blob_id.encode("ascii"), blocks=blobmap.blocks).pack()
    image[DEVT_OFFSET:DEVT_OFFSET + len(slot)] = slot


def _write_inode(image: bytearray, layout: Layout, plan: InodePlan, blobmap) -> None:
    node = plan.node
    # A compact inode has no mtime of its own (it reads as build_time): only an extended one needs it.
    mtime, mtime_nsec = divmod(node.mtime_ns, NS_PER_S) if plan.extended else (0, 0)
    head = Inode(
        mode=node.mode, nlink=node.nlink, size=plan.size, i_u=_i_u(plan, layout), ino=plan.position + 1,
        uid=node.uid, gid=node.gid, mtime=mtime & _U64, mtime_nsec=mtime_nsec, layout=plan.layout,
        xattr_icount=xattr.icount_for(plan.xattr_body), extended=plan.extended,
    ).pack() + plan.xattr_body
    _put(image, plan.offset, head)
    if plan.layout == LAYOUT_CHUNK_BASED:
        _put(image, chunk_index.array_offset(plan.offset + len(head)), _chunk_indexes(plan, blobmap))
    elif plan.flat is not None:
        _write_flat(image, plan, _directory_data(plan, layout) if node.is_dir else node.target)


def _write_plain_file(image: bytearray, layout: Layout, position: int, node, blobmap) -> None:
    """_write_inode for the most common inode by far, a CHUNK_BASED one without xattrs (a regular file),
    without making its InodePlan: the same bytes, written in place."""
    offset = layout.nids[position] * INODE_SLOT_SIZE
    if layout.formats[position] == _COMPACT_CHUNK_BASED:
        COMPACT.pack_into(image, offset, _COMPACT_CHUNK_BASED, 0, node.mode, node.nlink, node.size, 0,
                          layout.chunk_format, position + 1, node.uid, node.gid, 0)
        array = offset + COMPACT.size  # 8-byte aligned already: inodes start 32-byte aligned
    else:
        mtime, mtime_nsec = divmod(node.mtime_ns, NS_PER_S)
        EXTENDED.pack_into(image, offset, _EXTENDED_CHUNK_BASED, 0, node.mode, 0, node.size, layout.chunk_format,
                           position + 1, node.uid, node.gid, mtime & _U64, mtime_nsec, node.nlink, bytes(16))
        array = offset + EXTENDED.size
    try:
        blkaddrs = blobmap.blkaddrs(node.chunks)
        if len(blkaddrs) == 1 and blkaddrs[0] is not None:  # a small file: one index, packed in place
            chunk_index.CHUNK_INDEX.pack_into(image, array, 0, chunk_index.BLOB_DEVICE_ID, blkaddrs[0])
        else:
            _put(image, array, chunk_index.pack(blkaddrs))
    except NotFoundError as e:
        path = layout.path(position).decode(errors="backslashreplace")
        raise NotFoundError(e.message, where=f"/{path}: {e.where}") from e


def _i_u(plan: InodePlan, layout: Layout) -> int:
    mode = plan.node.mode
    if plan.layout == LAYOUT_CHUNK_BASED:
        return layout.chunk_format
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return encode_rdev(os.major(plan.node.rdev), os.minor(plan.node.rdev))
    if plan.flat is None:  # FIFOs, sockets, empty files: no data
        return 0 if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else EROFS_NULL_ADDR
    return plan.flat.blkaddr


def _put(image: bytearray, offset: int, data: bytes) -> None:
    image[offset:offset + len(data)] = data


def _chunk_indexes(plan: InodePlan, blobmap) -> bytes:
    try:
        return chunk_index.pack(blobmap.blkaddrs(plan.node.chunks))
    except NotFoundError as e:
        raise NotFoundError(e.message, where=f"/{plan.path.decode(errors='backslashreplace')}: {e.where}") from e


def _directory_data(plan: InodePlan, layout: Layout) -> bytes:
    """The directory's blocks, each zero-padded but the last, which ends after its last name."""
    position = plan.flat.first_child
    nodes, nids, children, links = layout.nodes, layout.nids, plan.node.children, layout.links
    file_type = dirent.file_type
    blocks = []
    for names in plan.flat.dir_blocks:
        entries = []
        for name in names:
            if name == b".":
                target = plan.position
            elif name == b"..":
                target = plan.parent
            else:  # in name order: the entries this directory reached first are placed from first_child
                child = children[name]
                if position < len(nodes) and nodes[position] is child:
                    target = position
                    position += 1
                else:
                    target = links[id(child)]
            entries.append((name, nids[target], file_type(nodes[target].mode)))
        blocks.append(dirent.pack_block(entries))
    return b"".join(block.ljust(BLOCK_SIZE, b"\0") for block in blocks[:-1]) + blocks[-1]


def _write_flat(image: bytearray, plan: InodePlan, data: bytes) -> None:
    """FLAT_PLAIN: all of ``data`` in blocks from blkaddr; FLAT_INLINE: the tail after the xattrs."""
    tail_size = plan.flat.tail_size if plan.layout == LAYOUT_FLAT_INLINE else 0
    in_blocks = len(data) - tail_size
    if in_blocks:
        _put(image, plan.flat.blkaddr * BLOCK_SIZE, data[:in_blocks])
    if tail_size:
        _put(image, plan.offset + plan.head_size, data[in_blocks:])
