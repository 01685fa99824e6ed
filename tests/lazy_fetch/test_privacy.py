"""Another local user (uid 65534) reads nothing of what the node keeps: not the daemon's state directory
(blob files, meta images, traces, the FUSE session), not its chunk cache, not a local store's packs;
while a layer is mounted in kernel and in fuse mode and its data has been read (so every kind of file
exists). Through the mountpoints the image's own modes decide: a 0644 file is readable, a 0600 root file
and anything in a 0700 root directory are not, in both modes and with every FUSE binding (the session
is mounted allow_other for sandboxes of other uids, and default_permissions so the kernel checks each
file's mode).

On main the state directory was 0755 and blob files 0444, so uid 65534 read a 0600 file's bytes from
``state/fuse/blobs/<blob id>``; the store's packs were 0644 in 0755 directories.

The test's directories are under a 0711 directory of its own, not pytest's tmp_path (whose 0700 parents
would keep uid 65534 out of everything and so prove nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from tests.lazy_fetch.daemon_support import Daemons

pytestmark = [pytest.mark.fuse, pytest.mark.root]

NOBODY = 65534
PUBLIC = b"anyone may read this\n" * 300
SECRET = b"root's alone\n" * 300
HIDDEN = b"in a 0700 directory\n"

# Run as uid 65534: for each path on stdin (JSON list), what opening and reading it gives, as
# {"path": [True, bytes read (latin-1)] or [False, errno]}. A directory is "read" by listing it.
PROBE = r"""
import errno, json, os, sys
results = {}
for path in json.load(sys.stdin):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            results[path] = [True, "\0".join(sorted(os.listdir(path)))]
        else:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                results[path] = [True, os.read(fd, 1 << 20).decode("latin-1")]
            finally:
                os.close(fd)
    except OSError as exc:
        results[path] = [False, exc.errno]
json.dump(results, sys.stdout)
"""


def as_nobody(paths: list[str]) -> dict[str, tuple[bool, object]]:
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-I", "-c", PROBE], input=json.dumps(paths), capture_output=True,
                           text=True, timeout=120, cwd="/")
    assert probe.returncode == 0, probe.stderr
    return {path: tuple(result) for path, result in json.loads(probe.stdout).items()}


def every_path_below(top: str) -> list[str]:
    """``top`` and everything below it, as root sees it (without descending into other mounts but the
    FUSE session, whose blobs and layer trees are what matters most)."""
    found = [top]
    for dirpath, dirnames, filenames in os.walk(top):
        found += [os.path.join(dirpath, name) for name in dirnames + filenames]
    return found


@pytest.fixture
def world_dir():
    """A directory every user may pass through (0711) but not list, removed at the end."""
    path = tempfile.mkdtemp(prefix="dsecfs-privacy-", dir="/tmp")
    os.chmod(path, 0o711)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def world_daemons(world_dir, mounts_below):
    started = Daemons(world_dir)
    try:
        yield started
    finally:
        started.stop_all()
        left = mounts_below(world_dir)
        assert left == []


def _make_source(root: Path) -> None:
    (root / "hidden").mkdir(parents=True)
    (root / "public.txt").write_bytes(PUBLIC)
    (root / "secret.txt").write_bytes(SECRET)
    (root / "hidden" / "inside.txt").write_bytes(HIDDEN)
    os.chmod(root, 0o755)
    os.chmod(root / "public.txt", 0o644)
    os.chmod(root / "secret.txt", 0o600)
    os.chmod(root / "hidden", 0o700)
    os.chmod(root / "hidden" / "inside.txt", 0o644)


@pytest.mark.parametrize("binding", ["raw", "pyfuse3", "fusepy"])
def test_another_user_reads_nothing_the_node_keeps(world_dir, world_daemons, binding):
    source = world_dir / "src"
    _make_source(source)
    store_dir = str(world_dir / "store")
    digest = build_layer(str(source), FilesystemStore(store_dir, fsync=False)).digest
    state_dir = world_daemons.state_dir
    os.makedirs(state_dir, mode=0o755)  # as an older version left it: the daemon narrows it
    os.chmod(state_dir, 0o755)

    node = world_daemons.start(store_dir, binding=binding).node
    mounts = {mode: str(world_dir / f"mnt-{mode}") for mode in ("kernel", "fuse")}
    for mode, mountpoint in mounts.items():
        os.makedirs(mountpoint)
        node.mount(digest, mountpoint, mode=mode)
        for name, data in (("public.txt", PUBLIC), ("secret.txt", SECRET), ("hidden/inside.txt", HIDDEN)):
            assert Path(mountpoint, name).read_bytes() == data  # root reads all; now the cache holds it
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
    blobs = os.path.join(state_dir, "fuse", "blobs")
    blob_files = [os.path.join(blobs, name) for name in os.listdir(blobs)]
    assert len(blob_files) == 1 and stat.S_IMODE(os.stat(blob_files[0]).st_mode) == 0o400
    assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
    store_files = [p for p in every_path_below(store_dir) if os.path.isfile(p)]
    assert store_files and {stat.S_IMODE(os.stat(p).st_mode) for p in store_files} == {0o600}

    kept = {"state": every_path_below(state_dir), "store": every_path_below(store_dir)}
    assert any(p.startswith(blobs + "/") for p in kept["state"]) and len(kept["store"]) > 3
    through_mounts = {os.path.join(mountpoint, name): (mode, name) for mode, mountpoint in mounts.items()
                      for name in ("public.txt", "secret.txt", "hidden", "hidden/inside.txt")}
    results = as_nobody([p for paths in kept.values() for p in paths] + list(through_mounts))

    for what, paths in kept.items():
        leaks = [p for p in paths if results[p][0]]
        assert leaks == [], f"uid {NOBODY} read these under the {what} directory: {leaks[:10]}"
    for path, (mode, name) in through_mounts.items():
        readable, got = results[path]
        if name == "public.txt":
            assert readable and got.encode("latin-1") == PUBLIC, f"{mode} mode: {path}: {got}"
        else:
            assert not readable and got == 13, f"{mode} mode: uid {NOBODY} read {path} (or not EACCES: {got})"
    for mountpoint in mounts.values():
        node.umount(mountpoint)


def test_another_user_reads_nothing_in_the_chunk_cache(world_dir, world_daemons):
    source = world_dir / "src"
    _make_source(source)
    store_dir = str(world_dir / "store")
    digest = build_layer(str(source), FilesystemStore(store_dir, fsync=False)).digest
    node = world_daemons.start(store_dir).node
    mountpoint = str(world_dir / "mnt")
    os.makedirs(mountpoint)
    node.mount(digest, mountpoint, mode="fuse")
    assert Path(mountpoint, "secret.txt").read_bytes() == SECRET
    cached = every_path_below(world_daemons.cache_dir)
    assert any(os.path.isfile(p) for p in cached), "nothing was cached"
    results = as_nobody(cached)
    node.umount(mountpoint)
    leaks = [p for p in cached if results[p][0]]
    assert leaks == [], f"uid {NOBODY} read these under the cache directory: {leaks[:10]}"
