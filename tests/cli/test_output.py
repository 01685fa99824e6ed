"""What scripts see: --json on every command (errors too: one object with class, kind, message, where and
exit code), -q, --log-level, exit 130 on Ctrl-C, and one size syntax."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import tarfile
import time

import click
import pytest
from cli_support import DSECFS, build, dsecfs, dsecfs_process, interruptible, json_of
from treecmp import write_files

from cli.common import walk_commands
from cli.main import main
from dsec_fs.layer import list_refs
from dsec_fs.store import open_store

LEAVES = [(" ".join(path), command) for path, command in walk_commands(main) if not isinstance(command, click.Group)]


@pytest.mark.parametrize("name, command", LEAVES, ids=[name for name, _ in LEAVES])
def test_every_command_has_json_quiet_and_log_level_and_shows_its_environment_variables(name, command):
    options = {opt for param in command.params for opt in param.opts}
    assert {"--json", "-q", "--quiet", "--log-level"} <= options, name
    shown = dsecfs(*name.split(), "--help")
    assert shown.exit_code == 0
    assert "--json" in shown.stdout and "--log-level" in shown.stdout and "env var: DSECFS_" in shown.stdout


def test_an_error_under_json_is_one_json_object_with_its_class_and_exit_code(tmp_path):
    store = str(tmp_path / "store")
    build(write_files(tmp_path / "src", {"f": b"x"}), store, "--name", "a:1")
    result = dsecfs("inspect", "b:1", "--store", store, "--json")
    assert result.exit_code == 6 and result.stderr == ""
    assert json_of(result) == {"error": {"class": "NotFoundError", "kind": "not-found", "exit_code": 6,
                                         "message": f"no such ref in store file://{store}", "where": "ref b:1"}}
    bad = dsecfs("inspect", "Bad Ref", "--store", store, "--json")
    assert bad.exit_code == 2 and json_of(bad)["error"]["class"] == "InputError"


def test_a_usage_error_under_json_is_json_too():
    result = dsecfs("build", "--no-such-option", "--json")
    assert result.exit_code == 2
    error = json_of(result)["error"]
    assert error["class"] == "NoSuchOption" and "--no-such-option" in error["message"]
    assert dsecfs("build", "--no-such-option").exit_code == 2  # and text without it


@pytest.mark.parametrize("command", [("umount", "/nonexistent"), ("sandbox", "down", "sb1"),
                                     ("sandbox", "exec", "sb1", "--", "true"), ("status",), ("cache", "stats")])
def test_the_daemon_commands_report_a_missing_daemon_in_json(tmp_path, command):
    options = ["--socket", str(tmp_path / "none.sock"), "--json"]
    end = command.index("--") if "--" in command else len(command)
    result = dsecfs(*command[:end], *options, *command[end:])
    assert result.exit_code == 5, result.output
    error = json_of(result)["error"]
    assert error["class"] == "UnavailableError" and error["where"] == str(tmp_path / "none.sock")


def test_quiet_prints_only_the_result_id(tmp_path):
    store = str(tmp_path / "store")
    src = write_files(tmp_path / "src", {"f": b"quiet"})
    built = dsecfs("build", src, "--store", store, "--name", "a:1", "-q")
    assert built.exit_code == 0
    with open_store(store) as opened:
        assert built.stdout == f"{list_refs(opened)['a:1']}\n" and built.stderr == ""
    assert dsecfs("ref", "ls", "--store", store, "--quiet").stdout == ""
    assert dsecfs("inspect", "a:1", "--store", store, "-q").stdout == ""
    missing = dsecfs("inspect", "b:1", "--store", store, "-q")
    assert missing.exit_code == 6 and "no such ref" in missing.stderr  # errors are never quiet


def test_log_level_on_any_command(tmp_path):
    store = str(tmp_path / "store")
    src = write_files(tmp_path / "src", {"f": b"one", "g": b"two"})
    parent = build(src, store)
    quiet = dsecfs_process("build", src, "--store", store, "--parent", parent)
    assert quiet.returncode == 0 and "patched parent layer" not in quiet.stderr
    loud = dsecfs_process("build", src, "--store", store, "--parent", parent, "--log-level", "info")
    assert loud.returncode == 0 and "INFO" in loud.stderr and "patched parent layer" in loud.stderr
    env = dsecfs_process("build", src, "--store", store, "--parent", parent, env={"DSECFS_LOG_LEVEL": "info"})
    assert "patched parent layer" in env.stderr


def test_ctrl_c_exits_130_and_publishes_nothing(tmp_path):
    store = str(tmp_path / "store")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo("big")
        member.size = 10**7
        tar.addfile(member, io.BytesIO(bytes(10**7)))
    build_ = subprocess.Popen([DSECFS, "build", "-", "--store", store, "--name", "a:1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    try:
        build_.stdin.write(archive.getvalue()[:3 * 10**6])  # stops in the middle of the file: the build waits
        build_.stdin.flush()
        time.sleep(1.5)
        build_.send_signal(signal.SIGINT)
        assert build_.wait(timeout=30) == 130
    finally:
        build_.kill()
        build_.wait()
        build_.stdin.close()
    assert b"interrupted" in build_.stderr.read() and build_.stdout.read() == b""
    with open_store(store) as opened:
        assert list_refs(opened) == {} and list(opened.list("layers/")) == []


def test_sizes_take_decimals_and_decimal_units(tmp_path):
    store = str(tmp_path / "store")
    src = write_files(tmp_path / "src", {"f": bytes(300_000)})
    digest = build(src, store, "--chunk-size", "0.25MiB")
    assert json_of(dsecfs("inspect", digest, "--store", store, "--json"))["chunk_size"] == 256 * 1024
    not_a_power = dsecfs("build", src, "--store", store, "--chunk-size", "1MB")  # 10^6 bytes
    assert not_a_power.exit_code == 2 and "1000000" in not_a_power.stderr
    bandwidth = dsecfs("daemon", "--bandwidth", "12 parsecs", "--socket", str(tmp_path / "s"))
    assert bandwidth.exit_code == 2 and "not a size: '12 parsecs'" in bandwidth.stderr


@pytest.mark.parametrize("args, expected", [
    (["sb1", "ls", "-la"], ["sb1", "--", "ls", "-la"]),
    (["sb1", "--network", "-e", "A=1", "--memory", "1G", "ls", "--color"],
     ["sb1", "--network", "-e", "A=1", "--memory", "1G", "--", "ls", "--color"]),
    (["--cwd", "/tmp", "sb1", "sh", "-c", "echo -n x"], ["--cwd", "/tmp", "sb1", "--", "sh", "-c", "echo -n x"]),
    (["sb1", "--env=A=1", "true"], ["sb1", "--env=A=1", "--", "true"]),
])
def test_sandbox_exec_needs_no_double_dash_before_a_command(args, expected):
    from cli.sandbox_cmds import exec_

    assert exec_._separated(args) == expected


def test_sandbox_exec_without_double_dash_reaches_the_daemon(tmp_path):
    """`exec SB ls -la` is a request to the daemon (none here: unavailable, 5), not a usage error for -la."""
    result = dsecfs("sandbox", "exec", "--socket", str(tmp_path / "none.sock"), "sb1", "ls", "-la")
    assert result.exit_code == 5 and "no daemon answers" in result.stderr
    dashed = dsecfs("sandbox", "exec", "--socket", str(tmp_path / "none.sock"), "sb1", "-la")
    assert dashed.exit_code == 2 and "No such option" in dashed.stderr  # ambiguous: needs --


def test_commands_of_other_modules_are_loaded_by_name_and_a_build_does_not_import_the_daemon_client(tmp_path):
    """cli.main's LazyCommands: each lazily loaded command is the one its name says, and the command line
    of a build imports neither the daemon's client nor the sandbox commands, nor the API types (its JSON is
    dicts) or the registry client (a fresh interpreter)."""
    for name in main.commands:
        assert main.commands[name].name == name
    source = write_files(tmp_path / "src", {"f": b"x"})
    probe = ("import sys; from cli.main import main\n"
             "try: main(sys.argv[1:])\n"
             "except SystemExit: pass\n"
             "print(sorted(m for m in ('dsec_fs.client', 'cli.daemon_cmds', 'cli.sandbox_cmds', 'cli.trace_cmds',"
             " 'dsec_fs.api', 'erofs_builder.registry')"
             " if m in sys.modules))")
    build_line = ["build", str(source), "--store", str(tmp_path / "store"), "--json"]
    out = subprocess.run([sys.executable, "-c", probe, *build_line], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    out = subprocess.run([sys.executable, "-c", probe, "status", "--help"], capture_output=True, text=True, check=True)
    assert "'cli.daemon_cmds'" in out.stdout.strip().splitlines()[-1]
