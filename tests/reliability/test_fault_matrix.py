"""The fault matrix (issue 8): a real node daemon reading a layer from real S3 (moto over HTTP), under each
fault a store or a node can throw at it. For every fault: what a reader of an uncached file sees (the
right bytes or EIO, never wrong bytes: every byte is compared with the source), that the daemon stays up
(its process lives and it answers ``status``), and that once the fault is over a new read succeeds with
no restart. docs/reliability.md tabulates the results; each row names its test here.

How each fault is made:

- Store faults (error bursts, permanent errors, missing objects, slow answers, truncated bodies,
  corrupted ranges): FaultStore rules in the daemon's DSECFS_FAULTS, which the daemon wraps around the
  S3 backend, under its retries. A rule fires on a window of get calls counted from the daemon's start:
  mounting a layer by digest makes 3 + (its packs) gets (manifest, meta, blob map, pack indexes), so the
  window starts at the first chunk read after the mount and the fault ends when the window has passed.
- The store going away and coming back: a private moto server is stopped, then started again on the
  same port with the same objects put back.
- The cache disk full: the cache directory is a small tmpfs, filled up by a file the test then removes.
- The cache directory deleted under the running daemon.
- SIGKILL at random points while readers are reading, then a new daemon on the same directories.
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest
from treecmp import write_files
from prometheus_client.parser import text_string_to_metric_families

from dsec_fs import mounts
from dsec_fs.errors import DsecError
from dsec_fs.mounts import mounts_below
from dsec_fs.store import open_store
from tests.reliability.support import (
    CHUNK,
    DATA,
    environment,
    publish,
    read_checked,
    read_until_correct,
    s3_environment,
)
from tests.lazy_fetch.daemon_support import wait_for
from tests.s3server import MotoServer

pytestmark = [pytest.mark.fuse, pytest.mark.root, pytest.mark.s3]

MODES = ("kernel", "fuse")
EIO = "EIO"
rng = random.Random(8)
FILES = {
    "victim.bin": rng.randbytes(4 * CHUNK - 7),  # read first, while the fault lasts
    "after.bin": rng.randbytes(3 * CHUNK + 11),  # read once the fault is over
    "cached.bin": rng.randbytes(2 * CHUNK),  # read before the fault
    "dir/small.txt": b"small\n",
}


@dataclass(frozen=True)
class FaultLayer:
    url: str
    env: dict[str, str]
    digest: str
    packs: int
    source: str

    @property
    def gets_to_mount(self) -> int:
        """Store gets a daemon makes to mount this layer by digest: manifest, meta, blob map, pack indexes."""
        return 3 + self.packs


@pytest.fixture(scope="module")
def fault_layer(moto_server, tmp_path_factory) -> FaultLayer:
    env = s3_environment(moto_server)
    url = f"s3://dsecfs-test/rel-matrix-{secrets.token_hex(4)}"
    source = write_files(str(tmp_path_factory.mktemp("matrix") / "src"), FILES)
    built = publish(url, env, source)
    return FaultLayer(url, env, built.digest, len(built.manifest.packs), source)


def mountpoint(tmp_path, name: str = "mnt") -> str:
    path = str(tmp_path / name)
    os.makedirs(path)
    return path


def check_daemon_up(daemon) -> None:
    assert daemon.alive(), "the daemon died"
    status = daemon.node.status()
    assert status.pid == daemon.pid


def layer_status(daemon, digest: str):
    layer, = (layer for layer in daemon.node.status().layers if layer.layer == digest)
    return layer


def fetch_latency_sum(daemon, digest: str) -> float:
    """Seconds the layer's store reads took in all, from the daemon's /metrics."""
    for family in text_string_to_metric_families(daemon.node.metrics_text()):
        for sample in family.samples:
            if sample.name == "dsecfs_fetch_latency_seconds_sum" and sample.labels.get("layer") == digest:
                return sample.value
    return 0.0


# ---- faults of the store, through FaultStore ------------------------------------------------------------------


@dataclass(frozen=True)
class StoreFault:
    name: str
    action: str  # FaultStore action
    # Store gets the fault lasts. The kernel retries a page that failed, so a fault that readers are to see
    # must outlast the first read(), retries included.
    width: int
    first_read: str  # what the first read of an uncached file sees
    evidence: str  # in the daemon's log once the fault fired ("": it shows in the fetch latency only)
    fetch_timeout: float = 5.0


STORE_FAULTS = [
    StoreFault("transient-burst-short", "transient", 3, DATA, "injected transient fault on get), retrying"),
    StoreFault("transient-burst-long", "transient", 25, EIO, "(gave up after 5 attempts)"),
    StoreFault("permanent", "permanent", 8, EIO, "injected permanent fault on get"),
    StoreFault("notfound", "notfound", 8, EIO, "injected notfound fault on get"),
    StoreFault("slow-under-timeout", "slow=0.5", 2, DATA, ""),
    StoreFault("slow-over-timeout", "slow=3", 4, EIO, "the store did not answer within 1.5 s", fetch_timeout=1.5),
    StoreFault("truncated", "truncate", 8, EIO, "zstd frame"),
    StoreFault("corrupted-frame-header", "corrupt=5-9", 8, EIO, "zstd frame"),
    # Inside the first chunk's data: the frame still decodes, only the sha256 check can catch it.
    StoreFault("corrupted-payload", "corrupt=20000-20004", 8, EIO, "sha256 mismatch"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", STORE_FAULTS, ids=[fault.name for fault in STORE_FAULTS])
def test_store_fault(fault_layer, daemons, tmp_path, mode, fault):
    first, last = fault_layer.gets_to_mount + 1, fault_layer.gets_to_mount + fault.width
    # No miss readahead: the windows count gets, and a run that carries readahead is split into one get
    # per chunk when it fails, which would use the window up before the reader's own chunk is read again.
    daemon = daemons.start(fault_layer.url, fault_layer.env, faults=f"get:{first}-{last}:{fault.action}",
                           fetch_timeout=fault.fetch_timeout, extra_args=["--miss-readahead", "0"])
    mnt = mountpoint(tmp_path)
    daemon.node.mount(fault_layer.digest, mnt, mode=mode)
    victim = os.path.join(mnt, "victim.bin")

    assert read_checked(victim, FILES["victim.bin"]) == fault.first_read
    check_daemon_up(daemon)
    if fault.evidence:
        assert fault.evidence in daemons.log()
    else:  # slow, but in time: the reads waited for it
        assert fetch_latency_sum(daemon, fault_layer.digest) >= 0.5
    assert (layer_status(daemon, fault_layer.digest).read_errors > 0) == (fault.first_read == EIO)

    # Each failed read uses at least one get of the fault's window, so the window runs out.
    outcomes = read_until_correct(victim, FILES["victim.bin"], attempts=fault.width + 1)
    assert outcomes[-1] == DATA and set(outcomes) <= {DATA, EIO}, outcomes
    assert read_checked(os.path.join(mnt, "after.bin"), FILES["after.bin"]) == DATA
    check_daemon_up(daemon)


# ---- the store going away and coming back ----------------------------------------------------------------------

AWAY_BUCKET = "dsecfs-away"


def store_objects(url: str, env: dict[str, str]) -> dict[str, bytes]:
    with environment(env), open_store(url) as store:
        return {key: store.get(key) for prefix in ("layers/", "packs/", "index/") for key in store.list(prefix)}


def put_objects(url: str, env: dict[str, str], objects: dict[str, bytes]) -> None:
    with environment(env), open_store(url) as store:
        for key, data in objects.items():
            store.put(key, data)


@pytest.mark.parametrize("mode", MODES)
def test_store_goes_away_and_comes_back(fault_layer, daemons, tmp_path, mode):
    with MotoServer() as server:
        server.create_bucket(AWAY_BUCKET)
        env, url = s3_environment(server), f"s3://{AWAY_BUCKET}/layers"
        digest = publish(url, env, fault_layer.source).digest
        objects = store_objects(url, env)
        daemon = daemons.start(url, env)
        mnt = mountpoint(tmp_path)
        daemon.node.mount(digest, mnt, mode=mode)
        assert read_checked(os.path.join(mnt, "cached.bin"), FILES["cached.bin"]) == DATA

        port = server.port
        server.stop()
        assert read_checked(os.path.join(mnt, "victim.bin"), FILES["victim.bin"]) == EIO
        assert read_checked(os.path.join(mnt, "cached.bin"), FILES["cached.bin"]) == DATA  # from the node's cache
        check_daemon_up(daemon)
        assert "EndpointConnectionError" in daemons.log()

        server.start(port=port)  # moto keeps nothing: the bucket and its objects are put back
        server.create_bucket(AWAY_BUCKET)
        put_objects(url, env, objects)
        assert read_checked(os.path.join(mnt, "victim.bin"), FILES["victim.bin"]) == DATA
        assert read_checked(os.path.join(mnt, "after.bin"), FILES["after.bin"]) == DATA
        check_daemon_up(daemon)


# ---- the cache disk ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs():
    """A 4 MiB tmpfs (outside tmp_path, which must hold no mounts when the daemons fixture checks)."""
    path = tempfile.mkdtemp(prefix="dsr-cachefs-", dir="/tmp")
    mounts.mount("tmpfs", path, "tmpfs", 0, "size=4m,mode=0700")
    try:
        yield path
    finally:
        mounts.umount(path, lazy=True)
        os.rmdir(path)


def fill_up(directory: str) -> str:
    """Write a file into ``directory`` until its filesystem is full; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    f.write(bytes(size))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return path


@pytest.mark.parametrize("mode", MODES)
def test_cache_disk_full(small_tmpfs, fault_layer, daemons, tmp_path, mode):
    # No memory cache, so a read that is not a page-cache hit is served by the disk cache or the store; no
    # miss readahead, whose background fetches would move the counts compared below.
    daemon = daemons.start(fault_layer.url, fault_layer.env, cache_dir=os.path.join(small_tmpfs, "cache"),
                           extra_args=["--memory-cache", "0", "--miss-readahead", "0"])
    mnt = mountpoint(tmp_path)
    daemon.node.mount(fault_layer.digest, mnt, mode=mode)
    filler = fill_up(small_tmpfs)

    assert read_checked(os.path.join(mnt, "victim.bin"), FILES["victim.bin"]) == DATA  # cached or not
    check_daemon_up(daemon)
    assert daemon.node.cache_stats().entries == 0
    assert "No space left on device" in daemons.log()

    os.unlink(filler)
    assert read_checked(os.path.join(mnt, "after.bin"), FILES["after.bin"]) == DATA
    cached = daemon.node.cache_stats().entries
    assert cached > 0  # caching again, by itself
    fetched = layer_status(daemon, fault_layer.digest).chunks_fetched
    assert read_checked(os.path.join(mnt, "after.bin"), FILES["after.bin"]) == DATA
    assert layer_status(daemon, fault_layer.digest).chunks_fetched == fetched  # from the disk cache
    check_daemon_up(daemon)


def remove_under_a_writer(path: str) -> None:
    """``rm -rf`` of a directory the daemon may be writing into: its cache writer, still putting a batch,
    can make segments/ again between rmtree's listing and its rmdir (ENOTEMPTY), or rename a temporary
    segment rmtree has listed into place before rmtree unlinks it (ENOENT); remove again then."""
    for _ in range(50):
        try:
            shutil.rmtree(path)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                raise
    raise AssertionError(f"{path} kept being written into")


@pytest.mark.parametrize("mode", MODES)
def test_cache_directory_deleted_under_the_daemon(fault_layer, daemons, tmp_path, mode):
    # No miss readahead: what it fetches in the background would move the counts compared below.
    daemon = daemons.start(fault_layer.url, fault_layer.env, extra_args=["--memory-cache", "0", "--miss-readahead", "0"])
    mnt = mountpoint(tmp_path)
    daemon.node.mount(fault_layer.digest, mnt, mode=mode)
    assert read_checked(os.path.join(mnt, "cached.bin"), FILES["cached.bin"]) == DATA
    wait_for(lambda: daemon.node.cache_stats().entries > 0, "the chunks read to be cached")  # after the reader has them

    remove_under_a_writer(daemons.cache_dir)
    assert read_checked(os.path.join(mnt, "cached.bin"), FILES["cached.bin"]) == DATA  # its files are gone
    assert read_checked(os.path.join(mnt, "victim.bin"), FILES["victim.bin"]) == DATA  # never cached
    check_daemon_up(daemon)
    cache = daemon.node.cache_stats()
    assert cache.rotten > 0 and cache.entries > 0
    assert os.listdir(os.path.join(daemons.cache_dir, "segments"))  # segments are written again
    fetched = layer_status(daemon, fault_layer.digest).chunks_fetched
    assert read_checked(os.path.join(mnt, "victim.bin"), FILES["victim.bin"]) == DATA
    assert layer_status(daemon, fault_layer.digest).chunks_fetched == fetched  # from the disk cache

    # The index went with the directory: a daemon started afterwards drops the files it does not index.
    daemon.stop()
    second = daemons.start(fault_layer.url, fault_layer.env)
    assert second.node.cache_stats().entries == 0
    second.node.mount(fault_layer.digest, mnt, mode=mode)
    for name, data in FILES.items():
        assert read_checked(os.path.join(mnt, name), data) == DATA


# ---- SIGKILL at random points -------------------------------------------------------------------------------------

KILL_ROUNDS = 4
AFTER_A_KILL = {DATA, EIO, "ENOTCONN", "ECONNABORTED"}  # the errors of a dead FUSE connection


def _read_until(stop: threading.Event, mnt: str, outcomes: list[str]) -> None:
    while not stop.is_set():
        for name, data in FILES.items():
            outcomes.append(read_checked(os.path.join(mnt, name), data))


def _churn_mounts(stop: threading.Event, node, digest: str, mnt: str) -> None:
    """Mount and unmount ``mnt`` until stopped; errors (the daemon was killed) end it."""
    while not stop.is_set():
        try:
            node.mount(digest, mnt, mode="kernel")
            node.umount(mnt)
        except DsecError:
            return


def test_sigkill_at_random_points(fault_layer, daemons, tmp_path):
    seed = secrets.randbits(32)
    print(f"random kill points from seed {seed}")
    delays = random.Random(seed)
    kernel, fuse, churn = (mountpoint(tmp_path, name) for name in ("kernel", "fuse", "churn"))
    for _round in range(KILL_ROUNDS):
        # Each store read takes 30 ms, and the cache starts cold: kills land in fetches, cache writes, mounts.
        daemon = daemons.start(fault_layer.url, fault_layer.env, latency_ms=30, fuse_binding="pyfuse3")
        node = daemon.node
        node.cache_evict(0)
        node.mount(fault_layer.digest, kernel)
        node.mount(fault_layer.digest, fuse, mode="fuse")
        stop, outcomes = threading.Event(), []
        threads = [threading.Thread(target=_read_until, args=(stop, mnt, outcomes)) for mnt in (kernel, fuse)]
        threads.append(threading.Thread(target=_churn_mounts, args=(stop, node, fault_layer.digest, churn)))
        for thread in threads:
            thread.start()
        time.sleep(delays.uniform(0.0, 1.0))
        daemon.kill()
        stop.set()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "a reader hangs on a dead daemon"
        assert set(outcomes) <= AFTER_A_KILL, f"seed {seed}: {sorted(set(outcomes))}"

    # A new daemon on the same directories detaches what the dead one left and serves again.
    node = daemons.start(fault_layer.url, fault_layer.env).node
    status = node.status()
    assert {kernel, fuse} <= set(status.cleaned) and status.mounts == []
    assert mounts_below(tmp_path) == [os.path.join(daemons.state_dir, "fuse")], f"seed {seed}"
    node.mount(fault_layer.digest, kernel)
    node.mount(fault_layer.digest, fuse, mode="fuse")
    for mnt in (kernel, fuse):
        for name, data in FILES.items():
            assert read_checked(os.path.join(mnt, name), data) == DATA
    assert node.cache_stats().rotten == 0


def test_sigkill_at_random_points_with_the_raw_binding_keeps_the_mounts(fault_layer, daemons, tmp_path):
    """The same kills with ``--fuse-binding raw`` (docs/architecture.md, "Daemon restarts"): the mounts
    outlive each daemon, the next one adopts them, and every read the readers make returns the right
    bytes: reads in flight at a kill are sent again to the next daemon, and reads made in between wait
    for it. No mount churn here: a daemon killed while one of its own threads waits in mount(2) for its
    own FUSE answer cannot exit until a next daemon serves, and DaemonProcess.kill waits for the exit."""
    seed = secrets.randbits(32)
    print(f"random kill points from seed {seed}")
    delays = random.Random(seed)
    kernel, fuse = (mountpoint(tmp_path, name) for name in ("kernel", "fuse"))
    daemon = daemons.start(fault_layer.url, fault_layer.env, latency_ms=30, fuse_binding="raw")
    daemon.node.mount(fault_layer.digest, kernel)
    daemon.node.mount(fault_layer.digest, fuse, mode="fuse")
    inodes = {mnt: os.stat(os.path.join(mnt, "victim.bin")).st_ino for mnt in (kernel, fuse)}
    for _round in range(KILL_ROUNDS):
        daemon.node.cache_evict(0)
        stop, outcomes = threading.Event(), []
        threads = [threading.Thread(target=_read_until, args=(stop, mnt, outcomes)) for mnt in (kernel, fuse)]
        for thread in threads:
            thread.start()
        time.sleep(delays.uniform(0.0, 1.0))
        daemon.kill()
        daemon = daemons.start(fault_layer.url, fault_layer.env, latency_ms=30, fuse_binding="raw")
        stop.set()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), f"seed {seed}: a reader hangs"
        assert set(outcomes) == {DATA}, f"seed {seed}: {sorted(set(outcomes))}"
        status = daemon.node.status()
        assert sorted(m.mountpoint for m in status.mounts) == sorted([kernel, fuse]) and status.cleaned == []
        assert {mnt: os.stat(os.path.join(mnt, "victim.bin")).st_ino for mnt in (kernel, fuse)} == inodes
    assert daemon.node.cache_stats().rotten == 0
    assert daemon.stop() == 0  # a normal stop still unmounts everything, and stops the holder
    assert mounts_below(tmp_path) == [], f"seed {seed}"
    assert not os.path.exists(os.path.join(daemons.state_dir, "fuse-holder.sock"))
