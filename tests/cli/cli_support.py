"""Helpers of the tests of the ``dsecfs`` command (tests/cli): run it in-process or as a real process.

Import it as ``cli_support`` (tests/cli is on sys.path, as every test directory is).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from click.testing import CliRunner, Result

from cli.main import main

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
# What a test must not inherit from the machine or from another test: where stores, configs and
# daemons are by default, and how dsecfs logs.
CLEAN_ENV = {name: None for name in ("DSECFS_STORE", "DSECFS_CONFIG", "DSECFS_SOCKET", "DSECFS_STATE_DIR",
                                     "DSECFS_CACHE_DIR", "DSECFS_QUIET", "DSECFS_LOG_LEVEL")}


def dsecfs(*args: str, env: dict[str, str | None] | None = None, input: bytes | None = None) -> Result:
    """``dsecfs ARGS`` in this process (click's runner: stdout and stderr apart, the exit code)."""
    return CliRunner().invoke(main, list(args), env={**CLEAN_ENV, **(env or {})}, input=input,
                              catch_exceptions=False)


def dsecfs_process(*args: str, env: dict[str, str] | None = None, **options) -> subprocess.CompletedProcess:
    """``dsecfs ARGS`` as a process of its own (the installed command), its output as text."""
    environ = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    return subprocess.run([DSECFS, *args], env={**environ, **(env or {})}, capture_output=True, text=True,
                          timeout=120, **options)


def json_of(result) -> dict:
    return json.loads(result.stdout)


def build(source: str, store: str, *extra: str) -> str:
    """Build ``source`` into ``store``; the layer digest."""
    result = dsecfs("build", source, "--store", store, "--json", *extra)
    assert result.exit_code == 0, result.output
    return json_of(result)["layer"]


def interruptible() -> None:
    """preexec_fn for a child a test will send SIGINT, as a terminal's ^C would: a shell that started the
    test run in the background (``make test &``, nohup) leaves SIGINT ignored, and a child inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
