"""One configuration: the file ($DSECFS_CONFIG, --config, /etc/dsecfs/config.toml), DSECFS_* environment
variables for every option, the command line over both; and the directories of a daemon that `mount`
starts follow them."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest
from cli_support import build, dsecfs, dsecfs_process, json_of
from treecmp import write_files


def write_config(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def layer(tmp_path):
    store = str(tmp_path / "store")
    return store, build(write_files(tmp_path / "src", {"f": bytes(100_000)}), store, "--name", "a:1")


def test_the_config_file_sets_options_of_every_command_and_of_one(tmp_path, layer):
    store, digest = layer
    config = write_config(tmp_path / "config.toml", f'store = "{store}"\n[build]\nchunk-size = "64KiB"\n'
                                                    '[ref.ls]\nno_trunc = true\n')
    env = {"DSECFS_CONFIG": config}
    shown = dsecfs("inspect", "a:1", "--json", env=env)
    assert shown.exit_code == 0, shown.output
    assert json_of(shown)["layer"] == digest
    assert f"a:1  {digest}" in dsecfs("ref", "ls", env=env).stdout  # [ref.ls]'s no-trunc
    rebuilt = dsecfs("build", str(tmp_path / "src"), "--json", env=env)
    assert json_of(dsecfs("inspect", json_of(rebuilt)["layer"], "--json", env=env))["chunk_size"] == 64 * 1024
    flag = dsecfs("--config", config, "build", str(tmp_path / "src"), "--chunk-size", "128KiB", "--json")
    assert json_of(dsecfs("inspect", json_of(flag)["layer"], "--json", env=env))["chunk_size"] == 128 * 1024


def test_the_environment_beats_the_file_and_the_command_line_beats_both(tmp_path, layer):
    store, digest = layer
    other = str(tmp_path / "other")
    dsecfs("store", "init", other)
    config = write_config(tmp_path / "config.toml", f'store = "{other}"\n')
    assert dsecfs("inspect", "a:1", env={"DSECFS_CONFIG": config}).exit_code == 6  # the file's store
    assert dsecfs("inspect", "a:1", env={"DSECFS_CONFIG": config, "DSECFS_STORE": store}).exit_code == 0
    assert dsecfs("inspect", "a:1", "--store", other, env={"DSECFS_STORE": store}).exit_code == 6
    by_auto_name = dsecfs("build", str(tmp_path / "src"), "--store", store, "--json",
                          env={"DSECFS_BUILD_CHUNK_SIZE": "32KiB"})
    assert json_of(dsecfs("inspect", json_of(by_auto_name)["layer"], "--store", store, "--json"))["chunk_size"] == 32768


@pytest.mark.parametrize("text, complaint", [
    ('stroe = "/x"\n', "config.toml: stroe"),
    ('[biuld]\nchunk-size = "1MiB"\n', "config.toml: [biuld]"),
    ('[build]\nchunk-sise = "1MiB"\n', "config.toml: build.chunk_sise"),
    ('[build.x]\na = 1\n', "build is a command"),
    ('store = \n', "not TOML"),
])
def test_a_mistake_in_the_config_file_is_an_input_error_naming_it(tmp_path, text, complaint):
    config = write_config(tmp_path / "config.toml", text)
    result = dsecfs("ref", "ls", "--json", env={"DSECFS_CONFIG": config})
    assert result.exit_code == 2, result.output
    assert complaint in json_of(result)["error"]["where"] + json_of(result)["error"]["message"]


def test_a_config_file_that_is_not_there_is_an_error_when_named(tmp_path):
    result = dsecfs("--config", str(tmp_path / "nope.toml"), "ref", "ls")
    assert result.exit_code == 2 and "nope.toml" in result.stderr


@pytest.mark.root
@pytest.mark.fuse
def test_mount_starts_its_daemon_with_the_configured_state_and_cache_directories(tmp_path, layer):
    store, digest = layer
    socket_dir = tempfile.mkdtemp(prefix="dsc-", dir="/tmp")  # a unix socket path is at most 107 bytes
    socket = os.path.join(socket_dir, "d.sock")
    state, cache, mnt = tmp_path / "state", tmp_path / "cache", tmp_path / "mnt"
    mnt.mkdir()
    config = write_config(tmp_path / "config.toml", f'state-dir = "{state}"\n')
    # The socket and the store from the environment, which any dsecfs honours: whatever this one does
    # with the rest, the daemon it starts is this test's, and stopped below.
    env = {"DSECFS_CONFIG": config, "DSECFS_CACHE_DIR": str(cache), "DSECFS_SOCKET": socket, "DSECFS_STORE": store}
    try:
        mounted = dsecfs_process("mount", digest[:12], str(mnt), "--json", env=env)
        assert mounted.returncode == 0, mounted.stderr
        status = json_of(dsecfs_process("status", "--json", env=env))
        assert status["state_dir"] == str(state) and status["socket"] == socket
        assert json_of(dsecfs_process("cache", "stats", "--json", env=env))["directory"] == str(cache)
        assert (state / "daemon.log").is_file() and (mnt / "f").read_bytes() == bytes(100_000)
        assert dsecfs_process("umount", str(mnt), env=env).returncode == 0
    finally:
        answer = dsecfs_process("status", "--json", env=env)
        if answer.returncode == 0:
            pid = json_of(answer)["pid"]
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(socket_dir, ignore_errors=True)
