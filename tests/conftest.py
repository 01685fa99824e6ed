"""Shared fixtures: the real Debian rootfs, an S3 endpoint, and a sweep of mounts a crashed run may have left behind.

``moto_server`` (session) runs one moto S3 server on a free port of 127.0.0.1 and stops it by PID at the
end, whatever the tests did; ``s3_url`` (per test) points the environment at it (fake credentials,
DSECFS_S3_ENDPOINT) and yields ``s3://dsecfs-test/<unique prefix>``, so tests never see each other's
objects.

Every mount a test makes is undone by that test (a fixture's finally); the sweep is the second line of
defence so one failed run cannot poison the next: before and after the session it detaches every
erofs, fuse and overlay mount below the temporary directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile

import pytest

from tests.s3server import MotoServer

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


S3_TEST_BUCKET = "dsecfs-test"


@pytest.fixture(scope="session")
def moto_server():
    with MotoServer() as server:
        server.create_bucket(S3_TEST_BUCKET)
        yield server


@pytest.fixture
def s3_url(moto_server, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{S3_TEST_BUCKET}/t-{secrets.token_hex(6)}"
