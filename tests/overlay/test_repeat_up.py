"""A repeat ``sandbox up`` (issue 13, item 5), end to end: a real ``dsecfs daemon`` over a posix store and
over S3 (moto over real HTTP), its store requests counted by the CountingStore it keeps below every other
wrapper (``dsecfs_store_requests_total`` on /metrics).

- up, down, up again: the second up asks the store at most once (refs cached for --ref-ttl, the layers
  still mounted, idle, for --idle-grace), and with those off it asks many times;
- once the TTL has passed, the ref is read again and a moved ref is followed;
- an idle layer is unmounted when its grace ends, and when the daemon stops;
- a copy of layer metadata in the cache directory that rotted, or was replaced by a symlink or a FIFO,
  is dropped and read from the store again: the mount reads the right bytes.
"""

from __future__ import annotations

import os
import time

import pytest
from treecmp import write_files

from dsec_fs.layer import resolve, set_ref
from dsec_fs.sandbox_client import Sandbox
from dsec_fs.store import init_store, keys, open_store
from erofs_builder import build_layer
from lazy_fetch.meta_cache import HEADER
from tests.lazy_fetch import daemon_support
from tests.overlay.test_node_sandboxes import loop_devices_below, mounts_below

pytestmark = [pytest.mark.root, pytest.mark.fuse]

BASE, TOOLKIT = "base/mini:1", "tk/tool:1"
BASE_FILES = {"etc/os-release": b"ID=mini\n", "bin/.keep": b""}
TOOL_FILES = {f"opt/tool/mod{i}.py": f"VERSION = {i}\n".encode() * 50 for i in range(30)}


@pytest.fixture(params=["posix", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path) -> str:
    if request.param == "s3":
        url = request.getfixturevalue("s3_url")
    else:
        url = f"posix://{tmp_path / 'store'}"
        init_store(url)[0].close()
    with open_store(url) as store:
        build_layer(write_files(tmp_path / "base", BASE_FILES), store, name=BASE)
        build_layer(write_files(tmp_path / "tool", TOOL_FILES), store, name=TOOLKIT)
    return url


@pytest.fixture
def daemons(tmp_path):
    started = daemon_support.Daemons(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()
        left = mounts_below(tmp_path)
        for target, _fstype in sorted(left, reverse=True):
            os.system(f"umount -l '{target}'")
        assert left == [] and loop_devices_below(tmp_path) == []


def store_requests(node) -> int:
    return int(sum(value for (name, _labels), value in daemon_support.metrics(node).items()
                   if name == "dsecfs_store_requests_total"))


def read_tree(rootfs: str, files: dict[str, bytes]) -> dict[str, bytes]:
    found = {}
    for name in files:
        with open(os.path.join(rootfs, name), "rb") as f:
            found[name] = f.read()
    return found


def up_read_down(node) -> int:
    """Start the sandbox, check what it reads, take it down; the store requests its up made."""
    before = store_requests(node)
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    made = store_requests(node) - before
    assert read_tree(info.rootfs, TOOL_FILES) == TOOL_FILES and read_tree(info.rootfs, BASE_FILES) == BASE_FILES
    Sandbox(node, info.id).down()
    return made


def test_a_repeat_up_asks_the_store_at_most_once(daemons, store_url, tmp_path):
    node = daemons.start(store_url, extra_args=["--idle-grace", "5m", "--ref-ttl", "5m"]).node
    first = up_read_down(node)
    idle = [m for m in node.status().mounts if m.idle_until]
    assert len(idle) == 2 and len(node.status().mounts) == 2  # both layers, idle, still mounted
    held = node.request("GET", "/v1/sandboxes")["layers"]
    assert [layer["users"] for layer in held] == [0, 0] and all(layer["idle_until"] for layer in held)
    assert [up_read_down(node) for _ in range(3)] == [0, 0, 0]  # at most one is the goal; none is made
    assert first > 5

    # The same with the repeat-start machinery off: every up asks the store again, many times over.
    daemons.stop_all()
    assert mounts_below(tmp_path) == []  # the idle layers went with the daemon
    node = daemons.start(store_url, extra_args=["--idle-grace", "0", "--ref-ttl", "0",
                                                "--meta-cache-size", "0"]).node
    up_read_down(node)
    assert up_read_down(node) > 5


def test_after_the_ttl_a_moved_ref_is_followed(daemons, store_url, tmp_path):
    node = daemons.start(store_url, extra_args=["--idle-grace", "5m", "--ref-ttl", "1s"]).node
    up_read_down(node)
    time.sleep(1.2)
    assert up_read_down(node) == 2  # the two refs, read again (side by side), and nothing else
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    old = info.layers[0].digest
    Sandbox(node, info.id).down()
    new_files = {"opt/tool/mod0.py": b"VERSION = 'two'\n"}
    with open_store(store_url) as store:
        new = build_layer(write_files(tmp_path / "tool2", new_files), store).digest
        set_ref(store, TOOLKIT, new)  # another node publishes a new release under the same ref
    time.sleep(1.2)
    before = store_requests(node)
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    assert info.layers[0].digest == new != old
    assert read_tree(info.rootfs, new_files) == new_files
    assert store_requests(node) > before  # the refs were read again
    Sandbox(node, info.id).down()


def test_an_idle_layer_is_unmounted_when_its_grace_ends(daemons, store_url, tmp_path):
    node = daemons.start(store_url, extra_args=["--idle-grace", "1s"]).node
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    Sandbox(node, info.id).down()
    assert len([m for m in node.status().mounts if m.idle_until]) == 2
    deadline = time.monotonic() + 15
    while node.status().mounts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.status().mounts == [] and node.request("GET", "/v1/sandboxes")["layers"] == []
    assert mounts_below(tmp_path) == [(os.path.join(daemons.state_dir, "fuse"), "fuse.dsecfs")]
    assert os.listdir(os.path.join(daemons.state_dir, "sandbox", "layers")) == []
    assert up_read_down(node) > 0  # mounted anew, and right


def test_a_daemon_that_stops_with_idle_layers_publishes_the_profile_of_each(daemons, store_url, tmp_path):
    """Idle layers are unmounted at the stop: their traces end then, and every profile must still go out
    (a publish started in the nursery being cancelled was lost: one layer of two was published)."""
    node = daemons.start(store_url, profiles=True, extra_args=["--idle-grace", "1h"]).node
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    assert read_tree(info.rootfs, TOOL_FILES) == TOOL_FILES and read_tree(info.rootfs, BASE_FILES) == BASE_FILES
    Sandbox(node, info.id).down()
    assert len([m for m in node.status().mounts if m.idle_until]) == 2
    daemons.stop_all()
    with open_store(store_url) as store:
        for ref in (BASE, TOOLKIT):
            assert list(store.list(keys.layer_profiles(resolve(store, ref)))), f"no profile of {ref}"


def copies(daemons, kind: str) -> list[str]:
    directory = os.path.join(daemons.cache_dir, "meta", kind)
    return sorted(os.path.join(directory, name) for name in os.listdir(directory))


@pytest.mark.parametrize("damage", ["rot", "symlink", "fifo"])
def test_a_damaged_metadata_copy_is_read_again_and_the_mount_reads_right(daemons, store_url, tmp_path, damage):
    node = daemons.start(store_url).node
    mountpoint, = daemon_support.mount_dirs(tmp_path, "mnt")
    with open_store(store_url) as store:
        digest = resolve(store, TOOLKIT)
    node.mount(digest, mountpoint)
    assert read_tree(mountpoint, TOOL_FILES) == TOOL_FILES
    node.umount(mountpoint)

    (meta,), (blobmap,) = copies(daemons, "meta"), copies(daemons, "blobmap")
    decoy = str(tmp_path / "decoy")
    with open(meta, "rb") as f:
        good = f.read()
    with open(decoy, "wb") as f:
        f.write(good)
    for path in (meta, blobmap):
        if damage == "rot":
            with open(path, "r+b") as f:
                f.seek(-3, os.SEEK_END)
                f.write(b"\xff\xfe\xfd")
        else:
            os.unlink(path)
            if damage == "symlink":
                os.symlink(decoy, path)  # a good copy elsewhere: following it would have "worked"
            else:
                os.mkfifo(path)  # opened O_NONBLOCK: nothing blocks on it
    before = store_requests(node)
    node.mount(digest, mountpoint)
    assert store_requests(node) - before == 2  # meta.erofs and the blob map, read again; nothing else
    daemon_support.drop_caches()
    assert read_tree(mountpoint, TOOL_FILES) == TOOL_FILES
    node.umount(mountpoint)
    with open(meta, "rb") as f:
        assert f.read()[HEADER.size:] == good[HEADER.size:]  # kept again, whole, as a regular file
    with open(decoy, "rb") as f:
        assert f.read() == good  # the decoy was neither written nor removed
    assert "dropping the metadata copy" in daemons.log()


def test_a_ref_this_node_commits_is_not_served_from_the_ref_cache(daemons, store_url, tmp_path):
    """A sandbox commit sets its ref through a store of its own, not the daemon's cached one: the next up
    of that ref on this node gets the new layer, TTL or not."""
    node = daemons.start(store_url, extra_args=["--idle-grace", "5m", "--ref-ttl", "5m"]).node
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    old = info.layers[0].digest
    with open(os.path.join(info.rootfs, "opt", "committed"), "wb") as f:
        f.write(b"made in the sandbox\n")
    committed = Sandbox(node, info.id).commit(TOOLKIT)  # the same name: the ref moves
    Sandbox(node, info.id).down()
    assert committed.layer != old
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    assert info.layers[0].digest == committed.layer
    assert read_tree(info.rootfs, {"opt/committed": b""}) == {"opt/committed": b"made in the sandbox\n"}
    Sandbox(node, info.id).down()


def test_an_idle_layer_a_killed_daemon_left_is_idle_for_its_successor(daemons, store_url, tmp_path):
    """raw binding: the next daemon adopts every mount of a daemon killed with SIGKILL, the idle layers'
    too; they are idle for a grace from its start, then go (not left mounted for good)."""
    node = daemons.start(store_url, extra_args=["--idle-grace", "5m"]).node
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    Sandbox(node, info.id).down()
    daemons.started[-1].kill()
    node = daemons.start(store_url, extra_args=["--idle-grace", "2s"]).node
    idle = [m.mountpoint for m in node.status().mounts if m.idle_until]
    assert len(idle) == 2 and len(node.status().mounts) == 2
    again = node.sandbox_up(BASE, toolkit=TOOLKIT)  # one is taken as it is
    assert read_tree(again.rootfs, TOOL_FILES) == TOOL_FILES
    Sandbox(node, again.id).down()
    deadline = time.monotonic() + 15
    while node.status().mounts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.status().mounts == [] and os.listdir(os.path.join(daemons.state_dir, "sandbox", "layers")) == []
