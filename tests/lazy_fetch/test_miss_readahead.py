"""Miss readahead (lazy_fetch/miss_readahead.py): the rest of a file on its first read, and a growing
window while a reader walks files in blob order; a reader of one file fetches that file's chunks only."""

from __future__ import annotations

import os
import random
from array import array

import pytest

from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from lazy_fetch.blob_reader import BlobChunk
from lazy_fetch.miss_readahead import WINDOW_START, FileChunks, MissReadahead
from lazy_fetch.trace import FLAG_MISS, read_trace
from tests.lazy_fetch.daemon_support import Daemons, file_chunks, layer_metric, layer_store, mount_dirs, wait_for

CHUNK = 64 * 1024
rng = random.Random(21)
FILES = {f"pkg/mod{i}.py": rng.randbytes(2 * CHUNK + 100 * i) for i in range(10)}


class _Blob:
    """What MissReadahead uses of a LayerBlob: the blob map's entries and chunk locations."""

    def __init__(self, lengths):
        self.blob_map = type("Map", (), {"entries": [(i, bytes([i]) * 32, n) for i, n in enumerate(lengths)]})()

    def location(self, entry, digest):
        return entry


def _chunks(*entries):
    return [BlobChunk(e, bytes([e]) * 32, e * CHUNK, CHUNK) for e in entries]


def _planner(files, lengths, max_window=4 * CHUNK, directories=None):
    """A planner over ``files`` (their blob entries); ``directories``: each file's directory number
    (default: each file a directory of its own)."""
    planner = MissReadahead(_Blob(lengths), max_window)
    owner = array("i", [-1]) * len(lengths)
    for number, entries in enumerate(files):
        for entry in entries:
            owner[entry] = number
    directories = directories or list(range(len(files)))
    small = [[] for _ in range(max(directories) + 1)]
    for number, parent in enumerate(directories):
        small[parent].append(number)
    planner.ready(FileChunks(owner, [tuple(f) for f in files], array("i", directories), small))
    return planner


def test_a_read_names_the_rest_of_its_file_and_no_other_file():
    planner = _planner([[0, 1, 2, 3], [4, 5]], [CHUNK] * 6)
    assert [location for _digest, location in planner.plan(_chunks(1))] == [2, 3]
    assert planner.plan(_chunks(3)) == []  # its file's last chunk: nothing after it
    assert [location for _digest, location in planner.plan(_chunks(0))] == [1, 2, 3]


def test_a_walk_in_blob_order_grows_a_window_and_a_jump_resets_it():
    files = [[2 * i, 2 * i + 1] for i in range(12)]  # 12 files of 2 chunks, side by side
    planner = _planner(files, [CHUNK] * 24, max_window=8 * CHUNK)
    planner.plan(_chunks(0, 1))  # file 0, read whole
    ahead = [loc for _d, loc in planner.plan(_chunks(2))]  # file 1 right after: a walk
    assert ahead == [3] + list(range(4, 4 + WINDOW_START // CHUNK))
    assert [loc for _d, loc in planner.plan(_chunks(3))] == list(range(4, 4 + WINDOW_START // CHUNK))  # holds
    ahead = [loc for _d, loc in planner.plan(_chunks(4, 5))]
    assert ahead == list(range(6, 6 + 2 * WINDOW_START // CHUNK))  # the next file: the window doubled
    assert [loc for _d, loc in planner.plan(_chunks(20))] == [21]  # a jump: the rest of its file only
    assert [loc for _d, loc in planner.plan(_chunks(8))] == [9]


def test_the_second_file_read_of_a_directory_names_its_other_small_files_nearest_first():
    # directory 0: files 0, 1, 2, 3 (entries 0..3); directory 1: file 4 (entry 4), file 5 far away (9)
    planner = _planner([[0], [1], [2], [3], [4], [9]], [CHUNK] * 10, directories=[0, 0, 0, 0, 1, 1])
    assert planner.plan(_chunks(2)) == [] and planner.to_warm() == []  # one file: nothing else
    assert [loc for _d, loc in planner.plan(_chunks(0))] == [1, 3]  # the second: the rest, nearest first
    assert [loc for _d, loc in planner.to_warm()] == [1, 3]  # and once more, in the background
    assert planner.to_warm() == []
    assert planner.plan(_chunks(3)) == []  # the directory was named already (and 3 is no walk from 0)


@pytest.fixture
def store_dir(tmp_path) -> str:
    return layer_store(tmp_path, FILES, "t/walk:1", CHUNK)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["kernel", "fuse"])
@pytest.mark.parametrize("window", ["default", "0"])
def test_one_file_fetches_its_chunks_only_and_a_walk_fewer_requests(store_dir, tmp_path, mode, window, mounts_below):
    daemons = Daemons(tmp_path)
    try:
        extra = [] if window == "default" else ["--miss-readahead", window]
        node = daemons.start(store_dir, extra_args=extra).node
        mnt, = mount_dirs(tmp_path, "mnt")
        info = node.mount("t/walk:1", mnt, mode=mode)
        layer = open_layer(FilesystemStore(store_dir), info.layer)
        if window != "0":  # the file map is built in a worker thread once the layer is mounted
            wait_for(lambda: node.status().layers[0].miss_readahead == "ready", "the file map")
        assert _read(os.path.join(mnt, "pkg/mod9.py")) == FILES["pkg/mod9.py"]  # the last in the blob
        assert layer_metric(node, "dsecfs_fetch_chunks_total", info.layer) == len(file_chunks(layer, "pkg/mod9.py"))
        for i in range(9):  # a walk: an import of a package, a directory scan
            assert _read(os.path.join(mnt, f"pkg/mod{i}.py")) == FILES[f"pkg/mod{i}.py"]
        ahead = layer_metric(node, "dsecfs_fetch_readahead_chunks_total", info.layer)
        trace = node.mounts()[0].trace
        node.umount(mnt)
        # the reads that waited for the store: the round trips on the reader's path
        waits = [r for r in read_trace(trace).records if r.flags & FLAG_MISS][1:]  # after mod9's
        if window == "0":
            assert ahead == 0 and len(waits) >= 9  # at least one per file
        else:
            assert ahead > 0 and len(waits) <= 4
    finally:
        daemons.stop_all()
    assert mounts_below(tmp_path) == []
