"""The filesystem core without FUSE: LayerTree against the source tree, the read path (chunk boundaries,
holes, one blob read per contiguous run, store errors), directory offsets, BlobDirectory and SessionTree.

Blobs are the real LayerBlob over a chunk fetcher and cache, in a trio loop of the test's own.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pytest
import trio

from dsec_fs.errors import ConflictError, NotFoundError
from dsec_fs.store import keys
from dsec_fs.store.wrappers import FaultStore
from erofs_builder.reader import ErofsImage
from lazy_fetch.blob_reader import open_layer_blob
from lazy_fetch.cache import ChunkCache
from lazy_fetch.fetcher import open_fetcher
from lazy_fetch.fs_core import (
    ROOT_INO,
    SLOT_SHIFT,
    BlobDirectory,
    FsError,
    LayerTree,
    SessionTree,
    errno_for,
)

BLOCK = 4096


def with_tree(built_layer, tmp_path, test, *, store=None):
    """Run ``await test(tree)`` with a LayerTree of the built layer whose blob fetches from ``store``."""

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 1 << 30) as cache:
            async with open_fetcher(store or built_layer.store, cache, timeout=10) as fetcher:
                blob = await open_layer_blob(built_layer.layer, fetcher)
                await test(LayerTree(ErofsImage(built_layer.layer.meta), blob))

    trio.run(main)


def resolve(fs, path: str) -> int:
    ino = ROOT_INO
    for name in os.fsencode(path).split(b"/"):
        ino = fs.lookup(ino, name).ino
    return ino


def test_layer_tree_shows_the_source(built_layer, tmp_path):
    async def check(tree: LayerTree):
        root = tree.getattr(ROOT_INO)
        assert root.ino == ROOT_INO and stat.S_ISDIR(root.mode)
        for dirpath, dirnames, filenames in os.walk(built_layer.source):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, built_layer.source)
                st = os.lstat(path)
                attrs = tree.getattr(resolve(tree, rel))
                assert (attrs.mode, attrs.uid, attrs.gid, attrs.mtime_ns, attrs.nlink) == \
                    (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_nlink), rel
                assert attrs.ino >= 36 and attrs.immutable
                xattrs = {os.fsencode(n): os.getxattr(path, n, follow_symlinks=False)
                          for n in os.listxattr(path, follow_symlinks=False)}
                assert {n: tree.getxattr(attrs.ino, n) for n in tree.listxattr(attrs.ino)} == xattrs, rel
                if stat.S_ISLNK(st.st_mode):
                    assert tree.readlink(attrs.ino) == os.fsencode(os.readlink(path))
                elif stat.S_ISREG(st.st_mode):
                    assert attrs.size == st.st_size
                    assert await tree.read(attrs.ino, 0, st.st_size + 10) == built_layer.files[rel], rel
                elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                    assert attrs.rdev == st.st_rdev
        # Hard links are one inode.
        assert resolve(tree, "big.bin") == resolve(tree, "dir/hard-link")

    with_tree(built_layer, tmp_path, check)


def test_errors_are_errnos(built_layer, tmp_path):
    async def check(tree: LayerTree):
        small = resolve(tree, "small.txt")
        cases = [
            (lambda: tree.lookup(ROOT_INO, b"missing"), errno.ENOENT),
            (lambda: tree.lookup(small, b"x"), errno.ENOTDIR),
            (lambda: list(tree.readdir(small, 0)), errno.ENOTDIR),
            (lambda: tree.readlink(small), errno.EINVAL),
            (lambda: tree.getxattr(small, b"user.missing"), errno.ENODATA),
        ]
        for call, expected in cases:
            with pytest.raises(FsError) as info:
                call()
            assert info.value.errno == expected
        with pytest.raises(FsError) as info:
            await tree.read(ROOT_INO, 0, 10)
        assert info.value.errno == errno.EISDIR

    with_tree(built_layer, tmp_path, check)


@pytest.mark.parametrize("name", ["big.bin", "dup.bin", "holes.bin", "zeros.bin", "small.txt", "empty"])
def test_reads_at_odd_offsets(built_layer, tmp_path, name):
    data = built_layer.files[name]

    async def check(tree: LayerTree):
        ino = resolve(tree, name)
        for offset, length in built_layer.odd_ranges(name):
            assert await tree.read(ino, offset, length) == data[offset:offset + length], (offset, length)

    with_tree(built_layer, tmp_path, check)


class CountingBlob:
    """Records the ranges asked of the real blob it wraps (observation only)."""

    def __init__(self, blob):
        self.blob, self.size, self.calls = blob, blob.size, []

    async def read(self, offset, length):
        self.calls.append((offset, length))
        return await self.blob.read(offset, length)


@pytest.mark.parametrize("name, blob_reads", [
    ("big.bin", 1),  # six chunks back to back in the blob
    ("dup.bin", 3),  # [p q] then p again (back at its first place), then the partial last chunk
    ("holes.bin", 2),  # two data chunks apart; the holes cost no read
    ("zeros.bin", 0),
])
def test_one_blob_read_per_contiguous_run(built_layer, tmp_path, name, blob_reads):
    async def check(tree: LayerTree):
        tree.blob = counting = CountingBlob(tree.blob)
        assert await tree.read(resolve(tree, name), 0, 1 << 20) == built_layer.files[name]
        assert len(counting.calls) == blob_reads
        assert all(offset % BLOCK == 0 for offset, _length in counting.calls)

    with_tree(built_layer, tmp_path, check)


@pytest.mark.parametrize("fault", ["permanent", "corrupt"])
def test_a_store_error_fails_only_reads_of_that_file(built_layer, tmp_path, caplog, fault):
    store = FaultStore(built_layer.store, f"get:{keys.pack(built_layer.victim_pack)}:{fault}")

    async def check(tree: LayerTree):
        victim, healthy = resolve(tree, "victim.bin"), resolve(tree, "healthy.bin")
        for _attempt in range(2):  # a failure is not remembered: the second read tries again, and fails again
            with caplog.at_level(logging.ERROR, logger="lazy_fetch.fs_core"), pytest.raises(FsError) as info:
                await tree.read(victim, 100, 10)
            assert info.value.errno == errno.EIO
            assert await tree.read(healthy, 0, 1 << 20) == built_layer.files["healthy.bin"]
        assert f"inode nid {victim}" in caplog.text
        assert list(tree.readdir(ROOT_INO, 0))

    with_tree(built_layer, tmp_path, check, store=store)


def test_readdir_resumes_at_every_offset(built_layer, tmp_path):
    async def check(tree: LayerTree):
        directory = resolve(tree, "dir")
        full = list(tree.readdir(directory, 0))
        assert {e.name for e in full} == {b".", b"..", b"sub", b"hard-link", b"dangling", b"!first", b"-dash"}
        for i, entry in enumerate(full):
            assert list(tree.readdir(directory, entry.next)) == full[i + 1:]
        dot, dotdot = (next(e for e in full if e.name == n) for n in (b".", b".."))
        assert dot.ino == directory and dotdot.ino == ROOT_INO

    with_tree(built_layer, tmp_path, check)


def test_errno_for_logs_what_is_not_an_fs_error(caplog):
    assert errno_for(FsError(errno.ENOENT, "gone", where="x"), "lookup") == errno.ENOENT
    assert not caplog.records
    assert errno_for(NotFoundError("no such chunk", where="chunk ab12"), "read") == errno.EIO
    assert errno_for(KeyError("bug"), "getattr") == errno.EIO
    assert "chunk ab12" in caplog.text and "KeyError" in caplog.text


class BytesBlob:
    def __init__(self, data: bytes):
        self.data, self.size = data, len(data)

    async def read(self, offset, length):
        return self.data[offset:offset + length]


def test_blob_directory_serves_blobs_by_name():
    blobs = BlobDirectory({"b" * 64: BytesBlob(b"B" * 8192)})
    blobs.add("a" * 64, BytesBlob(bytes(range(256)) * 16))
    a = blobs.lookup(ROOT_INO, b"a" * 64)
    assert a.size == 4096 and stat.S_IFMT(a.mode) == stat.S_IFREG and a.mode & 0o777 == 0o400
    assert trio.run(blobs.read, a.ino, 4000, 500) == (bytes(range(256)) * 16)[4000:]
    assert not blobs.names_immutable(ROOT_INO) and not blobs.getattr(ROOT_INO).immutable
    with pytest.raises(ConflictError):
        blobs.add("a" * 64, BytesBlob(b""))

    first = list(blobs.readdir(ROOT_INO, 0))
    assert [e.name for e in first] == [b"b" * 64, b"a" * 64]
    # Entries added or removed while a listing is under way neither repeat nor hide the others.
    blobs.add("c" * 64, BytesBlob(b"c"))
    blobs.remove("b" * 64)
    assert [e.name for e in blobs.readdir(ROOT_INO, first[0].next)] == [b"a" * 64, b"c" * 64]
    with pytest.raises(FsError) as info:
        blobs.getattr(first[0].ino)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(NotFoundError):
        blobs.remove("b" * 64)
    # A name that comes back is the same content: it gets its inode number back.
    blobs.add("b" * 64, BytesBlob(b"B" * 8192))
    assert blobs.lookup(ROOT_INO, b"b" * 64).ino == first[0].ino


def test_session_tree_routes_blobs_and_layers(built_layer):
    session = SessionTree()
    image = ErofsImage(built_layer.layer.meta)
    session.blobs.add("f" * 64, BytesBlob(b"x" * 4096))
    session.add_layer("1" * 64, LayerTree(image, None))
    session.add_layer("2" * 64, LayerTree(image, None))

    assert [e.name for e in session.readdir(ROOT_INO, 0)] == [b"blobs", b"layers", b"flush-probe"]
    probe = session.lookup(ROOT_INO, b"flush-probe")
    assert stat.S_ISREG(probe.mode) and probe.size == 0 and trio.run(session.read, probe.ino, 0, 4096) == b""
    layers = session.lookup(ROOT_INO, b"layers").ino
    assert [e.name for e in session.readdir(layers, 0)] == [b"1" * 64, b"2" * 64]
    first, second = (session.lookup(layers, d * 64) for d in (b"1", b"2"))
    assert first.ino >> SLOT_SHIFT != second.ino >> SLOT_SHIFT
    small = session.lookup(first.ino, b"small.txt")
    assert small.ino & ((1 << SLOT_SHIFT) - 1) == image.lookup(image.root_nid, b"small.txt")
    assert session.getxattr(small.ino, b"user.comment") == b"a note"
    assert session.names_immutable(first.ino) and not session.names_immutable(layers)
    entries = {e.name: e.ino for e in session.readdir(first.ino, 0)}
    assert entries[b"small.txt"] == small.ino

    blob_dir = session.lookup(ROOT_INO, b"blobs").ino
    blob = session.lookup(blob_dir, b"f" * 64)
    assert trio.run(session.read, blob.ino, 4090, 100) == b"x" * 6

    session.remove_layer("1" * 64)
    with pytest.raises(FsError) as info:
        session.getattr(small.ino)
    assert info.value.errno == errno.ENOENT
    assert [e.name for e in session.readdir(layers, 0)] == [b"2" * 64]
    session.add_layer("1" * 64, LayerTree(image, None))
    assert session.lookup(first.ino, b"small.txt").ino == small.ino  # same digest, same numbers
    with pytest.raises(ConflictError):
        session.add_layer("2" * 64, LayerTree(image, None))
