"""Miss readahead (lazy_fetch/miss_readahead.py): a window of a file's chunks that grows while the file is
read in order, a directory's small files, and a growing window while a reader walks files in blob order; a
reader of one file fetches that file's chunks only, and a reader of a big file in places not the file.
The map of which chunks are whose, read from the image's records, is the one the layer's LayerIndex gives
(file_chunks_support.py), and a layer whose image it refuses is served without readahead."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from array import array

import pytest

from dsec_fs.blobmap import MAX_CHUNK_BITS, BlobMap, EncodedBlobMap
from dsec_fs.digest import sha256
from dsec_fs.errors import FormatError
from dsec_fs.layer import open_layer, publish_layer, set_ref
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.ondisk.superblock import seal_block0
from erofs_builder.reader import ErofsImage
from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.blob_reader import BlobChunk
from lazy_fetch.miss_readahead import FILE_BYTES, FILE_START, WINDOW_START, FileChunks, MissReadahead
from lazy_fetch.trace import FLAG_MISS, read_trace
from tests.lazy_fetch.file_chunks_support import as_values, file_chunks_of_index
from tests.lazy_fetch.daemon_support import Daemons, file_chunks, layer_metric, layer_store, mount_dirs, wait_for

CHUNK = 64 * 1024
MAX_CHUNK = 1 << MAX_CHUNK_BITS
rng = random.Random(21)
FILES = {f"pkg/mod{i}.py": rng.randbytes(2 * CHUNK + 100 * i) for i in range(10)}


class _Blob:
    """What MissReadahead uses of a LayerBlob: its blob map (a real one of chunks of ``lengths``, entry i
    the chunk named i) and chunk locations."""

    def __init__(self, lengths):
        built = BlobMap(MAX_CHUNK)
        for i, n in enumerate(lengths):
            built.add(i.to_bytes(32, "big"), n)
        self.blob_map = EncodedBlobMap(built.encode(), source="blobmap")

    def location(self, entry, digest):
        return entry


def _chunks(*entries, length=CHUNK):
    return [BlobChunk(e, e.to_bytes(32, "big"), e * length, length) for e in entries]


def _planner(files, lengths, max_window=4 * CHUNK, directories=None, small_files=True, libraries=frozenset()):
    """A planner over ``files`` (their blob entries); ``directories``: each file's directory number
    (default: each file a directory of its own); ``small_files``: every file counts as a small one of its
    directory (else none does)."""
    planner = MissReadahead(_Blob(lengths), max_window)
    owner = array("i", [-1]) * len(lengths)
    for number, entries in enumerate(files):
        for entry in entries:
            owner[entry] = number
    directories = directories or list(range(len(files)))
    small = [[] for _ in range(max(directories) + 1)]
    for number, parent in enumerate(directories):
        if small_files:
            small[parent].append(number)
    planner.ready(FileChunks(owner, [tuple(f) for f in files], array("i", directories), small, libraries))
    return planner


def _locations(named):
    return [location for _digest, location in named]


def test_a_read_names_the_rest_of_a_small_file_and_no_other_file():
    planner = _planner([[0, 1, 2, 3], [4, 5]], [CHUNK] * 6)
    assert _locations(planner.plan(_chunks(1))) == [2, 3]
    assert planner.plan(_chunks(2, 3)) == []  # its file's last chunk: nothing after it


def test_a_big_file_read_in_places_names_its_first_window_only():
    """A library mapped into memory is read a page fault at a time, here and there: only the file's
    first read names a window; the others fetch what they read."""
    start = FILE_START // CHUNK
    planner = _planner([list(range(4 * start))], [CHUNK] * (4 * start))
    assert _locations(planner.plan(_chunks(0))) == list(range(1, 1 + start))
    assert planner.plan(_chunks(2 * start)) == []
    assert planner.plan(_chunks(3 * start + 5)) == []
    assert planner.to_warm() == []


def test_a_file_read_in_order_doubles_its_window_as_it_reads_into_it():
    start = FILE_START // CHUNK
    count = 2 * FILE_BYTES // CHUNK
    planner = _planner([list(range(count))], [CHUNK] * count)
    assert _locations(planner.plan(_chunks(0))) == list(range(1, 1 + start))
    assert planner.to_warm() == []  # the first window comes with the miss
    assert _locations(planner.plan(_chunks(1))) == list(range(2, 2 + 2 * start))  # read into it: doubled
    assert _locations(planner.to_warm()) == list(range(1 + start, 2 + 2 * start))  # what it grew by, warmed
    assert _locations(planner.plan(_chunks(2))) == list(range(3, 3 + 4 * start))
    for entry in range(3, 3 + 8):
        planner.plan(_chunks(entry))
    assert len(planner.plan(_chunks(11))) == FILE_BYTES // CHUNK  # at most FILE_BYTES


def test_a_file_read_in_places_keeps_its_first_window_when_it_is_then_read_in_order():
    """A mapped library's page faults read around each fault in order for a while (the kernel's
    read-around crosses a chunk boundary): once a file was read elsewhere than where its previous read
    ended, reading into its window in order names the same window again, never a doubled one."""
    start = FILE_START // CHUNK
    count = 4 * start
    planner = _planner([list(range(count))], [CHUNK] * count)
    assert _locations(planner.plan(_chunks(0))) == list(range(1, 1 + start))
    assert planner.plan(_chunks(3 * start)) == []  # a fault elsewhere
    assert planner.plan(_chunks(0)) == []  # the rest of the first chunk, read around another fault
    assert _locations(planner.plan(_chunks(1))) == list(range(2, 2 + start))  # into the first window: not doubled
    assert planner.to_warm() == []


def test_a_shared_object_read_in_order_keeps_its_first_window():
    """A loader maps a library before touching it: its first faults may well come in order."""
    start = FILE_START // CHUNK
    count = 4 * start
    planner = _planner([list(range(count))], [CHUNK] * count, libraries=frozenset({0}))
    assert _locations(planner.plan(_chunks(0))) == list(range(1, 1 + start))
    assert _locations(planner.plan(_chunks(1))) == list(range(2, 2 + start))
    assert planner.to_warm() == []


def test_shared_objects_are_known_by_name(tmp_path):
    tree = tmp_path / "tree"
    for name in ("libc.so.6", "_ssl.cpython-311-x86_64-linux-gnu.so", "libfoo.so", "notes.sort", "x.so.txt", "libz.so.1.2.13"):
        (tree / "lib").mkdir(parents=True, exist_ok=True)
        (tree / "lib" / name).write_bytes(name.encode() * 100)
    store_dir = str(tmp_path / "store")
    with FilesystemStore(store_dir) as store:
        layer = build_layer(str(tree), store, name="t:1", chunk_size=CHUNK)
        opened = open_layer(store, layer.digest)
        files = FileChunks.of_image(opened.meta, EncodedBlobMap(opened.blobmap, source="blobmap"), source="meta")
        index = LayerIndex.open(store, layer.digest)
    paths = [file.path for file in index.files.values() if file.chunks]
    assert sorted(paths[n].rpartition("/")[2] for n in files.libraries) == [
        "_ssl.cpython-311-x86_64-linux-gnu.so", "libc.so.6", "libfoo.so", "libz.so.1.2.13"]


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


def test_a_big_file_a_walk_reaches_grows_its_window_as_it_is_read_in_order():
    """The walk's window named the big file's first chunks: reading them in order is reading ahead
    that came true, whoever named it."""
    start = FILE_START // CHUNK
    planner = _planner([[0], [1], list(range(2, 2 + 8 * start))], [CHUNK] * (2 + 8 * start))
    planner.plan(_chunks(0))
    planner.plan(_chunks(1))  # a walk: its window names entries 2.. (the big file's first chunks)
    planner.plan(_chunks(2))
    assert len(planner.plan(_chunks(3))) >= 2 * start


def test_a_walk_of_small_files_names_at_most_twice_what_it_has_read():
    """A walk ends with its last window unread: the window must not run far ahead of the walk."""
    small = 16 * 1024
    files = [[i] for i in range(200)]  # 200 files of 16 KiB, side by side, each a directory of its own
    planner = _planner(files, [small] * 200, max_window=4 << 20)
    named = [len(planner.plan(_chunks(entry, length=small))) for entry in range(40)]
    assert named[:2] == [0, WINDOW_START // small]
    assert max(named[:8]) == WINDOW_START // small  # 8 files read: 128 KiB; the window stays at its start
    assert all(n * small <= max(2 * read * small, WINDOW_START) for read, n in enumerate(named, 1))
    assert named[39] > WINDOW_START // small  # and grows as the walk goes on


def test_a_walk_names_nothing_past_its_directory_until_it_walks_on_into_the_next():
    """An import reads files of a package's __pycache__ one after another; the build laid the package's
    sources and the next directories out after them, which such a reader seldom reads. A walk's window
    ends with the directory until the walk itself goes on into the next directory (a tree walk): then it
    runs across directories. A jump ends the walk, and the next walk starts inside its directory again."""
    files = [[i] for i in range(12)]  # 12 files of one chunk side by side: 3 directories of 4 files
    planner = _planner(files, [CHUNK] * 12, max_window=8 * CHUNK, directories=[i // 4 for i in range(12)],
                       small_files=False)
    assert planner.plan(_chunks(0)) == []
    assert _locations(planner.plan(_chunks(1))) == [2, 3]  # a walk: its window stops at the directory's end
    assert _locations(planner.plan(_chunks(2))) == [3]
    assert planner.plan(_chunks(3)) == []
    assert _locations(planner.plan(_chunks(4))) == list(range(5, 12))  # into directory 1: across directories
    assert planner.plan(_chunks(0)) == []  # a jump
    assert _locations(planner.plan(_chunks(1))) == [2, 3]


def test_the_second_file_read_of_a_directory_names_its_other_small_files_nearest_first():
    # directory 0: files 0, 1, 2, 3 (entries 0..3); directory 1: file 4 (entry 4), file 5 far away (9)
    planner = _planner([[0], [1], [2], [3], [4], [9]], [CHUNK] * 10, directories=[0, 0, 0, 0, 1, 1])
    assert planner.plan(_chunks(2)) == [] and planner.to_warm() == []  # one file: nothing else
    assert [loc for _d, loc in planner.plan(_chunks(0))] == [1, 3]  # the second: the rest, nearest first
    assert [loc for _d, loc in planner.to_warm()] == [1, 3]  # and once more, in the background
    assert planner.to_warm() == []
    assert planner.plan(_chunks(3)) == []  # the directory was named already (and 3 is no walk from 0)


@contextlib.contextmanager
def _unfilled_mount(tmp_path, store_dir, ref, mode):
    """A daemon with fill none and no profiles, ``ref`` of ``store_dir`` mounted in ``mode`` with its file
    map ready: yields (node, mountpoint, mount info); unmounted and stopped after."""
    daemons = Daemons(tmp_path)
    try:
        node = daemons.start(store_dir, extra_args=["--fill", "none", "--no-profiles"]).node
        mnt, = mount_dirs(tmp_path, "mnt")
        info = node.mount(ref, mnt, mode=mode)
        wait_for(lambda: node.status().layers[0].miss_readahead == "ready", "the file map")
        yield node, mnt, info
        node.umount(mnt)
    finally:
        daemons.stop_all()


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_pages_of_a_big_file_read_in_places_fetch_their_chunks_not_the_file(tmp_path, mode, mounts_below):
    """fill none, no profile: three pages of a 16 MiB file, read where a loader's page faults would (no
    kernel readahead: POSIX_FADV_RANDOM), fetch the first read's window and the two chunks read."""
    size = 16 << 20
    store_dir = layer_store(tmp_path, {"lib/big.so": rng.randbytes(size)}, "t/big:1", CHUNK)
    with _unfilled_mount(tmp_path, store_dir, "t/big:1", mode) as (node, mnt, info):
        data = open(os.path.join(store_dir, "..", "src", "lib", "big.so"), "rb").read()
        fd = os.open(os.path.join(mnt, "lib/big.so"), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for offset in (0, 5 << 20, 11 << 20):
                assert os.pread(fd, 4096, offset) == data[offset:offset + 4096]
        finally:
            os.close(fd)
        fetched = layer_metric(node, "dsecfs_fetch_chunks_total", info.layer)
    assert mounts_below(tmp_path) == []
    assert 3 <= fetched <= 1 + FILE_START // CHUNK + 2, f"{fetched} chunks of {size // CHUNK} fetched"


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
        # fill none: fill auto fills the layer once its store's round trip looks 10 ms or more, as a
        # local store's can on a loaded machine, and the fill's chunks are not the file's
        extra = ["--fill", "none"] + ([] if window == "default" else ["--miss-readahead", window])
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


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_an_import_of_a_package_fetches_none_of_its_sources(tmp_path, mode, mounts_below):
    """fill none, no profile: reading a package's compiled modules one after another in blob order (a
    walk of pkg/__pycache__) fetches those modules and not the sources the build laid out after them."""
    modules = {f"pkg/__pycache__/m{i}.cpython-311.pyc": rng.randbytes(20_000 + 100 * i) for i in range(8)}
    sources = {f"pkg/m{i}.py": rng.randbytes(20_000 + 100 * i) for i in range(8)}
    store_dir = layer_store(tmp_path, {**modules, **sources}, "t/pkg:1", CHUNK)
    with _unfilled_mount(tmp_path, store_dir, "t/pkg:1", mode) as (node, mnt, info):
        for path in sorted(modules):
            assert _read(os.path.join(mnt, path)) == modules[path]
        fetched = layer_metric(node, "dsecfs_fetch_chunks_total", info.layer)
    assert mounts_below(tmp_path) == []
    assert fetched == len(modules), f"{fetched} chunks fetched for {len(modules)} modules of one chunk each"


# ---- the file map, read from the image's records --------------------------------------------------------


def _maps_of(store, digest):
    """(the map FileChunks.of_image reads from the layer's meta.erofs, the one of its LayerIndex)."""
    layer = open_layer(store, digest)
    blob_map = EncodedBlobMap(layer.blobmap, source="blobmap")
    read = FileChunks.of_image(layer.meta, blob_map, source="meta.erofs")
    return read, file_chunks_of_index(LayerIndex.of_files(layer, blob_map))


def test_the_file_map_of_hard_links_shared_chunks_holes_symlinks_and_xattrs_is_the_layer_index_one(built_layer):
    """conftest's tree: a hard link, a chunk repeated in a file and one shared by two files, written
    zeros and a sparse file, symlinks, xattrs, a non-UTF-8 name, a fifo (and device nodes as root)."""
    read, walked = _maps_of(built_layer.store, built_layer.layer.digest)
    assert as_values(read) == as_values(walked)
    index = LayerIndex.of_files(built_layer.layer)
    numbers = {file.path: n for n, file in enumerate(f for f in index.files.values() if any(c is not None for c in f.chunks))}
    assert "/dir/hard-link" not in numbers and "/zeros.bin" not in numbers  # one file by its first name; all holes
    assert len(read.files[numbers["/dup.bin"]]) == 3  # four chunks, the first repeated
    holes = index.files[next(f.nid for f in index.files.values() if f.path == "/holes.bin")]
    assert len(read.files[numbers["/holes.bin"]]) == sum(c is not None for c in holes.chunks) < len(holes.chunks)


@pytest.mark.slow
def test_the_file_map_of_the_debian_rootfs_is_the_layer_index_one(debian_rootfs, tmp_path):
    with FilesystemStore(str(tmp_path / "store"), fsync=False) as store:
        digest = build_layer(debian_rootfs, store, name="base/debian:12").digest
        read, walked = _maps_of(store, digest)
    assert len(read.files) > 5000 and read.libraries
    assert as_values(read) == as_values(walked)


def test_a_chunk_index_inside_a_chunk_is_a_format_error_naming_the_image(built_layer):
    """The kernel serves such an image (it reads the blob where the index says); the map refuses it, and the
    daemon then mounts the layer without miss readahead (daemon_stores.py)."""
    layer = built_layer.layer
    image = ErofsImage(layer.meta)
    nid = image.resolve(b"big.bin")
    at = image._node(nid).data_offset + 4  # the first chunk index's blkaddr
    meta = bytearray(layer.meta)
    meta[at:at + 4] = (int.from_bytes(meta[at:at + 4], "little") + 1).to_bytes(4, "little")
    seal_block0(meta, image.block_size)
    with pytest.raises(FormatError, match=f"layer x meta.erofs.*inode nid {nid}.*not the start of a chunk"):
        FileChunks.of_image(bytes(meta), EncodedBlobMap(layer.blobmap, source="blobmap"), source="layer x meta.erofs")


@pytest.mark.fuse
@pytest.mark.root
def test_a_layer_whose_image_the_map_refuses_serves_its_files_without_readahead(store_dir, tmp_path, mounts_below):
    """A chunk index of pkg/mod0.py moved one block into its chunk: the kernel reads the blob where it
    says, the map refuses the image. The daemon says so in its log and status, and serves the layer."""
    with FilesystemStore(store_dir) as store:
        layer = open_layer(store, "t/walk:1")
        image = ErofsImage(layer.meta)
        at = image._node(image.resolve(b"pkg/mod0.py")).data_offset + 4  # chunk 0's blkaddr
        meta = bytearray(layer.meta)
        meta[at:at + 4] = (int.from_bytes(meta[at:at + 4], "little") + 1).to_bytes(4, "little")
        seal_block0(meta, image.block_size)
        digest = sha256(bytes(meta)).hex()
        publish_layer(store, bytes(meta), layer.blobmap, dataclasses.replace(layer.manifest, layer=digest))
        set_ref(store, "t/refused:1", digest)
    daemons = Daemons(tmp_path)
    try:
        node = daemons.start(store_dir, extra_args=["--fill", "none", "--no-profiles"]).node
        mnt, = mount_dirs(tmp_path, "mnt")
        node.mount("t/refused:1", mnt, mode="kernel")
        wait_for(lambda: node.status().layers[0].miss_readahead == "refused", "the map's refusal")
        for name in ("pkg/mod1.py", "pkg/mod5.py"):
            assert _read(os.path.join(mnt, name)) == FILES[name]
        assert f"no miss readahead for layer {digest[:12]}" in daemons.log()
        assert "not the start of a chunk in the blob map" in daemons.log()
        node.umount(mnt)
    finally:
        daemons.stop_all()
    assert mounts_below(tmp_path) == []
