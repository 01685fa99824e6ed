"""The userspace EROFS reader against real images: ours (build_layer, read through a StoreBlob or an
exported blob file) and erofs-utils' (mkfs.erofs, FLAT_INLINE and chunked), and against corrupt ones.

``reader_snapshot`` gives the reader's view of an image in tests/treecmp.py's format, so the reader is
held to exactly what the source directory (and the kernel, see test_export.py) shows. The helpers
(reader_snapshot, make_source, build, ...) are in reader_support.py, shared with test_fsck.py and
test_export.py; the ``rich`` fixture is in conftest.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
import stat
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec_fs.chunks import ChunkIndex
from dsec_fs.errors import FormatError, InputError, NotFoundError, UnavailableError, UnsupportedError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder.blob import FileBlob, StoreBlob
from erofs_builder.ondisk import chunk_index, dirent
from erofs_builder.ondisk.superblock import SB_OFFSET, seal_block0
from erofs_builder.reader import ErofsImage
from tests.erofs_builder.reader_support import (
    BLOCK, CHUNK, BuiltLayer, assert_reports_format_error, build, make_source, mkfs, needs_mkfs, read_all,
    reader_snapshot, write,
)
from treecmp import Entry, assert_same_tree, snapshot

# ---- reading our images ------------------------------------------------------------------------

def test_reader_sees_the_source_through_the_store(rich):
    layer = open_layer(rich.store, rich.digest)
    image = ErofsImage(layer.meta, blob=StoreBlob.for_layer(rich.store, layer))
    assert_same_tree(snapshot(rich.src), reader_snapshot(image))


def test_reader_sees_the_source_through_an_exported_blob(rich):
    with FileBlob(rich.blob_path) as blob:
        image = ErofsImage.from_path(rich.meta_path, blob=blob)
        assert_same_tree(snapshot(rich.src), reader_snapshot(image, piece=1000))


def test_walk_order_lookup_and_resolve(rich):
    image = ErofsImage(rich.meta)
    paths = [path for path, _nid in image.walk()]
    assert paths[0] == b""
    # Depth first, each directory's names in byte order: the order of sorting the components.
    assert paths == sorted(paths, key=lambda p: p.split(b"/"))
    for path, nid in image.walk():
        assert image.resolve(path) == nid
        assert image.resolve(b"/" + path + b"/") == nid
    d = image.resolve(b"d")
    assert image.lookup(d, b".") == d and image.lookup(d, b"..") == image.root_nid
    assert image.lookup(image.root_nid, b"..") == image.root_nid
    assert image.lookup(d, b"missing") is None
    names = [name for name, _nid, _ftype in image.readdir(image.resolve(b"many"))]
    assert names == sorted(names) and len(names) == 302 and b"." in names and b".." in names
    ftypes = {name: ftype for name, _nid, ftype in image.readdir(image.root_nid)}
    assert ftypes[b"link"] == dirent.FT_SYMLINK and ftypes[b"fifo"] == dirent.FT_FIFO and ftypes[b"d"] == dirent.FT_DIR
    assert image.resolve(b"hard") == image.resolve(b"small")
    assert image.stat(image.resolve(b"small")).nlink == 2
    assert image.stat(image.resolve(b"d/hardsym")).mode & stat.S_IFMT(0o170000) == stat.S_IFLNK
    with pytest.raises(NotFoundError):
        image.resolve(b"missing/x")
    with pytest.raises(NotFoundError):
        image.resolve(b"small/x")


def test_reads_at_any_offset_match_the_source(rich):
    with FileBlob(rich.blob_path) as blob:
        image = ErofsImage(rich.meta, blob=blob)
        rng = random.Random(1)
        for name in ["multi", "sparse", "zeros", "small", "one_chunk", "empty"]:
            with open(os.path.join(rich.src, name), "rb") as f:
                data = f.read()
            nid = image.resolve(name.encode())
            for _ in range(200):
                offset = rng.randrange(len(data) + CHUNK)
                length = rng.choice([0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, rng.randrange(5 * CHUNK)])
                assert image.read(nid, offset, length) == data[offset:offset + length], (name, offset, length)


def test_chunk_map_shows_holes_and_dedup(rich):
    image = ErofsImage(rich.meta)
    hole = chunk_index.HOLE
    sparse = image.chunk_map(image.resolve(b"sparse"))
    assert [blkaddr == hole for _dev, blkaddr in sparse] == [True, True, False, True, True, True]
    assert all(blkaddr == hole for _dev, blkaddr in image.chunk_map(image.resolve(b"zeros")))
    multi, dup = image.chunk_map(image.resolve(b"multi")), image.chunk_map(image.resolve(b"d/dup"))
    assert multi == dup and all(dev == 1 for dev, _ in multi) and len(multi) == 4
    with pytest.raises(InputError):  # the writer stores an empty file as FLAT_PLAIN: no chunks at all
        image.chunk_map(image.resolve(b"empty"))
    assert image.chunk_size(image.resolve(b"multi")) == CHUNK


def test_wrong_kind_of_inode_is_an_input_error(rich):
    image = ErofsImage(rich.meta)
    root, small = image.root_nid, image.resolve(b"small")
    with pytest.raises(InputError):
        image.read(root, 0, 10)
    with pytest.raises(InputError):
        image.readlink(small)
    with pytest.raises(InputError):
        image.readdir(small)
    with pytest.raises(InputError):
        image.read(small, -1, 10)


def test_chunked_data_without_a_blob_is_unavailable(rich):
    image = ErofsImage(rich.meta)
    assert image.read(image.resolve(b"zeros"), 0, 10) == bytes(10)  # holes need no blob
    with pytest.raises(UnavailableError):
        image.read(image.resolve(b"small"), 0, 10)


def test_a_blob_shorter_than_its_device_slot_is_refused(rich, tmp_path):
    short = tmp_path / "short"
    short.write_bytes(open(rich.blob_path, "rb").read()[:-BLOCK])
    with FileBlob(short) as blob, pytest.raises(FormatError, match="device slot 1"):
        ErofsImage(rich.meta, blob=blob)


def test_larger_chunks_and_an_unprivileged_tree(tmp_path):
    layer = build(tmp_path, make_source(tmp_path / "src", special=False), chunk_size=4 * CHUNK)
    with FileBlob(layer.blob_path) as blob:
        image = ErofsImage(layer.meta, blob=blob)
        assert image.chunk_size(image.resolve(b"multi")) == 4 * CHUNK
        assert_same_tree(snapshot(layer.src), reader_snapshot(image, piece=3 * CHUNK - 1))


# ---- the blob sources --------------------------------------------------------------------------

class CountingStore(FilesystemStore):
    """A real directory store that counts GETs per key prefix (to see caching, not to fake anything)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gets: collections.Counter = collections.Counter()

    def get(self, key, offset=0, length=None):
        self.gets[key.split("/")[0]] += 1
        return super().get(key, offset, length)


def store_blob(layer: BuiltLayer, **kw) -> tuple[StoreBlob, CountingStore]:
    store = CountingStore(layer.store.root, fsync=False)
    blob = StoreBlob.for_layer(store, open_layer(store, layer.digest), **kw)
    store.gets.clear()
    return blob, store


def test_store_blob_is_the_exported_blob_byte_for_byte(rich):
    blob, _store = store_blob(rich, cache_bytes=3 * CHUNK)
    expected = open(rich.blob_path, "rb").read()
    assert blob.size == len(expected)
    rng = random.Random(2)
    for _ in range(300):
        offset = rng.randrange(len(expected))
        length = rng.randrange(min(4 * CHUNK, len(expected) - offset) + 1)
        assert blob.read(offset, length) == expected[offset:offset + length], (offset, length)
    assert blob.read(0, len(expected)) == expected
    for offset, length in [(-1, 1), (0, len(expected) + 1), (len(expected), 1)]:
        with pytest.raises(InputError):
            blob.read(offset, length)


def test_store_blob_fetches_each_chunk_once_when_read_in_order(rich):
    blob, store = store_blob(rich)
    chunks = len(blob.blobmap)
    for offset in range(0, blob.size, 1000):
        blob.read(offset, min(1000, blob.size - offset))
    assert store.gets["packs"] <= chunks
    before = store.gets["packs"]
    blob.read(0, blob.size)  # all cached now
    assert store.gets["packs"] == before
    ahead, store = store_blob(rich, readahead_bytes=1 << 20)
    for offset in range(0, ahead.size, 1000):
        ahead.read(offset, min(1000, ahead.size - offset))
    assert store.gets["packs"] == 1  # one merged read of the whole (small) pack


def test_store_blob_serves_threads(rich):
    blob, _store = store_blob(rich, cache_bytes=2 * CHUNK)  # a small LRU, so threads evict each other
    expected = open(rich.blob_path, "rb").read()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(100):
            offset = rng.randrange(len(expected))
            length = rng.randrange(min(2 * CHUNK, len(expected) - offset) + 1)
            assert blob.read(offset, length) == expected[offset:offset + length]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(reader, seed) for seed in range(8)]:
            future.result()


def test_a_store_blob_with_a_missing_chunk_says_which(rich, tmp_path):
    layer = open_layer(rich.store, rich.digest)
    blob = StoreBlob.for_layer(rich.store, layer)
    blob.chunk_index = ChunkIndex()  # an index that knows no pack
    digest = blob.blobmap.entries[0][1]
    with pytest.raises(NotFoundError, match=digest.hex()):
        blob.read(0, 1)


# ---- reading erofs-utils images ----------------------------------------------------------------

@needs_mkfs
def test_reads_a_flat_inline_image_from_mkfs(tmp_path):
    src = make_source(tmp_path / "src", special=os.geteuid() == 0)
    path, data = mkfs(tmp_path, src, "-x-1")
    image = ErofsImage(data)
    layouts = {image.inode(nid).layout for _path, nid in image.walk()}
    assert 2 in layouts  # FLAT_INLINE
    expected = snapshot(src)
    # -x-1: mkfs.erofs stores no xattrs.
    expected = ({p: Entry(**{**e.__dict__, "xattrs": ()}) for p, e in expected[0].items()}, expected[1])
    assert_same_tree(expected, reader_snapshot(image, piece=5000))


@needs_mkfs
def test_reads_a_chunked_image_with_a_blob_device_from_mkfs(tmp_path):
    src = make_source(tmp_path / "src", special=os.geteuid() == 0)
    blob_path = tmp_path / "blob"
    _path, data = mkfs(tmp_path, src, f"--chunksize={CHUNK}", f"--blobdev={blob_path}", "-Enoinline_data")
    with FileBlob(blob_path) as blob:
        image = ErofsImage(data, blob=blob)
        assert image.devices[0].blocks == 0  # erofs-utils 1.5 leaves it unset; the blob's size is used
        assert image.inode(image.resolve(b"multi")).layout == 4
        assert_same_tree(snapshot(src), reader_snapshot(image))


# ---- corrupt images ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> BuiltLayer:
    """A few blocks of metadata with every structure the writer makes, for byte-level corruption."""
    tmp = tmp_path_factory.mktemp("small")
    src = tmp / "src"
    for name, data in {"a": b"alpha", "b/c": os.urandom(2 * CHUNK + 3), "b/dup": b"alpha" * 900,
                       "sparse": bytes(CHUNK) + b"x"}.items():
        write(os.path.join(src, name), data)
    os.symlink("a", src / "link")
    os.symlink("z" * 200, src / "b" / "long")
    os.link(src / "a", src / "b" / "hard")
    os.mkfifo(src / "fifo")
    os.setxattr(src / "a", b"user.k", b"value")
    os.utime(src / "b", ns=(0, 1_234_567_890_123_456_789))
    return build(tmp, str(src))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_is_reported_or_read_consistently(small, data):
    meta = bytearray(small.meta)
    # Half the flips land in the metadata written (block 0 and the blocks after), half anywhere.
    offset = data.draw(st.one_of(st.integers(SB_OFFSET, min(len(meta), 2 * BLOCK) - 1),
                                 st.integers(0, len(meta) - 1)), label="offset")
    meta[offset] ^= data.draw(st.integers(1, 255), label="xor")
    if data.draw(st.booleans(), label="reseal checksum"):
        seal_block0(meta, BLOCK)  # get past the checksum, into the structures
    with FileBlob(small.blob_path) as blob:
        assert_reports_format_error(bytes(meta), blob)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_truncated_image_is_reported(small, data):
    meta = bytearray(small.meta[:data.draw(st.integers(0, len(small.meta) - 1), label="length")])
    if data.draw(st.booleans(), label="fix up block count") and len(meta) >= BLOCK:
        del meta[len(meta) // BLOCK * BLOCK:]
        struct.pack_into("<I", meta, SB_OFFSET + 0x24, len(meta) // BLOCK)
        seal_block0(meta, BLOCK)
    with FileBlob(small.blob_path) as blob:
        with pytest.raises((FormatError, UnsupportedError)):
            read_all(bytes(meta), blob)


def test_every_single_byte_flip_is_reported_or_consistent(small):
    """Exhaustive over the written metadata, resealed: catches what random sampling misses."""
    meta = bytearray(small.meta)
    used = len(meta.rstrip(b"\0"))
    with FileBlob(small.blob_path) as blob:
        for offset in range(SB_OFFSET, used):
            flipped = bytearray(meta)
            flipped[offset] ^= 0x41
            seal_block0(flipped, BLOCK)
            assert_reports_format_error(bytes(flipped), blob)


def test_dont_care_bytes_change_nothing(small):
    """Fields no reader uses (boot area, uuid, i_ino, chunk-index advise, dirent reserved byte)."""
    with FileBlob(small.blob_path) as blob:
        clean = read_all(small.meta, blob)
        image = ErofsImage(small.meta)
        offsets = [0, 512, 1023, SB_OFFSET + 0x30, SB_OFFSET + 0x3F]  # boot area, uuid
        for _path, nid in image.walk():
            inode = image.inode(nid)
            offsets.append(image._node(nid).offset + 20)  # i_ino
            if inode.layout == 4:
                offsets.append(image._node(nid).data_offset)  # advise of chunk 0
            if stat.S_ISDIR(inode.mode):
                offsets.append(image._dir(nid).offsets[0] + 11)  # dirent reserved
        for offset in offsets:
            meta = bytearray(small.meta)
            meta[offset] ^= 0xFF
            seal_block0(meta, BLOCK)
            assert read_all(bytes(meta), blob) == clean, offset


def patched(meta: bytes, offset: int, fmt: str, *values: int) -> bytes:
    out = bytearray(meta)
    struct.pack_into(fmt, out, offset, *values)
    seal_block0(out, BLOCK)
    return bytes(out)


def test_targeted_corruptions_name_their_structure(small):
    image = ErofsImage(small.meta)
    root = image._node(image.root_nid)
    c = image._node(image.resolve(b"b/c"))
    b_dir = image._dir(image.resolve(b"b"))
    cases = [
        # (offset, struct format, values, what the error names)
        (SB_OFFSET, "<I", [0x12345678], "superblock"),
        (SB_OFFSET + 0x24, "<I", [999], "superblock"),  # block count
        (SB_OFFSET + 0x0E, "<H", [image.resolve(b"a")], "superblock"),  # root is not a directory
        (SB_OFFSET + 0x0E, "<H", [3], "inode nid 3"),  # inside the superblock
        (SB_OFFSET + 0x0E, "<H", [0xFFFF], "inode nid 65535"),  # past the end
        (c.data_offset, "<HHI", [0, 1, 10_000], "chunk index 0"),  # past the blob
        (c.data_offset, "<HHI", [0, 2, 10_000], "chunk index 0"),  # device 2 masks to 0: past the image
        (root.offset + 8, "<I", [5], f"inode nid {image.root_nid}"),  # directory too small for . and ..
        (b_dir.offsets[b_dir.by_name[b".."]], "<Q", [image.resolve(b"b")], "entry '..'"),
        (b_dir.offsets[b_dir.by_name[b"."]], "<Q", [image.root_nid], "entry '.'"),
        # a subdirectory entry pointing back at the root: a cycle
        (image._dir(image.root_nid).offsets[image._dir(image.root_nid).by_name[b"b"]], "<Q", [image.root_nid],
         "reached a second time"),
    ]
    with FileBlob(small.blob_path) as blob:
        for offset, fmt, values, names in cases:
            with pytest.raises(FormatError, match=names):
                read_all(patched(small.meta, offset, fmt, *values), blob)


def test_unsupported_features_are_unsupported_errors(small):
    image = ErofsImage(small.meta)
    a = image._node(image.resolve(b"a"))
    for offset, fmt, value in [
        (SB_OFFSET + 0x50, "<I", 0x1 | 0x4 | 0x8),  # LZ4_0PADDING: compression
        (a.offset, "<H", 1 << 4),  # an i_format bit we do not know
        (a.offset, "<H", (1 << 1) | image.inode(a.inode.nid).extended),  # COMPRESSED_FULL layout
        (a.offset + 16, "<I", 0x20 | 0x40),  # 48-bit chunk indexes
        (a.xattr_offset + 4, "<B", 1),  # a shared xattr
    ]:
        with FileBlob(small.blob_path) as blob, pytest.raises(UnsupportedError):
            read_all(patched(small.meta, offset, fmt, value), blob)


def test_directory_blocks_must_be_sorted_across_blocks(rich):
    """Swap the first names of two blocks of a multi-block directory: each block stays sorted inside."""
    image = ErofsImage(rich.meta)
    many = image._dir(image.resolve(b"many"))
    firsts = [i for i, off in enumerate(many.offsets) if off % BLOCK == 0]
    assert len(firsts) >= 3
    meta = bytearray(rich.meta)
    a, b = many.offsets[firsts[1]], many.offsets[firsts[2]]
    # Swap the whole blocks: each is still sorted inside, but block 2 now comes before block 1's names.
    meta[a:a + BLOCK], meta[b:b + BLOCK] = meta[b:b + BLOCK], meta[a:a + BLOCK]
    seal_block0(meta, BLOCK)
    with pytest.raises(FormatError, match="does not sort after the previous block"):
        ErofsImage(bytes(meta)).readdir(image.resolve(b"many"))
