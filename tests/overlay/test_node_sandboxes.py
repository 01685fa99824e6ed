"""Sandboxes served by the node daemon (overlay.node_service), end to end: ``dsecfs daemon`` runs as a
subprocess on a test's own directories, and the tests drive it as users do, through the SDK
(dsec_fs.client.Node, dsec_fs.sandbox_client) and the ``dsecfs sandbox`` commands.

The base layer is the whole cached Debian minbase rootfs (building it takes about a second and a half,
and a kernel-mode mount reads only its metadata image, so a subset would not be faster); the toolkit and
the twenty workspaces are small trees. Every test stops its daemons in the fixture's finally and then
checks that nothing is mounted below its tmp_path and no loop device reads a file there.
"""

from __future__ import annotations

import glob
import json
import os
import random
import stat
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from treecmp import write_files

from dsec_fs import mounts
from dsec_fs.client import DaemonProcess
from dsec_fs.errors import ConflictError, InputError, NotFoundError, UnavailableError
from dsec_fs.trees import remove_tree
from dsec_fs.layer import open_layer
from dsec_fs.sandbox_client import ExecResult, Sandbox
from dsec_fs.store import FilesystemStore, keys
from erofs_builder.build import build_layer
from erofs_builder.reader import ErofsImage
from tests.lazy_fetch import daemon_support

pytestmark = [pytest.mark.root, pytest.mark.fuse]
RUNC_LIST_ATTEMPTS = 10

BASE, TOOLKIT = "base/debian:12", "tk/tool:1"
WORKSPACES = [f"task{i:02d}" for i in range(20)]


def workspace_ref(name: str) -> str:
    return f"ws/{name}:1"


@dataclass
class Layers:
    store_dir: str
    os_release: bytes  # the base's /etc/os-release


@pytest.fixture(scope="module")
def layers(tmp_path_factory, debian_rootfs) -> Layers:
    root = tmp_path_factory.mktemp("sandbox-layers")
    store = FilesystemStore(str(root / "store"), fsync=False)
    build_layer(debian_rootfs, store, name=BASE)
    build_layer(write_files(root / "toolkit", {"opt/tool/VERSION": b"tool 1\n"}), store, name=TOOLKIT)
    for name in WORKSPACES:
        files = {"workspace/id.txt": f"{name}\n".encode(), "workspace/common": b"common\n"}
        build_layer(write_files(root / name, files), store, name=workspace_ref(name))
    link = os.readlink(os.path.join(debian_rootfs, "etc/os-release"))  # ../usr/lib/os-release
    with open(os.path.join(debian_rootfs, "etc", link), "rb") as f:
        return Layers(str(root / "store"), f.read())


def mounts_below(path) -> list[tuple[str, str]]:
    """(mountpoint, fstype) of every mount below ``path``."""
    prefix = os.path.realpath(str(path)) + "/"
    with open("/proc/self/mounts") as f:
        entries = [line.split()[1:3] for line in f]
    return [(target.encode().decode("unicode_escape"), fstype) for target, fstype in entries
            if target.encode().decode("unicode_escape").startswith(prefix)]


def loop_devices_below(path) -> list[str]:
    prefix = os.path.realpath(str(path)) + "/"
    found = []
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
        with open(backing) as f:
            if f.read().strip().startswith(prefix):
                found.append(backing)
    return found


class Daemons(daemon_support.Daemons):
    """The node daemons of one test (daemon_support.Daemons) over the test layers' store, with the sandbox
    side: its state directory, its CLI, its runc containers."""

    def __init__(self, tmp_path, store_dir: str):
        super().__init__(tmp_path)
        self.store_dir = store_dir

    @property
    def sandbox_dir(self) -> str:
        return os.path.join(self.state_dir, "sandbox")

    def start(self, *extra_args: str) -> DaemonProcess:
        return super().start(self.store_dir, extra_args=extra_args)

    def cli(self, *args: str, check: bool = True, stdin: bytes = b"") -> subprocess.CompletedProcess:
        """``dsecfs sandbox ARGS... --socket S``, output captured as bytes."""
        command, rest = args[0], args[1:]
        done = subprocess.run([daemon_support.DSECFS, "sandbox", command, "--socket", self.socket, *rest], capture_output=True,
                              input=stdin)
        if check:
            assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done

    def runc_containers(self) -> list:
        """The containers runc lists. ``runc list`` fails when a container it found is deleted before it
        reads its state (the daemon deleting one meanwhile): it is asked again, a few times."""
        argv = ["runc", "--root", os.path.join(self.sandbox_dir, "runc"), "list", "--format", "json"]
        for _attempt in range(RUNC_LIST_ATTEMPTS):
            listed = subprocess.run(argv, capture_output=True)
            if listed.returncode == 0:
                return json.loads(listed.stdout or b"null") or []
            time.sleep(0.05)
        raise AssertionError(f"runc list failed {RUNC_LIST_ATTEMPTS} times: {listed.stderr.decode(errors='replace')}")


@pytest.fixture
def daemons(tmp_path, layers):
    started = Daemons(tmp_path, layers.store_dir)
    try:
        yield started
    finally:
        started.stop_all()
        left = mounts_below(tmp_path)
        for target, _fstype in sorted(left, reverse=True):  # deepest first, so the next test is unharmed
            mounts.umount(target, lazy=True)
        assert left == [] and loop_devices_below(tmp_path) == []


def sandbox_entries(daemons: Daemons) -> list[str]:
    return sorted(os.listdir(os.path.join(daemons.sandbox_dir, "sandboxes")))


def layer_dirs(daemons: Daemons) -> list[str]:
    return sorted(os.listdir(os.path.join(daemons.sandbox_dir, "layers")))


def only_the_fuse_session_is_mounted(daemons: Daemons, tmp_path) -> bool:
    return mounts_below(tmp_path) == [(os.path.join(daemons.state_dir, "fuse"), "fuse.dsecfs")]


def test_twenty_sandboxes_share_one_mount_of_each_layer_and_keep_their_writes(daemons, tmp_path, layers):
    node = daemons.start().node
    with ThreadPoolExecutor(8) as pool:
        infos = list(pool.map(lambda name: node.sandbox_up(BASE, workspace_ref(name), TOOLKIT, name=name),
                              WORKSPACES))
    assert [info.name for info in infos] == WORKSPACES and {info.status for info in infos} == {"running"}
    assert [layer.role for layer in infos[0].layers] == ["toolkit", "workspace", "base"]

    # Each layer is mounted once on the node, under the daemon's state directory, and counted.
    fstypes = [fstype for _target, fstype in mounts_below(tmp_path)]
    assert fstypes.count("erofs") == 2 + 20 and fstypes.count("overlay") == 20
    users = {layer["layer"]: layer["users"] for layer in node.request("GET", "/v1/sandboxes")["layers"]}
    base, toolkit = infos[0].layers[2].digest, infos[0].layers[0].digest
    assert users.pop(base) == 20 and users.pop(toolkit) == 20 and sorted(users.values()) == [1] * 20
    assert len(node.status().mounts) == 22

    for info in infos:  # each sees its own workspace over the shared layers
        with open(os.path.join(info.rootfs, "workspace/id.txt"), "rb") as f:
            assert f.read() == f"{info.name}\n".encode()
        with open(os.path.join(info.rootfs, "opt/tool/VERSION"), "rb") as f:
            assert f.read() == b"tool 1\n"

    # Writes and deletions of lower files (whiteouts) stay in the sandbox that made them.
    first, *others = infos
    script = "echo mine > /workspace/private; rm /etc/os-release /workspace/common; cat /workspace/id.txt"
    result = Sandbox(node, first.name).exec(["/bin/sh", "-c", script])
    assert result == ExecResult(0, b"task00\n", b"")
    assert os.path.isfile(os.path.join(first.upper, "workspace/private"))
    for deleted in ("etc/os-release", "workspace/common"):
        whiteout = os.lstat(os.path.join(first.upper, deleted))
        assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
        assert not os.path.lexists(os.path.join(first.rootfs, deleted))
    for info in others:
        assert os.listdir(info.upper) == []
        assert not os.path.exists(os.path.join(info.rootfs, "workspace/private"))
        assert os.path.isfile(os.path.join(info.rootfs, "workspace/common"))
        assert os.path.lexists(os.path.join(info.rootfs, "etc/os-release"))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda name: Sandbox(node, name).down(), WORKSPACES))
    assert node.sandboxes() == [] and node.request("GET", "/v1/sandboxes")["layers"] == []
    assert node.status().mounts == [] and only_the_fuse_session_is_mounted(daemons, tmp_path)
    assert sandbox_entries(daemons) == [] and layer_dirs(daemons) == []


def test_exec_runs_commands_in_debian_through_runc(daemons, tmp_path, layers):
    node = daemons.start().node
    up = daemons.cli("up", "--base", BASE, "--workspace", workspace_ref("task00"), "--toolkit", TOOLKIT,
                     "--name", "deb", "--json")
    info = json.loads(up.stdout)
    assert info["name"] == "deb" and info["rootfs"].startswith(daemons.sandbox_dir + "/")

    done = daemons.cli("exec", "deb", "--", "/bin/sh", "-c", "id; cat /etc/os-release; ls /workspace")
    assert done.stdout == b"uid=0(root) gid=0(root) groups=0(root)\n" + layers.os_release + b"common\nid.txt\n"
    assert done.stderr == b""
    # Exit code, stdout and stderr pass through as they are.
    done = daemons.cli("exec", info["id"], "--", "/bin/sh", "-c", "printf 'out\\0'; printf err >&2; exit 7",
                       check=False)
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\0", b"err")
    done = daemons.cli("exec", "-i", "deb", "--", "/bin/sh", "-c", "read line; echo got $line", stdin=b"this\n")
    assert done.stdout == b"got this\n"

    # Its own pid, uts and network namespaces, and the limits asked for.
    sandbox = Sandbox(node, "deb")
    result = sandbox.exec(["/bin/sh", "-c", "echo $$; cat /proc/sys/kernel/hostname; ls /sys/class/net; "
                           "grep NoNewPrivs /proc/self/status"], stdin=b"", pids_limit=64, memory_bytes=256 << 20)
    assert result == ExecResult(0, b"1\ndeb\nlo\nNoNewPrivs:\t1\n", b"")
    assert sandbox.exec(["/bin/sh", "-c", "ls /sys/class/net"], network=True).stdout != b"lo\n"
    result = sandbox.exec(["/bin/sh", "-c", "read a; echo ${a}2"], stdin=b"1\n", runtime="namespaces")
    assert result == ExecResult(0, b"12\n", b"")
    result = sandbox.exec(["sleep", "30"], timeout=0.5)
    assert result.timed_out and result.exit_code == 137

    listed = daemons.cli("ls").stdout.decode()
    assert "deb" in listed and "toolkit=tk/tool:1 workspace=ws/task00:1 base=base/debian:12" in listed
    daemons.cli("down", "deb")
    assert node.sandboxes() == [] and only_the_fuse_session_is_mounted(daemons, tmp_path)


def test_commit_publishes_the_changes_as_a_layer_to_stack(daemons, tmp_path, layers):
    node = daemons.start().node
    script = ("rm /workspace/common; echo new > /workspace/new; rm -r /opt/tool; mkdir /opt/tool; "
              "echo mine > /opt/tool/mine")
    with node.sandbox(BASE, workspace_ref("task01"), TOOLKIT, name="changer") as sandbox:
        assert sandbox.exec(["/bin/sh", "-c", script]).exit_code == 0
        committed = sandbox.commit("ws/task01:2")
    assert committed.ref == "ws/task01:2" and committed.store == layers.store_dir
    assert committed.dropped == {"setuid": 0, "setgid": 0, "devices": 0, "capabilities": 0}  # whiteouts stay
    image = ErofsImage(open_layer(FilesystemStore(layers.store_dir), "ws/task01:2").meta, source="commit")
    assert image.resolve(b"workspace/new") and image.resolve(b"workspace/common")  # the whiteout

    # Stacked over the layers it was made on, the new layer shows what the sandbox saw.
    with node.sandbox(BASE, workspace_ref("task01"), ["ws/task01:2", TOOLKIT]) as sandbox:
        result = sandbox.exec(["/bin/sh", "-c", "ls /workspace /opt/tool"])
    assert result.stdout == b"/opt/tool:\nmine\n\n/workspace:\nid.txt\nnew\n"
    assert node.sandboxes() == [] and only_the_fuse_session_is_mounted(daemons, tmp_path)


def test_a_restarted_daemon_cleans_up_after_one_that_was_killed(daemons, tmp_path, layers):
    # With libfuse the layer mounts die with the daemon, and so do the sandboxes running on them.
    first = daemons.start("--fuse-binding", "pyfuse3")
    running = first.node.sandbox_up(BASE, workspace_ref("task02"), TOOLKIT, name="running")
    kept = first.node.sandbox_up(BASE, workspace_ref("task03"), name="kept")
    assert Sandbox(first.node, "kept").exec(["/bin/sh", "-c", "echo saved > /workspace/saved"]).exit_code == 0
    Sandbox(first.node, "kept").down(keep=True)
    failures = []

    def sleep_in_sandbox() -> None:
        try:
            Sandbox(first.node, "running").exec(["sleep", "600"])
        except UnavailableError as exc:
            failures.append(exc)

    sleeper = threading.Thread(target=sleep_in_sandbox)
    sleeper.start()
    deadline = time.monotonic() + 20
    while not daemons.runc_containers():
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    first.kill()
    sleeper.join(30)
    assert len(failures) == 1  # the answer never came
    assert (running.rootfs, "overlay") in mounts_below(tmp_path)  # left behind, its layers dead

    node = daemons.start().node
    listing = node.request("GET", "/v1/sandboxes")
    assert [(s["name"], s["status"]) for s in listing["sandboxes"]] == [("kept", "stopped")]
    assert listing["removed_at_start"] == [running.id] and listing["layers"] == []
    assert daemons.runc_containers() == []  # the sleeping command was killed
    assert only_the_fuse_session_is_mounted(daemons, tmp_path)
    assert sandbox_entries(daemons) == [kept.id, kept.id + ".json"] and layer_dirs(daemons) == []
    assert "is running but not whole: taking it apart" in daemons.log()

    # The stopped sandbox's changes survived the crash: commit them, then remove it.
    done = daemons.cli("commit", "kept", "--name", "ws/task03:2")
    digest = done.stdout.decode().strip()
    image = ErofsImage(open_layer(FilesystemStore(layers.store_dir), digest).meta, source="commit")
    assert image.resolve(b"workspace/saved")
    daemons.cli("down", "kept")
    assert node.sandboxes() == [] and sandbox_entries(daemons) == []
    assert only_the_fuse_session_is_mounted(daemons, tmp_path)


def test_a_stopped_daemon_keeps_its_sandboxes_changes(daemons, tmp_path):
    first = daemons.start()
    info = first.node.sandbox_up(BASE, workspace_ref("task04"), name="stays")
    Sandbox(first.node, "stays").exec(["/bin/sh", "-c", "echo kept > /workspace/kept"])
    assert first.stop() == 0
    assert mounts_below(tmp_path) == []

    node = daemons.start().node
    stopped, = node.sandboxes()
    assert (stopped.id, stopped.status) == (info.id, "stopped")
    with open(os.path.join(stopped.upper, "workspace/kept"), "rb") as f:
        assert f.read() == b"kept\n"
    with pytest.raises(UnavailableError, match="stopped"):
        Sandbox(node, "stays").exec(["true"])
    Sandbox(node, "stays").down()
    assert node.sandboxes() == [] and sandbox_entries(daemons) == []


@pytest.mark.parametrize("layer_mode", ["kernel", "fuse"])
def test_running_sandboxes_outlive_a_killed_daemon(daemons, tmp_path, layers, layer_mode):
    """With the raw binding (the default) the layer mounts survive the daemon: the next one adopts them,
    and the sandboxes on them keep running, their files and their writes intact."""
    first = daemons.start("--sandbox-layer-mode", layer_mode)
    info = first.node.sandbox_up(BASE, workspace_ref("task06"), TOOLKIT, name="survivor")
    sandbox = Sandbox(first.node, "survivor")
    assert sandbox.exec(["/bin/sh", "-c", "echo before > /workspace/note"]).exit_code == 0
    first.kill()

    node = daemons.start("--sandbox-layer-mode", layer_mode).node
    listing = node.request("GET", "/v1/sandboxes")
    assert [(s["id"], s["status"]) for s in listing["sandboxes"]] == [(info.id, "running")]
    assert listing["removed_at_start"] == [] and len(listing["layers"]) == 3
    assert {m.mountpoint for m in node.mounts()} == {layer["mountpoint"] for layer in listing["layers"]}
    again = Sandbox(node, "survivor")
    shown = again.exec(["cat", "/etc/os-release", "/workspace/id.txt", "/workspace/note", "/opt/tool/VERSION"])
    assert shown.stdout == layers.os_release + b"task06\nbefore\ntool 1\n"
    again.down()
    assert node.sandboxes() == [] and layer_dirs(daemons) == []
    assert only_the_fuse_session_is_mounted(daemons, tmp_path)


def test_layers_can_be_mounted_in_fuse_mode(daemons, tmp_path, layers):
    node = daemons.start("--sandbox-layer-mode", "fuse").node
    with node.sandbox(BASE, workspace_ref("task05"), name="fused") as sandbox:
        assert {fstype for _target, fstype in mounts_below(tmp_path)} == {"fuse.dsecfs", "overlay"}
        assert sandbox.exec(["cat", "/etc/os-release", "/workspace/id.txt"]).stdout == layers.os_release + b"task05\n"
    assert only_the_fuse_session_is_mounted(daemons, tmp_path) and layer_dirs(daemons) == []


def _break_layer(store_dir: str, tmp_path, ref: str, lose: str) -> None:
    """Publish ``ref`` (content no other layer has, so its packs are its own), then delete its packs'
    ``lose`` objects ("pack" or "index") from the store."""
    files = {"workspace/data.bin": random.Random(ref).randbytes(3 << 20)}
    source = write_files(tmp_path / ref.replace("/", "_").replace(":", "_"), files)
    store = FilesystemStore(store_dir, fsync=False)
    for pack in build_layer(source, store, name=ref).manifest.packs:
        store.delete(keys.pack(pack) if lose == "pack" else keys.index(pack))


def test_bad_input_fails_clearly_and_leaves_nothing_mounted(daemons, tmp_path, layers):
    node = daemons.start().node
    same = node.sandbox_up(BASE, workspace_ref("task06"), name="same")
    mounted = mounts_below(tmp_path)
    _break_layer(layers.store_dir, tmp_path, "ws/no-packs:1", "pack")
    _break_layer(layers.store_dir, tmp_path, "ws/no-index:1", "index")

    with pytest.raises(NotFoundError, match="no such ref") as error:
        node.sandbox_up(BASE, "ws/missing:1", TOOLKIT)  # the toolkit is mounted first, then given back
    assert error.value.where == "ref ws/missing:1"
    with pytest.raises(NotFoundError, match="packs holding the layer's chunks are not in the store"):
        node.sandbox_up(BASE, "ws/no-packs:1")
    with pytest.raises(NotFoundError):
        node.sandbox_up(BASE, "ws/no-index:1", TOOLKIT)
    with pytest.raises(ConflictError, match="a sandbox with this name exists"):
        node.sandbox_up(BASE, workspace_ref("task07"), name="same")
    with pytest.raises(ConflictError):
        node.sandbox_up(BASE, name=same.id)
    with pytest.raises(ConflictError, match="read layers from"):
        node.sandbox_up(BASE, store=str(tmp_path / "other-store"))
    with pytest.raises(InputError, match="at least one layer"):
        node.sandbox_up()
    with pytest.raises(InputError):
        node.sandbox_up(BASE, name="bad name")
    for call in (lambda s: s.exec(["true"]), lambda s: s.down(), lambda s: s.commit("ws/x:1"), Sandbox.info):
        with pytest.raises(NotFoundError, match="no such sandbox"):
            call(Sandbox(node, "nobody"))
    with pytest.raises(InputError, match="cannot execute"):
        Sandbox(node, "same").exec(["/no/such/program"])
    with pytest.raises(InputError):
        Sandbox(node, "same").commit("not a ref")
    with pytest.raises(InputError, match="argv"):
        Sandbox(node, "same").exec("ls /")

    # The CLI says the same, with the error class's exit code.
    done = daemons.cli("up", "--base", BASE, "--workspace", "ws/missing:1", check=False)
    assert done.returncode == 6 and b"not-found error: ref ws/missing:1: no such ref" in done.stderr
    done = daemons.cli("up", "--base", BASE, "--name", "same", check=False)
    assert done.returncode == 7 and b"conflict error" in done.stderr
    done = daemons.cli("exec", "nobody", "--", "true", check=False)
    assert done.returncode == 6 and done.stdout == b""

    assert mounts_below(tmp_path) == mounted
    assert [s.name for s in node.sandboxes()] == ["same"] and sandbox_entries(daemons) == [same.id, same.id + ".json"]
    assert layer_dirs(daemons) == sorted(layer.digest for layer in same.layers)
    Sandbox(node, "same").down()
    assert only_the_fuse_session_is_mounted(daemons, tmp_path) and layer_dirs(daemons) == []


def test_a_sandbox_writing_without_end_to_an_exec_leaves_the_daemon_its_memory(daemons):
    """exec gathered a command's whole output in the daemon (then base64 in its JSON answer): a sandbox's
    process writing GiB took the daemon to the OOM killer. It keeps the first MAX_OUTPUT bytes of each
    stream, says it cut them (``truncated``), and the command runs to its end."""
    from overlay.runtime import MAX_OUTPUT

    daemon = daemons.start()
    sandbox = Sandbox(daemon.node, daemon.node.sandbox_up(BASE, workspace_ref("task00"), name="chatty").id)
    assert sandbox.exec(["true"]).exit_code == 0
    peak = daemon_support.memory_bytes(daemon.pid, "VmHWM")
    result = sandbox.exec(["/bin/sh", "-c", "head -c 268435456 /dev/zero; echo done >&2; exit 3"])
    assert (result.exit_code, result.stdout, result.stderr, result.truncated) == (3, bytes(MAX_OUTPUT), b"done\n", True)
    assert daemon_support.memory_bytes(daemon.pid, "VmHWM") - peak < 64 << 20
    assert sandbox.exec(["echo", "ok"]) == ExecResult(0, b"ok\n", b"")


def test_execs_at_once_keep_no_more_output_than_the_nodes_budget(daemons):
    """Each stream of an exec keeps at most MAX_OUTPUT (4 MiB), but 256 execs at once kept up to 2 GiB
    (2.7 GiB with their answers encoded) in the daemon. Together they keep at most EXEC_OUTPUT_BYTES now:
    more execs than fit write their whole MAX_OUTPUT on both streams and wait until all have written (so
    they hold it at once); what their answers carry stays within the budget, those cut say ``truncated``,
    and once they are done the budget is whole again."""
    from overlay.node_service import EXEC_OUTPUT_BYTES
    from overlay.runtime import MAX_OUTPUT

    execs = EXEC_OUTPUT_BYTES // (2 * MAX_OUTPUT) + 8
    daemon = daemons.start()
    sandbox = Sandbox(daemon.node, daemon.node.sandbox_up(BASE, workspace_ref("task00"), name="loud").id)
    script = (f"head -c {MAX_OUTPUT} /dev/zero; head -c {MAX_OUTPUT} /dev/zero >&2; touch /tmp/held.$0; "
              f"for n in $(seq 1200); do [ $(ls /tmp | grep -c held) -ge {execs} ] && exit 0; sleep 0.1; done; exit 9")
    with ThreadPoolExecutor(execs) as pool:
        results = list(pool.map(lambda i: sandbox.exec(["/bin/sh", "-c", script, str(i)]), range(execs)))
    assert [r.exit_code for r in results] == [0] * execs
    assert sum(len(r.stdout) + len(r.stderr) for r in results) <= EXEC_OUTPUT_BYTES
    assert any(r.truncated for r in results)
    for r in results:
        assert r.stdout == bytes(len(r.stdout)) and r.stderr == bytes(len(r.stderr))
        assert r.truncated == (len(r.stdout) + len(r.stderr) < 2 * MAX_OUTPUT)
    whole = sandbox.exec(["/bin/sh", "-c", f"head -c {MAX_OUTPUT} /dev/zero; head -c {MAX_OUTPUT} /dev/zero >&2"])
    assert (len(whole.stdout), len(whole.stderr), whole.truncated) == (MAX_OUTPUT, MAX_OUTPUT, False)


DEEP_TREE = 3000  # directories nested in one another: more than Python's recursion limit (1000)


def test_a_sandbox_that_nests_directories_deeper_than_pythons_stack_is_taken_down(daemons):
    """shutil.rmtree recurses a stack frame a level, and raises RecursionError (ignore_errors or not) on a
    tree nested 1000 deep, which any process in a sandbox can make in its upper dir: its ``down`` answered
    "internal error" and left the sandbox ``stopping`` for good, and a restarted daemon, taking that one
    apart at start, could not start. The tree goes now, nested any depth."""
    daemon = daemons.start()
    node = daemon.node
    sandbox = Sandbox(node, node.sandbox_up(BASE, workspace_ref("task00"), name="deep").id)
    # Perl (in minbase) steps down one level at a time: a shell's cd composes the whole path, past PATH_MAX.
    nest = f"chdir '/root' or die; for (1..{DEEP_TREE}) {{ mkdir 'd' or die $!; chdir 'd' or die $! }}"
    assert sandbox.exec(["perl", "-e", nest]).exit_code == 0
    try:
        sandbox.down()
        assert node.sandboxes() == [] and sandbox_entries(daemons) == []
        daemon.stop()
        assert daemons.start().node.sandboxes() == []
    finally:  # a tree left by a failure would stop pytest's own clean-up (shutil.rmtree) of tmp_path
        for entry in sandbox_entries(daemons):
            remove_tree(os.path.join(daemons.sandbox_dir, "sandboxes", entry, "upper", "root", "d"))


def test_a_sandbox_that_swaps_the_path_of_a_layer_mounted_in_it_cannot_turn_the_unmount(daemons, tmp_path):
    """A layer mounted by the daemon into a running sandbox's root, at a directory the sandbox made, passes
    the check of who may change its path (root in the sandbox is root on the host), and the sandbox's mount
    namespace does not see the mount, so its process may rename the directory holding it. Before: the
    sandbox renamed it and put a symlink to a host directory in its place, and the daemon's unmount, by
    name, followed the symlink: it unmounted the host's tmpfs there and left the layer mounted where the
    sandbox had moved it (its blob dropped). Now the daemon unmounts the mount it made, where it went."""
    node = daemons.start().node
    sandbox = Sandbox(node, node.sandbox_up(BASE, workspace_ref("task00"), name="swap").id)
    rootfs = sandbox.rootfs
    victim = tmp_path / "host"
    os.makedirs(victim / "mnt")
    mounts.mount("tmpfs", victim / "mnt", "tmpfs", 0, "size=1m")
    try:
        assert sandbox.exec(["mkdir", "-p", "/srv/d/mnt"]).exit_code == 0
        mountpoint = os.path.join(rootfs, "srv/d/mnt")
        node.mount(TOOLKIT, mountpoint, mode="kernel")
        victim_id = mounts.top_mount(str(victim / "mnt")).mount_id
        layer_id = mounts.top_mount(mountpoint).mount_id
        swapped = sandbox.exec(["/bin/sh", "-c", f"mv /srv/d /srv/e && ln -s {victim} /srv/d"])
        assert swapped.exit_code == 0, swapped.stderr
        moved = os.path.join(rootfs, "srv/e/mnt")
        assert mounts.top_mount(moved).mount_id == layer_id
        node.umount(mountpoint)
        assert mounts.is_mountpoint(victim / "mnt") and mounts.top_mount(str(victim / "mnt")).mount_id == victim_id
        assert mounts.top_mount(moved) is None
        assert mountpoint not in [mount.mountpoint for mount in node.status().mounts]
        sandbox.down()
    finally:
        for entry in reversed(mounts.mount_table()):
            if entry.mountpoint.startswith(str(victim)) or entry.mountpoint.startswith(rootfs + "/"):
                mounts.umount(entry.mountpoint, lazy=True)
