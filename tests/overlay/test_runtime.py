"""The runtime shim (overlay.runtime) on a real Debian bookworm rootfs, through runc and the namespaces
fallback: identity, output, exit codes, isolation (network, no_new_privs, capabilities), limits, binds,
and clear errors for bad input.

The cached rootfs is never written: each test runs over an OverlayFS stack with a private upper (lowers:
a directory holding /workspace, then the rootfs). Every mount is undone in a finally and each test
checks that nothing is left mounted below its tmp_path.
"""

from __future__ import annotations

import os

import pytest
from treecmp import write_files

from dsec_fs.errors import InputError, NotFoundError, UnavailableError, UnsupportedError
from dsec_fs.mounts import mounts_below
from overlay.runtime import DEFAULT_CAPABILITIES, NAMESPACES_WITHHELD, run_in_rootfs
from overlay.stack import mount_stack, unmount_stack

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("nothing_left_mounted")]

BOTH = pytest.mark.parametrize("runtime", ["runc", "namespaces"])


@pytest.fixture
def rootfs(tmp_path, debian_rootfs):
    """Debian with /workspace/hello.txt, writable through a private upper dir."""
    workspace = write_files(tmp_path / "workspace-layer", {"workspace/hello.txt": b"hello\n"})
    upper, work, root = tmp_path / "upper", tmp_path / "work", tmp_path / "root"
    for directory in (upper, work, root):
        directory.mkdir()
    mount_stack([workspace, debian_rootfs], upper, work, root)
    try:
        yield str(root)
    finally:
        unmount_stack(root)


def sh(rootfs: str, script: str, runtime: str, **options):
    return run_in_rootfs(rootfs, ["/bin/sh", "-c", script], runtime=runtime, **options)


@BOTH
def test_runs_as_root_in_debian_with_the_workspace(rootfs, runtime):
    result = sh(rootfs, "id; cat /etc/os-release; ls /workspace", runtime)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "uid=0(root) gid=0(root) groups=0(root)"
    assert "VERSION_CODENAME=bookworm" in lines and 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"' in lines
    assert lines[-1] == "hello.txt"
    assert result.stderr == b""


@BOTH
def test_exit_codes_pass_through_and_stderr_is_separate(rootfs, runtime):
    result = sh(rootfs, "echo out; echo err >&2; exit 7", runtime)
    assert (result.exit_code, result.stdout, result.stderr) == (7, b"out\n", b"err\n")


@BOTH
def test_no_network_but_loopback(rootfs, runtime):
    result = sh(rootfs, "cat /proc/net/dev", runtime)
    interfaces = [line.split(":")[0].strip() for line in result.stdout.decode().splitlines()[2:]]
    assert interfaces == ["lo"]


def test_network_true_shares_the_host_network(rootfs):
    with open("/proc/net/dev") as f:
        host = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    result = sh(rootfs, "cat /proc/net/dev", "runc", network=True)
    assert sorted(line.split(":")[0].strip() for line in result.stdout.decode().splitlines()[2:]) == host


@BOTH
def test_no_new_privileges_and_reduced_capabilities(rootfs, runtime):
    output = sh(rootfs, "cat /proc/self/status", runtime).stdout.decode()
    status = dict(line.split(":\t", 1) for line in output.splitlines())
    assert status["NoNewPrivs"] == "1"
    allowed = {name: bit for name, bit in DEFAULT_CAPABILITIES.items()
               if runtime == "runc" or name not in NAMESPACES_WITHHELD}
    expected = sum(1 << bit for bit in allowed.values())
    assert int(status["CapBnd"], 16) == expected
    assert int(status["CapEff"], 16) == expected


def test_runc_pids_limit_bounds_a_fork_bomb(rootfs):
    script = ("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max; "
              "for i in $(seq 50); do sleep 5 & done; echo all forked")
    result = sh(rootfs, script, "runc", pids_limit=12)
    assert result.stdout.decode().splitlines()[0] == "12"
    assert b"all forked" not in result.stdout
    assert b"fork" in result.stderr.lower() and result.exit_code != 0


def test_runc_memory_and_cpu_limits_reach_the_cgroup(rootfs):
    script = ("cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max; "
              "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max")
    result = sh(rootfs, script, "runc", memory_bytes=96 << 20, cpus=0.5)
    assert result.stdout.decode().split() == [str(96 << 20), "50000"]


def test_runc_memory_limit_kills_with_a_signal_that_passes_through(rootfs):
    # The shell keeps 64 MiB in a variable; the cgroup allows 24 MiB, and the OOM killer's SIGKILL is the
    # one signal that stops a pid namespace's init from inside.
    script = "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived"
    result = sh(rootfs, script, "runc", memory_bytes=24 << 20)
    assert result.exit_code == 128 + 9 and b"survived" not in result.stdout


@BOTH
def test_binds_and_read_only_paths(rootfs, runtime, tmp_path):
    shared = write_files(tmp_path / "shared", {"in": b"from host\n"})
    reference = write_files(tmp_path / "reference", {"doc": b"read me\n"})
    script = ("cat /data/in /ref/doc; echo made > /data/out; "
              "echo x > /ref/new 2>/dev/null || echo ref-ro; echo x > /etc/new 2>/dev/null || echo etc-ro")
    result = sh(rootfs, script, runtime, extra_binds=[(shared, "/data", False), (reference, "/ref", True)],
                readonly_paths=["/etc"])
    assert result.stdout == b"from host\nread me\nref-ro\netc-ro\n", result.stderr
    with open(os.path.join(shared, "out"), "rb") as f:
        assert f.read() == b"made\n"
    assert os.listdir(reference) == ["doc"]


@BOTH
def test_env_cwd_hostname_and_stdin(rootfs, runtime):
    result = sh(rootfs, 'echo "$FOO"; pwd; cat /proc/sys/kernel/hostname; cat', runtime, env={"FOO": "bar baz"},
                cwd="/tmp", hostname="box-1", stdin=b"from stdin")
    assert result.stdout == b"bar baz\n/tmp\nbox-1\nfrom stdin"


@BOTH
def test_a_timeout_kills_the_sandbox(rootfs, runtime):
    result = sh(rootfs, "echo started; sleep 60", runtime, timeout=1)
    assert result.timed_out and result.exit_code == 128 + 9
    assert result.stdout == b"started\n"


@BOTH
def test_output_past_the_bound_is_cut_and_said_so_and_the_command_runs_to_its_end(rootfs, runtime):
    """A command's output was gathered whole in the caller's memory (the daemon's, for a sandbox's exec): a
    process writing without end took the daemon to the OOM killer. The first MAX_OUTPUT bytes of each
    stream are kept; the rest is read and dropped, so the command is not blocked, and ``truncated`` says so."""
    from overlay.runtime import MAX_OUTPUT

    script = f"head -c {3 * MAX_OUTPUT} /dev/zero; echo done >&2; head -c {MAX_OUTPUT + 1} /dev/zero >&2; exit 7"
    result = sh(rootfs, script, runtime)
    assert (result.exit_code, len(result.stdout), len(result.stderr)) == (7, MAX_OUTPUT, MAX_OUTPUT)
    assert result.truncated and result.stdout == bytes(MAX_OUTPUT) and result.stderr.startswith(b"done\n\0")
    small = sh(rootfs, f"head -c {MAX_OUTPUT} /dev/zero", runtime)
    assert len(small.stdout) == MAX_OUTPUT and not small.truncated


@BOTH
def test_a_command_that_cannot_run_is_an_input_error(rootfs, runtime):
    with pytest.raises(InputError, match="cannot execute '/no/such/program'"):
        run_in_rootfs(rootfs, ["/no/such/program"], runtime=runtime)


def test_bad_input_is_refused(rootfs, tmp_path, monkeypatch):
    with pytest.raises(NotFoundError):
        run_in_rootfs(tmp_path / "missing", ["true"])
    for bad in ({"runtime": "docker"}, {"cwd": "relative"}, {"env": {"A=B": "c"}}, {"pids_limit": 0},
                {"hostname": "no spaces"}, {"extra_binds": [(str(tmp_path), "relative", True)]}):
        with pytest.raises(InputError):
            run_in_rootfs(rootfs, ["true"], **bad)
    with pytest.raises(InputError):
        run_in_rootfs(rootfs, [])
    with pytest.raises(NotFoundError, match="bind source"):
        run_in_rootfs(rootfs, ["true"], extra_binds=[(str(tmp_path / "nope"), "/x", True)])
    with pytest.raises(UnsupportedError, match="pids_limit"):
        run_in_rootfs(rootfs, ["true"], runtime="namespaces", pids_limit=10)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(UnavailableError, match="runc is not installed"):
        run_in_rootfs(rootfs, ["true"])
    assert mounts_below(tmp_path) == [str(tmp_path / "root")]  # only the test's own stack
