"""OverlayFS stacks of real kernel EROFS layers (overlay.stack): precedence, copy-up, whiteouts, opaque
directories, read-only stacks, escaped paths, and commit (upper_to_tree) published as a layer that
reproduces the sandbox's view when stacked over the layers it was made on.

Layers are built with erofs_builder into a FilesystemStore, exported and mounted with kernel EROFS
(overlay.sandbox.ExportedLayers). Every mount is undone in a fixture's finally, and each test checks that
nothing is left mounted below its tmp_path (the fixtures are in conftest.py, the helpers in support.py).
"""

from __future__ import annotations

import errno
import os
import stat
from types import SimpleNamespace

import pytest
from treecmp import assert_same_tree, snapshot, write_files

from dsec_fs import mounts
from dsec_fs.errors import InputError, NotFoundError, UnsupportedError
from erofs_builder.build import build_tree
from overlay.stack import OPAQUE_XATTR, mount_stack, stack_mount_data, unmount_stack, upper_to_tree
from tests.overlay.support import build

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("nothing_left_mounted")]

BASE = {"etc/os-release": b"base os\n", "shared": b"base\n", "only-base": b"base only\n", "dir/a": b"a\n",
        "dir/b": b"b\n", "dir/sub/deep": b"deep\n"}
WORKSPACE = {"shared": b"workspace\n", "ws/main.py": b"print(1)\n", "dir/c": b"c\n"}
TOOLKIT = {"shared": b"toolkit\n", "opt/tool": b"#!/bin/sh\n"}


@pytest.fixture
def three_layers(store, tmp_path, layers):
    """Mountpoints of the toolkit, workspace and base layers (top first)."""
    refs = [build(store, tmp_path, "tk/tool:1", TOOLKIT), build(store, tmp_path, "ws/task:1", WORKSPACE),
            build(store, tmp_path, "base/os:1", BASE)]
    return [layers.acquire(ref).mountpoint for ref in refs]


@pytest.fixture
def writable_stack(tmp_path, three_layers):
    paths = SimpleNamespace(lowers=three_layers, upper=str(tmp_path / "upper"), work=str(tmp_path / "work"),
                            merged=str(tmp_path / "merged"))
    for directory in (paths.upper, paths.work, paths.merged):
        os.mkdir(directory)
    mount_stack(paths.lowers, paths.upper, paths.work, paths.merged)
    try:
        yield paths
    finally:
        if mounts.is_mountpoint(paths.merged):
            unmount_stack(paths.merged)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def change_the_stack(merged: str) -> None:
    """A new file, a copied-up file, a deleted lower file, a lower directory replaced by a new one."""
    with open(os.path.join(merged, "new"), "wb") as f:
        f.write(b"new\n")
    with open(os.path.join(merged, "only-base"), "ab") as f:
        f.write(b"changed\n")
    os.remove(os.path.join(merged, "dir/a"))
    os.remove(os.path.join(merged, "dir/sub/deep"))
    os.rmdir(os.path.join(merged, "dir/sub"))
    os.mkdir(os.path.join(merged, "dir/sub"))
    with open(os.path.join(merged, "dir/sub/fresh"), "wb") as f:
        f.write(b"fresh\n")


def test_the_top_layer_wins_and_directories_merge(writable_stack):
    merged = writable_stack.merged
    assert read(os.path.join(merged, "shared")) == b"toolkit\n"
    assert sorted(os.listdir(os.path.join(merged, "dir"))) == ["a", "b", "c", "sub"]
    assert sorted(os.listdir(merged)) == ["dir", "etc", "only-base", "opt", "shared", "ws"]
    assert read(os.path.join(merged, "ws/main.py")) == b"print(1)\n"
    # Every layer is its own filesystem, yet (st_dev, st_ino) tells files apart (tar, rsync, git need it).
    identities = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in
                  (os.path.join(merged, name) for name in ("shared", "only-base", "ws/main.py", "opt/tool", "dir/c"))}
    assert len(identities) == 5


def test_writes_go_to_the_upper_dir_only(writable_stack):
    base = writable_stack.lowers[2]
    change_the_stack(writable_stack.merged)
    upper = writable_stack.upper
    assert read(os.path.join(upper, "new")) == b"new\n"
    assert read(os.path.join(upper, "only-base")) == b"base only\nchanged\n"
    assert read(os.path.join(base, "only-base")) == b"base only\n"
    assert sorted(os.listdir(os.path.join(writable_stack.merged, "dir"))) == ["b", "c", "sub"]
    whiteout = os.lstat(os.path.join(upper, "dir/a"))
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(os.path.join(upper, "dir/sub"), OPAQUE_XATTR) == b"y"
    assert os.listdir(os.path.join(writable_stack.merged, "dir/sub")) == ["fresh"]
    assert os.path.exists(os.path.join(base, "dir/a")) and os.path.exists(os.path.join(base, "dir/sub/deep"))


def test_upper_to_tree_keeps_whiteouts_and_opaque_dirs_and_drops_bookkeeping(writable_stack):
    change_the_stack(writable_stack.merged)
    raw_xattrs = {name for path in ("", "dir", "only-base", "dir/sub")
                  for name in os.listxattr(os.path.join(writable_stack.upper, path))}
    # OverlayFS's bookkeeping on copy-up: what upper_to_tree must drop (all but opaque).
    assert {"trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.opaque"} <= raw_xattrs
    tree = upper_to_tree(writable_stack.upper)
    whiteout = tree.lookup(b"dir/a")
    assert stat.S_ISCHR(whiteout.mode) and whiteout.rdev == 0
    assert tree.lookup(b"dir/sub").xattrs == {OPAQUE_XATTR: b"y"}
    assert tree.lookup(b"dir/sub/fresh").is_reg
    assert tree.lookup(b"shared") is None  # never touched: not in the upper
    kept = {name for _path, node in tree.walk() for name in node.xattrs}
    assert kept == {OPAQUE_XATTR}


def test_a_committed_upper_reproduces_the_sandbox_view(store, layers, tmp_path, writable_stack):
    change_the_stack(writable_stack.merged)
    seen = snapshot(writable_stack.merged)
    unmount_stack(writable_stack.merged)
    digest = build_tree(upper_to_tree(writable_stack.upper), store, name="ws/task:2").digest
    committed = layers.acquire("ws/task:2")
    assert committed.digest == digest
    target = tmp_path / "replay"
    target.mkdir()
    mount_stack([committed.mountpoint] + writable_stack.lowers, None, None, target)
    try:
        assert_same_tree(snapshot(target), seen)
        assert not os.path.exists(target / "dir/a") and sorted(os.listdir(target / "dir/sub")) == ["fresh"]
    finally:
        unmount_stack(target)


def test_read_only_stacks(tmp_path, three_layers):
    target = tmp_path / "ro"
    target.mkdir()
    for lowers in (three_layers, three_layers[2:]):  # two or more layers: overlay; one: a read-only bind
        mount_stack(lowers, None, None, target)
        try:
            assert read(target / "shared") == (b"toolkit\n" if len(lowers) == 3 else b"base\n")
            with pytest.raises(OSError) as exc:
                (target / "new").write_bytes(b"x")
            assert exc.value.errno == errno.EROFS
        finally:
            unmount_stack(target)
        assert not mounts.is_mountpoint(target)


def test_paths_with_separators_are_escaped(tmp_path):
    lower = write_files(tmp_path / "low:er,1\\x", {"file": b"lower\n"})
    other = write_files(tmp_path / "other", {"file2": b"other\n"})
    upper, work, target = tmp_path / "up,per:", tmp_path / "wo:rk", tmp_path / "mer,ged"
    for directory in (upper, work, target):
        directory.mkdir()
    mount_stack([lower, other], upper, work, target)
    try:
        assert read(target / "file") == b"lower\n" and read(target / "file2") == b"other\n"
        (target / "written").write_bytes(b"w")
        assert read(upper / "written") == b"w"
    finally:
        unmount_stack(target)


def test_bad_stacks_are_refused_and_nothing_is_mounted(tmp_path):
    lower = write_files(tmp_path / "lower", {"f": b"f"})
    upper, work, target = tmp_path / "upper", tmp_path / "work", tmp_path / "target"
    for directory in (upper, work, target):
        directory.mkdir()
    with pytest.raises(NotFoundError, match="layer does not exist"):
        mount_stack([lower, tmp_path / "missing"], upper, work, target)
    with pytest.raises(InputError, match="at least one"):
        mount_stack([], upper, work, target)
    with pytest.raises(InputError, match="go together"):
        mount_stack([lower], upper, None, target)
    with pytest.raises(InputError, match="twice"):
        mount_stack([lower, lower], upper, work, target)
    with pytest.raises(NotFoundError, match="target"):
        mount_stack([lower], upper, work, tmp_path / "no-target")
    with pytest.raises(InputError, match="not a directory"):
        mount_stack([lower + "/f"], upper, work, target)
    long_names = [write_files(tmp_path / f"{i:02d}{'x' * 200}", {}) for i in range(20)]
    with pytest.raises(InputError, match="mount options"):
        stack_mount_data(long_names, str(upper), str(work))
    with pytest.raises(InputError, match="mount options"):
        mount_stack(long_names, upper, work, target)
    with pytest.raises(NotFoundError):
        unmount_stack(target)
    assert mounts.mounts_below(tmp_path) == []


def test_upper_to_tree_refuses_entries_that_depend_on_lower_layers(tmp_path):
    upper = write_files(tmp_path / "upper", {"moved/file": b"x", "copied": b"y"})
    os.setxattr(upper + "/copied", "trusted.overlay.origin", b"\x00\xfb")
    os.setxattr(upper + "/copied", "user.note", b"kept")
    assert upper_to_tree(upper).lookup(b"copied").xattrs == {b"user.note": b"kept"}
    os.setxattr(upper + "/moved", "trusted.overlay.redirect", b"/old")
    with pytest.raises(UnsupportedError, match="redirect"):
        upper_to_tree(upper)
