"""A store object that never answers, against the real daemon (``dsecfs daemon``, driven through
dsec_fs.client): a pack of a POSIX store replaced by a FIFO nobody writes to (hung_store.py), and an S3 GET
to a real moto server stalled by a FaultStore rule (``stall=PATH``, set through $DSECFS_FAULTS).

In both, many readers of the layer whose pack hangs get EIO within the fetch deadline; then reads of it
fail at once, and no further thread is sent after it (the abandoned-reads count stays at the fetcher's
bound); another mounted layer still reads the right bytes from the store, cold, and a new mount works;
and once the object answers again its layer reads right without a restart.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from dsec_fs.store import FilesystemStore, keys, open_store
from erofs_builder import build_layer
from lazy_fetch.fetcher import DEFAULT_OBJECT_READS
from tests.lazy_fetch.daemon_support import drop_caches, layer_metric, metrics, mount_dirs
from tests.lazy_fetch.hung_store import HungPack

pytestmark = [pytest.mark.fuse, pytest.mark.root]

CHUNK = 64 * 1024
FETCH_TIMEOUT = 2.0
rng = random.Random(12)
# One chunk per file, all in one pack: readers of different files make store reads of one object.
HUNG_FILES = {f"f{n:02}.bin": rng.randbytes(10_000 + n) for n in range(24)}
HEALTHY_FILES = {"large.bin": rng.randbytes(40 * CHUNK + 5), "dir/small.txt": b"small\n" * 100}
LATER_FILES = {"later.bin": rng.randbytes(3 * CHUNK + 1)}
LAYERS = {"test/hung:1": HUNG_FILES, "test/healthy:1": HEALTHY_FILES, "test/later:1": LATER_FILES}


def build_layers(store, tmp_path) -> dict[str, tuple[str, list[str]]]:
    """ref -> (layer digest, its packs), each layer built from its files."""
    built = {}
    for ref, files in LAYERS.items():
        source = tmp_path / "src" / ref.replace("/", "_")
        for name, data in files.items():
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            (source / name).write_bytes(data)
        result = build_layer(str(source), store, name=ref, chunk_size=CHUNK)
        built[ref] = (result.digest, list(result.manifest.packs))
    assert len(built["test/hung:1"][1]) == 1
    return built


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_error(path: str) -> tuple[int | None, float]:
    """(errno of reading the file, None if it read; seconds it took)."""
    started = time.monotonic()
    try:
        read(path)
        code = None
    except OSError as exc:
        code = exc.errno
    return code, time.monotonic() - started


def hang_and_recover(node, daemons, tmp_path, built, hung_key: str, answer) -> None:
    """The scenario of the module docstring; the object hangs already, ``answer()`` makes it answer."""
    hung_digest = built["test/hung:1"][0]
    hung_mnt, healthy_mnt, later_mnt = mount_dirs(tmp_path, "hung", "healthy", "later")
    node.mount("test/hung:1", hung_mnt, mode="fuse")
    node.mount("test/healthy:1", healthy_mnt)  # kernel mode: reads come as blob reads

    # More readers at once than the fetcher has slots, each of another chunk of the hung pack.
    results: dict[str, tuple[int | None, float]] = {}
    readers = [threading.Thread(target=lambda name=name: results.__setitem__(name, read_error(
        os.path.join(hung_mnt, name)))) for name in HUNG_FILES]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(60)
    assert sorted(results) == sorted(HUNG_FILES)
    assert {code for code, _ in results.values()} == {errno.EIO}
    assert max(seconds for _, seconds in results.values()) < 3 * FETCH_TIMEOUT
    # Now refused at once (no deadline to wait for), and no new thread goes after the object.
    code, seconds = read_error(os.path.join(hung_mnt, "f00.bin"))
    assert code == errno.EIO and seconds < FETCH_TIMEOUT
    assert layer_metric(node, "dsecfs_fetch_abandoned_reads_total", hung_digest) == DEFAULT_OBJECT_READS
    assert layer_metric(node, "dsecfs_fetch_errors_total", hung_digest, kind="stuck") >= 1
    assert metrics(node)[("dsecfs_store_reads_running", frozenset())] == 0

    # The other layer reads the right bytes from the store (cold: caches emptied), and a new mount works.
    node.cache_evict(0)
    drop_caches()
    for name, data in HEALTHY_FILES.items():
        assert read(os.path.join(healthy_mnt, name)) == data
    node.mount("test/later:1", later_mnt, mode="fuse")
    assert read(os.path.join(later_mnt, "later.bin")) == LATER_FILES["later.bin"]
    log = daemons.log()
    assert log.count(f"store object {hung_key} did not answer") == 1  # logged once, with the key

    answer()
    deadline = time.monotonic() + 30
    while read_error(os.path.join(hung_mnt, "f00.bin"))[0] is not None:
        assert time.monotonic() < deadline, "the object answers again, but its layer does not read"
        time.sleep(0.2)
    for name, data in HUNG_FILES.items():
        assert read(os.path.join(hung_mnt, name)) == data
    # Logged once the last abandoned read's thread is back, which may be after the reads above: the
    # chunks it fetched are cached from that thread before it returns.
    while f"store object {hung_key} answered again" not in daemons.log():
        assert time.monotonic() < deadline, "no log line says the object answers again"
        time.sleep(0.1)
    assert node.ping()
    for mountpoint in (hung_mnt, healthy_mnt, later_mnt):
        node.umount(mountpoint)


def test_a_posix_store_object_that_never_answers(daemons, tmp_path):
    store_dir = str(tmp_path / "store")
    built = build_layers(FilesystemStore(store_dir, fsync=False), tmp_path)
    hung = HungPack(store_dir, built["test/hung:1"][1][0])
    try:
        node = daemons.start(f"posix://{store_dir}", fetch_timeout=FETCH_TIMEOUT).node
        hang_and_recover(node, daemons, tmp_path, built, hung.key, hung.answer)
    finally:
        hung.answer()  # no thread of the daemon stays in the FIFO, whatever failed


@pytest.mark.s3
def test_an_s3_get_that_stalls(daemons, tmp_path, s3_url, monkeypatch):
    with open_store(s3_url) as store:
        built = build_layers(store, tmp_path)
    hung_key = keys.pack(built["test/hung:1"][1][0])
    release = tmp_path / "release"
    monkeypatch.setenv("DSECFS_FAULTS", f"get:{hung_key}:stall={release}")
    try:
        node = daemons.start(s3_url, fetch_timeout=FETCH_TIMEOUT).node
        hang_and_recover(node, daemons, tmp_path, built, hung_key, release.touch)
    finally:
        release.touch()
