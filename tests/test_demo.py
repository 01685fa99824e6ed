"""The README's main job, `make demo` (docs/demo.sh), run as written on the real Debian rootfs: layers
built, a sandbox started lazily by a daemon that `sandbox up` starts, commands run in it, how much was
fetched, a trace report, and a clean stop: no daemon, no mount left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from dsec_fs.mounts import mounts_below

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.slow]


def test_make_demo_shows_the_whole_system_and_stops_cleanly(tmp_path, debian_rootfs):
    demo_dir = tempfile.mkdtemp(prefix="dsd-", dir="/tmp")  # short: the daemon's socket is in it
    env = {**os.environ, "DSECFS": os.path.join(BIN, "dsecfs"), "PYTHON": sys.executable,
           "ROOTFS": debian_rootfs, "STORE": str(tmp_path / "store"), "DEMO_DIR": demo_dir}
    for name in ("DSECFS_STORE", "DSECFS_SOCKET", "DSECFS_STATE_DIR", "DSECFS_CACHE_DIR", "DSECFS_CONFIG"):
        env.pop(name, None)
    try:
        done = subprocess.run(["sh", os.path.join(REPO, "docs", "demo.sh")], env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = done.stdout
        packages = subprocess.run(["dpkg-query", f"--admindir={debian_rootfs}/var/lib/dpkg", "-W"],
                                  capture_output=True, text=True, check=True).stdout.count("\n")
        assert f"Debian GNU/Linux 12 (bookworm): {packages} packages" in out  # run in the sandbox
        assert "toolkit: " in out and " Python files" in out
        assert f"created store file://{tmp_path / 'store'}" in done.stderr
        status = out[out.index("daemon   pid"):out.index("== stop")]
        assert f"state    {demo_dir}/state" in status  # the daemon `sandbox up` started follows the env
        lines = [line.split() for line in status.splitlines() if line.split()[-1:] == ["0"]]
        assert len(lines) == 2 and all(float(line[2].rstrip("%")) < 100 for line in lines)  # fetched lazily
        with open(os.path.join(demo_dir, "report", "report.json")) as f:
            assert len(json.load(f)["layers"]) == 2
        assert out.rstrip().splitlines()[-1] == str(packages)  # the exported image, mounted by the kernel
        assert not os.path.exists(os.path.join(demo_dir, "daemon.sock"))
        assert mounts_below(demo_dir) == []
    finally:
        shutil.rmtree(demo_dir, ignore_errors=True)
