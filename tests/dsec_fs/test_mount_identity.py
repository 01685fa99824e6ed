"""dsec_fs.mounts: an unmount goes by the mount it made, not by the names on its path (real tmpfs mounts)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dsec_fs import mounts

pytestmark = pytest.mark.root

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _ids() -> set[int]:
    return {entry.mount_id for entry in mounts.mount_table()}


def test_an_unmount_in_another_users_directory_leaves_the_mount_their_swap_points_at(tmp_path):
    """``mounted`` (what ``dsecfs mount-export`` runs a command in) unmounted its target by name. Before:
    uid 65534, owner of the directory holding the mountpoint, renamed the directory on the way and put a
    symlink to root's directory in its place while the block ran; the unmount followed it and took root's
    tmpfs there away, and left the one mounted in the block where it had been moved. Now the block's own
    mount is unmounted where it went, and root's stays."""
    base = f"/var/tmp/swap-{os.getpid()}-{time.monotonic_ns()}"
    theirs, victim = f"{base}-theirs", f"{base}-victim"
    os.makedirs(f"{victim}/mnt")
    subprocess.run([*NOBODY, "mkdir", "-p", f"{theirs}/a/mnt"], check=True)
    mounts.mount("tmpfs", f"{victim}/mnt", "tmpfs", 0, "size=1m")
    victim_id = mounts.top_mount(f"{victim}/mnt").mount_id
    try:
        with mounts.mounted("tmpfs", f"{theirs}/a/mnt", "tmpfs", 0, "size=1m"):
            ours = mounts.top_mount(f"{theirs}/a/mnt").mount_id
            subprocess.run([*NOBODY, "sh", "-c", f"cd {theirs} && mv a b && ln -s {victim} a"], check=True)
            assert mounts.top_mount(f"{theirs}/b/mnt").mount_id == ours
        assert victim_id in _ids() and mounts.is_mountpoint(f"{victim}/mnt")
        assert ours not in _ids()
    finally:
        for entry in reversed(mounts.mount_table()):
            if entry.mountpoint.startswith(base):
                mounts.umount(entry.mountpoint, lazy=True)
        subprocess.run(["rm", "-rf", theirs, victim], check=True)


def test_an_unmount_refuses_a_symlink_and_a_mount_over_its_own(tmp_path):
    """The mountpoint's own name swapped for a symlink to another mount is not followed; a mount covered by
    another is left (an error naming the place), and unmounted once uncovered; one gone is False."""
    target, other = tmp_path / "target", tmp_path / "other"
    target.mkdir()
    other.mkdir()
    mounts.mount("tmpfs", other, "tmpfs", 0, "size=1m")
    mounts.mount("tmpfs", target, "tmpfs", 0, "size=1m")
    identity = mounts.mount_identity(target)
    try:
        link = tmp_path / "link"
        link.symlink_to(other)
        assert mounts.umount_identified(identity, link) is True  # found where mountinfo shows it, not at link
        assert mounts.is_mountpoint(other) and not mounts.is_mountpoint(target)
        assert mounts.umount_identified(identity, target) is False
        mounts.mount("tmpfs", target, "tmpfs", 0, "size=1m")
        identity = mounts.mount_identity(target)
        mounts.mount("tmpfs", target, "tmpfs", 0, "size=1m")  # another mount over ours
        with pytest.raises(mounts.UnavailableError, match="cannot be reached as itself"):
            mounts.umount_identified(identity, target)
        assert identity.mount_id in _ids()
        mounts.umount(target)
        assert mounts.umount_identified(identity, target) is True
        assert identity.mount_id not in _ids()
    finally:
        for path in (target, target, other):
            if mounts.is_mountpoint(path):
                mounts.umount(path, lazy=True)
