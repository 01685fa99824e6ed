"""A start on a node that already holds a layer's chunks (issue 13, "warm"): the mount does none of the
work only misses need. The miss readahead's file map (a walk of the whole image) is built at the layer's
first read that waits for the store, not at its mount; on a node that holds none of the layer it is
built at the mount, as the first reads will miss, unless a prefetch (another node's profile) brings
what they read: then at the first read that waits for the store for a chunk the prefetch does not bring."""

from __future__ import annotations

import os
import random

import pytest

from dsec_fs.store import FilesystemStore, keys
from tests.lazy_fetch.daemon_support import Daemons, layer_metric, layer_store, mount_dirs, wait_for

CHUNK = 64 * 1024
rng = random.Random(13)
FILES = {"pkg/a.py": rng.randbytes(CHUNK // 2), "pkg/b.py": rng.randbytes(3 * CHUNK), "pkg/c.py": rng.randbytes(CHUNK)}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_a_node_holding_some_chunks_maps_the_files_at_the_first_miss(tmp_path, mode, mounts_below):
    store_dir = layer_store(tmp_path, FILES, "t/warm:1", CHUNK)
    daemons = Daemons(tmp_path)
    args = ["--fill", "none"]
    try:
        first = daemons.start(store_dir, extra_args=args)
        mnt, = mount_dirs(tmp_path, "mnt")
        first.node.mount("t/warm:1", mnt, mode=mode)
        assert first.node.status().layers[0].miss_readahead in ("pending", "ready")  # nothing on the node
        assert _read(os.path.join(mnt, "pkg/a.py")) == FILES["pkg/a.py"]  # into the disk cache
        first.node.umount(mnt)
        assert first.stop() == 0

        node = daemons.start(store_dir, extra_args=args).node  # the same cache, nothing mounted
        info = node.mount("t/warm:1", mnt, mode=mode)
        assert node.status().layers[0].miss_readahead == "deferred"
        assert _read(os.path.join(mnt, "pkg/a.py")) == FILES["pkg/a.py"]  # from the disk cache
        assert layer_metric(node, "dsecfs_fetch_chunks_total", info.layer) == 0
        assert node.status().layers[0].miss_readahead == "deferred"
        assert _read(os.path.join(mnt, "pkg/b.py")) == FILES["pkg/b.py"]  # waits for the store
        assert layer_metric(node, "dsecfs_fetch_chunks_total", info.layer) > 0
        wait_for(lambda: node.status().layers[0].miss_readahead == "ready", "the file map after the first miss")
        assert _read(os.path.join(mnt, "pkg/c.py")) == FILES["pkg/c.py"]
        node.umount(mnt)
    finally:
        daemons.stop_all()
    assert mounts_below(tmp_path) == []


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_a_new_node_with_a_profile_maps_the_files_at_the_first_miss_outside_it(tmp_path, mode, mounts_below):
    store_dir = layer_store(tmp_path, FILES, "t/warm:1", CHUNK)
    learner, other = Daemons(tmp_path / "a"), Daemons(tmp_path / "b")  # their own state and cache each
    args = ["--fill", "profile"]
    try:
        node = learner.start(store_dir, profiles=True, extra_args=args).node
        mnt, = mount_dirs(tmp_path, "mnt")
        info = node.mount("t/warm:1", mnt, mode=mode)
        for name in ("pkg/a.py", "pkg/b.py"):
            assert _read(os.path.join(mnt, name)) == FILES[name]
        node.umount(mnt)
        wait_for(lambda: list(FilesystemStore(store_dir).list(keys.layer_profiles(info.layer))), "the profile")
        learner.stop_all()

        node = other.start(store_dir, profiles=True, extra_args=args).node  # nothing of the layer cached
        info = node.mount("t/warm:1", mnt, mode=mode)
        assert info.prefetch.startswith("profile:") and info.prefetch_chunks > 0
        assert node.status().layers[0].miss_readahead == "deferred"
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the prefetch")
        for name in ("pkg/a.py", "pkg/b.py"):  # what the profile brought
            assert _read(os.path.join(mnt, name)) == FILES[name]
        assert node.status().layers[0].miss_readahead == "deferred"
        assert _read(os.path.join(mnt, "pkg/c.py")) == FILES["pkg/c.py"]  # outside the profile: waits for the store
        wait_for(lambda: node.status().layers[0].miss_readahead == "ready", "the file map after the miss")
        node.umount(mnt)
    finally:
        learner.stop_all()
        other.stop_all()
    assert mounts_below(tmp_path) == []
