"""Fixtures for the filesystem core and the layer mounts: a small layer built into a FilesystemStore, and
a node daemon (chunk cache + fetcher + LayerMounter in a trio loop on a background thread) that mounts
it in each mode with each FUSE binding.

The layer (``LAYER_CHUNK`` = 8 KiB chunks, two blocks each) has every inode kind the kernel lets us make,
hard links, xattrs, a non-UTF-8 name, setuid/sticky bits, nanosecond mtimes, and files whose chunks test
the data path: several chunks and a partial last one, holes (sparse and written zeros), and a chunk
repeated inside one file (so its chunks are not back to back in the blob). ``victim.bin`` is built into
a layer of its own first, so its only chunk sits in a pack no other file uses: a store fault on that pack
fails that file and nothing else.

``layers`` (per module) is the two layers of the trace-analysis tests (analysis_support.py); test_daemon.py
has a ``layers`` fixture of its own, which overrides it there.

``daemons`` starts real ``dsecfs daemon`` processes (daemon_support.Daemons) for test_daemon*.py and, at the
end, stops them and checks that nothing is left mounted below the test's tmp_path.
"""

from __future__ import annotations

import os
import random
import stat
import threading
from dataclasses import dataclass

import pytest
import trio

from dsec_fs.layer import LayerFiles, open_layer
from dsec_fs.mounts import umount
from dsec_fs.store import FilesystemStore
from dsec_fs.store.base import Store
from erofs_builder import build_layer
from lazy_fetch.blob_reader import open_layer_blob
from lazy_fetch.cache import ChunkCache
from lazy_fetch.fetcher import open_fetcher
from lazy_fetch.layer_mount import open_mounter
from tests.lazy_fetch.analysis_support import Layers, build_layers
from tests.lazy_fetch.daemon_support import Daemons

LAYER_CHUNK = 8192
BLOCK_SIZE = 4096
MTIME_NS = 1_600_000_000_123_456_789
IS_ROOT = os.geteuid() == 0
VICTIM = random.Random(5).randbytes(LAYER_CHUNK - 3)  # one chunk of its own


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def make_source(root: str) -> dict[str, bytes]:
    """Create the test tree under ``root``; returns the content of every regular file by relative path."""
    rng = random.Random(4)
    chunk = LAYER_CHUNK
    p, q = rng.randbytes(chunk), rng.randbytes(chunk)
    files = {
        "big.bin": rng.randbytes(5 * chunk + 1234),
        "dup.bin": p + q + p + q[:777],  # chunk 2 is chunk 0 again: the blob holds it once
        "zeros.bin": bytes(3 * chunk),  # written zeros: every chunk is a hole
        "small.txt": b"hello\n",
        "empty": b"",
        "dir/sub/deep.txt": b"deep " * 100,
        "dir/!first": b"sorts before '.'",
        "dir/-dash": b"dash",
        "caf\udce9": b"latin-1 name",  # the name is the bytes b"caf\xe9"
        "healthy.bin": rng.randbytes(2 * chunk),
        "victim.bin": VICTIM,
    }
    for name, data in files.items():
        _write(os.path.join(root, name), data)
    # A sparse file: data, a two-chunk hole, a little data inside a chunk, then a hole to the end.
    sparse = os.path.join(root, "holes.bin")
    head, middle = rng.randbytes(chunk), rng.randbytes(100)
    with open(sparse, "wb") as f:
        f.write(head)
        f.seek(3 * chunk + 50)
        f.write(middle)
        f.truncate(5 * chunk + 10)
    files["holes.bin"] = head + bytes(2 * chunk + 50) + middle + bytes(5 * chunk + 10 - 3 * chunk - 150)

    os.link(os.path.join(root, "big.bin"), os.path.join(root, "dir/hard-link"))
    files["dir/hard-link"] = files["big.bin"]
    os.symlink("small.txt", os.path.join(root, "link"))
    os.symlink("no/such/target", os.path.join(root, "dir/dangling"))
    os.mkfifo(os.path.join(root, "fifo"))
    os.setxattr(os.path.join(root, "small.txt"), "user.comment", b"a note")
    os.setxattr(os.path.join(root, "dir"), "user.empty", b"")
    os.chmod(os.path.join(root, "big.bin"), 0o4755)
    os.makedirs(os.path.join(root, "sticky"))
    os.chmod(os.path.join(root, "sticky"), 0o1777)
    if IS_ROOT:
        os.mknod(os.path.join(root, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(os.path.join(root, "blockdev"), stat.S_IFBLK | 0o600, os.makedev(300, 70000))
        os.chown(os.path.join(root, "small.txt"), 1234, 5678)
        os.setxattr(os.path.join(root, "healthy.bin"), "trusted.overlay.opaque", b"y")
    # mtimes last, deepest first, so creating entries does not change a directory's mtime afterwards.
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        paths += [os.path.join(dirpath, name) for name in filenames + dirnames]
    for path in sorted(paths, key=lambda p: -p.count("/")):
        os.utime(path, ns=(MTIME_NS, MTIME_NS + len(path)), follow_symlinks=False)
    os.utime(root, ns=(MTIME_NS, MTIME_NS))
    return files


@dataclass
class BuiltLayer:
    source: str
    files: dict[str, bytes]  # relative path (str, surrogateescape) -> content
    store: FilesystemStore
    layer: LayerFiles
    victim_pack: str  # the pack that holds victim.bin's chunk and nothing else
    chunk_size: int = LAYER_CHUNK

    def odd_ranges(self, name: str) -> list[tuple[int, int]]:
        """(offset, length) pairs to read from file ``name``: around every block and chunk boundary, empty,
        whole, past the end."""
        size = len(self.files[name])
        ranges = [(0, 0), (0, 1), (0, size), (0, size + 4096), (size, 10), (size + 1, 10), (max(0, size - 1), 5)]
        for boundary in range(BLOCK_SIZE, size + self.chunk_size, BLOCK_SIZE):
            ranges += [(boundary - 1, 2), (boundary - 100, 333), (boundary + 7, self.chunk_size + 3),
                       (max(0, boundary - 5000), 3 * self.chunk_size + 17)]
        return ranges


@pytest.fixture(scope="session")
def built_layer(tmp_path_factory) -> BuiltLayer:
    base = tmp_path_factory.mktemp("layer")
    store = FilesystemStore(str(base / "store"), fsync=False)
    victim_only = base / "victim-only"
    _write(str(victim_only / "victim.bin"), VICTIM)
    victim_pack, = build_layer(str(victim_only), store, chunk_size=LAYER_CHUNK).manifest.packs
    source = str(base / "src")
    files = make_source(source)
    result = build_layer(source, store, chunk_size=LAYER_CHUNK)
    assert victim_pack in result.manifest.packs and len(result.manifest.packs) == 2
    return BuiltLayer(source, files, store, open_layer(store, result.digest), victim_pack)


class Daemon:
    """What the node daemon runs, in a trio loop on a background thread: a chunk cache and fetcher over
    ``store``, and a LayerMounter with its FUSE session. Sync test code drives it with ``mount`` and
    ``unmount``; ``close`` unmounts everything and stops the loop (and raises what the loop raised)."""

    def __init__(self, store: Store, workdir, *, binding: str):
        self.store = store
        self.cache_dir = str(workdir / "cache")
        self.state_dir = str(workdir / "state")
        self.binding = binding
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test daemon", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._failure = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        with ChunkCache(self.cache_dir, 1 << 30) as cache:
            async with open_fetcher(self.store, cache, timeout=10) as fetcher, \
                    open_mounter(self.state_dir, binding=self.binding) as mounter:
                self.fetcher, self.mounter = fetcher, mounter
                self._stop = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()

    async def _mount(self, layer: LayerFiles, mountpoint: str, mode: str):
        blob = await open_layer_blob(layer, self.fetcher)
        return await self.mounter.mount_layer(layer, blob, mountpoint, mode=mode)

    def mount(self, layer: LayerFiles, mountpoint, mode: str):
        if not os.path.lexists(mountpoint):
            os.makedirs(mountpoint)
        return trio.from_thread.run(self._mount, layer, str(mountpoint), mode, trio_token=self._token)

    def unmount(self, mountpoint, lazy: bool = False) -> None:
        trio.from_thread.run(lambda: self.mounter.unmount(str(mountpoint), lazy=lazy), trio_token=self._token)

    def wait(self) -> None:
        """Wait for the loop to end by itself (it does when the mounter fails)."""
        self._thread.join()

    def close(self) -> None:
        """Stop the loop (a second call does nothing); raises what the loop raised."""
        if self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:  # the loop ended by itself meanwhile (it failed)
                pass
            self._thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


def mounted_below(path) -> list[str]:
    """Mount points at or below ``path``, from /proc/self/mountinfo."""
    path = os.path.realpath(str(path))
    with open("/proc/self/mountinfo") as f:
        targets = [line.split()[4].encode().decode("unicode_escape") for line in f]
    return [t for t in targets if t == path or t.startswith(path + "/")]


MODES_AND_BINDINGS = [("kernel", "pyfuse3"), ("fuse", "pyfuse3"), ("kernel", "fusepy"), ("fuse", "fusepy"),
                      ("kernel", "raw"), ("fuse", "raw")]


@pytest.fixture(params=MODES_AND_BINDINGS, ids=["-".join(p) for p in MODES_AND_BINDINGS])
def mode_and_binding(request) -> tuple[str, str]:
    return request.param


@pytest.fixture
def start_daemon(tmp_path):
    """Start a Daemon (working in tmp_path) over a store; it is closed at teardown, and then nothing may
    be left mounted below tmp_path."""
    daemons = []

    def start(store: Store, *, binding: str) -> Daemon:
        assert not daemons, "one daemon per test: pyfuse3 has one session per process"
        daemons.append(Daemon(store, tmp_path, binding=binding))
        return daemons[0]

    try:
        yield start
    finally:
        for daemon in daemons:
            daemon.close()
    assert mounted_below(tmp_path) == []


@dataclass
class Mounted:
    mountpoint: str
    mode: str
    daemon: Daemon


@pytest.fixture
def mounted_layer(built_layer, tmp_path, mode_and_binding, start_daemon) -> Mounted:
    """``built_layer`` mounted by a fresh Daemon, in every mode with every binding."""
    mode, binding = mode_and_binding
    daemon = start_daemon(built_layer.store, binding=binding)
    mountpoint = str(tmp_path / "mnt")
    daemon.mount(built_layer.layer, mountpoint, mode)
    return Mounted(mountpoint, mode, daemon)


@pytest.fixture
def mounts_below():
    """``mounted_below`` for tests (a function, handed out as a fixture so tests need not import conftest)."""
    return mounted_below


@pytest.fixture
def daemons(tmp_path, mounts_below):
    """Start ``dsecfs daemon`` processes with ``daemons.start``; at the end they are stopped, and nothing may
    be left mounted below tmp_path."""
    started = Daemons(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()
        left = mounts_below(tmp_path)
        for target in sorted(left, key=len, reverse=True):  # so the next test is unharmed
            umount(target, lazy=True)
        assert left == []


@pytest.fixture(scope="module")
def layers(tmp_path_factory) -> Layers:
    return build_layers(tmp_path_factory.mktemp("layers"))
