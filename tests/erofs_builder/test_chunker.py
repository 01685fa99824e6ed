"""chunk_tree against a real directory store: holes, dedup in a tree and against the store, bounded memory."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import tracemalloc

import pytest

from dsec_fs.chunks import ChunkIndex, ChunkUploader, read_chunk
from dsec_fs.errors import InputError
from dsec_fs.store import FilesystemStore
from erofs_builder.chunker import chunk_tree
from erofs_builder.tree import Node, Tree
from erofs_builder.walk_dir import walk_directory

CHUNK = 4096


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def mem_file(data: bytes) -> Node:
    """A regular file whose content comes from memory, as a tar walker's would."""

    def reader(chunk_size: int):
        for offset in range(0, len(data), chunk_size):
            yield data[offset:offset + chunk_size]

    return Node(mode=stat.S_IFREG | 0o644, size=len(data), reader=reader, source="mem")


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def run(tree: Tree, store, chunk_size: int = CHUNK, **kw):
    index = ChunkIndex()
    index.load(store)
    with ChunkUploader(store, index) as uploader:
        blob_map, stats = chunk_tree(tree, uploader, index, chunk_size=chunk_size, **kw)
        uploader.flush()
    return blob_map, stats, index


def test_chunks_holes_and_content(tmp_path, store):
    src = tmp_path / "src"
    src.mkdir()
    a, b = os.urandom(CHUNK), os.urandom(CHUNK)
    (src / "zeros-inside").write_bytes(a + bytes(CHUNK) + b + b"tail")
    with open(src / "sparse", "wb") as f:
        f.seek(3 * CHUNK)
        f.write(a)
    (src / "empty").write_bytes(b"")
    (src / "all-zero").write_bytes(bytes(100))
    tree = walk_directory(src)

    blob_map, stats, index = run(tree, store)

    assert list(tree.lookup(b"zeros-inside").chunks) == [sha(a), None, sha(b), sha(b"tail")]
    assert list(tree.lookup(b"sparse").chunks) == [None, None, None, sha(a)]
    assert list(tree.lookup(b"empty").chunks) == []
    assert list(tree.lookup(b"all-zero").chunks) == [None]
    assert [(d, n) for _addr, d, n in blob_map.entries] == [(sha(a), CHUNK), (sha(b), CHUNK), (sha(b"tail"), 4)]
    assert stats.files == 4 and stats.bytes == 3 * CHUNK + 4 + 4 * CHUNK + 100
    assert (stats.chunks, stats.hole_chunks, stats.distinct_chunks, stats.new_chunks) == (9, 5, 3, 3)
    assert stats.new_bytes == 2 * CHUNK + 4 and stats.dedup_bytes == CHUNK
    for _addr, digest, _length in blob_map.entries:
        assert sha(read_chunk(store, digest, index.get(digest))) == digest


def test_dedup_within_a_tree_and_hard_links_once(store):
    a, b = os.urandom(CHUNK), os.urandom(CHUNK)
    tree = Tree()
    tree.add(b"one", mem_file(a + b + a))
    tree.add(b"copy", mem_file(a + b + a))
    linked = mem_file(b + b"x")
    tree.add(b"link1", linked)
    tree.add(b"dir/link2", linked)

    blob_map, stats, _index = run(tree, store)

    # Tree order (copy, dir/link2, link1, one) is build order: copy's chunks come first.
    assert [d for _addr, d, _n in blob_map.entries] == [sha(a), sha(b), sha(b"x")]
    assert list(tree.lookup(b"one").chunks) == list(tree.lookup(b"copy").chunks) == [sha(a), sha(b), sha(a)]
    assert stats.files == 3 and stats.chunks == 8
    assert stats.new_chunks == 3 and stats.new_bytes == 2 * CHUNK + 1
    assert stats.dedup_bytes == 5 * CHUNK
    assert 0 < stats.stored_bytes


def test_second_build_finds_everything_in_the_store(store):
    def tree_of(data: bytes) -> Tree:
        tree = Tree()
        tree.add(b"f", mem_file(data))
        return tree

    data = os.urandom(10 * CHUNK + 7)
    first, first_stats, _ = run(tree_of(data), store)
    packs = sorted(store.list("packs/"))
    again, stats, _ = run(tree_of(data), store)
    assert (stats.new_chunks, stats.new_bytes, stats.stored_bytes) == (0, 0, 0)
    assert stats.dedup_bytes == len(data) == first_stats.new_bytes
    assert again.encode() == first.encode()
    assert sorted(store.list("packs/")) == packs


def test_progress_reports_every_byte(store):
    tree = Tree()
    tree.add(b"a", mem_file(os.urandom(3 * CHUNK + 5)))
    tree.add(b"b", mem_file(bytes(2 * CHUNK)))
    calls = []
    run(tree, store, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (5 * CHUNK + 5, 5 * CHUNK + 5)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert len(calls) == 6


@pytest.mark.parametrize("chunk_size", [2048, 3 * 4096, 32 << 20])
def test_bad_chunk_size(store, chunk_size):
    with pytest.raises(InputError, match="chunk size"):
        run(Tree(), store, chunk_size=chunk_size)


@pytest.mark.parametrize("pieces", [[b"x" * CHUNK], [b"x" * CHUNK, b"x" * 5, b"x"], [b"x" * 100, b"y" * 5]])
def test_a_reader_that_disagrees_with_the_size(store, pieces):
    node = Node(mode=stat.S_IFREG | 0o644, size=CHUNK + 5, reader=lambda _size: iter(pieces), source="m/f")
    tree = Tree()
    tree.add(b"f", node)
    with pytest.raises(InputError) as info:
        run(tree, store)
    assert info.value.where == "m/f"


@pytest.mark.parametrize("pieces", [[], [b"x" * 99], [b"x" * 101], [b"x" * 100, b"y"], [b"x" * 100, None]])
def test_a_small_file_whose_reader_disagrees_with_the_size(store, pieces):
    # A file of one piece under INLINE_BYTES is named in the main thread, outside the batch loop.
    node = Node(mode=stat.S_IFREG | 0o644, size=100, reader=lambda _size: iter(pieces), source="m/small")
    tree = Tree()
    tree.add(b"f", node)
    with pytest.raises(InputError) as info:
        run(tree, store)
    assert info.value.where == "m/small"


def test_small_files_of_zeros_or_holes_are_holes_and_repeats_are_stored_once(store):
    tree = Tree()
    tree.add(b"zeros", mem_file(bytes(300)))
    tree.add(b"a", mem_file(b"same content"))
    tree.add(b"b", mem_file(b"same content"))
    tree.add(b"hole", Node(mode=stat.S_IFREG | 0o644, size=50, reader=lambda _size: iter([None]), source="m/h"))
    _blob_map, stats, _index = run(tree, store)
    nodes = dict(tree.walk())
    assert list(nodes[b"zeros"].chunks) == [None] and list(nodes[b"hole"].chunks) == [None]
    assert list(nodes[b"a"].chunks) == list(nodes[b"b"].chunks) == [sha(b"same content")]
    assert (stats.new_chunks, stats.hole_chunks, stats.dedup_bytes) == (1, 2, len(b"same content"))


def test_memory_stays_bounded_whatever_the_data_size(store):
    """512 MiB of distinct chunks pass through with a peak of a few pieces (2 workers: 4 in flight)."""
    piece_count, chunk_size = 512, 1 << 20
    filler = b"compressible " * (chunk_size // 13 + 1)

    def reader(size: int):
        for n in range(piece_count):  # distinct, so every piece is hashed, compressed and uploaded
            yield n.to_bytes(8, "little") + filler[: size - 8]

    tree = Tree()
    tree.add(b"big", Node(mode=stat.S_IFREG | 0o644, size=piece_count * chunk_size, reader=reader))
    tracemalloc.start()
    try:
        _blob_map, stats, _ = run(tree, store, chunk_size=chunk_size, workers=2)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.new_chunks == piece_count
    assert peak < 24 << 20, f"peak {peak >> 20} MiB"


def test_stats_are_plain_numbers(store):
    tree = Tree()
    tree.add(b"f", mem_file(b"hello"))
    _blob_map, stats, _ = run(tree, store)
    assert all(type(v) is int for v in dataclasses.asdict(stats).values())
