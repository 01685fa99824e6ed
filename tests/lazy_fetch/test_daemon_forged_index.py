"""A node daemon serving an intact layer of a shared store in which one writer lies (issue 14; the
forgery is tests/dsec_fs/forgery.py), on a local store and on S3.
"""

from __future__ import annotations

import pytest

from dsec_fs.store import open_store
from erofs_builder import build_layer
from tests.dsec_fs.forgery import CHUNK, chunks_of_layer, forge, random_files
from tests.lazy_fetch.daemon_support import mount_dirs
from treecmp import assert_same_tree, snapshot, write_files


@pytest.mark.root
@pytest.mark.fuse
def test_an_intact_layer_reads_right_on_a_node_that_mounted_the_forgers_layer_first(store_url, tmp_path, daemons):
    store = open_store(store_url)
    victim_files = random_files(1)
    victim_src = write_files(tmp_path / "victim", victim_files)
    victim = build_layer(victim_src, store, name="victim/app:1", chunk_size=CHUNK).digest
    forger = build_layer(write_files(tmp_path / "forger", random_files(2, 3)), store, name="forger/app:1",
                         chunk_size=CHUNK).digest
    forge(store, chunks_of_layer(store, victim), forger)

    node = daemons.start(store_url).node
    forger_mnt, victim_mnt = mount_dirs(tmp_path, "mnt-forger", "mnt-victim")
    node.mount("forger/app:1", forger_mnt)  # loads the forged index first: its locations come first
    node.mount("victim/app:1", victim_mnt)
    assert_same_tree(snapshot(victim_src), snapshot(victim_mnt))
    for info in node.mounts():
        node.umount(info.mountpoint)


