"""dsecfs snapshotter under Debian's real containerd 1.6 (its own root, state and config; CRI off), images
from Debian's docker-registry pushed by skopeo: an ordinary image pulled with ctr and unpacked into the
snapshotter's snapshots runs with ctr run; snapshot metadata survives a snapshotter restart."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from ociimage import TAR, TAR_GZIP, layer_tar, member, single_image
from containerdserver import Containerd, SnapshotterProcess, have_containerd
from registryserver import DockerRegistry, have_registry_tools

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(not (have_containerd() and have_registry_tools()),
                                 reason="needs root, containerd, docker-registry and skopeo")]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with DockerRegistry(tmp_path_factory.mktemp("registry")) as server:
        yield server


@pytest.fixture(scope="module")
def debian_image(registry, debian_rootfs, tmp_path_factory) -> tuple[str, Path]:
    """The Debian rootfs as a two-layer image (the rootfs, and an app layer), pushed as debian/app:v1."""
    tmp = tmp_path_factory.mktemp("debian-image")
    base = tmp / "rootfs.tar"
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--format=posix", "-C",
                    debian_rootfs, "-cf", str(base), "."], check=True)
    app = layer_tar(member("opt/app/hello", b"#!/bin/sh\necho hello from the app layer\n", mode=0o755))
    layout = single_image(tmp / "layout", (TAR, base.read_bytes()), (TAR_GZIP, app))
    base.unlink()
    registry.push(layout.root, "debian/app:v1")
    return f"{registry.address}/debian/app:v1", layout.root


def test_an_ordinary_image_unpacks_into_the_snapshotter_and_runs(registry, debian_image, debian_rootfs, tmp_path):
    ref, _layout = debian_image
    with SnapshotterProcess(tmp_path / "snap") as snap:
        with Containerd(tmp_path / "ctrd", snapshotter_socket=snap.socket) as ctrd:
            ctrd.ctr("images", "pull", "--plain-http", "--snapshotter", "dsecfs", ref)
            run = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", ref, "c1", "/bin/sh", "-c",
                           "cat /etc/debian_version; /opt/app/hello")
            expected = Path(debian_rootfs, "etc/debian_version").read_text()
            assert run.stdout == expected + "hello from the app layer\n"
            snapshots = ctrd.ctr("snapshots", "--snapshotter", "dsecfs", "ls").stdout
            assert snapshots.count("Committed") == 2
        snap.stop()
        snap.start()  # metadata from the first run: the image is still unpacked
        with Containerd(tmp_path / "ctrd", snapshotter_socket=snap.socket) as ctrd:
            run = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", ref, "c2", "cat", "/etc/debian_version")
            assert run.stdout == expected
            ctrd.ctr("images", "rm", "--sync", ref)
