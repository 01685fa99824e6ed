"""The node daemon on the real Debian minbase rootfs: built into an S3 store (moto over HTTP), mounted by a
``dsecfs daemon`` process in kernel and fuse mode, read through both, compared with the source, and the
store fetches checked through the daemon's /metrics.

Reading the whole tree cold, one small file after another, costs one store request per file (about 7,000
here), which moto answers slowly; so after the single-file checks the test fetches the rest of the layer
with a prefetch list of every chunk (large merged reads, as a learned list would be fetched), then compares
the trees.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from treecmp import assert_same_tree, snapshot

from dsec_fs.layer import open_layer
from dsec_fs.store import open_store
from dsec_fs.blobmap import EncodedBlobMap
from erofs_builder import build_layer
from lazy_fetch import prefetch_list
from lazy_fetch.prefetch_list import ChunkUse
from tests.lazy_fetch.daemon_support import drop_caches, file_chunks, layer_metric, mount_dirs

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.fuse, pytest.mark.s3]

# Read alone after drop_caches, one per mode; they share no chunk.
FIRST, SECOND = "usr/bin/bash", "usr/lib/x86_64-linux-gnu/libc.so.6"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_debian_from_s3_in_both_modes(debian_rootfs, s3_url, daemons, tmp_path):
    with open_store(s3_url) as store:
        layer = open_layer(store, build_layer(debian_rootfs, store, name="base/debian:12").digest)
    node = daemons.start(s3_url, fetch_timeout=120).node  # a loaded machine's disk may crawl
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    node.mount("base/debian:12", kernel, mode="kernel")
    node.mount("base/debian:12", fuse, mode="fuse")

    # With a fresh cache, reading one file fetches exactly that file's chunks from the store.
    assert layer_metric(node, "dsecfs_fetch_chunks_total", layer.digest) == 0
    first, second = file_chunks(layer, FIRST), file_chunks(layer, SECOND)
    assert len(first) > 1 and len(second) > 1 and not first & second
    for mountpoint, path, chunks, before in ((kernel, FIRST, first, 0), (fuse, SECOND, second, len(first))):
        drop_caches()
        assert _sha256(os.path.join(mountpoint, path)) == _sha256(os.path.join(debian_rootfs, path))
        assert layer_metric(node, "dsecfs_fetch_chunks_total", layer.digest) == before + len(chunks)

    blob_map = EncodedBlobMap(layer.blobmap, source="blobmap")
    everything = prefetch_list.learn([ChunkUse(first_read={entry: entry for entry in range(len(blob_map))})],
                                     blob_map, layer=layer.digest)
    prefetch_list.save(everything, tmp_path / "everything.json")
    node.prefetch(kernel, str(tmp_path / "everything.json"))
    deadline = time.monotonic() + 300
    while (job := node.prefetches()[-1]).state == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert (job.state, job.done_chunks) == ("done", len(blob_map))
    # Each chunk came from the store exactly once: the prefetch found the two files' chunks cached.
    assert layer_metric(node, "dsecfs_fetch_chunks_total", layer.digest) == len(blob_map) \
        == layer.manifest.stats["distinct_chunks"]

    drop_caches()
    expected = snapshot(debian_rootfs)
    assert_same_tree(expected, snapshot(kernel))
    assert_same_tree(expected, snapshot(fuse))
    status, = node.status().layers
    assert status.fetched_ratio == 1.0 and status.read_errors == 0 and status.fetch_errors == 0
    assert status.chunks_fetched == len(blob_map)
