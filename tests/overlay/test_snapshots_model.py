"""overlay.snapshotter.Snapshots without containerd: the mounts each kind of snapshot answers, the rules a
snapshotter must keep (committed parents, no removal under children, update masks), metadata kept across
a reopen, and remote Prepare labels an image cannot abuse (a store not allowed, a digest that is none)."""

from __future__ import annotations

import os

import pytest

from dsec_fs.errors import ConflictError, InputError, NotFoundError
from overlay.snapshotter import ACTIVE, COMMITTED, LAYER_LABEL, STORE_LABEL, TARGET_LABEL, VIEW, Snapshots


@pytest.fixture
def snapshots(tmp_path):
    model = Snapshots(str(tmp_path / "root"), node=None, allowed_stores=("file:///allowed",))
    yield model
    model.close()


def test_mounts_of_each_kind(snapshots, tmp_path):
    base = snapshots.prepare("a", "", {})
    assert [(m.type, m.options) for m in base] == [("bind", ["rw", "rbind"])]
    snapshots.commit("A", "a", {"x": "1"})
    snapshots.prepare("b", "A", {})
    snapshots.commit("B", "b", {})
    (upper,) = snapshots.prepare("c", "B", {})
    lowers = [option for option in upper.options if option.startswith("lowerdir=")][0][len("lowerdir="):].split(":")
    assert upper.type == "overlay" and len(lowers) == 2 and lowers[0].endswith("/fs")  # B's tree above A's
    assert snapshots.stat("B").parent == "A" and snapshots.stat("c").kind == ACTIVE
    (one,) = snapshots.view("v1", "A", {})
    assert one.type == "bind" and one.options == ["ro", "rbind"]
    (two,) = snapshots.view("v2", "B", {})
    assert two.type == "overlay" and not any(o.startswith("upperdir=") for o in two.options)
    assert snapshots.stat("v2").kind == VIEW and snapshots.mounts("c") == [upper]
    assert snapshots.stat("A").labels == {"x": "1"} and snapshots.stat("A").kind == COMMITTED


def test_the_rules(snapshots):
    snapshots.prepare("a", "", {})
    with pytest.raises(ConflictError):
        snapshots.prepare("a", "", {})
    with pytest.raises(InputError, match="not committed"):
        snapshots.prepare("b", "a", {})
    with pytest.raises(NotFoundError):
        snapshots.prepare("b", "missing", {})
    snapshots.commit("A", "a", {})
    with pytest.raises(InputError, match="committed: it has no mounts"):
        snapshots.mounts("A")
    with pytest.raises(InputError, match="not active"):
        snapshots.commit("A2", "A", {})
    snapshots.prepare("child", "A", {})
    with pytest.raises(InputError, match="has a child"):
        snapshots.remove("A")
    snapshots.remove("child")
    snapshots.remove("A")
    assert snapshots.list() == []
    with pytest.raises(NotFoundError):
        snapshots.stat("A")


def test_update_with_and_without_a_mask(snapshots):
    snapshots.prepare("a", "", {"keep": "1", "drop": "2"})
    assert snapshots.update("a", {"new": "3", "keep": "9"}, ["labels.new", "labels.drop"]).labels == \
        {"keep": "1", "new": "3"}
    assert snapshots.update("a", {"only": "x"}, []).labels == {"only": "x"}
    with pytest.raises(InputError, match="cannot update field 'parent'"):
        snapshots.update("a", {}, ["parent"])


def test_metadata_survives_a_reopen(tmp_path):
    first = Snapshots(str(tmp_path / "root"))
    first.prepare("a", "", {"l": "v"})
    first.commit("A", "a", {})
    first.close()
    again = Snapshots(str(tmp_path / "root"))
    assert [(i.name, i.kind, i.labels) for i in again.list()] == [("A", COMMITTED, {"l": "v"})]
    again.close()


@pytest.mark.parametrize("labels, message", [
    ({LAYER_LABEL: "ab" * 32, STORE_LABEL: "file:///elsewhere"}, "not one this snapshotter may read"),
    ({LAYER_LABEL: "ab" * 32}, "not one this snapshotter may read"),
    ({LAYER_LABEL: "../../etc", STORE_LABEL: "file:///allowed"}, "is not a layer digest"),
])  # fmt: skip
def test_remote_labels_an_image_cannot_abuse(snapshots, labels, message):
    with pytest.raises(InputError, match=message):
        snapshots.prepare("extract-1-sha256:x", "", {TARGET_LABEL: "sha256:x", **labels})
    assert snapshots.list() == []  # nothing recorded, nothing mounted


def test_a_remote_layer_needs_a_node_daemon(snapshots):
    with pytest.raises(InputError, match="need a node daemon"):
        snapshots.prepare("k", "", {TARGET_LABEL: "sha256:x", LAYER_LABEL: "ab" * 32, STORE_LABEL: "file:///allowed"})
    assert snapshots.list() == []


def test_cleanup_removes_directories_no_snapshot_names(snapshots, tmp_path):
    snapshots.prepare("a", "", {})
    stray = tmp_path / "root" / "snapshots" / "999"
    (stray / "fs").mkdir(parents=True)
    snapshots.cleanup()
    assert not stray.exists() and snapshots.stat("a").kind == ACTIVE


def test_a_container_nesting_directories_deeper_than_pythons_stack_is_measured_and_removed(snapshots, tmp_path):
    """An active snapshot's tree is a container's to write, nested as deep as it likes: os.walk (usage) and
    shutil.rmtree (remove, cleanup at start) recursed a stack frame a level and raised RecursionError on
    a tree 1000 deep; a stray one stopped the snapshotter's start for good."""
    from tests.dsec_fs.test_files import _nest

    (mount,) = snapshots.prepare("a", "", {})
    _nest(mount.source, 3000)
    size, inodes = snapshots.usage("a")
    assert inodes == 2 * 3000 and size > 0
    snapshots.remove("a")
    assert os.listdir(tmp_path / "root" / "snapshots") == []
    stray = tmp_path / "root" / "snapshots" / "999" / "fs"
    stray.mkdir(parents=True)
    _nest(stray, 3000)
    snapshots.cleanup()
    assert os.listdir(tmp_path / "root" / "snapshots") == []
