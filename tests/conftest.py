"""Shared fixtures: the real Debian rootfs, and a sweep of mounts a crashed run may have left behind.

Every mount a test makes is undone by that test (a fixture's finally); the sweep is the second line of
defence so one failed run cannot poison the next: before and after the session it detaches every
erofs, fuse and overlay mount below the temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

DEBIAN_ROOTFS = os.environ.get("DSECFS_TEST_ROOTFS", "/var/cache/dsecfs-test/debian-minbase")
SWEPT_FSTYPES = ("erofs", "overlay", "fuse")


def _stale_mounts(base: str) -> list[str]:
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _src, target, fstype, *_ = line.split()
            target = target.encode().decode("unicode_escape")
            if target.startswith(base) and fstype.split(".")[0] in SWEPT_FSTYPES:
                found.append(target)
    # Deepest first, so an overlay comes off before the layers under it.
    return sorted(found, key=len, reverse=True)


def sweep_mounts(base: str = tempfile.gettempdir()) -> list[str]:
    if os.geteuid() != 0:
        return []
    from dsec_fs.mounts import umount

    swept = []
    for target in _stale_mounts(base):
        try:
            umount(target, lazy=True)
            swept.append(target)
        except Exception:
            pass
    return swept


def pytest_sessionstart(session):
    sweep_mounts()


def pytest_sessionfinish(session, exitstatus):
    sweep_mounts()


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (mount(2), mknod, chown)")
    for item in items:
        if "root" in item.keywords or "fuse" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def debian_rootfs() -> str:
    """A Debian bookworm minbase rootfs made by mmdebstrap, built once per machine and cached."""
    if not os.path.isdir(os.path.join(DEBIAN_ROOTFS, "usr")):
        if shutil.which("mmdebstrap") is None or os.geteuid() != 0:
            pytest.skip("mmdebstrap (as root) is needed to make the Debian rootfs")
        tmp = DEBIAN_ROOTFS + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.dirname(DEBIAN_ROOTFS), exist_ok=True)
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "bookworm", tmp], check=True)
        os.rename(tmp, DEBIAN_ROOTFS)
    return DEBIAN_ROOTFS
