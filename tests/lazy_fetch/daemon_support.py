"""Helpers of the tests that run the node daemon for real (test_daemon*.py); the ``daemons`` fixture that
uses ``Daemons`` is in conftest.py.

- ``Daemons``: ``dsecfs daemon`` subprocesses on one test's directories, driven through dsec_fs.client.
- ``metrics``/``layer_metric``: samples of a daemon's /metrics.
- ``file_chunks``: the chunks holding a file's data, from a layer's image and blob map.
- ``drop_caches``/``mount_dirs``: a cold page cache, fresh mount points.
- ``wait_for``: poll a condition until it holds, or fail naming what was awaited.

Import it as ``tests.lazy_fetch.daemon_support`` (not through conftest: pytest loads every directory's
conftest under the one name "conftest").
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

from prometheus_client.parser import text_string_to_metric_families

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.client import DaemonProcess, Node
from dsec_fs.layer import LayerFiles
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.ondisk.chunk_index import HOLE
from erofs_builder.reader import ErofsImage
from treecmp import write_files

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")


class Daemons:
    """Real daemon processes working in one test's directories (state, cache, log under tmp_path; the
    socket in a short directory of its own, since a unix socket path holds at most 107 bytes)."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.socket_dir = tempfile.mkdtemp(prefix="dsd-", dir="/tmp")
        self.socket = os.path.join(self.socket_dir, "daemon.sock")
        self.state_dir = str(tmp_path / "state")
        self.cache_dir = str(tmp_path / "cache")
        self.log_file = str(tmp_path / "daemon.log")
        self.started: list[DaemonProcess] = []

    def start(self, store: str, *, binding: str | None = None, profiles: bool = False, **options) -> DaemonProcess:
        """Start one (the previous one must have stopped: they share the directories); ``binding`` None:
        the daemon's default. Access profiles are off unless ``profiles``: tests share stores, and a
        profile one test's mount published would make another's mount prefetch. Idle sandbox layers are
        unmounted at once unless ``extra_args`` give ``--idle-grace``."""
        options.setdefault("fetch_timeout", 10)
        # Sandbox layers go at the last down (later arguments may say otherwise): tests look for them gone.
        options["extra_args"] = ["--idle-grace", "0", *options.get("extra_args", ())]
        if not profiles:
            options["extra_args"] = [*options["extra_args"], "--no-profiles"]
        options.setdefault("cache_dir", self.cache_dir)
        options.setdefault("command", [DSECFS])
        daemon = Node.start_daemon(self.socket, state_dir=self.state_dir, store=store, fuse_binding=binding,
                                   log_file=self.log_file, **options)
        self.started.append(daemon)
        return daemon

    def log(self) -> str:
        with open(self.log_file, errors="replace") as f:
            return f.read()

    def stop_all(self) -> None:
        """Stop every daemon started and remove the socket directory, then fail if any daemon failed: one
        that failed must not leave the others running, nor the directory behind."""
        try:
            codes = [daemon.stop() for daemon in self.started]
        finally:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        assert all(code in (0, -signal.SIGKILL) for code in codes), \
            f"a daemon failed ({codes}); the log:\n{self.log()[-3000:]}"


def metrics(node: Node) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, from the daemon's /metrics."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(node.metrics_text()) for sample in family.samples}


def layer_metric(node: Node, name: str, layer: str, **labels) -> float:
    return metrics(node).get((name, frozenset({"layer": layer, **labels}.items())), 0.0)


def file_chunks(layer: LayerFiles, path: str) -> set[bytes]:
    """The distinct chunks (digests) holding a file's data, from the layer's image and blob map."""
    image = ErofsImage(layer.meta, source="meta.erofs")
    blob_map = EncodedBlobMap(layer.blobmap, source="blobmap")
    digest_at = {blkaddr: digest for blkaddr, digest, _length in blob_map.entries}
    return {digest_at[blkaddr] for _device, blkaddr in image.chunk_map(image.resolve(path.encode()))
            if blkaddr != HOLE}


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def layer_store(base, files: dict[str, bytes], ref: str, chunk_size: int) -> str:
    """A local store under ``base`` holding one layer of ``files`` (written to base/src) named ``ref``;
    returns the store's directory."""
    store = str(base / "store")
    build_layer(write_files(base / "src", files), FilesystemStore(store, fsync=False), name=ref,
                chunk_size=chunk_size)
    return store


def mount_dirs(tmp_path, *names) -> list[str]:
    paths = [str(tmp_path / name) for name in names]
    for path in paths:
        os.makedirs(path)
    return paths


def memory_bytes(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of process ``pid`` from /proc/PID/status: VmRSS (resident now), VmHWM (its peak)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def wait_for(condition, what: str, timeout: float = 20.0):
    """``condition()``'s first true value, polled every 20 ms; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
