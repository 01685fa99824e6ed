"""The builder's fast paths keep the slow paths' answers: a small file read with one pread is still checked
against the walk, only a file with holes is searched for them, files named in the main thread and in
workers get the same chunks, a build's packed blob layout is BlobMap's, and a build leaves Python's cycle
collector as it found it."""

from __future__ import annotations

import gc
import os

import pytest

from dsec_fs.blobmap import BlobMap, EncodedBlobMap
from dsec_fs.chunks import ChunkIndex, ChunkUploader
from dsec_fs.digest import sha256
from dsec_fs.errors import InputError
from dsec_fs.store import FilesystemStore
from erofs_builder.blob_layout import lay_out_blob
from erofs_builder.build import build_layer
from erofs_builder.chunker import INLINE_BYTES, chunk_tree, regular_files
from erofs_builder.walk_dir import walk_directory

CHUNK = 4096


@pytest.mark.timeout(20)
@pytest.mark.parametrize("replacement", ["fifo", "directory"])
def test_a_small_file_replaced_after_the_walk_is_reported_not_waited_for(tmp_path, replacement):
    (tmp_path / "f").write_bytes(b"small")
    node = walk_directory(tmp_path).lookup(b"f")
    (tmp_path / "f").unlink()
    if replacement == "fifo":
        os.mkfifo(tmp_path / "f")  # opened for reading without a writer, it would block
    else:
        (tmp_path / "f").mkdir()
    with pytest.raises(InputError, match="changed since the directory was scanned") as info:
        list(node.reader(CHUNK))
    assert info.value.where == str(tmp_path / "f")


def test_a_file_with_holes_is_skipped_where_they_are_and_one_without_is_read(tmp_path):
    dense = os.urandom(CHUNK) + bytes(2 * CHUNK) + b"end"
    (tmp_path / "dense").write_bytes(dense)  # zeros written out: read (or skipped, if the filesystem made holes)
    with open(tmp_path / "sparse", "wb") as f:
        f.seek(3 * CHUNK)
        f.write(b"end")
    tree = walk_directory(tmp_path)
    pieces = list(tree.lookup(b"dense").reader(CHUNK))
    assert b"".join(bytes(CHUNK) if piece is None else piece for piece in pieces) == dense
    assert list(tree.lookup(b"sparse").reader(CHUNK)) == [None, None, None, b"end"]


def test_files_named_in_the_main_thread_and_in_workers_get_the_same_chunks(tmp_path):
    head = os.urandom(2 * CHUNK) + bytes(CHUNK)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "small").write_bytes(head + b"tail")  # below INLINE_BYTES: the main thread
    (tmp_path / "src" / "large").write_bytes(head + os.urandom(INLINE_BYTES))  # batches for the workers
    tree = walk_directory(tmp_path / "src")
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    index = ChunkIndex()
    with ChunkUploader(store, index) as uploader:
        _blob_map, stats = chunk_tree(tree, uploader, index, chunk_size=CHUNK, workers=2)
        uploader.flush()
    expected = [sha256(head[:CHUNK]), sha256(head[CHUNK:2 * CHUNK]), None]
    assert list(tree.lookup(b"small").chunks[:3]) == list(tree.lookup(b"large").chunks[:3]) == expected
    assert stats.new_chunks == 2 + 1 + INLINE_BYTES // CHUNK  # the shared two, b"tail", the large tail
    assert stats.dedup_bytes == 2 * CHUNK


@pytest.mark.parametrize("enabled", [True, False])
def test_a_build_leaves_the_cycle_collector_as_it_found_it(tmp_path, enabled):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        build_layer(tmp_path / "src", store)
        assert gc.isenabled() is enabled
        with pytest.raises(InputError):
            build_layer(tmp_path / "missing", store)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_the_packed_blob_layout_is_the_blob_map_of_the_files(tmp_path):
    """blob_layout.lay_out_blob (what a build publishes and writes meta.erofs against) gives BlobMap's
    encoding for the same files, each file's blocks as BlobMap places its chunks, and as shared the entries
    more than one chunk index names: a chunk two files share, a chunk one file has twice, holes, a file
    of several chunks, hard links (one file), an empty file."""
    a, b = os.urandom(CHUNK), os.urandom(CHUNK)
    src = tmp_path / "src"
    src.mkdir()
    (src / "one").write_bytes(a + b + a)  # a twice in one file
    (src / "two").write_bytes(b)  # b again, in another file
    (src / "holes").write_bytes(bytes(CHUNK) + a[:100])
    (src / "small").write_bytes(b"small")
    (src / "empty").write_bytes(b"")
    os.link(src / "small", src / "link")
    tree = walk_directory(src)
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    index = ChunkIndex()
    with ChunkUploader(store, index) as uploader:
        blob_map, _stats = chunk_tree(tree, uploader, index, chunk_size=CHUNK)
        uploader.flush()
    files = regular_files(tree)
    expected = {id(node): blob_map.blkaddrs(node.chunks) for node in files}

    blob = lay_out_blob(files, CHUNK)

    assert bytes(blob.encoded) == blob_map.encode() and len(blob) == len(blob_map) == 4
    assert blob.blocks == blob_map.blocks
    assert all(list(blob.blkaddrs(node.chunks)) == expected[id(node)] for node in files)
    entry_of = {digest: k for k, (_blkaddr, digest, _length) in enumerate(blob_map.entries)}
    assert blob.shared == sorted([entry_of[sha256(a)], entry_of[sha256(b)]])
    assert EncodedBlobMap(blob.encoded, source="test").entries == blob_map.entries
