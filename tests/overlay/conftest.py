"""Fixtures of the overlay tests; their helpers are in support.py.

``store`` is a FilesystemStore in the test's tmp_path and ``layers`` exports and mounts its layers with
kernel EROFS (overlay.sandbox.ExportedLayers), unmounting them at teardown. ``nothing_left_mounted``
(modules that mount opt in with ``pytest.mark.usefixtures``) fails a test that leaves anything mounted
below its tmp_path, after detaching it so the next test is unharmed.
"""

from __future__ import annotations

import pytest

from dsec_fs import mounts
from dsec_fs.store.filesystem import FilesystemStore
from overlay.sandbox import ExportedLayers, SandboxManager


@pytest.fixture
def nothing_left_mounted(tmp_path):
    yield
    left = mounts.mounts_below(tmp_path)
    for target in sorted(left, key=len, reverse=True):
        mounts.umount(target, lazy=True)
    assert not left, f"left mounted: {left}"


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


@pytest.fixture
def layers(store, tmp_path):
    provider = ExportedLayers(store, tmp_path / "layers")
    try:
        yield provider
    finally:
        provider.close()


@pytest.fixture
def manager(tmp_path, layers):
    """A SandboxManager in tmp_path over ``layers``; every sandbox left is taken down at teardown."""
    with SandboxManager(tmp_path / "state", layers) as sandboxes:
        try:
            yield sandboxes
        finally:
            for state in sandboxes.list():
                if state.status in ("running", "stopped"):
                    sandboxes.down(state.id)
