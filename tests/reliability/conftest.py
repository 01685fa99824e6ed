"""Fixtures of the reliability tests; their helpers are in support.py.

``daemons`` starts real node daemons in a test's directories and, at the end, stops them, checks their
log holds none of the fake credentials, and that nothing is left mounted below the test's tmp_path.
``shell_tree`` is a small base image of Debian binaries (support.make_shell_tree), made once a session.
"""

from __future__ import annotations

import os

import pytest

from dsec_fs.mounts import mounts_below, umount
from tests.reliability.support import Daemons, find_secrets, make_shell_tree


@pytest.fixture
def daemons(tmp_path):
    """Start daemons with ``daemons.start``; at the end they are stopped, their log must hold none of the
    fake credentials, and nothing may be left mounted below tmp_path."""
    started = Daemons(tmp_path)
    try:
        yield started
    finally:
        try:
            started.stop_all()
        finally:
            left = mounts_below(tmp_path)
            for target in sorted(left, key=len, reverse=True):  # so the next test is unharmed
                umount(target, lazy=True)
        assert left == []
        assert find_secrets(started.log()) == []


@pytest.fixture(scope="session")
def shell_tree(tmp_path_factory, debian_rootfs) -> str:
    if not os.path.exists(os.path.join(debian_rootfs, "usr/lib64/ld-linux-x86-64.so.2")):
        pytest.skip("the Debian rootfs is not x86_64")
    return make_shell_tree(str(tmp_path_factory.mktemp("shell") / "tree"), debian_rootfs)
