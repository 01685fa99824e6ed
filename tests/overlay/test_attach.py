"""Attached commands (overlay/attach.py, dsec_fs/attach_client.py, ``dsecfs sandbox exec``) end to end: a real
daemon, real runc, a sandbox on the Debian rootfs; the terminal cases drive the CLI through a pty of the
test's own, as a user's terminal would.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import termios
import tempfile
import threading
import time

import pytest

from dsec_fs import exec_frames
from dsec_fs.errors import InputError, NotFoundError, UnavailableError, UnsupportedError
from dsec_fs.sandbox_client import Sandbox
from tests.lazy_fetch import daemon_support
from tests.cli.cli_support import interruptible
from tests.lazy_fetch.daemon_support import memory_bytes, wait_for
from tests.other_user import NOBODY
# The layers (the Debian base) and the daemons of a test, as the other sandbox tests have them.
from tests.overlay.test_node_sandboxes import BASE, daemons, layers, workspace_ref  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.root, pytest.mark.fuse]

WORKSPACE = workspace_ref("task00")
DEADLINE = 20.0  # seconds any one expected output may take


@pytest.fixture
def sandbox(daemons):
    node = daemons.start().node
    info = node.sandbox_up(BASE, WORKSPACE, name="att")
    return Sandbox(node, info.id, info=info)


def read_until(fd: int, needle: bytes, seen: bytearray, deadline: float = DEADLINE) -> bytes:
    """Read ``fd`` into ``seen`` until it holds ``needle``; returns what was seen."""
    end = time.monotonic() + deadline
    while needle not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {needle!r} within {deadline} s; saw {bytes(seen)!r}")
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            raise AssertionError(f"output ended without {needle!r}; saw {bytes(seen)!r}")
        seen += data
    return bytes(seen)


WAIT_FOR_GO = "echo ready; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo after >&2; exit 3"


def test_output_arrives_while_the_command_runs_and_its_exit_code_passes_through(sandbox, daemons):
    with sandbox.attach(["/bin/sh", "-c", WAIT_FOR_GO]) as command:
        output = command.output()
        assert next(output) == ("stdout", b"ready\n")  # the command is still waiting for /tmp/go
        open(os.path.join(sandbox.rootfs, "tmp/go"), "w").close()
        assert list(output) == [("stderr", b"after\n")]
    assert command.result.exit_code == 3 and not command.result.timed_out

    # The CLI streams too, and exits with the command's code.
    os.unlink(os.path.join(sandbox.rootfs, "tmp/go"))
    cli = subprocess.Popen([daemon_support.DSECFS, "sandbox", "exec", "--socket", daemons.socket, "att",
                            "/bin/sh", "-c", WAIT_FOR_GO], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert cli.stdout.readline() == b"ready\n"
        assert cli.poll() is None
        open(os.path.join(sandbox.rootfs, "tmp/go"), "w").close()
        assert cli.wait(DEADLINE) == 3 and cli.stderr.read() == b"after\n"
    finally:
        cli.kill()
        cli.wait()


def test_stdin_is_forwarded_as_it_is_written(sandbox, daemons):
    with sandbox.attach(["/bin/sh", "-c", "while read line; do echo got $line; done; echo end"], stdin=True) as command:
        output = command.output()
        for word in ("one", "two"):  # each answer comes before the next line is sent
            command.write(f"{word}\n".encode())
            assert next(output) == ("stdout", f"got {word}\n".encode())
        command.close_stdin()
        assert list(output) == [("stdout", b"end\n")]
    assert command.result.exit_code == 0
    done = daemons.cli("exec", "-i", "att", "/bin/sh", "-c", "cat; echo $?", stdin=b"a\x00b\n" * 1000)
    assert done.stdout == b"a\x00b\n" * 1000 + b"0\n"


def test_timeout_kills_the_command(sandbox):
    started = time.monotonic()
    with sandbox.attach(["/bin/sh", "-c", "echo start; sleep 30"], timeout=2.0) as command:
        output = list(command.output())
    assert command.result.exit_code == 137 and command.result.timed_out and time.monotonic() - started < 20
    assert output in ([], [("stdout", b"start\n")])  # [] when runc took the 2 s to start it (a loaded machine)


def test_errors_before_and_after_the_start(sandbox):
    with pytest.raises(InputError, match="cannot execute"):
        with sandbox.attach(["/no/such/program"]) as command:
            list(command.output())
    with pytest.raises(UnsupportedError, match="terminal needs the runc runtime"):
        sandbox.attach(["true"], tty=True, runtime="namespaces")
    with sandbox.attach(["/bin/sh", "-c", "read a; echo ${a}2"], stdin=True, runtime="namespaces") as command:
        command.write(b"1\n")
        command.close_stdin()
        assert list(command.output()) == [("stdout", b"12\n")]


def spawn_on_pty(args: list[str], rows: int, cols: int) -> tuple[subprocess.Popen, int, int]:
    """``args`` with a new pty as its controlling terminal (stdin, stdout, stderr); (process, master, slave)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                               preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    return process, master, slave


TTY_SCRIPT = ("tty; test -t 0 && echo stdin-is-a-tty; stty size; "
              "trap 'echo caught-sigint; exit 5' INT; "
              "while read line; do [ \"$line\" = q ] && break; echo \"got $line\"; stty size; done; "
              "echo waiting; while :; do sleep 0.05; done")


def test_exec_it_gives_the_command_a_terminal_of_the_callers_size_and_its_keys(sandbox, daemons):
    process, master, slave = spawn_on_pty(
        [daemon_support.DSECFS, "sandbox", "exec", "-it", "--socket", daemons.socket, "att", "/bin/sh", "-c",
         TTY_SCRIPT], 37, 91)
    before = termios.tcgetattr(slave)
    seen = bytearray()
    try:
        read_until(master, b"37 91\r\n", seen)
        assert b"/dev/pts/0\r\n" in seen and b"stdin-is-a-tty\r\n" in seen
        # While dsecfs runs the terminal is raw: keys go through untouched.
        assert not termios.tcgetattr(slave)[3] & (termios.ICANON | termios.ECHO | termios.ISIG)

        # A resize reaches the command (SIGWINCH to dsecfs, a RESIZE frame, runc resizes its terminal).
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        n = 0

        def answered() -> bool:
            nonlocal n
            n += 1
            os.write(master, f"line{n}\r".encode())
            read_until(master, f"got line{n}\r\n".encode(), seen)
            return seen.rstrip().endswith(b"50 120")

        wait_for(answered, "the new size inside the sandbox")

        # ^C is the command's: its trap answers, and its exit code is dsecfs's (not 130).
        os.write(master, b"q\r")
        read_until(master, b"waiting\r\n", seen)
        os.write(master, b"\x03")
        read_until(master, b"caught-sigint", seen)
        assert process.wait(DEADLINE) == 5
        assert termios.tcgetattr(slave) == before  # restored on the way out
    finally:
        process.kill()
        process.wait()
        os.close(master)
        os.close(slave)


def test_a_client_that_leaves_mid_stream_ends_the_command_and_the_daemon_serves_on(sandbox, daemons):
    endless = ["/bin/sh", "-c", "while :; do echo tick; sleep 0.01; done"]
    command = sandbox.attach(endless)
    assert next(command.output())[1].startswith(b"tick")
    assert len(daemons.runc_containers()) == 1
    command.close()
    wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted")

    # A client that sends a frame longer than the protocol allows is refused: ERROR, and the command killed.
    with sandbox.attach(endless, stdin=True) as command:
        output = command.output()
        next(output)
        command._send(struct.pack(">BI", exec_frames.STDIN, 1 << 31))
        with pytest.raises(InputError, match="frame of 2147483648 bytes"):
            list(output)
    wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted")

    # A client that vanishes in the handshake, and one that never upgrades, leave nothing either.
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(daemons.socket)
    raw.sendall(b"POST /v1/sandboxes/att/attach HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\n{\"argv\"")
    raw.close()
    with pytest.raises(InputError, match="Upgrade: dsecfs-exec/1"):
        sandbox.node.request("POST", "/v1/sandboxes/att/attach", {"argv": ["true"]})

    assert sandbox.exec(["echo", "still here"]).stdout == b"still here\n"
    assert sandbox.node.status().pid


def test_a_flood_of_output_to_a_slow_reader_keeps_the_daemon_small(daemons):
    daemon = daemons.start()
    node = daemon.node
    sandbox = Sandbox(node, node.sandbox_up(BASE, WORKSPACE, name="flood").id)
    with sandbox.attach(["/bin/sh", "-c", "exec yes 0123456789abcdefghijklmnopqrstuvwxyz"]) as command:
        output = command.output()
        next(output)
        before = memory_bytes(daemon.pid)
        received = 0
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # 64 KiB per 10 ms at most: far slower than `yes` writes
            time.sleep(0.01)
            received += len(next(output)[1])
        grown = memory_bytes(daemon.pid) - before
    assert received > 0 and grown < 16 << 20, (received, grown)
    wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted")
    assert sandbox.exec(["true"]).exit_code == 0


def test_only_root_reaches_the_attach_route(sandbox, daemons):
    assert stat.S_IMODE(os.stat(daemons.socket).st_mode) == 0o600
    probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
             "except PermissionError:\n    print('refused')\nelse:\n    print('connected')\n")
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                           "-I", "-S", "-c", probe, daemons.socket], capture_output=True, check=True)
    assert done.stdout == b"refused\n"


def test_a_stopping_daemon_ends_attached_commands_and_cleans_up(daemons):
    daemon = daemons.start()
    sandbox = Sandbox(daemon.node, daemon.node.sandbox_up(BASE, WORKSPACE, name="stops").id)
    with sandbox.attach(["/bin/sh", "-c", "echo up; exec sleep 600"]) as command:
        output = command.output()
        assert next(output) == ("stdout", b"up\n")
        daemon.process.send_signal(signal.SIGTERM)
        try:
            rest = list(output)
        except UnavailableError:  # the connection closed before the exit could be sent
            rest = []
        assert rest == [] and (command.result is None or command.result.exit_code == 137)
    assert daemon.process.wait(60) == 0


def test_a_terminated_exec_it_restores_the_terminal_and_ends_the_command(sandbox, daemons):
    process, master, slave = spawn_on_pty(
        [daemon_support.DSECFS, "sandbox", "exec", "-it", "--socket", daemons.socket, "att", "/bin/sh", "-c",
         "echo started; exec sleep 600"], 24, 80)
    before = termios.tcgetattr(slave)
    try:
        read_until(master, b"started", bytearray())
        assert termios.tcgetattr(slave) != before
        process.send_signal(signal.SIGTERM)
        assert process.wait(DEADLINE) == 128 + signal.SIGTERM
        assert termios.tcgetattr(slave) == before
        wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted")
    finally:
        process.kill()
        process.wait()
        os.close(master)
        os.close(slave)


def threads_waiting_on_children(pid: int) -> int:
    """Threads of ``pid`` blocked in a wait for a child or on a pipe (what a thread serving a command does)."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                count += f.read() in ("do_wait", "pipe_read", "pipe_write")
        except FileNotFoundError:
            pass
    return count


def test_attached_commands_hold_no_daemon_thread(daemons):
    """Unlike exec, whose worker thread waits for its command, an attached command is served by the daemon's
    event loop alone: commands that run on and on do not use up the daemon's threads."""
    daemon = daemons.start()
    sandbox = Sandbox(daemon.node, daemon.node.sandbox_up(BASE, WORKSPACE, name="threads").id)
    endless = ["/bin/sh", "-c", "while :; do echo tick; sleep 0.2; done"]
    commands = []
    try:
        for _ in range(4):
            commands.append(sandbox.attach(endless))
            next(commands[-1].output())
        assert len(daemons.runc_containers()) == 4
        assert threads_waiting_on_children(daemon.pid) == 0
    finally:
        for command in commands:
            command.close()
    wait_for(lambda: daemons.runc_containers() == [], "the containers to be deleted")


def test_a_client_that_leaves_while_its_stdin_waits_for_the_command_ends_it(sandbox, daemons):
    """The command reads no stdin, so the daemon stops reading the client (backpressure) and the client's
    writes block; the client leaving then is still noticed."""
    command = sandbox.attach(["/bin/sh", "-c", "echo ready; exec sleep 600"], stdin=True)
    assert next(command.output()) == ("stdout", b"ready\n")
    blocked = threading.Thread(target=lambda: pytest.raises(UnavailableError, command.write, b"x" * (8 << 20)))
    blocked.start()
    time.sleep(0.5)
    assert blocked.is_alive()  # the daemon reads no more than the command takes
    command.close()
    blocked.join(DEADLINE)
    assert not blocked.is_alive()
    wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted", timeout=5.0)
    assert sandbox.exec(["true"]).exit_code == 0


def test_ctrl_c_without_a_terminal_stops_dsecfs_with_130_and_the_command_with_it(sandbox, daemons):
    cli = subprocess.Popen([daemon_support.DSECFS, "sandbox", "exec", "--socket", daemons.socket, "att", "/bin/sh",
                            "-c", "echo started; exec sleep 600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           preexec_fn=interruptible)
    try:
        assert cli.stdout.readline() == b"started\n"
        cli.send_signal(signal.SIGINT)
        assert cli.wait(DEADLINE) == 130
        wait_for(lambda: daemons.runc_containers() == [], "the container to be deleted", timeout=5.0)
    finally:
        cli.kill()
        cli.wait()


def test_attached_namespaces_commands_whose_clients_left_leave_the_daemon_its_worker_threads(sandbox, daemons):
    """A command of the namespaces runtime runs in a worker thread that outlives a client that leaves.
    Forty-one of them once held all of trio's default threads, which the daemon's own calls (a path
    looked up, a cache lookup) need: those then waited out their deadlines."""
    commands = [sandbox.attach(["sleep", "12"], runtime="namespaces") for _ in range(41)]
    wait_for(lambda: _processes(b"sleep\x0012\x00") == 41, "the commands to start")
    for command in commands:
        command.close()
    empty = tempfile.mkdtemp(dir=daemons.state_dir + "/..")
    try:
        started = time.monotonic()
        with pytest.raises(NotFoundError):  # resolved in a worker thread: nothing is mounted there
            sandbox.node.umount(empty)
        assert time.monotonic() - started < 5.0
    finally:
        os.rmdir(empty)
        # the commands end on their own (the namespaces runtime does not stop them for a client that left)
        wait_for(lambda: _processes(b"sleep\x0012\x00") == 0, "the sleeps to end", timeout=30.0)


def _processes(cmdline: bytes) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                count += f.read() == cmdline
        except OSError:  # gone meanwhile
            pass
    return count


def test_an_attached_namespaces_command_says_its_gathered_output_was_cut(sandbox, daemons):
    """The namespaces runtime gathers an attached command's output as exec does, so it keeps the first
    MAX_OUTPUT bytes of each stream too (the daemon's memory); the EXIT frame and the CLI say so."""
    from overlay.runtime import MAX_OUTPUT

    script = f"head -c {MAX_OUTPUT + 1} /dev/zero; echo err >&2"
    with sandbox.attach(["/bin/sh", "-c", script], runtime="namespaces") as command:
        output = list(command.output())
    assert b"".join(data for kind, data in output if kind == "stdout") == bytes(MAX_OUTPUT)
    assert b"".join(data for kind, data in output if kind == "stderr") == b"err\n"
    assert command.result.exit_code == 0 and command.result.truncated
    done = daemons.cli("exec", "--runtime", "namespaces", "att", "/bin/sh", "-c", script)
    assert len(done.stdout) == MAX_OUTPUT and done.stderr.startswith(b"err\n") and b"output was cut" in done.stderr
