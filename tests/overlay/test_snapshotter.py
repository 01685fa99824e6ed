"""dsecfs snapshotter under Debian's real containerd 1.6 (its own root, state and config; CRI off), images
from Debian's docker-registry pushed by skopeo: an ordinary image pulled with ctr and unpacked into the
snapshotter's snapshots runs with ctr run; snapshot metadata survives a snapshotter restart."""

from __future__ import annotations

import os
import subprocess
import time
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


def test_dsecfs_image_pull_unpacks_an_ordinary_image(registry, debian_image, debian_rootfs, tmp_path):
    """Layers that are not dsecfs layers: downloaded once each, applied by containerd's differ into the
    snapshotter's snapshots, committed under their chain IDs; the image runs."""
    from erofs_builder.registry import RegistryOptions
    from overlay.containerd_client import ContainerdClient
    from overlay.image_pull import pull_image

    ref, _layout = debian_image
    layers = [d["digest"] for d in registry.inspect_raw("debian/app:v1")["layers"]]
    with SnapshotterProcess(tmp_path / "snap") as snap, \
            Containerd(tmp_path / "ctrd", snapshotter_socket=snap.socket) as ctrd:
        before = len(registry.access_log())
        with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
            pulled = pull_image(f"docker://{ref}", client, registry=RegistryOptions(plain_http=True, auth_files=()))
            assert (pulled.mounted, pulled.unpacked) == (0, 2)
            gets = [line for line in registry.access_log()[before:] if line.startswith("GET ")]
            assert [sum(digest in line for line in gets) for digest in layers] == [1, 1]
            again = pull_image(f"docker://{ref}", client, registry=RegistryOptions(plain_http=True, auth_files=()))
            assert (again.mounted, again.unpacked) == (0, 0)
        run = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", pulled.name, "c1", "/bin/sh", "-c",
                       "cat /etc/debian_version; /opt/app/hello")
        assert run.stdout == Path(debian_rootfs, "etc/debian_version").read_text() + "hello from the app layer\n"
        assert ctrd.ctr("snapshots", "--snapshotter", "dsecfs", "ls").stdout.count("Committed") == 2
        ctrd.ctr("images", "rm", "--sync", pulled.name)


def test_a_converted_image_runs_from_dsecfs_layers(registry, debian_image, debian_rootfs, tmp_path):
    """convert, dsecfs image pull, ctr run: no layer blob is read from the registry during pull and run,
    and the node daemon fetched a small part of the image's chunks."""
    from dsec_fs.client import Node
    from dsec_fs.store import FilesystemStore
    from erofs_builder.convert import convert_image
    from erofs_builder.registry import RegistryOptions
    from lazy_fetch.analysis import learn_prefetch_list
    from lazy_fetch.prefetch_list import save
    from overlay.containerd_client import ContainerdClient
    from overlay.image_pull import pull_image

    ref, _layout = debian_image
    store = FilesystemStore(str(tmp_path / "store"))
    converted = convert_image(f"docker://{ref}", f"docker://{registry.address}/debian/app:v1-dsecfs", store,
                              registry=RegistryOptions(plain_http=True, auth_files=()))
    source_layers = [d["digest"] for d in registry.inspect_raw("debian/app:v1")["layers"]]
    meta_blobs = [d["digest"] for d in registry.inspect_raw("debian/app:v1-dsecfs")["layers"]]
    daemon = Node.start_daemon(str(tmp_path / "d.sock"), state_dir=str(tmp_path / "dstate"),
                               cache_dir=str(tmp_path / "dcache"), store=store.url,
                               log_file=str(tmp_path / "daemon.log"))
    try:
        prefetch_dir = tmp_path / "prefetch"
        prefetch_dir.mkdir()
        with SnapshotterProcess(tmp_path / "snap", allow_store=store.url, daemon_socket=str(tmp_path / "d.sock"),
                                prefetch_dir=prefetch_dir) as snap, \
                Containerd(tmp_path / "ctrd", snapshotter_socket=snap.socket) as ctrd:
            before = len(registry.access_log())
            with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
                pulled = pull_image(f"docker://{registry.address}/debian/app:v1-dsecfs", client,
                                    registry=RegistryOptions(plain_http=True, auth_files=()))
            assert pulled.mounted == 2 and len(pulled.chain_ids) == 2
            run = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", pulled.name, "c1", "/bin/sh", "-c",
                           "cat /etc/debian_version; /opt/app/hello")
            assert run.stdout == Path(debian_rootfs, "etc/debian_version").read_text() + "hello from the app layer\n"
            blob_gets = [line for line in registry.access_log()[before:] if "/blobs/" in line]
            assert not [line for line in blob_gets if any(d in line for d in source_layers + meta_blobs)], blob_gets
            base = next(layer for layer in daemon.node.status().layers if layer.layer == converted.layers[0].digest)
            assert 0 < base.chunks_fetched < converted.layers[0].stats.distinct_chunks / 10
            # Pulled again: the snapshots are there, nothing is mounted twice.
            with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
                assert pull_image(f"docker://{registry.address}/debian/app:v1-dsecfs", client,
                                  registry=RegistryOptions(plain_http=True, auth_files=())).mounted == 0
            traces = {m.layer: m.trace for m in daemon.node.mounts()}
            ctrd.ctr("images", "rm", "--sync", pulled.name)
            assert daemon.node.mounts() == []  # gc removed the snapshots, and the snapshotter the mounts

            # Prefetch lists learned from this node's traces go with the next mounts of those layers.
            for layer, trace in traces.items():
                save(learn_prefetch_list([trace], store), str(prefetch_dir / f"{layer}.json"))
            with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
                assert pull_image(f"docker://{registry.address}/debian/app:v1-dsecfs", client,
                                  registry=RegistryOptions(plain_http=True, auth_files=())).mounted == 2
            assert sorted(m.prefetch for m in daemon.node.mounts()) == \
                sorted(str(prefetch_dir / f"{layer}.json") for layer in traces)
            run = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", pulled.name, "c2", "cat", "/etc/debian_version")
            assert run.stdout == Path(debian_rootfs, "etc/debian_version").read_text()
            ctrd.ctr("images", "rm", "--sync", pulled.name)
    finally:
        daemon.stop()


def _largest_files(rootfs: str, directory: str, count: int) -> list[str]:
    paths = [os.path.join(directory, name) for name in os.listdir(os.path.join(rootfs, directory))]
    regular = [p for p in paths if os.path.isfile(os.path.join(rootfs, p)) and not os.path.islink(os.path.join(rootfs, p))]
    return sorted(regular, key=lambda p: os.path.getsize(os.path.join(rootfs, p)), reverse=True)[:count]


def test_a_running_container_reads_on_across_restarts(registry, debian_image, debian_rootfs, tmp_path):
    """A container of a converted image keeps reading files it never read before while the snapshotter is
    restarted and while the node daemon is killed and a new one takes its mounts over."""
    import hashlib

    from dsec_fs.client import Node
    from dsec_fs.store import FilesystemStore
    from erofs_builder.convert import convert_image
    from erofs_builder.registry import RegistryOptions
    from overlay.containerd_client import ContainerdClient
    from overlay.image_pull import pull_image

    ref, _layout = debian_image
    plain = RegistryOptions(plain_http=True, auth_files=())
    store = FilesystemStore(str(tmp_path / "store"))
    target = f"docker://{registry.address}/debian/app:restarts"
    convert_image(f"docker://{ref}", target, store, registry=plain)
    first, second = _largest_files(debian_rootfs, "usr/bin", 2)
    expected = {path: hashlib.sha256(Path(debian_rootfs, path).read_bytes()).hexdigest() for path in (first, second)}
    options = dict(state_dir=str(tmp_path / "dstate"), cache_dir=str(tmp_path / "dcache"), store=store.url,
                   log_file=str(tmp_path / "daemon.log"))
    daemon = Node.start_daemon(str(tmp_path / "d.sock"), **options)
    try:
        with SnapshotterProcess(tmp_path / "snap", allow_store=store.url, daemon_socket=str(tmp_path / "d.sock")) as snap, \
                Containerd(tmp_path / "ctrd", snapshotter_socket=snap.socket) as ctrd:
            with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
                name = pull_image(target, client, registry=plain).name
            ctrd.ctr("run", "-d", "--snapshotter", "dsecfs", name, "long", "sleep", "600")
            try:
                def digest_in_container(path: str, exec_id: str) -> str:
                    out = ctrd.ctr("task", "exec", "--exec-id", exec_id, "long", "sha256sum", "/" + path).stdout
                    return out.split()[0]

                snap.stop()
                snap.start()
                assert digest_in_container(first, "e1") == expected[first]
                daemon.kill()
                daemon = Node.start_daemon(str(tmp_path / "d.sock"), **options)
                assert digest_in_container(second, "e2") == expected[second]
            finally:
                ctrd.ctr("task", "kill", "-s", "KILL", "long", check=False)
                for _ in range(50):
                    if ctrd.ctr("task", "rm", "long", check=False).returncode == 0:
                        break
                    time.sleep(0.1)
                ctrd.ctr("containers", "rm", "long", check=False)
            ctrd.ctr("images", "rm", "--sync", name)
    finally:
        daemon.stop()
