"""Daemon restarts with the raw FUSE binding (issue 4): a daemon killed with SIGKILL leaves its mounts
alive (the FUSE fd holder keeps the connection), the next daemon on the same state directory takes the
session over and adopts them: open files keep reading, new opens work, inode numbers stay, and a read
that was in flight at the kill is sent again (FUSE_NOTIFY_RESEND) and answered by the new daemon. A
normal stop (SIGTERM) still unmounts everything and stops the holder; a daemon with another binding
stops a holder it finds and detaches the dead mounts, as before.

Daemons are real ``dsecfs daemon`` processes (the ``daemons`` fixture, which checks that nothing is left
mounted); ``no_holder_left`` stops a holder a failed test left and checks that none is.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from dsec_fs.layer import LayerFiles, open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from lazy_fetch import fuse_holder
from lazy_fetch.layer_mount import HOLDER_SOCKET
from tests.lazy_fetch.daemon_support import drop_caches, layer_metric, mount_dirs

pytestmark = [pytest.mark.fuse, pytest.mark.root]

CHUNK = 64 * 1024
rng = random.Random(11)
FILES = {
    "big.bin": rng.randbytes(24 * CHUNK + 321),
    "cold.bin": rng.randbytes(6 * CHUNK + 5),  # read only while a kill happens
    "dir/small.txt": b"small\n",
}
MODES = ("kernel", "fuse")


@pytest.fixture(scope="module")
def restart_layer(tmp_path_factory) -> tuple[str, LayerFiles]:
    base = tmp_path_factory.mktemp("restart-layer")
    for name, data in FILES.items():
        os.makedirs(os.path.dirname(base / "src" / name), exist_ok=True)
        (base / "src" / name).write_bytes(data)
    store = FilesystemStore(str(base / "store"), fsync=False)
    built = build_layer(str(base / "src"), store, chunk_size=CHUNK)
    return str(base / "store"), open_layer(store, built.digest)


@pytest.fixture
def no_holder_left(daemons):
    holder = os.path.join(daemons.state_dir, HOLDER_SOCKET)
    try:
        yield holder
    finally:
        daemons.stop_all()  # first, so that a holder the last daemon stopped is not counted
        left = fuse_holder.stop(holder)
    assert not left, "a FUSE fd holder was left running"


def _blob_file(state_dir: str, layer: LayerFiles) -> str:
    return os.path.join(state_dir, "fuse", "blobs", layer.manifest.blob_id)


@pytest.mark.parametrize("mode", MODES)
def test_mounts_and_open_files_survive_a_sigkill(restart_layer, daemons, no_holder_left, tmp_path, mode):
    store, layer = restart_layer
    # No miss readahead: the first daemon must leave chunks of big.bin for the second to fetch.
    no_readahead = ["--miss-readahead", "0"]
    first = daemons.start(store, binding="raw", extra_args=no_readahead)
    mnt, = mount_dirs(tmp_path, "mnt")
    first.node.mount(layer.digest, mnt, mode=mode)
    big = os.path.join(mnt, "big.bin")
    inodes = {path: os.stat(path).st_ino for path in (big, os.path.join(mnt, "dir/small.txt"), mnt)}
    if mode == "kernel":
        blob_file = _blob_file(daemons.state_dir, layer)
        inodes[blob_file] = os.stat(blob_file).st_ino
    with open(big, "rb", buffering=0) as f:
        assert f.read(3 * CHUNK) == FILES["big.bin"][:3 * CHUNK]
        assert first.kill() < 0
        assert fuse_holder.alive(no_holder_left)

        second = daemons.start(store, binding="raw", extra_args=no_readahead).node
        status = second.status()
        assert [(m.mountpoint, m.mode, m.layer) for m in status.mounts] == [(mnt, mode, layer.digest)]
        assert status.cleaned == []
        drop_caches()  # what is read now comes from the new daemon
        assert f.read() == FILES["big.bin"][3 * CHUNK:]
        assert layer_metric(second, "dsecfs_fetch_chunks_total", layer.digest) > 0
    assert {path: os.stat(path).st_ino for path in inodes} == inodes
    with open(os.path.join(mnt, "dir/small.txt"), "rb") as f:
        assert f.read() == FILES["dir/small.txt"]
    second.umount(mnt)  # the adopted mount is the new daemon's to unmount
    assert second.mounts() == []


@pytest.mark.parametrize("mode", MODES)
def test_a_read_in_flight_at_the_kill_is_answered_by_the_next_daemon(restart_layer, daemons, no_holder_left,
                                                                    tmp_path, mode):
    store, layer = restart_layer
    first = daemons.start(store, binding="raw", latency_ms=1500)  # each store read takes 1.5 s
    mnt, = mount_dirs(tmp_path, "mnt")
    first.node.mount(layer.digest, mnt, mode=mode)
    first.node.cache_evict(0)
    drop_caches()
    got: list[bytes | BaseException] = []

    def read() -> None:
        try:
            with open(os.path.join(mnt, "cold.bin"), "rb") as f:
                got.append(f.read())
        except BaseException as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        time.sleep(0.5)  # the reader's first READ now waits for the store in the first daemon
        assert not got, "the read finished before the kill"
        first.kill()
        second = daemons.start(store, binding="raw").node  # no latency
    finally:
        reader.join(60)
    assert not reader.is_alive(), "the read in flight was never answered"
    assert got == [FILES["cold.bin"]]
    assert layer_metric(second, "dsecfs_fetch_chunks_total", layer.digest) > 0


def _raw_daemon_with_both_modes(restart_layer, daemons, tmp_path):
    """A raw-binding daemon with the layer mounted in kernel mode and in fuse mode; (daemon, kernel, fuse)."""
    store, layer = restart_layer
    daemon = daemons.start(store, binding="raw")
    kernel, fuse = mount_dirs(tmp_path, "kernel", "fuse")
    daemon.node.mount(layer.digest, kernel)
    daemon.node.mount(layer.digest, fuse, mode="fuse")
    return daemon, kernel, fuse


def test_sigterm_still_unmounts_everything_and_stops_the_holder(restart_layer, daemons, no_holder_left, tmp_path,
                                                               mounts_below):
    daemon, kernel, fuse = _raw_daemon_with_both_modes(restart_layer, daemons, tmp_path)
    assert fuse_holder.alive(no_holder_left)
    assert daemon.stop() == 0
    assert mounts_below(tmp_path) == []
    assert not fuse_holder.alive(no_holder_left) and not os.path.exists(no_holder_left)


def test_a_daemon_with_another_binding_stops_the_holder_and_detaches(restart_layer, daemons, no_holder_left, tmp_path,
                                                                     mounts_below):
    first, kernel, fuse = _raw_daemon_with_both_modes(restart_layer, daemons, tmp_path)
    first.kill()
    status = daemons.start(restart_layer[0], binding="pyfuse3").node.status()
    assert sorted(status.cleaned) == sorted([kernel, fuse]) and status.mounts == []
    assert not fuse_holder.alive(no_holder_left)
    assert mounts_below(tmp_path) == [os.path.join(daemons.state_dir, "fuse")]


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_file_while_no_daemon_runs_does_not_wait(restart_layer, daemons, no_holder_left, tmp_path, mode):
    """The kernel opens files itself (OPEN answered ENOSYS), so it would send FLUSH at every close, which
    waits for an answer; the daemon has it refuse FLUSH for good before any layer is mounted. Without
    that, this close (and any fork that closes inherited descriptors) hangs until a daemon starts."""
    store, layer = restart_layer
    first = daemons.start(store, binding="raw")
    mnt, = mount_dirs(tmp_path, "mnt")
    first.node.mount(layer.digest, mnt, mode=mode)
    f = open(os.path.join(mnt, "dir/small.txt"), "rb")
    assert f.read() == FILES["dir/small.txt"]
    first.kill()
    closer = threading.Thread(target=f.close)
    closer.start()
    try:
        closer.join(10)
        assert not closer.is_alive(), "close(2) waited for a daemon"
    finally:
        second = daemons.start(store, binding="raw").node  # answers a FLUSH resent to it, if any
        closer.join(60)
    second.umount(mnt)


def _holder_pids(socket_path: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if socket_path.encode() in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return pids


def test_a_stopping_daemon_ends_a_holder_whose_socket_is_gone(restart_layer, daemons, no_holder_left, tmp_path,
                                                              mounts_below):
    daemon, _kernel, _fuse = _raw_daemon_with_both_modes(restart_layer, daemons, tmp_path)
    holder_pids = _holder_pids(no_holder_left)
    assert len(holder_pids) == 1
    os.unlink(no_holder_left)  # e.g. the state directory cleaned by hand: the holder cannot be asked to stop
    assert daemon.stop(timeout=30) == 0
    assert _holder_pids(no_holder_left) == []
    assert mounts_below(tmp_path) == []
