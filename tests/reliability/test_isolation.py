"""Isolation (issue 8): what a sandbox can and cannot reach, with real runc (and namespaces) sandboxes whose
layers a real node daemon serves from S3 (moto over HTTP).

From inside a sandbox: another sandbox's upper dir, root and processes are out of reach, and so are the
daemon's socket and the host's state directories; writes never reach the shared layers (EROFS, mounted
read-only) nor the other sandboxes; a setuid-root file of an image gives a non-root user no privileges,
and a device node of an image (or one made inside) cannot be opened. On the host: the daemon's socket is
0600 in a 0700 directory, and no fake credential the tests use appears in the daemon's log (even at debug
level), its traces, its answers, or the reports made from the traces.

The images: a base of Debian binaries (conftest.shell_tree), a "hostile" toolkit holding a setuid-root
copy of the shell and world-writable device nodes (/dev/null's 1:3, the host's kernel log 1:11, and the
block device that holds the host's root filesystem: some machines refuse that one even to the host's
root, so the kernel log is the probe that always counts), and a workspace per sandbox.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest
from treecmp import write_files

from overlay.sandbox import SandboxManager, SandboxSpec
from tests.reliability.support import (
    DSECFS,
    USER_UID,
    DaemonLayers,
    environment,
    find_secrets,
    mount_table,
    publish,
    s3_environment,
)
from tests.s3server import MotoServer

pytestmark = [pytest.mark.fuse, pytest.mark.root, pytest.mark.s3]

RUNTIMES = ("runc", "namespaces")
NOBODY = 65534
HOST_DISK = os.stat("/").st_dev  # the block device of the host's root filesystem


@dataclass(frozen=True)
class Images:
    url: str
    env: dict[str, str]
    base: str
    hostile: str
    base_tree: str
    hostile_digest: str
    gets_to_mount: int  # store gets a daemon makes to mount base and hostile by ref


def make_hostile_tree(root: str, shell_tree: str) -> str:
    os.makedirs(os.path.join(root, "usr/bin"))
    shutil.copy(os.path.join(shell_tree, "usr/bin/dash"), os.path.join(root, "usr/bin/suid-sh"))
    os.chown(os.path.join(root, "usr/bin/suid-sh"), 0, 0)
    os.chmod(os.path.join(root, "usr/bin/suid-sh"), 0o4755)
    os.makedirs(os.path.join(root, "evil"))
    os.mknod(os.path.join(root, "evil/null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(os.path.join(root, "evil/kmsg"), stat.S_IFCHR | 0o666, os.makedev(1, 11))
    os.mknod(os.path.join(root, "evil/disk"), stat.S_IFBLK | 0o666, HOST_DISK)
    for name in ("evil/null", "evil/kmsg", "evil/disk"):
        os.chmod(os.path.join(root, name), 0o666)  # mknod obeys the umask
    return root


@pytest.fixture(scope="module")
def images(moto_server, tmp_path_factory, shell_tree) -> Images:
    env = s3_environment(moto_server)
    url = f"s3://dsecfs-test/rel-isolation-{secrets.token_hex(4)}"
    root = tmp_path_factory.mktemp("isolation")
    base = publish(url, env, shell_tree, name="iso/base:1")
    hostile = publish(url, env, make_hostile_tree(str(root / "hostile"), shell_tree), name="iso/hostile:1")
    for name in ("a", "b"):
        files = {f"ws/{name}.txt": f"workspace of {name}\n".encode(), "ws/shared.txt": b"shared\n"}
        publish(url, env, write_files(str(root / f"ws-{name}"), files), name=f"iso/ws-{name}:1")
    gets_to_mount = sum(4 + len(layer.manifest.packs) for layer in (base, hostile))  # ref, manifest, meta, ...
    return Images(url, env, "iso/base:1", "iso/hostile:1", shell_tree, hostile.digest, gets_to_mount)


class Sandboxes:
    """A daemon serving the layers, and a SandboxManager stacking them (conftest.DaemonLayers)."""

    def __init__(self, images: Images, daemons, tmp_path):
        self.images = images
        self.daemons = daemons
        self.daemon = daemons.start(images.url, images.env)
        self.layers = DaemonLayers(self.daemon.node, str(tmp_path / "layers"))
        self.manager = SandboxManager(tmp_path / "sandboxes", self.layers)

    def up(self, name: str):
        return self.manager.up(SandboxSpec(base=self.images.base, workspace=f"iso/ws-{name}:1",
                                           toolkits=[self.images.hostile], name=name))

    def sh(self, sandbox, script: str, runtime: str = "runc", **options):
        return self.manager.exec(sandbox.id, ["/bin/sh", "-c", script], runtime=runtime, timeout=60, **options)

    def close(self) -> None:
        try:
            for state in self.manager.list():
                self.manager.down(state.id)
        finally:
            self.manager.close()


@pytest.fixture
def sandboxes(images, daemons, tmp_path):
    made = Sandboxes(images, daemons, tmp_path)
    try:
        yield made
    finally:
        made.close()


def probe(paths_and_commands: list[tuple[str, str]]) -> str:
    """A script printing "LEAK <what>" for each command that succeeds and "denied <what>" otherwise."""
    return "; ".join(f"if {command} >/dev/null 2>&1; then echo {shlex.quote('LEAK ' + what)}; "
                     f"else echo {shlex.quote('denied ' + what)}; fi" for what, command in paths_and_commands)


def as_nobody_on_the_host(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True)


# ---- other sandboxes, the host's directories, the daemon's socket ----------------------------------------------


def _host_pids_running(argv: list[str]) -> list[int]:
    wanted = "\0".join(argv).encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if entry.isdigit() and f.read() == wanted:
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_a_sandbox_cannot_reach_another_sandbox(sandboxes):
    a, b = sandboxes.up("a"), sandboxes.up("b")
    secret, nap = secrets.token_hex(8), f"{60 + secrets.randbelow(1000) / 1000:.3f}"
    b_run = threading.Thread(target=sandboxes.sh, args=(b, f"echo {secret} > /tmp/b-secret; exec sleep {nap}"))
    b_run.start()
    try:
        deadline = time.monotonic() + 30
        while not (pids := _host_pids_running(["sleep", nap])):
            assert time.monotonic() < deadline, "sandbox b never started"
            time.sleep(0.05)
        b_pid, = pids
        script = probe([
            (f"b's process {b_pid}", f"ls /proc/{b_pid}/root"),
            ("b's upper dir", f"ls {b.upper}"),
            ("b's root", f"ls {b.rootfs}"),
            ("b's secret by path", f"cat {b.upper}/tmp/b-secret"),
            ("a write into b's upper", f"echo planted > {b.upper}/tmp/planted"),
            ("the sandbox state dir", f"ls {sandboxes.manager.state_dir}"),
            ("the daemon state dir", f"ls {sandboxes.daemons.state_dir}"),
            ("the daemon cache dir", f"ls {sandboxes.daemons.cache_dir}"),
            ("a layer mountpoint", f"ls {sandboxes.layers.mountpoints()[0]}"),
        ]) + "; for p in /proc/[0-9]*; do cat $p/root/tmp/b-secret 2>/dev/null; echo pid ${p#/proc/}; done"
        result = sandboxes.sh(a, script)
        lines = result.stdout.decode().splitlines()
        assert result.exit_code == 0, result
        assert [line for line in lines if line.startswith("LEAK")] == []
        assert secret not in result.stdout.decode()
        visible = {int(line.split()[1]) for line in lines if line.startswith("pid ")}
        assert 1 in visible and b_pid not in visible and max(visible) < 100  # its own pid namespace only
    finally:
        for pid in _host_pids_running(["sleep", nap]):
            os.kill(pid, 9)
        b_run.join(60)
    assert not os.path.exists(os.path.join(b.upper, "tmp/planted"))
    with open(os.path.join(b.upper, "tmp/b-secret")) as f:
        assert f.read() == secret + "\n"


def test_the_daemon_socket_is_0600_and_out_of_reach(sandboxes):
    socket_path = sandboxes.daemons.socket
    st = os.stat(socket_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700  # the daemon made it

    # A user of the host other than root cannot connect, however the directories above it are set.
    os.chmod(sandboxes.daemons.socket_dir, 0o755)
    connect = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
               "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\nprint('connected')")
    assert as_nobody_on_the_host("/usr/bin/python3", "-c", connect, socket_path).returncode == 13
    os.chmod(os.path.dirname(socket_path), 0o755)
    try:
        assert as_nobody_on_the_host("/usr/bin/python3", "-c", connect, socket_path).returncode == 13  # 0600
    finally:
        os.chmod(os.path.dirname(socket_path), 0o700)

    # A sandbox sees neither the socket nor its directory, nor the socket in its /proc/net/unix.
    a = sandboxes.up("a")
    result = sandboxes.sh(a, probe([("the socket", f"ls {socket_path}"),
                                    ("the socket dir", f"ls {os.path.dirname(socket_path)}")])
                          + "; cat /proc/net/unix")
    assert result.exit_code == 0, result
    assert "LEAK" not in result.stdout.decode() and socket_path not in result.stdout.decode()


# ---- the shared layers ----------------------------------------------------------------------------------------


def test_sandboxes_never_write_to_the_shared_layers(sandboxes, images):
    a, b = sandboxes.up("a"), sandboxes.up("b")
    for mountpoint in sandboxes.layers.mountpoints():
        entry, = (entry for entry in mount_table() if entry.target == mountpoint)
        assert entry.fstype == "erofs" and "ro" in entry.options
    base, = (layer for layer in a.layers if layer.role == "base")
    layer_file = os.path.join(base.mountpoint, "etc/os-release")
    with pytest.raises(OSError) as info:
        open(layer_file, "ab")
    assert info.value.errno == 30  # EROFS: not even root on the host writes to a layer

    script = ("echo changed > /etc/os-release && echo more >> /ws/shared.txt && rm /usr/bin/suid-sh && "
              "dd if=/dev/zero of=/usr/bin/cat bs=1 count=1 conv=notrunc 2>/dev/null && echo done")
    result = sandboxes.sh(a, script)
    assert (result.exit_code, result.stdout) == (0, b"done\n"), result
    with open(os.path.join(a.upper, "etc/os-release"), "rb") as f:
        assert f.read() == b"changed\n"  # a's own copy
    originals = {"etc/os-release": b"ID=reliability\n", "ws/shared.txt": b"shared\n"}
    with open(os.path.join(images.base_tree, "usr/bin/cat"), "rb") as f:
        originals["usr/bin/cat"] = f.read()
    for name, data in originals.items():
        with open(os.path.join(b.rootfs, name), "rb") as f:
            assert f.read() == data, name  # b sees the layers as they are
    with open(layer_file, "rb") as f:
        assert f.read() == originals["etc/os-release"]
    assert os.path.exists(os.path.join(b.rootfs, "usr/bin/suid-sh"))


# ---- setuid files and device nodes in images ------------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_setuid_file_in_an_image_gives_no_privileges(sandboxes, runtime):
    a = sandboxes.up("a")
    script = (f"stat -c '%a %u' /usr/bin/suid-sh; setpriv --reuid={USER_UID} --regid={USER_UID} --clear-groups "
              "/usr/bin/suid-sh -p -c 'id -u; cat /proc/self/status'")
    result = sandboxes.sh(a, script, runtime)
    assert result.exit_code == 0, result
    mode_and_owner, effective_uid, *status_lines = result.stdout.decode().splitlines()
    status = dict(line.split(":\t", 1) for line in status_lines if ":\t" in line)
    assert mode_and_owner == "4755 0"  # the image does carry a setuid-root shell
    assert effective_uid == str(USER_UID)
    assert status["Uid"].split() == [str(USER_UID)] * 4 and status["NoNewPrivs"] == "1"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_device_node_in_an_image_cannot_be_opened(sandboxes, runtime):
    a = sandboxes.up("a")
    major, minor = os.major(HOST_DISK), os.minor(HOST_DISK)
    result = sandboxes.sh(a, probe([
        ("the image's 1:3", "head -c 1 /evil/null"),
        ("the image's host kernel log, for writing", "dd if=/dev/null of=/evil/kmsg count=0 conv=notrunc"),
        ("the image's host disk", "dd if=/evil/disk of=/dev/null bs=512 count=1"),
        ("a host disk node made inside", f"mknod /tmp/disk b {major} {minor} && dd if=/tmp/disk of=/dev/null "
                                         "bs=512 count=1"),
        ("a host kernel log node made inside", "mknod /tmp/kmsg c 1 11 && "
                                               "dd if=/dev/null of=/tmp/kmsg count=0 conv=notrunc"),
    ]) + "; head -c 1 /dev/null && echo 'own /dev works'", runtime)
    assert result.exit_code == 0, result
    lines = result.stdout.decode().splitlines()
    assert [line for line in lines if line.startswith("LEAK")] == [], lines
    assert lines[-1] == "own /dev works"  # the runtime's /dev is not affected


def test_the_sandbox_root_is_nosuid_and_nodev(sandboxes):
    a = sandboxes.up("a")
    entry, = (entry for entry in mount_table() if entry.target == a.rootfs)
    assert entry.fstype == "overlay" and {"nosuid", "nodev"} <= entry.options


def test_layers_on_the_host_give_no_privileges(images, daemons, tmp_path):
    # The daemon's directories as it makes them by default: its state dir in a directory others may enter.
    open_dir = tempfile.mkdtemp(prefix="dsr-open-", dir="/tmp")
    os.chmod(open_dir, 0o755)
    daemon = None
    try:
        daemon = daemons.start(images.url, images.env, state_dir=os.path.join(open_dir, "state"))
        mnt = str(tmp_path / "hostile")
        os.makedirs(mnt)
        daemon.node.mount(images.hostile_digest, mnt, mode="fuse")
        served = os.path.join(open_dir, "state", "fuse", "layers", images.hostile_digest)
        shell = as_nobody_on_the_host(os.path.join(served, "usr/bin/suid-sh"), "-p", "-c", "id -u")
        device = as_nobody_on_the_host("head", "-c", "1", os.path.join(served, "evil/null"))
    finally:
        if daemon is not None:
            daemon.stop()  # its FUSE session is mounted in open_dir
        shutil.rmtree(open_dir, ignore_errors=True)
    assert shell.stdout.strip() != "0", "a user of the host ran the image's setuid shell as root"
    assert device.returncode != 0, "a user of the host opened a device node of the image"


# ---- credentials ------------------------------------------------------------------------------------------------


def test_no_credentials_in_logs_traces_answers_or_reports(images, daemons, tmp_path):
    # Debug logging, faults (error messages name keys and requests), mounts in both modes, traces, reports.
    first_read = images.gets_to_mount + 1
    daemon = daemons.start(images.url, images.env, faults=f"get:{first_read}-{first_read + 2}:permanent",
                           extra_args=["--log-level", "debug"])
    node = daemon.node
    kernel, fuse = str(tmp_path / "kernel"), str(tmp_path / "fuse")
    for path in (kernel, fuse):
        os.makedirs(path)
    node.mount(images.base, kernel)
    node.mount(images.hostile, fuse, mode="fuse")
    for root in (kernel, fuse):
        for directory, _dirs, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                if stat.S_ISREG(os.lstat(path).st_mode):
                    try:
                        with open(path, "rb") as f:
                            f.read()
                    except OSError:
                        pass  # the faults
    answers = [node.request("GET", "/v1/status"), node.metrics_text(), node.request("GET", "/v1/cache")]
    with pytest.raises(Exception) as failed_mount:
        node.mount("iso/no-such-layer:1", kernel + "-missing")
    for path in (kernel, fuse):
        node.umount(path)

    report_dir = str(tmp_path / "report")
    trace_dir = os.path.join(daemons.state_dir, "traces")
    with environment(images.env):
        made = subprocess.run([DSECFS, "trace", "report", trace_dir, "-o", report_dir, "--store", images.url],
                              capture_output=True, text=True)
        status = subprocess.run([DSECFS, "status", "--json", "--socket", daemons.socket], capture_output=True,
                                text=True)
    assert made.returncode == 0, made.stderr
    daemon.stop()

    # An endpoint that refuses the credentials: its error names none of them either. (moto checks them
    # after its first two requests: the check that it is up, and the bucket made here.)
    with MotoServer(server_env={"INITIAL_NO_AUTH_ACTION_COUNT": "2"}) as strict:
        strict.create_bucket("dsecfs-strict")
        node = daemons.start("s3://dsecfs-strict/x", s3_environment(strict), extra_args=["--log-level", "debug"]).node
        with pytest.raises(Exception) as refused:
            node.mount(images.base, kernel)

    texts = {"answers": repr(answers), "failed mount": str(failed_mount.value), "refused": str(refused.value),
             "report command": made.stdout + made.stderr, "status command": status.stdout + status.stderr,
             "log": daemons.log()}
    for directory in (daemons.state_dir, report_dir):
        for root, _dirs, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                if stat.S_ISREG(os.lstat(path).st_mode):
                    with open(path, "rb") as f:
                        texts[path] = f.read()
    assert os.listdir(trace_dir) and os.listdir(report_dir)
    leaks = {where: found for where, text in texts.items() if (found := find_secrets(text))}
    assert leaks == {}
    assert "credentials rejected" in texts["refused"]
