"""fsck_layer and fsck_image: a clean layer passes; every kind of damage (store objects rotted or missing,
an image that disagrees with its blob map, a corrupt image) is reported with where it is, and fsck never
raises for corrupt input."""

from __future__ import annotations

import dataclasses
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec_fs.chunks import ChunkIndex
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import NotFoundError
from dsec_fs.layer import open_layer, publish_layer
from dsec_fs.store import FilesystemStore, keys
from erofs_builder.blob import FileBlob
from dsec_fs.blobmap import EncodedBlobMap
from erofs_builder.fsck import fsck_image, fsck_layer
from erofs_builder.ondisk.superblock import SB_OFFSET, seal_block0
from erofs_builder.reader import ErofsImage
from tests.dsec_fs.oversized import republish_blob_map
from tests.erofs_builder.reader_support import (
    BLOCK, CHUNK, assert_reports_format_error, build, make_source, mkfs, needs_mkfs, write,
)


@pytest.fixture
def layer(tmp_path):
    """A small layer with 16 KiB chunks (so a chunk spans blocks), hard links and a hole."""
    src = tmp_path / "src"
    for name, data in {"a": os.urandom(3 * 4 * CHUNK + 100), "b/c": b"tiny", "b/d": os.urandom(5000),
                       "sparse": bytes(8 * CHUNK) + b"end"}.items():
        write(os.path.join(src, name), data)
    os.link(src / "a", src / "b" / "a2")
    os.symlink("a", src / "link")
    return build(tmp_path, str(src), chunk_size=4 * CHUNK)


def store_path(store: FilesystemStore, key: str) -> str:
    return os.path.join(store.root, *key.split("/"))


def republish(layer, meta: bytes) -> str:
    """Publish ``meta`` as a layer with the same blob map: a consistent manifest around a bad image."""
    files = open_layer(layer.store, layer.digest)
    manifest = dataclasses.replace(files.manifest, layer=to_hex(sha256(meta)), meta_size=len(meta))
    return publish_layer(layer.store, meta, files.blobmap, manifest)


def patched(meta: bytes, offset: int, fmt: str, *values: int) -> bytes:
    out = bytearray(meta)
    struct.pack_into(fmt, out, offset, *values)
    seal_block0(out, BLOCK)
    return bytes(out)


def test_a_clean_layer_passes(layer):
    report = fsck_layer(layer.store, layer.digest)
    assert report.ok, report.problems
    assert not report.warnings
    assert report.layer == layer.digest
    assert report.entries == 8 and report.inodes == 7  # root, a, b, b/c, b/d, b/a2 (= a), link, sparse
    assert report.chunks == report.chunks_verified == 7  # a: 4, b/c: 1, b/d: 1, sparse: 1 (and 2 holes)
    fast = fsck_layer(layer.store, layer.digest, check_chunks=False)
    assert fast.ok and fast.chunks_verified == 0


def test_a_rotted_chunk_is_named(layer):
    files = open_layer(layer.store, layer.digest)
    blobmap = EncodedBlobMap(files.blobmap, source="blobmap")
    index = ChunkIndex()
    index.load_packs(layer.store, files.manifest.packs)
    blkaddr, digest, _length = blobmap.entries[2]
    location = index.get(digest)
    with open(store_path(layer.store, keys.pack(location.pack_id)), "r+b") as f:
        f.seek(location.offset + location.clen // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    report = fsck_layer(layer.store, layer.digest)
    assert [p.where for p in report.problems] == [f"chunk {to_hex(digest)} (blob block {blkaddr})"]
    assert report.problems[0].kind == "corrupt"
    assert report.chunks_verified == report.chunks - 1
    assert fsck_layer(layer.store, layer.digest, check_chunks=False).ok


def test_a_missing_pack_or_index_is_named(layer):
    files = open_layer(layer.store, layer.digest)
    (pack_id,) = files.manifest.packs
    os.unlink(store_path(layer.store, keys.pack(pack_id)))
    report = fsck_layer(layer.store, layer.digest)
    assert len(report.problems) == report.chunks and report.chunks_verified == 0
    assert all(p.kind == "not-found" and p.where.startswith("chunk ") for p in report.problems)
    os.unlink(store_path(layer.store, keys.index(pack_id)))
    report = fsck_layer(layer.store, layer.digest)
    assert report.problems[0].where == keys.index(pack_id)
    assert sum("in no pack the manifest lists" in p.message for p in report.problems) == report.chunks


def test_a_tampered_object_fails_its_digest(layer):
    with open(store_path(layer.store, keys.layer_meta(layer.digest)), "r+b") as f:  # a zstd frame
        middle = os.fstat(f.fileno()).st_size // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0x40]))
    report = fsck_layer(layer.store, layer.digest)
    assert len(report.problems) == 1 and "sha256 mismatch" in report.problems[0].message
    with pytest.raises(NotFoundError):
        fsck_layer(layer.store, "0" * 64)
    with pytest.raises(NotFoundError):
        fsck_layer(layer.store, "no/such:ref")


def test_an_image_that_disagrees_with_its_blob_map(layer):
    image = ErofsImage(layer.meta)
    a = image._node(image.resolve(b"a"))
    a_chunks = image.chunk_map(image.resolve(b"a"))  # 3 chunks of 16 KiB, then 100 bytes
    d_chunk = image.chunk_map(image.resolve(b"b/d"))[0]  # 5000 bytes
    slot = image._devt_range[0]
    nlink = (a.offset + 44, "<I") if a.inode.extended else (a.offset + 6, "<H")
    cases = [
        # (offset, format, values, where the problem is, what it says)
        (a.data_offset, "<HHI", [0, 1, a_chunks[0][1] + 1], "(/a) chunk 0", "inside chunk"),
        (a.data_offset + 3 * 8, "<HHI", [0, 1, d_chunk[1]], "(/a) chunk 3",
         "is 5000 bytes, this chunk of the file is 100"),
        (a.data_offset + 3 * 8, "<HHI", [0, 0, 0], "(/a) chunk 3", "on device 0, not the blob"),
        (slot, "<4s", [b"beef"], "device slot 1", "is not the blob id"),
        (slot + 64, "<I", [99], "device slot 1", "99 blocks, the blob map has"),
        (*nlink, [5], "(/a)", "nlink is 5, the tree has 2"),
    ]
    for offset, fmt, values, where, message in cases:
        digest = republish(layer, patched(layer.meta, offset, fmt, *values))
        report = fsck_layer(layer.store, digest, check_chunks=False)
        assert [(where in p.where, message in p.message) for p in report.problems] == [(True, True)], \
            (message, report.problems)


def test_a_blob_map_naming_a_chunk_twice_is_reported(layer):
    """A mount reads such a map (dsec_fs/blobmap.py); fsck names the entry and the one before it."""
    files = open_layer(layer.store, layer.digest)
    entries = list(EncodedBlobMap(files.blobmap, source="blobmap").entries)
    assert len(entries) > 2
    twice = files.blobmap.replace(entries[2][1], entries[1][1])
    republish_blob_map(layer.store, layer.digest, twice)
    report = fsck_layer(layer.store, layer.digest, check_chunks=False)
    assert any(p.where == f"{keys.layer_blobmap(layer.digest)} entry 2"
               and f"chunk {to_hex(entries[1][1])} is already at entry 1" in p.message for p in report.problems), \
        report.problems


def test_an_unused_chunk_is_a_warning(layer):
    image = ErofsImage(layer.meta)
    d = image.resolve(b"b/d")
    digest = republish(layer, patched(layer.meta, image._node(d).data_offset, "<HHI", 0, 0, 0xFFFFFFFF))
    report = fsck_layer(layer.store, digest)
    assert report.ok and len(report.warnings) == 1 and "used by no file" in report.warnings[0].message


def test_fsck_image_with_an_exported_blob(layer, tmp_path):
    blobmap = EncodedBlobMap(open_layer(layer.store, layer.digest).blobmap, source="blobmap")
    with FileBlob(layer.blob_path) as blob:
        report = fsck_image(layer.meta, blob, blobmap=blobmap)
        assert report.ok and report.chunks_verified == report.chunks
    blkaddr, digest, length = blobmap.entries[-1]
    with open(layer.blob_path, "r+b") as f:
        f.seek(blkaddr * BLOCK + length)  # the padding after the last chunk
        f.write(b"\1")
    with FileBlob(layer.blob_path) as blob:
        report = fsck_image(layer.meta, blob, blobmap=blobmap)
    assert [p.where for p in report.problems] == [f"chunk {to_hex(digest)} (blob block {blkaddr})"]
    assert "padding" in report.problems[0].message


@needs_mkfs
def test_fsck_image_of_mkfs_images(tmp_path):
    src = make_source(tmp_path / "src", special=False)
    blob_path = tmp_path / "blob"
    _path, data = mkfs(tmp_path, src, f"--chunksize={CHUNK}", f"--blobdev={blob_path}")
    with FileBlob(blob_path) as blob:
        report = fsck_image(data, blob)
    assert report.ok, report.problems
    inodes = {os.lstat(os.path.join(d, n)).st_ino for d, dirs, files in os.walk(src) for n in dirs + files}
    assert report.inodes == len(inodes) + 1  # and the root


def test_fsck_image_of_garbage_reports_and_does_not_raise():
    for data in [b"", b"\0" * 4096, os.urandom(8192)]:
        report = fsck_image(data)
        assert not report.ok and report.problems[0].where == "meta.erofs"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsck-small")
    src = tmp / "src"
    write(os.path.join(src, "a"), os.urandom(2 * CHUNK + 1))
    write(os.path.join(src, "d", "b"), b"bee")
    os.link(src / "a", src / "d" / "a2")
    os.symlink("a", src / "link")
    return build(tmp, str(src))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fsck_never_raises_and_agrees_with_the_reader(small, data):
    meta = bytearray(small.meta)
    offset = data.draw(st.integers(SB_OFFSET, len(meta.rstrip(b"\0")) - 1), label="offset")
    meta[offset] ^= data.draw(st.integers(1, 255), label="xor")
    seal_block0(meta, BLOCK)
    blobmap = EncodedBlobMap(open_layer(small.store, small.digest).blobmap, source="blobmap")
    with FileBlob(small.blob_path) as blob:
        report = fsck_image(bytes(meta), blob, blobmap=blobmap)
        if assert_reports_format_error(bytes(meta), blob) is None:
            assert not report.ok  # what the reader refuses, fsck reports
