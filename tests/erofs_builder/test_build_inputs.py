"""Builds from tar streams and OCI images, judged by the kernel: a layer mounted with the kernel's EROFS
driver must equal the source tree; per-layer OCI builds stacked under a real OverlayFS must equal the
flattened build; hostile input publishes nothing."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
from ociimage import TAR, TAR_GZIP, TAR_ZSTD, Layout, directory, layer_tar, member, single_image
from treecmp import assert_same_tree, snapshot

from dsec_fs.errors import InputError
from dsec_fs.layer import list_refs
from dsec_fs.mounts import mounted_erofs
from dsec_fs.store import FilesystemStore
from erofs_builder.build import build_image_layers, build_layer, source_kind
from erofs_builder.export import export_layer
from overlay.stack import mount_stack, unmount_stack

pytestmark = pytest.mark.root


def mount_layer(store, digest: str, work: Path):
    """Export the layer and mount it with the kernel (a context manager yielding the mountpoint)."""
    out = work / f"export-{digest[:12]}"
    export_layer(store, digest, out)
    mnt = work / f"mnt-{digest[:12]}"
    mnt.mkdir()
    return mounted_erofs(out / "meta.erofs", mnt, [out / "blob"])


def tar_directory(root: str, dest: Path, compression: str) -> None:
    """GNU tar of a real tree, with xattrs and numeric owners, as an image CI job would make it."""
    flag = {"": [], "gz": ["--gzip"], "zst": ["--zstd"]}[compression]
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--acls", "--numeric-owner", "--sparse",
                    "--format=posix", "-C", root, "-cf", str(dest), *flag, "."], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["", "zst"])
def test_a_tar_of_the_debian_rootfs_mounts_as_the_source(debian_rootfs, tmp_path, compression):
    archive = tmp_path / f"rootfs.tar{'.' + compression if compression else ''}"
    tar_directory(debian_rootfs, archive, compression)
    store = FilesystemStore(str(tmp_path / "store"))
    assert source_kind(archive) == "tar"
    result = build_layer(archive, store, name="base/debian:tar")
    with mount_layer(store, result.digest, tmp_path) as mnt:
        assert_same_tree(snapshot(debian_rootfs), snapshot(mnt))
    # The same tree from a directory walk dedups completely against the tar build.
    assert build_layer(debian_rootfs, store).stats.new_chunks == 0


@pytest.mark.slow
def test_an_oci_layout_of_the_debian_rootfs_mounts_as_the_source(debian_rootfs, tmp_path):
    archive = tmp_path / "layer.tar"
    tar_directory(debian_rootfs, archive, "")
    layout = Layout(tmp_path / "image")
    layout.index(layout.image([(TAR_GZIP, archive.read_bytes())]))
    store = FilesystemStore(str(tmp_path / "store"))
    assert source_kind(layout.root) == "oci"
    result = build_layer(layout.root, store, name="base/debian:oci")
    with mount_layer(store, result.digest, tmp_path) as mnt:
        assert_same_tree(snapshot(debian_rootfs), snapshot(mnt))


LOWER = layer_tar(
    directory("etc"), member("etc/keep", b"kept\n"), member("etc/gone", b"deleted above\n"),
    directory("opt"), directory("opt/app"), member("opt/app/old", b"replaced by an opaque dir\n"),
    directory("var"), member("var/log", b"x" * 10000),
)
UPPER = layer_tar(
    directory("etc"), member("etc/.wh.gone"), member("etc/new", b"added above\n"),
    directory("opt"), directory("opt/app"), member("opt/app/.wh..wh..opq"), member("opt/app/fresh", b"new\n"),
    member("var/log", b"y" * 20000),
)


def test_a_two_layer_image_flattened_and_stacked_give_the_same_tree(tmp_path):
    layout = single_image(tmp_path, (TAR_ZSTD, LOWER), (TAR, UPPER))
    store = FilesystemStore(str(tmp_path / "store"))
    flat = build_layer(layout.root, store, name="app/img:1")
    stacked = build_image_layers(layout.root, store, name="app/img:1")
    assert sorted(list_refs(store)) == ["app/img:1", "app/img:1-l0", "app/img:1-l1"]

    with mount_layer(store, flat.digest, tmp_path) as mounted:
        flat_mnt = Path(mounted)
        flat_view = snapshot(flat_mnt)
        assert sorted(os.listdir(flat_mnt / "etc")) == ["keep", "new"]
        assert os.listdir(flat_mnt / "opt/app") == ["fresh"]
        assert (flat_mnt / "var/log").read_bytes() == b"y" * 20000
    with mount_layer(store, stacked[0].digest, tmp_path) as lower, \
            mount_layer(store, stacked[1].digest, tmp_path) as mounted_upper:
        upper = Path(mounted_upper)
        # The upper layer carries an overlay whiteout (char 0:0) and an opaque directory.
        assert stat.S_ISCHR(os.lstat(upper / "etc/gone").st_mode)
        assert os.getxattr(upper / "opt/app", "trusted.overlay.opaque") == b"y"
        merged = tmp_path / "merged"
        merged.mkdir()
        mount_stack([upper, lower], None, None, merged)
        try:
            assert_same_tree(flat_view, snapshot(merged))
        finally:
            unmount_stack(merged)


def test_a_hostile_tar_publishes_nothing(tmp_path):
    store = FilesystemStore(str(tmp_path / "store"))
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        tar.addfile(*_file("ok", b"fine"))
        tar.addfile(*_file("../escape", b"out of the layer"))
    with pytest.raises(InputError, match=r"\.\."):
        build_layer(archive, store, name="evil/one:1")
    assert list_refs(store) == {}
    assert list(store.list("layers/")) == []
    # Leniently, the bad member is skipped and the rest is published.
    result = build_layer(archive, store, name="evil/one:1", lenient=True)
    assert result.manifest.stats["files"] == 1


def test_a_truncated_tar_publishes_nothing(tmp_path):
    store = FilesystemStore(str(tmp_path / "store"))
    good = layer_tar(member("a", b"a" * 5000), member("b", b"b" * 5000))
    archive = tmp_path / "cut.tar"
    archive.write_bytes(good[: 512 + 2048])
    with pytest.raises(InputError, match="truncated"):
        build_layer(archive, store, name="cut/one:1")
    assert list(store.list("layers/")) == [] and list(store.list("refs/")) == []


def test_parent_needs_a_directory(tmp_path):
    archive = tmp_path / "a.tar"
    archive.write_bytes(layer_tar(member("a", b"a")))
    with pytest.raises(InputError, match="--parent"):
        build_layer(archive, FilesystemStore(str(tmp_path / "store")), parent="x:1")


def _file(name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, io.BytesIO(data)
