"""A daemon serving with fusepy (libfuse2) and SIGPIPE. libfuse2 ends a session by setting SIGPIPE back to
SIG_DFL when it finds it ignored (fuse_remove_signal_handlers), as Python starts every process: from then
on, the next write to a pipe or socket whose reader is gone kills the whole process. A daemon's session
ends only as the daemon stops (one unmounted from outside stops it), and it logs on after that.

Before: a ``--fuse-binding fusepy`` daemon whose log reader had gone (its stderr a pipe whose read end was
closed: a supervisor's log pipe, ``| tee`` ended), then sent SIGTERM, died of SIGPIPE (status -13) at its
next log line after the session ended; pyfuse3 (which installs no signal handlers) exited 0. Now the
fusepy adapter puts SIGPIPE back to ignored as soon as libfuse returns. (The same reset in the test process,
where mount tests run fusepy sessions, killed a CI run: tests/conftest.py ignored SIGPIPE again before
every test; the adapter's fix made that unneeded.)"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from dsec_fs import mounts
from tests.lazy_fetch.daemon_support import DSECFS

pytestmark = [pytest.mark.fuse, pytest.mark.root]


@pytest.mark.parametrize("binding", ["fusepy", "pyfuse3"])
def test_a_daemon_whose_log_reader_is_gone_stops_cleanly(tmp_path, binding):
    (tmp_path / "store").mkdir()
    socket_path = str(tmp_path / "s")
    read_end, write_end = os.pipe()
    daemon = subprocess.Popen([DSECFS, "daemon", "--socket", socket_path, "--state-dir", str(tmp_path / "state"),
                               "--cache-dir", str(tmp_path / "cache"), "--store", str(tmp_path / "store"),
                               "--fuse-binding", binding, "--no-profiles", "--log-level", "info"],
                              stdout=subprocess.DEVNULL, stderr=write_end)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as log:
            seen = b""
            while b"serving on" not in seen:
                line = log.readline()
                assert line, f"the daemon ended before serving: {seen.decode(errors='replace')}"
                seen += line
        # The read end is closed: every log line from here on is a write to a pipe nobody reads.
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for mountpoint in reversed(mounts.mounts_below(tmp_path)):
            mounts.umount(mountpoint, lazy=True)
