"""archive_kind: telling an image archive from a root filesystem tar by a header-only scan, judged against
Python's tarfile (the rule's own reader) on archives written by GNU tar in each format and by tarfile."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import tarfile

import pytest

from erofs_builder.archive_kind import _scan_names, _Unusual, is_image_archive

LONG = "d" * 120  # a name longer than the 100 bytes of a header's name field


def tarfile_rule(path) -> bool:
    """The rule as build.source_kind decided it before the scan: tarfile's names, "./" and "/" stripped."""
    try:
        with tarfile.open(path, "r:") as archive:
            top = {name.lstrip("./") for name in archive.getnames()}
    except (tarfile.TarError, OSError):
        return False
    return bool(top & {"manifest.json", "oci-layout"})


def tarfile_names(path) -> list[bytes]:
    with tarfile.open(path, "r:") as archive:
        return [os.fsencode(name) for name in archive.getnames()]


def make_tree(root, top: dict[str, bytes]) -> None:
    for rel, data in {"etc/passwd": b"root:x:0:0\n", f"usr/{LONG}/{LONG}/f": b"deep", "bin/sh": b"\x7fELF",
                      "var/empty/": b"", **top}.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not rel.endswith("/"):
            with open(path, "wb") as f:
                f.write(data)
    os.symlink("sh", os.path.join(root, "bin", "bash"))
    os.link(os.path.join(root, "bin", "sh"), os.path.join(root, "bin", "dash"))


@pytest.mark.parametrize("tar_format", ["gnu", "posix", "ustar", "oldgnu"])
@pytest.mark.parametrize("top, image", [({}, False), ({"manifest.json": b"[]"}, True),
                                        ({"oci-layout": b"{}"}, True), ({"etc/manifest.json": b"[]"}, False)])
def test_gnu_tar_archives_are_judged_as_tarfile_judges_them(tmp_path, tar_format, top, image):
    tree = tmp_path / "tree"
    make_tree(tree, top)
    archive = tmp_path / "a.tar"
    names = [] if tar_format == "ustar" else ["."]  # ustar cannot hold the long names: members given one by one
    if tar_format == "ustar":
        names = [rel for rel in ["etc", "bin", *top] if os.path.exists(tree / rel)]
    subprocess.run(["tar", f"--format={tar_format}", "-cf", archive, "-C", tree, *names], check=True)
    assert is_image_archive(str(archive)) == tarfile_rule(archive) == image
    if tar_format in ("posix", "ustar"):  # no GNU long-name members: the scan reads these itself
        assert _scan_names(str(archive)) == tarfile_names(archive)


def test_pax_names_and_trailing_slashes_as_tarfile_reads_them(tmp_path):
    archive = tmp_path / "pax.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as out:
        for name, kind in [(f"{LONG}/{LONG}/x", tarfile.REGTYPE), ("./manifest.json/", tarfile.DIRTYPE),
                           ("plain/", tarfile.AREGTYPE), ("./oci-layout", tarfile.REGTYPE)]:
            info = tarfile.TarInfo(name)
            info.type = kind
            data = b"{}" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    assert _scan_names(str(archive)) == tarfile_names(archive)
    assert is_image_archive(str(archive)) and tarfile_rule(archive)


def test_what_is_no_tar_is_no_image_archive(tmp_path):
    tree = tmp_path / "tree"
    make_tree(tree, {"manifest.json": b"[]"})
    archive = tmp_path / "a.tar"
    subprocess.run(["tar", "--format=posix", "-cf", archive, "-C", tree, "."], check=True)
    data = archive.read_bytes()
    cases = {"gzip": gzip.compress(data), "text": b"not a tar\n" * 100, "empty": b"", "zeros": bytes(10240)}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        assert is_image_archive(str(path)) == tarfile_rule(path) is False, name
    for cut in (700, 1536, len(data) - 2048):  # truncated archives: judged by what tarfile still reads
        path = tmp_path / f"cut{cut}"
        path.write_bytes(data[:cut])
        assert is_image_archive(str(path)) == tarfile_rule(path), cut
    corrupt = bytearray(data)
    corrupt[1024 + 20] ^= 0xFF  # a header's name byte: its checksum no longer matches
    (tmp_path / "corrupt").write_bytes(corrupt)
    with pytest.raises(_Unusual):
        _scan_names(str(tmp_path / "corrupt"))
    assert is_image_archive(str(tmp_path / "corrupt")) == tarfile_rule(tmp_path / "corrupt")
