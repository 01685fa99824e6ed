"""The bounds a service or a transfer keeps, set on the command line: ``dsecfs sched serve``'s connection
bounds (overlay/http_bounds.py) and the registry commands' transfer deadline (erofs_builder/registry.py).
Before, neither had a flag: the defaults could not be changed. A bad value is an input error naming the
option, exit 2, before anything starts."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from cli_support import DSECFS, dsecfs

from tests.s3server import free_port


@pytest.mark.parametrize("args, where", [
    (["sched", "serve", "--max-connections", "0"], "--max-connections 0"),
    (["sched", "serve", "--max-connections", "many"], "--max-connections many"),
    (["sched", "serve", "--idle-timeout", "0s"], "--idle-timeout 0s"),
    (["sched", "serve", "--request-timeout", "soon"], "--request-timeout soon"),
    (["build", "docker://127.0.0.1:1/a:b", "--registry-timeout", "0"], "--registry-timeout 0"),
    (["build", "docker://127.0.0.1:1/a:b", "--registry-min-rate", "fast"], "--registry-min-rate fast"),
    (["convert", "oci:x:y", "docker://127.0.0.1:1/a:b", "--registry-min-rate", "0"], "--registry-min-rate 0"),
    (["image", "pull", "docker://127.0.0.1:1/a:b", "--registry-timeout", "1x"], "--registry-timeout 1x"),
])
def test_a_bad_bound_is_an_input_error_naming_the_option(args, where, tmp_path):
    result = dsecfs(*args, "--store", str(tmp_path / "store")) if args[0] == "build" else dsecfs(*args)
    assert result.exit_code == 2, result.output
    assert f"input error: {where}: " in result.stderr
    assert not (tmp_path / "store").exists()


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False


def test_sched_serve_keeps_the_bounds_it_is_given():
    """An idle connection is closed after --idle-timeout, one that drips its request after
    --request-timeout (their defaults are 300 s and 30 s: the test would wait past its 20 s)."""
    port = free_port()
    server = subprocess.Popen([DSECFS, "sched", "serve", "--listen", f"127.0.0.1:{port}", "--idle-timeout", "1s",
                               "--request-timeout", "2s", "--max-connections", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening" in server.stdout.readline()
        with socket.create_connection(("127.0.0.1", port)) as idle, \
                socket.create_connection(("127.0.0.1", port)) as drip:
            drip.sendall(b"POST /v1/place HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            started = time.monotonic()
            closed = False
            while not closed and time.monotonic() - started < 20:
                try:
                    drip.sendall(b" ")
                except OSError:  # reset: closed by the server
                    break
                closed = _closed_by_server(drip, 0.2)
            closed = closed or time.monotonic() - started < 20
            assert closed
            assert _closed_by_server(idle, 20)
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=30)
