"""The image writer's layout rules, checked on the bytes it writes (no mounts; the kernel judges in
test_kernel_mount.py).

The images are parsed here with the on-disk struct modules only, so these tests do not depend on the
userspace reader.
"""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec_fs.digest import sha256
from dsec_fs.errors import FormatError, InputError, NotFoundError, UnsupportedError
from dsec_fs.blobmap import BlobMap
from erofs_builder.layout import INODE_AREA_START, plan_layout
from erofs_builder.ondisk import BLOCK_SIZE, EROFS_NULL_ADDR, chunk_index, dirent, xattr
from erofs_builder.ondisk.device_slot import DeviceSlot
from erofs_builder.ondisk.inode import (
    COMPACT, EXTENDED, LAYOUT_CHUNK_BASED, LAYOUT_FLAT_INLINE, LAYOUT_FLAT_PLAIN, Inode, decode_rdev,
)
from erofs_builder.ondisk.superblock import (
    COMPAT_SB_CHKSUM, INCOMPAT_CHUNKED_FILE, INCOMPAT_DEVICE_TABLE, SB_OFFSET, Superblock,
)
from erofs_builder.tree import Node, Tree, make_dir
from erofs_builder.writer import spill_image, write_image
from strategies import exact_block_names

CHUNK = 8192
MTIME = 1_700_000_000_000_000_007


# ---- building trees --------------------------------------------------------------------------------


class Builder:
    """A Tree plus the blob map its files' chunks go into."""

    def __init__(self, chunk_size: int = CHUNK):
        self.chunk_size = chunk_size
        self.tree = Tree(make_dir(mtime_ns=MTIME))
        self.blobmap = BlobMap(chunk_size)

    def file(self, path: bytes, data: bytes = b"", **kw) -> Node:
        node = Node(mode=kw.pop("mode", stat.S_IFREG | 0o644), size=len(data), mtime_ns=kw.pop("mtime_ns", MTIME), **kw)
        node.chunks = []
        for start in range(0, len(data), self.chunk_size):
            piece = data[start:start + self.chunk_size]
            if piece == bytes(len(piece)):
                node.chunks.append(None)
            else:
                node.chunks.append(sha256(piece))
                self.blobmap.add(node.chunks[-1], len(piece))
        self.tree.add(path, node)
        return node

    def add(self, path: bytes, mode: int, **kw) -> Node:
        node = Node(mode=mode, mtime_ns=kw.pop("mtime_ns", MTIME), **kw)
        if stat.S_ISDIR(mode):
            node.children = {}
        self.tree.add(path, node)
        return node

    def symlink(self, path: bytes, target: bytes, **kw) -> Node:
        return self.add(path, stat.S_IFLNK | 0o777, target=target, size=len(target), **kw)

    def build(self) -> "Image":
        return Image(write_image(self.tree, self.blobmap, self.chunk_size))


# ---- reading images back -------------------------------------------------------------------------


class Image:
    """Just enough of an EROFS reader to check the layout: inodes, flat data, directory blocks."""

    def __init__(self, data: bytes):
        self.data = data
        self.sb = Superblock.unpack(data)

    def inode(self, nid: int) -> Inode:
        return Inode.unpack(self.data, nid, meta_offset=0, build_time=self.sb.build_time,
                            build_time_nsec=self.sb.build_time_nsec)

    def data_start(self, nid: int) -> int:
        """Image offset right after the inode header and its xattrs."""
        ino = self.inode(nid)
        return nid * 32 + ino.header_size + ino.xattr_size

    def flat_data(self, nid: int) -> bytes:
        ino = self.inode(nid)
        if ino.layout == LAYOUT_FLAT_PLAIN:
            if ino.size == 0:
                assert ino.i_u == EROFS_NULL_ADDR
            return self.data[ino.i_u * BLOCK_SIZE:ino.i_u * BLOCK_SIZE + ino.size]
        assert ino.layout == LAYOUT_FLAT_INLINE
        full = ino.size - ino.size % BLOCK_SIZE
        head = self.data[ino.i_u * BLOCK_SIZE:ino.i_u * BLOCK_SIZE + full] if full else b""
        if not full:
            assert ino.i_u == EROFS_NULL_ADDR
        start = self.data_start(nid)
        return head + self.data[start:start + ino.size % BLOCK_SIZE]

    def dir_blocks(self, nid: int) -> list[list[tuple[bytes, int, int]]]:
        data = self.flat_data(nid)
        return [list(dirent.unpack_block(data[i:i + BLOCK_SIZE], offset=i, nid=nid, source="test"))
                for i in range(0, len(data), BLOCK_SIZE)]

    def entries(self, nid: int) -> dict[bytes, int]:
        return {name: child for block in self.dir_blocks(nid) for name, child, _ft in block}

    def lookup(self, path: bytes) -> int:
        nid = self.sb.root_nid
        for name in path.split(b"/") if path else []:
            nid = self.entries(nid)[name]
        return nid

    def all_nids(self) -> set[int]:
        found, stack = {self.sb.root_nid}, [self.sb.root_nid]
        while stack:
            for name, child, ftype in (e for block in self.dir_blocks(stack.pop()) for e in block):
                if name not in (b".", b"..") and child not in found:
                    found.add(child)
                    if ftype == dirent.FT_DIR:
                        stack.append(child)
        return found


# ---- superblock and device table -----------------------------------------------------------------


def test_superblock_device_table_and_checksum():
    b = Builder()
    b.file(b"a", b"x" * 10_000)
    b.add(b"d", stat.S_IFDIR | 0o755)
    image = b.build()
    sb = image.sb
    assert sb.feature_compat == COMPAT_SB_CHKSUM
    assert sb.feature_incompat == INCOMPAT_CHUNKED_FILE | INCOMPAT_DEVICE_TABLE
    assert (sb.extra_devices, sb.devt_slotoff, sb.meta_blkaddr, sb.xattr_blkaddr) == (1, 9, 0, 0)
    assert sb.root_nid == INODE_AREA_START // 32 == 40
    assert sb.inos == 3
    assert sb.blocks * BLOCK_SIZE == len(image.data)
    assert (sb.build_time, sb.build_time_nsec) == divmod(MTIME, 10**9)
    slot = DeviceSlot.unpack(image.data, sb.devt_slotoff * 128)
    assert slot.tag == b.blobmap.blob_id.encode() and len(slot.tag) == 64
    assert slot.blocks == b.blobmap.blocks == 3

    # The checksum covers block 0 after the superblock: the device table and the first inodes.
    for offset in (SB_OFFSET + 0x10, sb.devt_slotoff * 128 + 64, INODE_AREA_START + 8, BLOCK_SIZE - 1):
        corrupt = bytearray(image.data)
        corrupt[offset] ^= 0x01
        with pytest.raises(FormatError, match="checksum"):
            Superblock.unpack(corrupt)


def test_no_chunked_feature_without_file_data():
    b = Builder()
    b.file(b"empty")
    b.symlink(b"link", b"empty")
    image = b.build()
    assert image.sb.feature_incompat == INCOMPAT_DEVICE_TABLE
    assert DeviceSlot.unpack(image.data, 9 * 128).blocks == 0


def test_same_tree_gives_same_bytes():
    def make() -> bytes:
        b = Builder()
        for i in range(50):
            b.file(b"d%d/f%d" % (i % 7, i), bytes([i]) * (i * 300), xattrs={b"user.i": b"%d" % i})
        return b.build().data

    assert make() == make()


def test_regular_files_written_in_place_are_the_bytes_the_general_path_writes(monkeypatch):
    """writer._write_plain_file (CHUNK_BASED inodes without xattrs) against _write_inode for every inode."""
    import erofs_builder.writer as writer

    def make() -> bytes:
        b = Builder()
        for i in range(60):
            data = bytes([1 + i % 5]) * (1 + i * 700) if i % 9 else bytes(CHUNK) + b"tail"  # one with a hole
            b.file(b"d%d/f%d" % (i % 4, i), data, mtime_ns=MTIME if i % 3 else MTIME + i,  # compact / extended
                   uid=70000 if i == 7 else i, gid=i % 4, xattrs={b"user.x": b"1"} if i == 5 else {})
        link = b.file(b"linked", b"shared content", mtime_ns=MTIME + 1000)  # extended, two names
        compact_link = b.file(b"linked2", b"more shared content")
        b.tree.add(b"d1/another-name", compact_link)
        b.tree.add(b"d0/second-name", link)
        b.file(b"empty")
        b.symlink(b"s", b"target")
        return bytes(b.build().data)

    fast = make()
    monkeypatch.setattr(writer, "_PLAIN_FILE_FORMATS", ())
    assert make() == fast


def test_one_chunk_files_placed_inline_get_the_inodes_the_general_rules_give(monkeypatch):
    """layout._place_inodes decides a one-chunk regular file without xattrs itself: the same image as
    _inode_form's for every inode, across each field that makes an inode extended or takes it off that path."""
    import erofs_builder.layout as layout

    def make() -> bytes:
        b = Builder()
        for i in range(48):
            data = bytes([1 + i % 5]) * (1 + i * 90)  # 1 byte to just over CHUNK: one chunk, or two
            b.file(b"d%d/f%d" % (i % 3, i), data, mtime_ns=MTIME if i % 3 else MTIME + i * 7,
                   uid=0x10000 if i == 4 else 0xFFFF if i == 6 else i, gid=0x10000 if i == 8 else i % 2,
                   xattrs={b"user.x": b"1"} if i == 10 else {})
        b.file(b"before-1970", b"old", mtime_ns=-1_500_000_000)
        b.file(b"sparse", bytes(CHUNK))  # one chunk, a hole
        many = b.file(b"many-names", b"linked")
        for k in range(3):
            b.tree.add(b"d0/name-%d" % k, many)
        b.file(b"empty")
        b.symlink(b"s", b"target")
        return bytes(b.build().data)

    inline = make()
    monkeypatch.setattr(layout, "_COMPACT_FIELD_MAX", -1)  # no inode takes the inline path
    assert make() == inline


def _varied_tree() -> Builder:
    """Every kind of inode record: compact and extended files, a hole, xattrs, hard links, a directory of
    several blocks (data area), short and long symlinks, an empty file."""
    b = Builder()
    for i in range(40):
        data = bytes([1 + i % 5]) * (1 + i * 700) if i % 9 else bytes(CHUNK) + b"tail"
        b.file(b"d%d/f%d" % (i % 4, i), data, mtime_ns=MTIME if i % 3 else MTIME + i,
               xattrs={b"user.x": b"1"} if i == 5 else {})
    for i in range(400):
        b.file(b"big/a-rather-long-name-%04d" % i, b"%d" % i)
    b.tree.add(b"d1/another-name", b.file(b"linked", b"shared content"))
    b.file(b"empty")
    b.symlink(b"s", b"target")
    b.symlink(b"long", b"t" * (BLOCK_SIZE + 10))
    return b


def test_an_image_spilled_to_a_file_is_the_image_written_in_memory(monkeypatch):
    """spill_image (a build's meta.erofs, in a temporary file, its pages handed back as it goes) gives
    write_image's bytes, sealed the same."""
    import erofs_builder.writer as writer

    b = _varied_tree()
    in_memory = bytes(write_image(b.tree, b.blobmap, CHUNK))
    monkeypatch.setattr(writer, "RELEASE_EVERY", 3)  # hand pages back often, mid-directory too
    with spill_image(b.tree, b.blobmap, CHUNK) as spilled:
        assert len(spilled) == len(in_memory) > 4 * BLOCK_SIZE
        assert b"".join(bytes(piece) for piece in spilled.pieces()) == in_memory
        assert spilled.sha256() == sha256(in_memory)


def test_a_failed_spilled_image_leaves_no_file(tmp_path, monkeypatch):
    spill_dir = tmp_path / "tmp"
    spill_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_dir))
    b = _varied_tree()
    missing = b.file(b"z-last", b"not in the blob map")
    b.blobmap = BlobMap(CHUNK)
    for node in b.tree.nodes():
        if node.is_reg and node is not missing:
            for number, digest in enumerate(node.chunks):
                if digest is not None and digest not in b.blobmap:
                    b.blobmap.add(digest, min(CHUNK, node.size - number * CHUNK))
    with pytest.raises(NotFoundError, match="z-last") as raised:  # its traceback holds the writer's frame
        spill_image(b.tree, b.blobmap, CHUNK)
    assert raised.traceback  # alive until here: the file must be closed, not left to the garbage
    assert os.listdir(spill_dir) == []
    assert not [fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")
                and os.readlink(f"/proc/self/fd/{fd}").startswith(str(spill_dir))]


# ---- directories ---------------------------------------------------------------------------------


def test_directory_entries_sorted_memcmp_and_packed_greedily():
    b = Builder()
    names = [b"!bang", b"-dash", b"a", b"\xff\xfe", b"Z" * 255, b".hidden", b"..dots"]
    names += [b"entry-%04d" % i for i in range(600)] + [b"L%03d" % i + b"x" * 200 for i in range(30)]
    for name in names:
        b.file(b"dir/" + name)
    image = b.build()
    nid = image.lookup(b"dir")
    blocks = image.dir_blocks(nid)
    flat = [name for block in blocks for name, _nid, _ft in block]
    assert flat == sorted(names + [b".", b".."])
    assert flat.index(b".") == 2  # "!bang" and "-dash" sort before "."
    assert len(blocks) > 3
    for block, following in zip(blocks, blocks[1:]):
        used = sum(dirent.DIRENT.size + len(name) for name, _nid, _ft in block)
        assert used <= BLOCK_SIZE < used + dirent.DIRENT.size + len(following[0][0])
    ino = image.inode(nid)
    last_used = sum(dirent.DIRENT.size + len(name) for name, _nid, _ft in blocks[-1])
    assert ino.size == (len(blocks) - 1) * BLOCK_SIZE + last_used
    entries = image.entries(nid)
    assert entries[b"."] == nid and entries[b".."] == image.sb.root_nid
    assert image.entries(image.sb.root_nid)[b".."] == image.sb.root_nid


def test_directory_of_exactly_one_block_has_no_tail():
    b = Builder()
    for name in exact_block_names():
        b.file(b"d/" + name)
    image = b.build()
    nid = image.lookup(b"d")
    ino = image.inode(nid)
    assert (ino.size, ino.layout) == (BLOCK_SIZE, LAYOUT_FLAT_PLAIN)
    assert len(image.dir_blocks(nid)) == 1 and len(image.entries(nid)) == 292


def test_directory_file_types_and_link_counts():
    b = Builder()
    b.add(b"sub", stat.S_IFDIR | 0o755)
    b.add(b"sub/inner", stat.S_IFDIR | 0o700)
    b.symlink(b"sym", b"sub")
    b.add(b"chr", stat.S_IFCHR | 0o600, rdev=os.makedev(4095, 2**20 - 1))
    b.add(b"blk", stat.S_IFBLK | 0o600, rdev=os.makedev(8, 1))
    b.add(b"fifo", stat.S_IFIFO | 0o644)
    b.add(b"sock", stat.S_IFSOCK | 0o755)
    shared = b.file(b"file", b"data")
    b.tree.add(b"sub/hardlink", shared)
    b.tree.add(b"sub/inner/hardlink", shared)
    image = b.build()
    root = image.sb.root_nid
    types = {name: ft for name, _nid, ft in image.dir_blocks(root)[0]}
    assert types == {b".": dirent.FT_DIR, b"..": dirent.FT_DIR, b"sub": dirent.FT_DIR, b"sym": dirent.FT_SYMLINK,
                     b"chr": dirent.FT_CHR, b"blk": dirent.FT_BLK, b"fifo": dirent.FT_FIFO,
                     b"sock": dirent.FT_SOCK, b"file": dirent.FT_REG}
    assert image.inode(root).nlink == 3
    assert image.inode(image.lookup(b"sub")).nlink == 3
    assert image.inode(image.lookup(b"sub/inner")).nlink == 2
    nid = image.lookup(b"file")
    assert image.lookup(b"sub/hardlink") == image.lookup(b"sub/inner/hardlink") == nid
    assert image.inode(nid).nlink == 3
    assert decode_rdev(image.inode(image.lookup(b"chr")).i_u) == (4095, 2**20 - 1)
    assert decode_rdev(image.inode(image.lookup(b"blk")).i_u) == (8, 1)
    for name in (b"fifo", b"sock"):
        ino = image.inode(image.lookup(name))
        assert (ino.i_u, ino.size, ino.layout) == (0, 0, LAYOUT_FLAT_PLAIN)
    # i_ino numbers every inode once, 1..inos.
    inos = sorted(image.inode(n).ino for n in image.all_nids())
    assert inos == list(range(1, image.sb.inos + 1))


def test_100000_entry_directory():
    b = Builder()
    root = b.tree.root
    for i in range(100_000):
        root.children[b"file-%06d" % i] = Node(mode=stat.S_IFREG | 0o644, mtime_ns=MTIME, chunks=[])
    image = b.build()
    assert image.sb.inos == 100_001
    blocks = image.dir_blocks(image.sb.root_nid)
    names = [name for block in blocks for name, _nid, _ft in block]
    assert names == [b".", b".."] + [b"file-%06d" % i for i in range(100_000)]
    nids = {nid for block in blocks for name, nid, _ft in block if name.startswith(b"file")}
    assert len(nids) == 100_000
    assert image.inode(max(nids)).ino == 100_001


# ---- inline tails --------------------------------------------------------------------------------


def _check_inline_rule(image: Image, nid: int) -> None:
    """A FLAT_INLINE record (header, xattrs, tail) lies in one block; FLAT_PLAIN only when it cannot."""
    ino = image.inode(nid)
    record = ino.header_size + ino.xattr_size + ino.size % BLOCK_SIZE
    if ino.layout == LAYOUT_FLAT_INLINE:
        assert (nid * 32) % BLOCK_SIZE + record <= BLOCK_SIZE, f"nid {nid}"
    elif stat.S_ISLNK(ino.mode) or stat.S_ISDIR(ino.mode):
        assert ino.size % BLOCK_SIZE == 0 or record > BLOCK_SIZE, f"nid {nid}: tail could be inline"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 4095), st.integers(0, 1200), st.booleans()), min_size=1, max_size=40))
def test_inline_tail_never_crosses_a_block(entries):
    """Symlinks and directories of every tail size, behind xattrs of every size, in any order."""
    b = Builder()
    for i, (length, xattr_size, is_dir) in enumerate(entries):
        xattrs = {b"trusted.x": b"v" * xattr_size} if xattr_size else {}
        if is_dir:
            d = b.add(b"d%d" % i, stat.S_IFDIR | 0o755, xattrs=xattrs)
            for j in range(length // 24):  # 12-byte dirents + 12-byte names: ~length bytes of directory
                d.children[b"n%011d" % j] = Node(mode=stat.S_IFIFO | 0o644, mtime_ns=MTIME)
        else:
            b.symlink(b"s%d" % i, bytes([65 + i % 26]) * length, xattrs=xattrs)
    image = b.build()
    for nid in image.all_nids():
        _check_inline_rule(image, nid)
    for i, (length, _xattr_size, is_dir) in enumerate(entries):
        if not is_dir:
            assert image.flat_data(image.lookup(b"s%d" % i)) == bytes([65 + i % 26]) * length


def test_tail_that_would_cross_is_moved_to_the_next_block():
    b = Builder()
    b.symlink(b"a", b"x" * 2000)
    b.symlink(b"b", b"y" * 2000)  # right after "a" it would cross the end of block 0 or 1
    image = b.build()
    a, c = image.lookup(b"a"), image.lookup(b"b")
    assert image.inode(a).layout == image.inode(c).layout == LAYOUT_FLAT_INLINE
    assert (c * 32) % BLOCK_SIZE == 0
    assert image.flat_data(c) == b"y" * 2000


def test_long_symlinks_use_data_blocks():
    b = Builder()
    b.symlink(b"longest", b"a" * 4095)  # 32-byte header + 4095 bytes cannot share a block
    b.symlink(b"tar-only", b"b" * 9000)  # only a tar can hold one; stored all the same
    b.symlink(b"empty", b"")
    image = b.build()
    for name, target, blocks in ((b"longest", b"a" * 4095, 1), (b"tar-only", b"b" * 9000, 3), (b"empty", b"", 0)):
        ino = image.inode(image.lookup(name))
        assert ino.layout == LAYOUT_FLAT_PLAIN and ino.size == len(target)
        assert image.flat_data(image.lookup(name)) == target
        if blocks:
            assert ino.i_u * BLOCK_SIZE >= image.lookup(b"empty") * 32  # in the data area, after the inodes


# ---- compact or extended -------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, extended", [
    ("mtime_ns", MTIME, False),
    ("mtime_ns", MTIME + 1, True),
    ("mtime_ns", -1_500_000_000, True),
    ("uid", 65535, False),
    ("uid", 65536, True),
    ("gid", 2**32 - 1, True),
])
def test_compact_unless_a_field_does_not_fit(field, value, extended):
    b = Builder()
    for i in range(3):  # the majority sets build_time
        b.file(b"common%d" % i)
    node = b.file(b"probe")
    setattr(node, field, value)
    image = b.build()
    ino = image.inode(image.lookup(b"probe"))
    assert ino.extended == extended
    assert ino.header_size == (EXTENDED.size if extended else COMPACT.size)
    if field == "mtime_ns":
        seconds, nsec = divmod(value, 10**9)
        assert (ino.mtime - (1 << 64) if ino.mtime >= 1 << 63 else ino.mtime, ino.mtime_nsec) == (seconds, nsec)
    else:
        assert getattr(ino, field) == value


def test_size_over_4gib_and_many_links_need_extended_inodes():
    b = Builder(chunk_size=1 << 24)
    huge = b.file(b"huge")
    huge.size = (4 << 30) + 1
    huge.chunks = [None] * 257
    shared = b.file(b"shared")
    for i in range(65_535):  # 65,536 names in all
        b.tree.add(b"links/%d" % i, shared)
    image = b.build()
    ino = image.inode(image.lookup(b"huge"))
    assert ino.extended and ino.size == (4 << 30) + 1 and ino.layout == LAYOUT_CHUNK_BASED
    ino = image.inode(image.lookup(b"shared"))
    assert ino.extended and ino.nlink == 65_536


def test_build_time_is_the_most_common_mtime():
    b = Builder()
    b.tree.root.mtime_ns = 5
    for i in range(5):
        b.file(b"x%d" % i, mtime_ns=123_000_000_456)
    b.file(b"y", mtime_ns=MTIME)
    image = b.build()
    assert (image.sb.build_time, image.sb.build_time_nsec) == (123, 456)
    assert not image.inode(image.lookup(b"x0")).extended
    assert image.inode(image.sb.root_nid).extended


# ---- regular files -------------------------------------------------------------------------------


def test_chunk_indexes_point_into_the_blob_and_holes_are_null():
    b = Builder()
    data = b"a" * CHUNK + bytes(CHUNK) + b"b" * 100 + bytes(CHUNK - 100) + b"a" * CHUNK + b"tail"
    node = b.file(b"f", data, xattrs={b"user.k": b"v" * 5})  # xattrs shift the array: it stays 8-aligned
    b.file(b"empty")
    image = b.build()
    nid = image.lookup(b"f")
    ino = image.inode(nid)
    assert ino.layout == LAYOUT_CHUNK_BASED and ino.size == len(data)
    assert ino.i_u == chunk_index.FORMAT_INDEXES | 1  # 8 KiB chunks on 4 KiB blocks
    start = image.data_start(nid)
    assert chunk_index.array_offset(start) % 8 == 0
    entries = chunk_index.unpack(image.data, chunk_index.array_offset(start), 5, nid=nid, source="test")
    expected = [(1, b.blobmap.blkaddr_of(d)) if d else (0, EROFS_NULL_ADDR) for d in node.chunks]
    assert entries == expected
    assert entries[0] == entries[3] and entries[1][1] == EROFS_NULL_ADDR
    empty = image.inode(image.lookup(b"empty"))
    assert (empty.layout, empty.size, empty.i_u) == (LAYOUT_FLAT_PLAIN, 0, EROFS_NULL_ADDR)


def test_xattrs_are_stored_inline():
    b = Builder()
    xattrs = {b"user.a": b"1", b"trusted.overlay.opaque": b"y", b"security.selinux": b"ctx\0",
              b"system.posix_acl_access": b"\x02\x00\x00\x00"}
    b.file(b"f", b"", xattrs=xattrs)
    image = b.build()
    nid = image.lookup(b"f")
    ino = image.inode(nid)
    assert xattr.decode(image.data, nid * 32 + ino.header_size, ino.xattr_icount, nid=nid, source="test") == xattrs


# ---- what cannot be written ----------------------------------------------------------------------


def test_unstorable_input_is_refused():
    b = Builder()
    b.file(b"f", b"", xattrs={b"os2.name": b"v"})
    with pytest.raises(UnsupportedError, match="prefix"):
        b.build()

    b = Builder()
    b.add(b"dev", stat.S_IFCHR | 0o600, rdev=os.makedev(5000, 1))
    with pytest.raises(UnsupportedError, match="5000:1"):
        b.build()

    b = Builder()
    node = b.file(b"f", b"x" * (CHUNK + 1))
    node.chunks.pop()
    with pytest.raises(InputError, match="need 2 chunks"):
        b.build()

    b = Builder()
    d = b.add(b"d", stat.S_IFDIR | 0o755)
    b.tree.root.children[b"again"] = d
    with pytest.raises(InputError, match="two paths"):
        b.build()

    b = Builder()
    b.file(b"f", b"")
    with pytest.raises(InputError, match="chunk size"):
        write_image(b.tree, b.blobmap, 3000)


def test_layout_alone_needs_no_blob_map():
    b = Builder()
    b.file(b"f", b"z" * 100)
    layout = plan_layout(b.tree, CHUNK)
    assert [p.path for p in layout.inodes] == [b"", b"f"]
    assert layout.chunked and layout.inodes[1].chunk_count == 1
