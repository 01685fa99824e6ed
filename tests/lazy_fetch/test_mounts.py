"""Layer mounts for real: kernel mode (EROFS over the FUSE blob file) and fuse mode (the tree over FUSE,
bind-mounted), each with pyfuse3 and with fusepy. Daemons come from the ``start_daemon`` fixture, which
closes them (unmounting everything) and then checks that nothing is left mounted."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest
import trio
from treecmp import assert_same_tree, snapshot

import lazy_fetch
from dsec_fs.errors import ConflictError, UnavailableError
from dsec_fs.layer import open_layer
from dsec_fs.mounts import umount
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import FaultStore
from erofs_builder import build_tree
from erofs_builder.tree import Node, Tree
from lazy_fetch.fs_core import LayerTree
from lazy_fetch.layer_mount import open_mounter

pytestmark = [pytest.mark.fuse, pytest.mark.root]

BIG_DIRECTORY = 100_000


def test_the_mounted_tree_is_the_source(built_layer, mounted_layer):
    assert_same_tree(snapshot(built_layer.source), snapshot(mounted_layer.mountpoint))


def test_reads_at_odd_offsets(built_layer, mounted_layer):
    for name in ("big.bin", "dup.bin", "holes.bin", "zeros.bin", "small.txt"):
        data = built_layer.files[name]
        fd = os.open(os.path.join(mounted_layer.mountpoint, name), os.O_RDONLY)
        try:
            for offset, length in built_layer.odd_ranges(name):
                assert os.pread(fd, length, offset) == data[offset:offset + length], (name, offset, length)
        finally:
            os.close(fd)


def test_the_mount_is_read_only_and_ignores_setuid_and_devices(mounted_layer):
    flags = os.statvfs(mounted_layer.mountpoint).f_flag
    assert flags & os.ST_RDONLY and flags & os.ST_NOSUID and flags & os.ST_NODEV
    with pytest.raises(PermissionError):  # the device node 1:3 of the image opens nothing (nodev)
        open(os.path.join(mounted_layer.mountpoint, "null"), "rb")
    path = os.path.join(mounted_layer.mountpoint, "small.txt")
    for attempt in (lambda: open(path, "ab"), lambda: os.mkdir(path + ".d"), lambda: os.unlink(path)):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS


@pytest.fixture(scope="module")
def big_directory_layer(tmp_path_factory):
    """A layer with one directory of BIG_DIRECTORY empty files (built from a Tree: no files on disk)."""
    tree = Tree()
    for i in range(BIG_DIRECTORY):
        tree.add(b"big/entry-%06d" % i, Node(mode=stat.S_IFREG | 0o644))
    store = FilesystemStore(str(tmp_path_factory.mktemp("big") / "store"), fsync=False)
    return store, open_layer(store, build_tree(tree, store, chunk_size=4096).digest)


def test_a_large_directory_lists_fully(big_directory_layer, tmp_path, mode_and_binding, start_daemon):
    store, layer = big_directory_layer
    mode, binding = mode_and_binding
    start_daemon(store, binding=binding).mount(layer, tmp_path / "mnt", mode)
    names = os.listdir(tmp_path / "mnt" / "big")
    assert len(names) == BIG_DIRECTORY
    assert set(names) == {"entry-%06d" % i for i in range(BIG_DIRECTORY)}
    assert os.stat(tmp_path / "mnt" / "big" / names[-1]).st_size == 0


@pytest.mark.parametrize("fault", ["permanent", "corrupt"])
def test_a_store_error_is_eio_for_that_file_only(built_layer, tmp_path, mode_and_binding, start_daemon, fault):
    mode, binding = mode_and_binding
    store = FaultStore(built_layer.store, f"get:{keys.pack(built_layer.victim_pack)}:{fault}")
    mnt = tmp_path / "mnt"
    start_daemon(store, binding=binding).mount(built_layer.layer, mnt, mode)
    for _attempt in range(2):
        with open(mnt / "victim.bin", "rb") as f, pytest.raises(OSError) as info:
            f.read()
        assert info.value.errno == errno.EIO
        assert (mnt / "healthy.bin").read_bytes() == built_layer.files["healthy.bin"]
    assert "victim.bin" in os.listdir(mnt)
    assert (mnt / "dir/sub/deep.txt").read_bytes() == built_layer.files["dir/sub/deep.txt"]


@pytest.mark.parametrize("binding", ["pyfuse3", "fusepy", "raw"])
def test_both_modes_and_shared_layers_in_one_daemon(built_layer, tmp_path, start_daemon, mounts_below, binding):
    daemon = start_daemon(built_layer.store, binding=binding)
    mountpoints = [tmp_path / name for name in ("kernel-1", "kernel-2", "fuse-1", "fuse-2")]
    for mountpoint, mode in zip(mountpoints, ["kernel", "kernel", "fuse", "fuse"]):
        daemon.mount(built_layer.layer, mountpoint, mode)
    fuse_dir = tmp_path / "state" / "fuse"
    assert os.listdir(fuse_dir / "blobs") == [built_layer.layer.manifest.blob_id]
    assert os.listdir(fuse_dir / "layers") == [built_layer.layer.digest]
    expected = snapshot(built_layer.source)
    for mountpoint in mountpoints:
        assert_same_tree(expected, snapshot(mountpoint))

    # Two mounts of a layer in one mode share its blob (or tree), which stays until the second goes.
    daemon.unmount(mountpoints[0])
    daemon.unmount(mountpoints[2])
    assert os.listdir(fuse_dir / "blobs") == [built_layer.layer.manifest.blob_id]
    assert (mountpoints[1] / "small.txt").read_bytes() == b"hello\n"
    assert (mountpoints[3] / "small.txt").read_bytes() == b"hello\n"
    daemon.unmount(mountpoints[1])
    daemon.unmount(mountpoints[3])
    assert os.listdir(fuse_dir / "blobs") == os.listdir(fuse_dir / "layers") == []
    assert mounts_below(tmp_path) == [str(fuse_dir)]
    daemon.close()
    assert mounts_below(tmp_path) == []


def test_a_busy_mount_is_refused_then_detached_lazily(built_layer, tmp_path, mode_and_binding, start_daemon,
                                                      mounts_below):
    mode, binding = mode_and_binding
    daemon = start_daemon(built_layer.store, binding=binding)
    mnt = tmp_path / "mnt"
    daemon.mount(built_layer.layer, mnt, mode)
    with open(mnt / "big.bin", "rb") as busy:
        with pytest.raises(UnavailableError) as info:
            daemon.unmount(mnt)
        assert info.value.transient
        daemon.unmount(mnt, lazy=True)
        assert str(mnt) not in mounts_below(tmp_path)
        # The detached mount still serves the file that is open.
        assert busy.read() == built_layer.files["big.bin"]


def test_one_pyfuse3_session_and_one_owner_per_state_directory(built_layer, tmp_path, start_daemon):
    daemon = start_daemon(built_layer.store, binding="pyfuse3")

    async def open_second(state_dir):
        async with open_mounter(state_dir, binding="pyfuse3"):
            pass

    with pytest.raises(ConflictError, match="another daemon"):
        trio.run(open_second, daemon.state_dir)
    with pytest.raises(ConflictError, match="one FUSE session per process"):
        trio.run(open_second, str(tmp_path / "other-state"))


@pytest.mark.parametrize("binding", ["pyfuse3", "fusepy", "raw"])
def test_unmounts_from_outside_are_noticed(built_layer, tmp_path, start_daemon, mounts_below, binding):
    daemon = start_daemon(built_layer.store, binding=binding)
    mnt = tmp_path / "mnt"
    daemon.mount(built_layer.layer, mnt, "kernel")
    umount(mnt)
    daemon.unmount(mnt)  # someone else did it: the daemon still drops the blob
    assert os.listdir(tmp_path / "state" / "fuse" / "blobs") == []

    # The session itself going away ends the daemon's mounter with an error: nothing can be served.
    umount(tmp_path / "state" / "fuse")
    daemon.wait()
    with pytest.raises(ExceptionGroup) as info:  # from the nursery of the test daemon's fetcher
        daemon.close()
    assert info.group_contains(UnavailableError, match="unmounted from outside")
    assert mounts_below(tmp_path) == []


def test_pyfuse3_caches_missing_names_of_a_layer(built_layer, tmp_path, start_daemon, monkeypatch):
    asked = []
    real_lookup = LayerTree.lookup

    def counting_lookup(tree, parent, name):  # observation only: counts what reaches the core
        asked.append(name)
        return real_lookup(tree, parent, name)

    monkeypatch.setattr(LayerTree, "lookup", counting_lookup)
    start_daemon(built_layer.store, binding="pyfuse3").mount(built_layer.layer, tmp_path / "mnt", "fuse")
    for _attempt in range(3):
        assert not os.path.exists(tmp_path / "mnt" / "dir" / "missing")
        assert os.path.exists(tmp_path / "mnt" / "dir" / "-dash")
    assert asked.count(b"missing") == 1 and asked.count(b"-dash") == 1


@pytest.mark.parametrize("mode", ["kernel", "fuse"])
def test_a_failed_mount_leaves_nothing_behind(built_layer, tmp_path, start_daemon, mounts_below, mode):
    daemon = start_daemon(built_layer.store, binding="pyfuse3")
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    with pytest.raises(UnavailableError):
        daemon.mount(built_layer.layer, not_a_directory, mode)
    state = tmp_path / "state"
    assert os.listdir(state / "fuse" / "blobs") == os.listdir(state / "fuse" / "layers") == []
    assert os.listdir(state / "meta") == []
    assert mounts_below(tmp_path) == [str(state / "fuse")]
    daemon.mount(built_layer.layer, tmp_path / "mnt", mode)  # and the next one works
    assert (tmp_path / "mnt" / "small.txt").read_bytes() == b"hello\n"


def test_a_failed_second_kernel_mount_keeps_the_meta_image_the_first_one_uses(built_layer, tmp_path, start_daemon,
                                                                              mounts_below):
    """The meta image is written by a layer's first kernel mount and shared by the others: a later mount
    of the layer that fails (its mountpoint is a file) must not remove it, nor the blob the first serves."""
    daemon = start_daemon(built_layer.store, binding="pyfuse3")
    daemon.mount(built_layer.layer, tmp_path / "mnt", "kernel")
    state = tmp_path / "state"
    images = os.listdir(state / "meta")
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    with pytest.raises(UnavailableError):
        daemon.mount(built_layer.layer, not_a_directory, "kernel")
    assert os.listdir(state / "meta") == images and len(images) == 1
    assert mounts_below(tmp_path) == [str(state / "fuse"), str(tmp_path / "mnt")]
    daemon.unmount(tmp_path / "mnt")
    assert os.listdir(state / "meta") == [] and os.listdir(state / "fuse" / "blobs") == []
    daemon.mount(built_layer.layer, tmp_path / "mnt2", "kernel")  # written again for the next first mount
    assert (tmp_path / "mnt2" / "small.txt").read_bytes() == b"hello\n"


def test_a_new_daemon_clears_the_session_a_killed_one_left(built_layer, tmp_path, start_daemon, mounts_below):
    state_dir = tmp_path / "state"
    script = (
        "import trio\n"
        "from lazy_fetch.layer_mount import open_mounter\n"
        "async def main():\n"
        f"    async with open_mounter({str(state_dir)!r}, binding='pyfuse3'):\n"
        "        print('ready', flush=True)\n"
        "        await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(lazy_fetch.__file__)))
    killed = subprocess.Popen([sys.executable, "-c", script], cwd=repo, stdout=subprocess.PIPE)
    try:
        assert killed.stdout.readline() == b"ready\n"
    finally:
        killed.kill()
        killed.wait()
    assert mounts_below(tmp_path) == [str(state_dir / "fuse")]  # dead: its server is gone
    with pytest.raises(OSError) as info:
        os.listdir(state_dir / "fuse")
    assert info.value.errno == errno.ENOTCONN

    daemon = start_daemon(built_layer.store, binding="pyfuse3")
    daemon.mount(built_layer.layer, tmp_path / "mnt", "kernel")
    assert (tmp_path / "mnt" / "small.txt").read_bytes() == b"hello\n"
    assert mounts_below(tmp_path) == [str(state_dir / "fuse"), str(tmp_path / "mnt")]
