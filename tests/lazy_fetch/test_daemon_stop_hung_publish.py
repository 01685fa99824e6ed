"""A daemon stops, in bounded time, even when the store stops answering its profile publishes (the real
daemon, its S3 store a moto server behind tests/lazy_fetch/black_hole.py, which then accepts and never
answers). Before, a publish under way ran in a worker thread the stop waited for, whatever the store did
(each of its requests waits out S3's read timeout, five times over with the retries): SIGTERM left the
daemon and its mounts there for minutes. Now a publish under way at the stop has
profile_keeper.FLUSH_SECONDS, and the flush after the last unmounts as long again for all it publishes;
past that a publish is given up and logged, its thread left where it waits. A stop whose store answers still publishes every profile (the second test).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess

import pytest

from dsec_fs.store import keys, open_store
from erofs_builder import build_layer
from lazy_fetch.profile_keeper import FLUSH_SECONDS
from tests.lazy_fetch.black_hole import BlackHoleProxy
from tests.lazy_fetch.daemon_support import mount_dirs
from treecmp import write_files

pytestmark = [pytest.mark.fuse, pytest.mark.root, pytest.mark.s3]

CHUNK = 64 * 1024
rng = random.Random(9)
LAYERS = {f"t/stop{n}:1": {f"f{i}.bin": rng.randbytes(2 * CHUNK + i) for i in range(3)} for n in range(2)}
# Two deadlines (the publish under way, then the flush's), and time for the unmounts and the exit.
STOP_BOUND = 2 * FLUSH_SECONDS + 30


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def mounted_and_read(daemons, s3_url, tmp_path) -> tuple:
    """A daemon with profiles on, both layers mounted (fuse mode) and every file read."""
    daemon = daemons.start(s3_url, profiles=True)
    mountpoints = mount_dirs(tmp_path, *(ref.split("/")[1].split(":")[0] for ref in LAYERS))
    digests = []
    for (ref, files), mountpoint in zip(LAYERS.items(), mountpoints):
        digests.append(daemon.node.mount(ref, mountpoint, mode="fuse").layer)
        for name, data in files.items():
            assert read(os.path.join(mountpoint, name)) == data
    return daemon, mountpoints, digests


def stopped_within(daemon, seconds: float) -> int | None:
    """SIGTERM; the exit status, or None if the daemon was still there after ``seconds`` (then killed)."""
    daemon.process.send_signal(signal.SIGTERM)
    try:
        return daemon.process.wait(seconds)
    except subprocess.TimeoutExpired:
        daemon.kill()
        return None


@pytest.fixture
def built(s3_url, tmp_path):
    with open_store(s3_url) as store:
        for ref, files in LAYERS.items():
            build_layer(write_files(tmp_path / "src" / ref.replace("/", "_"), files), store, name=ref,
                        chunk_size=CHUNK)


def test_a_stop_gives_up_publishes_to_a_store_that_never_answers(daemons, s3_url, built, tmp_path, monkeypatch,
                                                                 moto_server, mounts_below):
    with BlackHoleProxy(moto_server.url) as proxy:
        monkeypatch.setenv("DSECFS_S3_ENDPOINT", proxy.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        daemon, mountpoints, _digests = mounted_and_read(daemons, s3_url, tmp_path)
        proxy.hang()
        daemon.node.umount(mountpoints[0])  # its publish begins, in the background, and waits on the store
        status = stopped_within(daemon, STOP_BOUND)  # the other layer's publish is the flush's
        log = daemons.log()
        assert status == 0, f"the daemon did not stop within {STOP_BOUND} s of SIGTERM:\n{log[-3000:]}"
        assert mounts_below(tmp_path) == []
        assert log.count("gave up publishing the profile of layer") == 2, log[-3000:]


def test_a_stop_whose_store_answers_publishes_every_profile(daemons, s3_url, built, tmp_path, mounts_below):
    daemon, mountpoints, digests = mounted_and_read(daemons, s3_url, tmp_path)
    daemon.node.umount(mountpoints[0])  # under way, or queued, at the stop
    assert stopped_within(daemon, STOP_BOUND) == 0
    assert mounts_below(tmp_path) == []
    with open_store(s3_url) as store:
        for digest in digests:
            assert len(list(store.list(keys.layer_profiles(digest)))) == 1
    assert "gave up publishing" not in daemons.log()
