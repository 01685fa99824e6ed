"""Mounts of a stack's layers run at once in one node daemon, and the calls on one mountpoint or one
layer still take turns (lazy_fetch/turns.py, daemon_mounts.py): a real NodeDaemon in this test's trio
loop (raw FUSE binding, kernel-mode mounts, a directory store), one layer's mount(2) held in its worker
thread until the test lets it go. That hold is the only thing not real: no real part makes a mount(2)
slow on demand.

Before the turns, one lock made every mount wait for the one under way: the second layer of a stack
waited for the first layer's whole mount (docs/benchmarks.md, issue 13, session 12).
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import trio

from dsec_fs.errors import ConflictError, NotFoundError
from dsec_fs.mounts import mount_table
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from lazy_fetch.daemon import DaemonOptions, NodeDaemon
from lazy_fetch.layer_mount import LayerMounter
from tests.lazy_fetch.daemon_support import mount_dirs
from treecmp import write_files

pytestmark = [pytest.mark.fuse, pytest.mark.root]

FILES_A = {"a.txt": b"layer a\n" * 500, "dir/a.bin": os.urandom(200_000)}
FILES_B = {"b.txt": b"layer b\n" * 500, "dir/b.bin": os.urandom(150_000)}
HOLD_SECONDS = 20  # a hold never outlives a failed test by more


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> tuple[str, str, str, str]:
    """(store directory, digest of layer A, digest of layer B, blob id of layer A)."""
    base = tmp_path_factory.mktemp("turns")
    store = FilesystemStore(str(base / "store"), fsync=False)
    a = build_layer(write_files(base / "a", FILES_A), store, name="t/a:1", chunk_size=64 * 1024)
    b = build_layer(write_files(base / "b", FILES_B), store, name="t/b:1", chunk_size=64 * 1024)
    return str(base / "store"), a.digest, b.digest, a.manifest.blob_id


class HeldMount:
    """Holds the worker-thread part of a kernel-mode mount (meta image, mount(2)) of one layer until
    ``go``; ``entered`` is set once a mount of it got there."""

    def __init__(self, monkeypatch, digest: str):
        self.entered, self.released = threading.Event(), threading.Event()
        original = LayerMounter._place_meta_and_mount

        def place(mounter, layer, *args):
            if layer.digest == digest:
                self.entered.set()
                self.released.wait(HOLD_SECONDS)
            return original(mounter, layer, *args)

        monkeypatch.setattr(LayerMounter, "_place_meta_and_mount", place)

    def go(self) -> None:
        self.released.set()


def _ours_below(path: str) -> list[str]:
    return sorted(e.mountpoint for e in mount_table() if e.mountpoint.startswith(path + "/"))


async def _read(path: str) -> bytes:
    """From a worker thread: this thread serves the FUSE session the read may need."""
    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return await trio.to_thread.run_sync(read)


async def _with_daemon(tmp_path, store: str, body) -> None:
    daemon = NodeDaemon(DaemonOptions(socket_path=str(tmp_path / "s"), state_dir=str(tmp_path / "state"),
                                      cache_dir=str(tmp_path / "cache"), store_url=store, fuse_binding="raw",
                                      profiles=False, idle_grace=0))
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        try:
            await body(daemon)
        finally:
            daemon.shutdown()


async def _until(condition, what: str) -> None:
    with trio.fail_after(HOLD_SECONDS):
        while not condition():
            await trio.sleep(0.01)


def test_a_layer_mounts_while_another_layers_mount_is_under_way_and_one_mountpoint_takes_turns(
        store_dir, tmp_path, monkeypatch):
    store, a, b, blob_a = store_dir
    x, y, z = mount_dirs(tmp_path, "x", "y", "z")
    held = HeldMount(monkeypatch, a)
    results: dict[str, object] = {}

    async def run(name, call, *args, **kwargs):
        try:
            results[name] = await call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - what each call ended with is what the test checks
            results[name] = exc

    async def body(daemon: NodeDaemon) -> None:
        try:
            async with trio.open_nursery() as calls:
                calls.start_soon(run, "a at x", daemon.mount, a, x)
                await trio.to_thread.run_sync(held.entered.wait, HOLD_SECONDS)
                # Layer B mounts, whole, while A's mount(2) is held; the table lists A's as being made.
                with trio.fail_after(HOLD_SECONDS):
                    info = await daemon.mount(b, y)
                assert info.layer == b and await _read(os.path.join(y, "b.txt")) == FILES_B["b.txt"]
                with open(tmp_path / "state" / "mounts.json") as f:
                    listed = {e["mountpoint"]: e.get("mounting", False) for e in json.load(f)["mounts"]}
                assert listed == {x: True, y: False}
                # These wait for A's mount: A again elsewhere (its blob's turn), then at x B (a conflict
                # once A is there) and x's unmount, in that order (x's turn).
                calls.start_soon(run, "a at z", daemon.mount, a, z)
                await _until(lambda: daemon._turns.callers(("blob", blob_a)) == 2, "a at z waits")
                calls.start_soon(run, "b at x", daemon.mount, b, x)
                await _until(lambda: daemon._turns.callers(("mountpoint", x)) == 2, "b at x waits")
                calls.start_soon(run, "unmount x", daemon.unmount, x)
                await _until(lambda: daemon._turns.callers(("mountpoint", x)) == 3, "the unmount waits")
                assert set(results) == set()  # none of them went past A's mount
                held.go()
        finally:
            held.go()
        assert results["a at x"].layer == a and results["a at z"].layer == a
        assert isinstance(results["b at x"], ConflictError)
        assert results["unmount x"] == x
        assert sorted(daemon.table.mounts) == sorted([y, z]) and not daemon.table.mounting
        assert daemon.layers[a].mounts == 1 and daemon.layers[b].mounts == 1
        assert _ours_below(str(tmp_path)) == sorted([str(tmp_path / "state" / "fuse"), y, z])
        assert await _read(os.path.join(z, "dir/a.bin")) == FILES_A["dir/a.bin"]
        assert await _read(os.path.join(y, "dir/b.bin")) == FILES_B["dir/b.bin"]
        for mountpoint in (y, z):
            await daemon.unmount(mountpoint)
        with pytest.raises(NotFoundError):
            await daemon.unmount(x)
        assert not daemon.layers and not daemon._served and len(daemon._turns) == 0
        assert os.listdir(tmp_path / "state" / "meta") == []

    try:
        trio.run(_with_daemon, tmp_path, store, body)
    finally:
        assert _ours_below(str(tmp_path)) == []

