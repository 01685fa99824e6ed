"""The daemon's chunk cache directory, against the real daemon (``dsecfs daemon``, driven through
dsec_fs.client): a cache directory littered with strays of every kind does not stop the daemon from
starting, none is followed, and the layer still reads the right bytes; and another local user (uid 65534)
reads nothing under the cache directory, even one an older version left world-readable.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import tempfile

import pytest

from dsec_fs.digest import to_hex
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from tests.lazy_fetch.daemon_support import drop_caches, mount_dirs
from tests.other_user import all_paths, readable_by_nobody

pytestmark = [pytest.mark.fuse, pytest.mark.root]

CHUNK = 64 * 1024
rng = random.Random(6)
FILES = {"large.bin": rng.randbytes(20 * CHUNK + 7), "small.txt": b"small\n", "dir/other.bin": rng.randbytes(CHUNK)}


@pytest.fixture
def world_traversable_dir():
    """A directory other users may enter (pytest's own tmp directory is 0700, which would hide the cache
    from them whatever its modes)."""
    parent = tempfile.mkdtemp(prefix="dsecfs-cache-test-", dir="/tmp")
    os.chmod(parent, 0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent)


def build(tmp_path) -> str:
    source = tmp_path / "src"
    for name, data in FILES.items():
        os.makedirs(source / os.path.dirname(name), exist_ok=True)
        (source / name).write_bytes(data)
    store_dir = str(tmp_path / "store")
    build_layer(str(source), FilesystemStore(store_dir, fsync=False), name="test/cache:1", chunk_size=CHUNK)
    return store_dir


def read_all(node, mountpoint: str, mode: str) -> None:
    node.mount("test/cache:1", mountpoint, mode=mode)
    try:
        drop_caches()
        for name, data in FILES.items():
            with open(os.path.join(mountpoint, name), "rb") as f:
                assert f.read() == data
    finally:
        node.umount(mountpoint)


def litter(cache_dir: str, outside: str) -> None:
    """Strays of every kind: in place of segments, among them, where segments/, index/ hold theirs, and an
    older layout's chunks/ directory."""
    segments_dir = os.path.join(cache_dir, "segments")
    segments = sorted(os.path.join(segments_dir, name) for name in os.listdir(segments_dir))
    assert segments
    for path, kind in zip(segments, ["directory", "symlink", "fifo", "truncated", "empty"]):
        if kind == "truncated":
            with open(path, "r+b") as f:
                f.truncate(10)
            continue
        os.unlink(path)
        if kind == "directory":
            os.makedirs(os.path.join(path, "sub"))  # a directory where a segment belongs
        elif kind == "symlink":
            os.symlink(os.path.join(outside, "precious"), path)
        elif kind == "fifo":
            os.mkfifo(path)  # a read of it would block for ever
        else:
            open(path, "w").close()
    os.makedirs(os.path.join(segments_dir, "some-dir"))  # issue 12's own example
    os.symlink(outside, os.path.join(segments_dir, "f" * 16))  # a segment's name, a symlink out of the cache
    with open(os.path.join(segments_dir, "README"), "wb") as f:
        f.write(b"a file of a wrong name")
    os.mkfifo(os.path.join(segments_dir, "fifo"))
    short = tempfile.mkdtemp(prefix="dsd-", dir="/tmp")  # a socket path holds at most 107 bytes: bind, then move
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.join(short, "s"))
    os.rename(os.path.join(short, "s"), os.path.join(segments_dir, "e" * 16))
    os.rmdir(short)
    os.makedirs(os.path.join(segments_dir, "wrong name", "x"))
    os.chmod(os.path.join(segments_dir, "wrong name"), 0)
    old_chunks = os.path.join(cache_dir, "chunks")  # layout 1's, with a fan-out that is a symlink out
    os.makedirs(os.path.join(old_chunks, "ab", "some-dir"))
    os.symlink(outside, os.path.join(old_chunks, "cd"))
    os.makedirs(os.path.join(cache_dir, "index", "stray-dir"))


def test_the_daemon_starts_on_a_littered_cache_and_serves_right_bytes(daemons, tmp_path, world_traversable_dir):
    store_dir = build(tmp_path)
    cache_dir = os.path.join(world_traversable_dir, "cache")
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "precious"), "wb") as f:
        f.write(b"not the cache's")
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")

    daemon = daemons.start(store_dir, cache_dir=cache_dir)
    read_all(daemon.node, fuse, "fuse")
    assert daemon.stop() == 0
    litter(cache_dir, outside)
    for dirpath, dirnames, filenames in os.walk(cache_dir):  # as an older version left it
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path) and stat.S_ISDIR(os.lstat(path).st_mode):
                os.chmod(path, 0o755)
            elif not os.path.islink(path) and stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, 0o644)
    os.chmod(cache_dir, 0o755)

    node = daemons.start(store_dir, cache_dir=cache_dir).node
    for mountpoint, mode in ((kernel, "kernel"), (fuse, "fuse")):
        read_all(node, mountpoint, mode)
    node.cache_evict(0)
    read_all(node, fuse, "fuse")  # from the store again, into the cache's places
    assert node.ping()
    with open(os.path.join(outside, "precious"), "rb") as f:
        assert f.read() == b"not the cache's"
    assert os.listdir(outside) == ["precious"]

    # Nobody else reads a byte of it: not the directory, not a chunk, not the index.
    paths = all_paths(cache_dir)
    assert any("/segments/" in path for path in paths) and any(path.endswith("data.mdb") for path in paths)
    assert not os.path.lexists(os.path.join(cache_dir, "chunks"))
    assert readable_by_nobody([world_traversable_dir]) == [world_traversable_dir]  # the probe works
    assert readable_by_nobody(paths) == []
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
