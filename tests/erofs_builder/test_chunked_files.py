"""erofs_builder/chunked_files.py: the chunk-based files of an image in walk order with their blob block
addresses, read from the image's records: the reader's view of real images (ours and mkfs.erofs's), and
hostile images refused within time and memory of their size."""

from __future__ import annotations

import os
import random
import stat
import struct

import pytest

from dsec_fs.errors import FormatError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.build import build_tree
from erofs_builder.chunked_files import chunked_files
from erofs_builder.ondisk import INODE_SLOT_SIZE
from erofs_builder.ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from erofs_builder.ondisk.inode import LAYOUT_CHUNK_BASED
from erofs_builder.ondisk.superblock import seal_block0
from erofs_builder.reader import ErofsImage
from erofs_builder.tree import Node, Tree, make_dir
from tests.erofs_builder.reader_support import make_source, mkfs, needs_mkfs
from tests.fuzz.fuzzlib import bounded

CHUNK = 4096
BLOCK = 4096


def _file(data: bytes, **attrs) -> Node:
    def reader(chunk_size: int):
        return (data[i:i + chunk_size] for i in range(0, len(data), chunk_size))

    return Node(mode=stat.S_IFREG | 0o644, size=len(data), reader=reader if data else None, **attrs)


def _meta(tmp_path, entries: dict[bytes, Node]) -> bytes:
    tree = Tree(make_dir())
    for path, node in entries.items():
        tree.add(path, node)
    tree.finish()
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    return open_layer(store, build_tree(tree, store, chunk_size=CHUNK).digest).meta


def _walked(meta: bytes) -> list[tuple[int, int, bytes, list[int]]]:
    """What chunked_files should yield, from the reader: its walk, each file at its first name."""
    image = ErofsImage(meta)
    parents, seen, found = {b"": image.root_nid}, set(), []
    for path, nid in image.walk():
        mode = image.stat(nid).mode
        if stat.S_ISDIR(mode):
            parents[path] = nid
        if not stat.S_ISREG(mode) or nid in seen or image.inode(nid).layout != LAYOUT_CHUNK_BASED:
            continue
        seen.add(nid)
        blocks = [blkaddr for device, blkaddr in image.chunk_map(nid) if blkaddr != HOLE and device == BLOB_DEVICE_ID]
        if blocks:
            directory, _, name = path.rpartition(b"/")
            found.append((nid, parents[directory], name, blocks))
    return found


def test_every_kind_of_inode_reads_as_the_reader_walks_it(tmp_path):
    """make_source's tree (reader_support): hard links, a duplicated file, holes, symlinks, xattrs, a
    directory of several blocks, names that sort before '.'."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    meta = open_layer(store, build_layer(make_source(tmp_path / "src", special=os.geteuid() == 0), store,
                                         chunk_size=CHUNK).digest).meta
    found = [tuple(file) for file in chunked_files(meta, chunk_bits=12)]
    assert found == _walked(meta) and len(found) > 10


@needs_mkfs
def test_an_image_mkfs_erofs_chunked_onto_a_blob_device_reads_as_the_reader_walks_it(tmp_path):
    src = make_source(tmp_path / "src", special=False)
    _path, image = mkfs(tmp_path, src, "--chunksize=4096", f"--blobdev={tmp_path / 'blob'}")
    found = [tuple(file) for file in chunked_files(image, chunk_bits=12)]
    assert found == _walked(image) and found


def _inode_offset(image: ErofsImage, nid: int) -> int:
    return image.superblock.meta_blkaddr * image.block_size + nid * INODE_SLOT_SIZE


def test_inodes_sharing_one_chunk_index_array_are_refused_in_time_and_memory_of_the_image(tmp_path):
    """A thousand files' inodes, each pointing (through the size of an xattr body it claims) at a big
    file's array of 16,384 valid chunk indexes: the reader's walk (LayerIndex) would build 16 million
    entries, and ran past 5 s."""
    block = random.Random(1).randbytes(CHUNK)
    entries = {b"a/%04d" % i: _file(b"%d" % i * 100) for i in range(1000)}
    entries[b"z/big"] = _file(block * 16384)  # one chunk, 16,384 times: every index names block 0
    meta = bytearray(_meta(tmp_path, entries))
    image = ErofsImage(bytes(meta))
    big = image.resolve(b"z/big")
    array_at = image._node(big).data_offset
    for i in range(1000):
        nid = image.resolve(b"a/%04d" % i)
        at = _inode_offset(image, nid)
        assert image.inode(nid).layout == LAYOUT_CHUNK_BASED and not image.inode(nid).extended
        icount = (array_at - at - INODE_SLOT_SIZE - 12) // 4 + 1  # the body ends where big's array starts
        assert 0 < icount <= 0xFFFF and not image.inode(nid).xattr_icount
        struct.pack_into("<H", meta, at + 2, icount)
        struct.pack_into("<I", meta, at + 8, 16384 * CHUNK)  # i_size: as many chunks as big's
    seal_block0(meta, BLOCK)
    outcome = bounded(lambda: list(chunked_files(bytes(meta), chunk_bits=12)), allowed=FormatError,
                      input_size=len(meta), seconds=5.0)
    assert isinstance(outcome, FormatError), f"{len(outcome)} files read"
    assert "chunk indexes add up to more than" in str(outcome) and "arrays overlap" in str(outcome)


def test_directories_sharing_their_blocks_are_refused_in_time_and_memory_of_the_image(tmp_path):
    """A thousand directories whose inodes name the blocks of one directory of 2,000 files."""
    entries = {b"many/" + b"x" * 40 + b"%04d" % i: _file(b"%d" % i) for i in range(2000)}
    entries.update({b"e/%04d/f" % i: _file(b"f") for i in range(1000)})
    meta = bytearray(_meta(tmp_path, entries))
    image = ErofsImage(bytes(meta))
    many = image.inode(image.resolve(b"many"))
    assert many.layout == 0 or many.size > BLOCK  # its blocks start at i_u
    for i in range(1000):
        at = _inode_offset(image, image.resolve(b"e/%04d" % i))
        assert not image.inode(image.resolve(b"e/%04d" % i)).extended
        struct.pack_into("<H", meta, at, 0)  # compact, FLAT_PLAIN: every block at i_u
        struct.pack_into("<I", meta, at + 8, (many.size // BLOCK) * BLOCK)  # i_size: many's whole blocks
        struct.pack_into("<I", meta, at + 16, many.i_u)
    seal_block0(meta, BLOCK)
    outcome = bounded(lambda: list(chunked_files(bytes(meta), chunk_bits=12)), allowed=FormatError,
                      input_size=len(meta), seconds=5.0)
    assert isinstance(outcome, FormatError), f"{len(outcome)} files read"
    assert "directories' data add up to more than" in str(outcome)


def test_a_directory_named_twice_is_refused(tmp_path):
    meta = bytearray(_meta(tmp_path, {b"a/f": _file(b"a"), b"b/g": _file(b"b")}))
    image = ErofsImage(bytes(meta))
    root, a = image.root_nid, image.resolve(b"a")
    b_at = image._dir(root).offsets[image._dir(root).by_name[b"b"]]
    struct.pack_into("<Q", meta, b_at, a)  # "b" names a's inode too
    seal_block0(meta, BLOCK)
    with pytest.raises(FormatError, match=f"directory nid {a} is reached a second time"):
        list(chunked_files(bytes(meta), chunk_bits=12))


def test_a_chunk_size_other_than_the_blob_maps_is_refused(tmp_path):
    meta = _meta(tmp_path, {b"f": _file(b"x" * 10000)})
    with pytest.raises(FormatError, match="chunk size 4096, the blob map's is 8192"):
        list(chunked_files(meta, chunk_bits=13))
