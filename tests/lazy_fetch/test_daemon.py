"""The node daemon for real: ``dsecfs daemon`` runs as a subprocess on a test's own directories and the tests
talk to it through dsec_fs.client, as users do. Every test stops its daemons (``daemons`` fixture, in
conftest.py; the helpers are in daemon_support.py) and then checks that nothing is left mounted below its
tmp_path.

The layer (``CHUNK`` = 64 KiB chunks) holds a large file for reads that take a while, a few small ones,
and ``victim.bin``, built into a layer of its own first, so that its chunk sits in a pack no other file
uses; ``solo.bin`` is a layer by itself, so that kernel-mode readahead on the blob file can only ever
touch its own chunks.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
from treecmp import assert_same_tree, snapshot

from dsec_fs.digest import to_hex
from dsec_fs.errors import ConflictError, CorruptError, InputError, NotFoundError, UnavailableError
from dsec_fs.layer import LayerFiles, open_layer
from dsec_fs.pack import decode_index
from dsec_fs.store import FilesystemStore, keys, open_store
from erofs_builder import build_layer
from erofs_builder.reader import ErofsImage
from lazy_fetch.prefetcher import PREFETCH_FIRST_GROUP_BYTES, PREFETCH_GROUP_BYTES, prefetch_groups
from lazy_fetch.traced_blob import PRELOAD_AFTER_BYTES
from lazy_fetch.prefetch_list import PrefetchEntry
from lazy_fetch.trace import FLAG_BLOB, FLAG_ERROR, FLAG_MISS, FLAG_PREFETCH, read_trace
from tests.lazy_fetch.daemon_support import DSECFS, drop_caches, file_chunks, layer_metric, metrics, mount_dirs, wait_for
from tests.s3server import MotoServer

pytestmark = [pytest.mark.fuse, pytest.mark.root]

CHUNK = 64 * 1024
rng = random.Random(7)
VICTIM = rng.randbytes(CHUNK - 5)
FILES = {
    "large.bin": rng.randbytes(48 * CHUNK + 999),
    "huge.bin": rng.randbytes(128 * CHUNK + 3),  # long enough for a read in order to be preloaded for
    "medium.bin": rng.randbytes(5 * CHUNK + 17),
    "healthy.bin": rng.randbytes(2 * CHUNK),
    "dir/small.txt": b"small\n",
    "dir/sub/other.txt": b"other " * 1000,
    "empty": b"",
    "victim.bin": VICTIM,
}
SOLO = rng.randbytes(16 * CHUNK)


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@dataclass
class Layers:
    store_dir: str
    source: str
    main: LayerFiles  # the tree of FILES
    solo: LayerFiles  # solo.bin alone
    victim_pack: str


@pytest.fixture(scope="module")
def layers(tmp_path_factory) -> Layers:
    base = tmp_path_factory.mktemp("daemon-layers")
    store = FilesystemStore(str(base / "store"), fsync=False)
    _write(base / "victim-only" / "victim.bin", VICTIM)
    victim_pack, = build_layer(str(base / "victim-only"), store, chunk_size=CHUNK).manifest.packs
    source = base / "src"
    for name, data in FILES.items():
        _write(source / name, data)
    os.symlink("dir/small.txt", source / "link")
    main = build_layer(str(source), store, name="test/main:1", chunk_size=CHUNK)
    _write(base / "solo-src" / "solo.bin", SOLO)
    solo = build_layer(str(base / "solo-src"), store, name="test/solo:1", chunk_size=CHUNK)
    return Layers(str(base / "store"), str(source), open_layer(store, main.digest), open_layer(store, solo.digest),
                  victim_pack)


@pytest.mark.parametrize("binding", ["raw", "pyfuse3", "fusepy"])
def test_both_modes_serve_the_tree_and_trace_their_reads(layers, daemons, tmp_path, binding):
    node = daemons.start(layers.store_dir, binding=binding).node
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    infos = [node.mount("test/main:1", kernel), node.mount(layers.main.digest, fuse, mode="fuse")]
    assert [(m.mountpoint, m.mode, m.layer) for m in node.mounts()] == \
        [(kernel, "kernel", layers.main.digest), (fuse, "fuse", layers.main.digest)]
    expected = snapshot(layers.source)
    assert_same_tree(expected, snapshot(kernel))
    assert_same_tree(expected, snapshot(fuse))
    with pytest.raises(ConflictError):
        node.mount("test/main:1", kernel)

    status = node.status()
    layer, = status.layers
    assert layer.fetched_ratio == 1.0 and layer.read_errors == 0 and status.fuse_binding == binding
    for info in infos:
        node.umount(info.mountpoint)
    assert node.mounts() == []

    # Kernel mode sees blob reads; fuse mode names the file read (nid) and its offset.
    kernel_trace, fuse_trace = (read_trace(info.trace) for info in infos)
    assert kernel_trace.header.mode == "kernel" and kernel_trace.header.ref == "test/main:1"
    assert kernel_trace.records and all(r.flags & FLAG_BLOB for r in kernel_trace.records)
    assert any(r.flags & FLAG_MISS for r in kernel_trace.records)
    image = ErofsImage(layers.main.meta, source="meta.erofs")
    large = image.resolve(b"large.bin")
    assert fuse_trace.header.mode == "fuse" and not any(r.flags & FLAG_BLOB for r in fuse_trace.records)
    assert {r.nid for r in fuse_trace.records} >= {large, image.resolve(b"medium.bin")}
    assert sum(r.length for r in fuse_trace.records if r.nid == large) == len(FILES["large.bin"])


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
@pytest.mark.parametrize("read_ahead", [None, "0", "512KiB"])
def test_read_ahead_sets_how_much_the_kernel_asks_for_at_once(layers, daemons, tmp_path, mode, read_ahead):
    """The kernel asks the daemon for a file's readahead window at once: 128 KiB by default; the daemon sets
    read_ahead_kb (1 MiB unless told otherwise) on each kernel-mode EROFS mount and on its FUSE session,
    so a big file comes in fewer requests."""
    extra = [] if read_ahead is None else ["--read-ahead", read_ahead]
    node = daemons.start(layers.store_dir, extra_args=extra).node
    mnt, = mount_dirs(tmp_path, "mnt")
    info = node.mount("test/main:1", mnt, mode=mode)
    with open(os.path.join(mnt, "large.bin"), "rb") as f:
        assert f.read() == FILES["large.bin"]
    node.umount(mnt)
    largest = max(record.length for record in read_trace(info.trace).records)
    assert largest == {None: 1 << 20, "0": 128 << 10, "512KiB": 512 << 10}[read_ahead]


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_reading_one_file_fetches_only_its_chunks(layers, daemons, tmp_path, mode):
    node = daemons.start(layers.store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/main:1", mnt, mode=mode)
    drop_caches()
    with open(os.path.join(mnt, "medium.bin"), "rb") as f:
        assert f.read() == FILES["medium.bin"]
    digest = layers.main.digest
    assert layer_metric(node, "dsecfs_fetch_chunks_total", digest) == len(file_chunks(layers.main, "medium.bin"))
    assert layer_metric(node, "dsecfs_fetch_bytes_total", digest) == len(FILES["medium.bin"])
    ratio = layer_metric(node, "dsecfs_layer_fetched_ratio", digest)
    assert ratio == pytest.approx(len(FILES["medium.bin"]) / sum(len(d) for d in FILES.values()), rel=0.01)


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_concurrent_readers_of_a_cold_file_fetch_each_chunk_once(layers, daemons, tmp_path, mode):
    # Reader i reads pages i, i + 16, i + 32, ... without readahead, so the sixteen of them ask for
    # different pages of the same chunk at the same time; a store request takes 100 ms, so they overlap.
    node = daemons.start(layers.store_dir, latency_ms=100).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/solo:1", mnt, mode=mode)
    readers, page = 16, 4096
    start = threading.Barrier(readers)
    pages: dict[int, bytes] = {}
    failures: list[BaseException] = []

    def read(i: int) -> None:
        try:
            fd = os.open(os.path.join(mnt, "solo.bin"), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                start.wait()
                for number in range(i, len(SOLO) // page, readers):
                    pages[number] = os.pread(fd, page, number * page)
            finally:
                os.close(fd)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert b"".join(pages[number] for number in sorted(pages)) == SOLO
    digest, chunks = layers.solo.digest, len(file_chunks(layers.solo, "solo.bin"))
    assert layer_metric(node, "dsecfs_fetch_chunks_total", digest) == chunks == 16
    assert layer_metric(node, "dsecfs_fetch_coalesced_total", digest) > 0  # they did ask at once
    # The disk cache is written behind the readers (the fetcher's one cache writer): soon, not at once.
    wait_for(lambda: node.cache_stats().entries == chunks, "the chunks in the disk cache")


def test_sigkill_mid_read_then_restart(layers, daemons, tmp_path, mounts_below):
    # With libfuse the mounts die with the daemon (test_daemon_restart.py: with raw they live on). No miss
    # readahead: the reader must still be waiting for chunks when the daemon is killed.
    first = daemons.start(layers.store_dir, binding="pyfuse3", latency_ms=150, extra_args=["--miss-readahead", "0"])
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    first.node.mount("test/main:1", kernel)
    first.node.mount("test/main:1", fuse, mode="fuse")
    with open(os.path.join(fuse, "medium.bin"), "rb") as f:  # cached before the crash
        assert f.read() == FILES["medium.bin"]
    cached = len(file_chunks(layers.main, "medium.bin"))
    reader = subprocess.Popen(["cat", os.path.join(kernel, "large.bin")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while layer_metric(first.node, "dsecfs_fetch_chunks_total", layers.main.digest) <= cached:
            assert time.monotonic() < deadline and reader.poll() is None, "the reader never got going"
            time.sleep(0.02)
        first.kill()
        assert reader.wait(30) != 0  # the read fails, it does not hang
    finally:
        reader.kill()
        reader.wait()
    assert {kernel, fuse} <= set(mounts_below(tmp_path))  # dead mounts, left behind

    second = daemons.start(layers.store_dir).node
    status = second.status()
    assert sorted(status.cleaned) == sorted([kernel, fuse]) and status.mounts == []
    assert mounts_below(tmp_path) == [daemons.state_dir + "/fuse"]
    assert status.cache.rotten == 0 and status.cache.entries >= cached
    second.mount("test/main:1", kernel)
    with open(os.path.join(kernel, "medium.bin"), "rb") as f:
        assert f.read() == FILES["medium.bin"]
    assert layer_metric(second, "dsecfs_fetch_chunks_total", layers.main.digest) == 0  # all from the cache
    with open(os.path.join(kernel, "large.bin"), "rb") as f:
        assert f.read() == FILES["large.bin"]


def test_a_kill_between_mount_and_table_update_leaves_nothing_behind(layers, daemons, tmp_path, mounts_below):
    """A daemon killed right after mount(2) has listed the mount only as the one being made; the next
    daemon must detach it all the same (with libfuse: the mounts die with the daemon)."""
    first = daemons.start(layers.store_dir, binding="pyfuse3")
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    first.node.mount("test/main:1", kernel)
    table_path = os.path.join(daemons.state_dir, "mounts.json")
    with open(table_path) as f:
        (being_made,) = json.load(f)["mounts"]
    assert being_made["mountpoint"] == kernel and not being_made.get("mounting")
    first.node.mount("test/main:1", fuse, mode="fuse")
    first.kill()
    with open(table_path, "w") as f:  # what a kill between mount(2) and the update leaves
        json.dump({"pid": 0, "mounts": [{"mountpoint": path, "mode": mode, "layer": layers.main.digest,
                                         "mounting": True} for path, mode in ((kernel, "kernel"), (fuse, "fuse"))]}, f)
    status = daemons.start(layers.store_dir).node.status()
    assert sorted(status.cleaned) == sorted([kernel, fuse]) and status.mounts == []
    assert mounts_below(tmp_path) == [daemons.state_dir + "/fuse"]


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_a_read_in_order_finds_the_next_chunks_preloaded_from_the_disk_cache(layers, daemons, tmp_path, mode):
    """With the chunks on disk but not in memory (a memory cache of 64 chunks, a file of 129), each chunk a
    reader reached would wait for a worker thread to read and check it; once a read in order has gone
    on for PRELOAD_AFTER_BYTES, the chunks ahead of it are loaded into memory before the reader comes,
    from the disk cache and never the store. (Reads of 2 chunks each: the default 1 MiB readahead would
    ask for a quarter of the memory the test allows at once.)"""
    node = daemons.start(layers.store_dir,
                         extra_args=["--memory-cache", f"{64 * CHUNK}", "--read-ahead", "128KiB"]).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/main:1", mnt, mode=mode)
    path, digest = os.path.join(mnt, "huge.bin"), layers.main.digest
    chunks = len(file_chunks(layers.main, "huge.bin"))
    with open(path, "rb") as f:
        assert f.read() == FILES["huge.bin"]  # from the store, into the disk cache
    fetched = layer_metric(node, "dsecfs_fetch_chunks_total", digest)
    misses = metrics(node)["dsecfs_memory_cache_misses_total", frozenset()]
    drop_caches()
    with open(path, "rb") as f:
        assert f.read() == FILES["huge.bin"]
    assert layer_metric(node, "dsecfs_fetch_chunks_total", digest) == fetched
    before_preloading = PRELOAD_AFTER_BYTES // CHUNK
    assert metrics(node)["dsecfs_memory_cache_misses_total", frozenset()] - misses < before_preloading + 8 < chunks


def _corrupt_chunk_in_store(store_dir: str, pack_id: str) -> bytes:
    """Flip a byte inside the (only) chunk frame of a pack on disk; returns the chunk's digest."""
    entry, = decode_index(FilesystemStore(store_dir).get(keys.index(pack_id)), source=pack_id)
    path = os.path.join(store_dir, keys.pack(pack_id))
    with open(path, "r+b") as f:
        f.seek(entry.offset + entry.clen // 2)
        byte = f.read(1)
        f.seek(entry.offset + entry.clen // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return entry.digest


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_a_corrupt_chunk_fails_its_file_only(layers, daemons, tmp_path, mode):
    store_dir = str(tmp_path / "store")
    shutil.copytree(layers.store_dir, store_dir)
    digest = _corrupt_chunk_in_store(store_dir, layers.victim_pack)
    node = daemons.start(store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/main:1", mnt, mode=mode)
    for _attempt in range(2):  # a failure is not remembered: the second read fails the same way
        drop_caches()
        with open(os.path.join(mnt, "victim.bin"), "rb") as f, pytest.raises(OSError) as info:
            f.read()
        assert info.value.errno == errno.EIO
    for name in ("healthy.bin", "medium.bin", "dir/small.txt"):
        with open(os.path.join(mnt, name), "rb") as f:
            assert f.read() == FILES[name]
    assert node.ping()
    errors = layer_metric(node, "dsecfs_fetch_errors_total", layers.main.digest, kind="corrupt")
    layer, = node.status().layers
    assert errors >= 2 and layer.corrupt == errors and layer.read_errors >= 2
    assert f"fetching chunk {to_hex(digest)} failed" in daemons.log()


def test_store_faults_come_from_the_environment(layers, daemons, tmp_path, monkeypatch):
    monkeypatch.setenv("DSECFS_FAULTS", f"get:{keys.pack(layers.victim_pack)}:permanent")
    node = daemons.start(layers.store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/main:1", mnt, mode="fuse")
    with open(os.path.join(mnt, "victim.bin"), "rb") as f, pytest.raises(OSError) as info:
        f.read()
    assert info.value.errno == errno.EIO
    with open(os.path.join(mnt, "healthy.bin"), "rb") as f:
        assert f.read() == FILES["healthy.bin"]
    assert layer_metric(node, "dsecfs_fetch_errors_total", layers.main.digest, kind="other") >= 1


@pytest.mark.parametrize("damage", ["truncate", "another digest"])
def test_a_ref_damaged_on_the_way_fails_one_mount_and_not_the_next(layers, daemons, tmp_path, monkeypatch, damage):
    """The daemon's first store get is the ref its first mount reads. Cut short, it is a CorruptError; with
    a low bit flipped where the digest stays hex, it names a layer that is not there (NotFoundError). The
    daemon's ref cache (15 s by default) keeps neither, so the next mount reads the ref again and mounts
    the layer: the reliability soak's sandboxes failed every up for the TTL after one such read."""
    digest = layers.main.digest
    if damage == "truncate":
        rule, error = "get:1:truncate", CorruptError
    else:
        at = next(i for i, c in enumerate(digest) if c in "0123456789bcde")  # stays hex with its low bit flipped
        rule, error = f"get:1:corrupt={at}-{at + 1}", NotFoundError
    monkeypatch.setenv("DSECFS_FAULTS", rule)
    node = daemons.start(layers.store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    with pytest.raises(error):
        node.mount("test/main:1", mnt)
    assert node.mount("test/main:1", mnt).layer == digest
    with open(os.path.join(mnt, "dir/small.txt"), "rb") as f:
        assert f.read() == FILES["dir/small.txt"]


@pytest.mark.parametrize(("field", "failing"), [("meta_size", "meta.erofs: zstd frame"),
                                               ("blob_blocks", "blob map header")])
def test_a_manifest_damaged_on_the_way_fails_one_mount_and_not_the_next(layers, daemons, tmp_path, monkeypatch,
                                                                        field, failing):
    """The second store get of the daemon's first mount is the layer's manifest (the first is its ref). With
    a digit of its meta_size flipped it still parses, and names a meta.erofs no object is (the layer open
    fails); with one of its blob_blocks, a blob its blob map is not (the blob open fails): that mount
    fails (corrupt). The next one reads the manifest again, not the node's copy of the damaged one, which
    would fail every mount of the layer for an hour (meta_cache.MANIFEST_FRESH_SECONDS)."""
    digest = layers.main.digest
    text = FilesystemStore(layers.store_dir).get(keys.layer_manifest(digest)).decode()
    at = text.index(f'"{field}": ') + len(f'"{field}": ')  # a digit: it stays one with its low bit flipped
    monkeypatch.setenv("DSECFS_FAULTS", f"get:2:corrupt={at}-{at + 1}")
    node = daemons.start(layers.store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    with pytest.raises(CorruptError, match=failing):
        node.mount("test/main:1", mnt)
    assert node.mount("test/main:1", mnt).layer == digest
    with open(os.path.join(mnt, "dir/small.txt"), "rb") as f:
        assert f.read() == FILES["dir/small.txt"]


@pytest.mark.s3
@pytest.mark.slow
def test_an_unreachable_store_fails_reads_within_the_timeout(daemons, tmp_path, monkeypatch):
    with MotoServer() as server:  # a server of its own, to stop halfway
        server.create_bucket("unreachable")
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        source = tmp_path / "src"
        _write(source / "first.bin", FILES["medium.bin"])
        _write(source / "second.bin", FILES["large.bin"])
        url = "s3://unreachable/layers"
        with open_store(url) as store:
            digest = build_layer(str(source), store, chunk_size=CHUNK).digest
            _write(source / "third.bin", b"a layer never opened\n")
            unopened = build_layer(str(source), store, chunk_size=CHUNK).digest
        node = daemons.start(url, fetch_timeout=3).node
        kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
        node.mount(digest, kernel)
        node.mount(digest, fuse, mode="fuse")
        with open(os.path.join(kernel, "first.bin"), "rb") as f:
            assert f.read() == FILES["medium.bin"]
    # The server is gone: what is cached still reads, the rest fails with EIO, and soon.
    drop_caches()
    for mnt in (kernel, fuse):
        with open(os.path.join(mnt, "first.bin"), "rb") as f:
            assert f.read() == FILES["medium.bin"]
        started = time.monotonic()
        with open(os.path.join(mnt, "second.bin"), "rb") as f, pytest.raises(OSError) as info:
            f.read()
        assert info.value.errno == errno.EIO
        assert time.monotonic() - started < 30
    assert node.ping()
    again, = mount_dirs(tmp_path, "again")
    with pytest.raises(UnavailableError):
        node.mount(unopened, again)  # a layer the node never opened cannot be opened either
    node.mount(digest, again)  # one it did opens from its copies of the metadata (meta_cache.py)
    with open(os.path.join(again, "first.bin"), "rb") as f:
        assert f.read() == FILES["medium.bin"]
    with pytest.raises(InputError):  # and nothing may be mounted over the daemon's own directories
        node.mount(digest, str(tmp_path))


def test_a_prefetch_list_learned_from_a_trace_is_fetched_in_the_background(layers, daemons, tmp_path):
    node = daemons.start(layers.store_dir).node
    mnt, = mount_dirs(tmp_path, "mnt")
    info = node.mount("test/main:1", mnt, mode="fuse")
    for name in ("medium.bin", "dir/small.txt"):
        with open(os.path.join(mnt, name), "rb") as f:
            f.read()
    node.umount(mnt)
    plist = str(tmp_path / "prefetch.json")
    subprocess.run([DSECFS, "prefetch", "build", info.trace, "-o", plist, "--store", layers.store_dir], check=True,
                   stdout=subprocess.DEVNULL)
    node.cache_evict(0)
    wanted = file_chunks(layers.main, "medium.bin") | file_chunks(layers.main, "dir/small.txt")

    info = node.mount("test/main:1", mnt, mode="kernel", prefetch_list=plist)
    deadline = time.monotonic() + 30
    while (job := node.prefetches()[-1]).state == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (job.state, job.chunks, job.done_chunks, job.failed_chunks) == ("done", len(wanted), len(wanted), 0)
    fetched = layer_metric(node, "dsecfs_fetch_chunks_total", layers.main.digest)
    drop_caches()
    with open(os.path.join(mnt, "medium.bin"), "rb") as f:
        assert f.read() == FILES["medium.bin"]
    assert layer_metric(node, "dsecfs_fetch_chunks_total", layers.main.digest) == fetched  # nothing new
    node.umount(mnt)
    prefetched = [r for r in read_trace(info.trace).records if r.flags & FLAG_PREFETCH]
    assert len(prefetched) == len(wanted) and not any(r.flags & FLAG_ERROR for r in prefetched)


def test_a_prefetch_asks_for_a_small_first_group_then_large_ones():
    mib = 1 << 20
    entries = [PrefetchEntry(chunk=n, digest=bytes(32), offset=n * mib, length=mib, first_read_us=n, traces=1)
               for n in range(PREFETCH_GROUP_BYTES // mib + 10)]
    groups = list(prefetch_groups(entries))
    first = PREFETCH_FIRST_GROUP_BYTES // mib
    assert [len(group) for group in groups] == [first, PREFETCH_GROUP_BYTES // mib, 10 - first]
    assert [entry for group in groups for entry in group] == entries  # in list order


def test_sigterm_unmounts_everything_and_removes_the_socket(layers, daemons, tmp_path, mounts_below):
    daemon = daemons.start(layers.store_dir)
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    daemon.node.mount("test/main:1", kernel)
    daemon.node.mount("test/main:1", fuse, mode="fuse")
    assert daemon.stop() == 0
    assert mounts_below(tmp_path) == []
    assert not os.path.exists(daemons.socket)
    with pytest.raises(UnavailableError, match="no daemon answers"):
        daemon.node.status()


def test_the_cli_talks_to_the_daemon(layers, daemons, tmp_path):
    daemons.start(layers.store_dir)
    mnt, = mount_dirs(tmp_path, "mnt")

    def dsecfs(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([DSECFS, *args, "--socket", daemons.socket], capture_output=True, text=True)

    mounted = dsecfs("mount", "test/main:1", mnt, "--mode", "fuse")
    assert mounted.returncode == 0, mounted.stderr
    assert "fuse mode" in mounted.stdout
    with open(os.path.join(mnt, "dir/small.txt"), "rb") as f:
        assert f.read() == FILES["dir/small.txt"]
    status = dsecfs("status")
    assert mnt in status.stdout and layers.main.digest[:12] in status.stdout
    assert "evicted 1 chunks" in dsecfs("cache", "evict", "--to", "0").stdout
    missing = dsecfs("umount", str(tmp_path))
    assert missing.returncode == NotFoundError.exit_code and "not-found error" in missing.stderr
    assert dsecfs("umount", mnt).returncode == 0


def test_metrics_over_tcp_show_the_page_and_nothing_else_of_the_api(layers, daemons, tmp_path):
    import socket as socket_module
    import urllib.error
    import urllib.request

    with socket_module.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = daemons.start(layers.store_dir, extra_args=["--metrics-address", f"127.0.0.1:{port}"]).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("test/main:1", mnt, mode="fuse")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            page = response.read().decode()
        assert response.status == 200
        for name in ('dsecfs_build_info{', "process_cpu_seconds_total", "process_resident_memory_bytes",
                     'dsecfs_mounts{mode="fuse"} 1.0'):
            assert name in page, name
        for method, path in (("GET", "/v1/status"), ("POST", "/v1/mounts"), ("GET", "/v1/sandboxes")):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"{}"
                                             if method == "POST" else None)
            with pytest.raises(urllib.error.HTTPError) as error:
                urllib.request.urlopen(request, timeout=10)
            assert error.value.code == 404
    finally:
        node.umount(mnt)
