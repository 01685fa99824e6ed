"""Sandbox lifecycle (overlay.sandbox) over real kernel EROFS layers and OverlayFS: many sandboxes sharing
layers, exec through runc and the namespaces runtime, commit, keep, failures that leave nothing behind,
and recovery after a daemon that crashed (a real second process).

The base layer is a minimal shell (Debian's dash and the C library, taken from the cached rootfs), so
commands run in sandboxes whose every layer is EROFS. Every mount is undone in a finally and each test
checks that nothing is left mounted below its tmp_path.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsec_fs import mounts
from dsec_fs.errors import ConflictError, InputError, NotFoundError, UnavailableError
from overlay.sandbox import SandboxManager, SandboxSpec
from overlay.stack import StackOptions
from tests.overlay.support import build, build_programs

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("nothing_left_mounted")]

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# In-image path -> path in the Debian rootfs (x86_64): enough for /bin/sh.
SHELL_FILES = {"bin/sh": "usr/bin/dash", "lib64/ld-linux-x86-64.so.2": "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
               "lib/x86_64-linux-gnu/libc.so.6": "usr/lib/x86_64-linux-gnu/libc.so.6"}


@pytest.fixture
def shell_base(store, tmp_path, debian_rootfs):
    """Publish base/sh:1, a layer holding a working /bin/sh and /etc/os-release; returns the ref."""
    return build_programs(store, tmp_path, debian_rootfs, "base/sh:1", SHELL_FILES, {"etc/os-release": b"ID=shell\n"})


def workspace(store, tmp_path, name: str) -> str:
    ref = f"ws/{name}:1"
    build(store, tmp_path, ref, {"workspace/id.txt": name.encode() + b"\n", "workspace/common": b"common\n"})
    return ref


def sandbox_files(manager) -> list[str]:
    return sorted(os.listdir(manager.sandboxes_dir))


def test_twenty_sandboxes_share_their_base_and_toolkit(manager, layers, store, tmp_path, shell_base):
    build(store, tmp_path, "tk/tool:1", {"opt/tool": b"tool\n"})
    names = [f"task{i:02d}" for i in range(20)]
    refs = {name: workspace(store, tmp_path, name) for name in names}
    with ThreadPoolExecutor(8) as pool:
        states = list(pool.map(lambda name: manager.up(SandboxSpec(
            base=shell_base, workspace=refs[name], toolkits=["tk/tool:1"], name=name)), names))

    held = layers.held()
    base_digest, toolkit_digest = states[0].layers[2].digest, states[0].layers[0].digest
    assert held[base_digest] == 20 and held[toolkit_digest] == 20
    assert sorted(count for digest, count in held.items() if digest not in (base_digest, toolkit_digest)) == [1] * 20
    fstypes = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _source, target, fstype, *_ = line.split()
            if target.startswith(str(tmp_path) + "/"):
                fstypes.append(fstype)
    assert fstypes.count("erofs") == 22 and fstypes.count("overlay") == 20  # each layer mounted once

    # Each sees its own workspace; writes and deletions stay in that sandbox's upper dir.
    for state in states:
        with open(os.path.join(state.rootfs, "workspace/id.txt"), "rb") as f:
            assert f.read() == state.name.encode() + b"\n"
        with open(os.path.join(state.rootfs, "opt/tool"), "rb") as f:
            assert f.read() == b"tool\n"
    first, *others = states
    with open(os.path.join(first.rootfs, "workspace/private"), "wb") as f:
        f.write(b"mine\n")
    os.remove(os.path.join(first.rootfs, "etc/os-release"))
    assert os.path.isfile(os.path.join(first.upper, "workspace/private"))
    assert stat.S_ISCHR(os.lstat(os.path.join(first.upper, "etc/os-release")).st_mode)
    for state in others:
        assert not os.path.exists(os.path.join(state.rootfs, "workspace/private"))
        assert os.path.isfile(os.path.join(state.rootfs, "etc/os-release"))
        assert os.listdir(state.upper) == []

    result = manager.exec("task07", ["/bin/sh", "-c", "read id < /workspace/id.txt; echo $id; echo hi > /out"])
    assert (result.exit_code, result.stdout) == (0, b"task07\n")
    assert os.path.isfile(os.path.join(states[7].upper, "out"))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(manager.down, names))
    assert mounts.mounts_below(tmp_path) == []
    assert manager.list() == [] and sandbox_files(manager) == []
    assert layers.held() == {} and os.listdir(layers.cache_dir) == []


@pytest.mark.parametrize("runtime", ["runc", "namespaces"])
def test_exec_and_commit(manager, store, tmp_path, shell_base, runtime):
    state = manager.up(SandboxSpec(base=shell_base, workspace=workspace(store, tmp_path, "one"), name="one"))
    assert state.status == "running" and [layer.role for layer in state.layers] == ["workspace", "base"]
    script = "read id < /workspace/id.txt; echo $id; cat_missing 2>/dev/null; echo made > /workspace/made; exit 3"
    result = manager.exec(state.id, ["/bin/sh", "-c", script], runtime=runtime)
    assert (result.exit_code, result.stdout) == (3, b"one\n")
    result = manager.exec("one", ["/bin/sh", "-c", "read h < /proc/sys/kernel/hostname; echo $h"], runtime=runtime)
    assert result.stdout == b"one\n"
    tree = manager.commit("one").tree
    assert tree.lookup(b"workspace/made").is_reg


def test_down_keep_leaves_the_upper_for_commit(manager, layers, store, tmp_path, shell_base):
    state = manager.up(SandboxSpec(base=shell_base, workspace=workspace(store, tmp_path, "kept"), name="kept"))
    os.remove(os.path.join(state.rootfs, "workspace/common"))
    manager.down("kept", keep=True)
    stopped = manager.get("kept")
    assert stopped.status == "stopped"
    assert mounts.mounts_below(tmp_path) == [] and layers.held() == {}
    with pytest.raises(UnavailableError, match="stopped"):
        manager.exec("kept", ["/bin/sh", "-c", "true"])
    tree = manager.commit("kept").tree
    assert stat.S_ISCHR(tree.lookup(b"workspace/common").mode)
    manager.down("kept")
    assert manager.list() == [] and sandbox_files(manager) == []


def test_a_taken_name_is_a_conflict(manager, layers, store, tmp_path, shell_base):
    first = manager.up(SandboxSpec(base=shell_base, name="same"))
    mounted = mounts.mounts_below(tmp_path)
    with pytest.raises(ConflictError):
        manager.up(SandboxSpec(base=shell_base, workspace=workspace(store, tmp_path, "x"), name="same"))
    with pytest.raises(ConflictError):
        manager.up(SandboxSpec(base=shell_base, name=first.id))
    assert mounts.mounts_below(tmp_path) == mounted and layers.held() == {first.layers[0].digest: 1}
    assert [state.id for state in manager.list()] == [first.id]
    with pytest.raises(ConflictError, match="another sandbox manager"):
        SandboxManager(manager.state_dir, layers)


def test_failed_ups_leave_nothing(manager, layers, store, tmp_path, shell_base):
    build(store, tmp_path, "tk/tool:1", {"opt/tool": b"tool\n"})
    with pytest.raises(NotFoundError, match="ws/missing"):
        manager.up(SandboxSpec(base=shell_base, workspace="ws/missing:1", toolkits=["tk/tool:1"]))
    with pytest.raises(InputError):
        manager.up(SandboxSpec(name="nothing"))
    with pytest.raises(InputError):
        manager.up(SandboxSpec(base=shell_base, name="bad name"))
    with pytest.raises(NotFoundError):
        manager.exec("nobody", ["true"])
    # Every layer acquired, then the overlay mount fails.
    bad = SandboxManager(tmp_path / "state2", layers, stack_options=StackOptions(xino="sometimes"))
    with bad, pytest.raises(InputError, match="xino"):
        bad.up(SandboxSpec(base=shell_base, toolkits=["tk/tool:1"]))
    assert sandbox_files(bad) == [] and bad.list() == []
    assert mounts.mounts_below(tmp_path) == [] and layers.held() == {}
    assert manager.list() == [] and sandbox_files(manager) == []


CRASHING_DAEMON = """
import os, sys
from dsec_fs.store.filesystem import FilesystemStore
from overlay.sandbox import ExportedLayers, SandboxManager, SandboxSpec
store_dir, state_dir, cache_dir = sys.argv[1:]
manager = SandboxManager(state_dir, ExportedLayers(FilesystemStore(store_dir, fsync=False), cache_dir))
for name, toolkits in (("a", []), ("b", ["tk/tool:1"]), ("c", [])):
    manager.up(SandboxSpec(base="base/sh:1", workspace=f"ws/{name}:1", toolkits=toolkits, name=name))
os._exit(0)  # a crash: nothing is taken down, the flock goes with the process
"""


def test_recover_after_a_crash_keeps_whole_sandboxes_and_removes_dead_ones(layers, store, tmp_path, shell_base):
    build(store, tmp_path, "tk/tool:1", {"opt/tool": b"tool\n"})
    for name in "abc":
        workspace(store, tmp_path, name)
    state_dir = tmp_path / "state"
    subprocess.run([sys.executable, "-c", CRASHING_DAEMON, store.root, str(state_dir), layers.cache_dir],
                   check=True, env={**os.environ, "PYTHONPATH": PROJECT_ROOT})

    with SandboxManager(state_dir, layers) as manager:
        before = {state.name: state for state in manager.list()}
        assert sorted(before) == ["a", "b", "c"] and all(s.status == "running" for s in before.values())
        mounts.umount(before["b"].rootfs)  # b's overlay is gone
        mounts.umount(before["c"].layers[0].mountpoint, lazy=True)  # c's workspace layer is gone
        os.makedirs(os.path.join(manager.sandboxes_dir, "sb-stray", "rootfs"))  # a crash inside up

        recovery = manager.recover()
        assert [state.name for state in recovery.live] == ["a"] and recovery.live[0].pid == os.getpid()
        assert sorted(recovery.removed) == sorted([before["b"].id, before["c"].id])
        a = before["a"]
        assert layers.held() == {layer.digest: 1 for layer in a.layers}
        assert sorted(mounts.mounts_below(tmp_path)) == sorted([a.rootfs] + [layer.mountpoint for layer in a.layers])
        assert sandbox_files(manager) == [a.id, a.id + ".json"]
        result = manager.exec("a", ["/bin/sh", "-c", "read id < /workspace/id.txt; echo $id"])
        assert result.stdout == b"a\n"

        manager.down("a")
        assert mounts.mounts_below(tmp_path) == [] and sandbox_files(manager) == []
        assert layers.held() == {} and os.listdir(layers.cache_dir) == []


def test_the_sandbox_root_looks_like_the_top_layers_root(manager, tmp_path, shell_base):
    state = manager.up(SandboxSpec(base=shell_base))
    top = os.stat(state.layers[0].mountpoint)
    root = os.stat(state.rootfs)
    assert (root.st_mode, root.st_uid, root.st_gid) == (top.st_mode, top.st_uid, top.st_gid)
