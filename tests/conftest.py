"""Shared fixtures: the real Debian rootfs, an S3 endpoint, and a sweep of mounts a crashed run may have left behind.

``moto_server`` (session) runs one moto S3 server on a free port of 127.0.0.1 and stops it by PID at the
end, whatever the tests did; ``s3_url`` (per test) points the environment at it (fake credentials,
DSECFS_S3_ENDPOINT) and yields ``s3://dsecfs-test/<unique prefix>``, so tests never see each other's
objects.

Every mount a test makes is undone by that test (a fixture's finally); the sweep is the second line of
defence so one failed run cannot poison the next: at the end of a session it detaches every erofs, fuse
and overlay mount below the session's temporary directory and stops the FUSE fd holders (of raw-binding
daemons) listening there, and at the start does the same below the directories of earlier sessions
whose pytest process is gone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from dsec_fs.store import init_store

from tests.s3server import MotoServer

DEBIAN_ROOTFS = os.environ.get("DSECFS_TEST_ROOTFS", "/var/cache/dsecfs-test/debian-minbase")
# Daemons the tests start fill by their profile only, not the whole layer (the default fill, ``auto``, of
# a layer with no profile): tests count store requests and chunks fetched, and a background stream of
# the rest of the layer would race them. Tests of the fill ask for it (mount/sandbox ``fill=``).
os.environ.setdefault("DSECFS_DAEMON_FILL", "profile")
SWEPT_FSTYPES = ("erofs", "overlay", "fuse")


PID_FILE = ".dsecfs-pytest-pid"


def _mounts_below(base: str) -> list[str]:
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _src, target, fstype, *_ = line.split()
            target = target.encode().decode("unicode_escape")
            if target.startswith(base + "/") and fstype.split(".")[0] in SWEPT_FSTYPES:
                found.append(target)
    # Deepest first, so an overlay comes off before the layers under it.
    return sorted(found, key=len, reverse=True)


def _stop_holders(base: str) -> None:
    """SIGTERM every FUSE fd holder (lazy_fetch/fuse_holder.py) whose socket is below ``base``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"lazy_fetch.fuse_holder" in argv and any(arg.startswith(os.fsencode(base) + b"/") for arg in argv):
                os.kill(int(pid), 15)
        except OSError:  # gone meanwhile
            pass


def _detach(base: str) -> None:
    from dsec_fs.mounts import umount

    _stop_holders(base)
    for target in _mounts_below(base):
        try:
            umount(target, lazy=True)
        except Exception:
            pass


def _session_alive(session_dir: str) -> bool:
    try:
        with open(os.path.join(session_dir, PID_FILE)) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def pytest_sessionstart(session):
    """Detach what dead test runs left mounted; runs of other live pytest processes are left alone."""
    if os.geteuid() != 0:
        return
    basetemp = session.config._tmp_path_factory.getbasetemp()
    with open(basetemp / PID_FILE, "w") as f:
        f.write(str(os.getpid()))
    root = str(basetemp.parent)
    for name in os.listdir(root):
        other = os.path.join(root, name)
        if other != str(basetemp) and os.path.isdir(other) and not _session_alive(other):
            _detach(other)


def pytest_sessionfinish(session, exitstatus):
    if os.geteuid() == 0:
        _detach(str(session.config._tmp_path_factory.getbasetemp()))


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


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path):
    """A local store's URL, then an S3 one's (moto over real HTTP): a test taking it runs on both."""
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    url = f"file://{tmp_path / 'store'}"
    init_store(url)[0].close()
    return url


@pytest.fixture(autouse=True, scope="session")
def index_mirror_dir(tmp_path_factory):
    """Builds keep each store's index mirror (dsec_fs.index_mirror) under the session's temporary
    directory: every test store has its own URL, so the default (/var/cache, ~/.cache) would fill up."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSECFS_INDEX_DIR", str(tmp_path_factory.mktemp("index-mirror")))
        yield
