"""walk_oci / oci_layer_streams on OCI image layouts and docker-archives written by the test: platform
choice, blob verification, whiteouts flattened or turned into overlay whiteouts (checked against a real
OverlayFS mount), and the descriptors we refuse."""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest
from treecmp import assert_same_tree, snapshot

from dsec_fs.errors import InputError, IntegrityError, NotFoundError, UnsupportedError
from dsec_fs.mounts import MS_RDONLY, mounted
from erofs_builder.tar_members import MemberError
from erofs_builder.tree import Tree
from erofs_builder.walk_oci import OVERLAY_OPAQUE_XATTR, oci_layer_streams, walk_oci
from erofs_builder.walk_tar import walk_tar

from ociimage import (  # noqa: E402
    OCI_INDEX, OCI_MANIFEST, TAR, TAR_GZIP, TAR_ZSTD, Layout, directory, layer_tar, member,
    sha256, single_image,
)

class Collect:
    """The build's per-file function stand-in: reads each file while it streams by, keeps the bytes."""

    def __init__(self):
        self.content: dict[int, bytes] = {}
        self.sources: list[str] = []

    def __call__(self, node) -> None:
        self.sources.append(node.source)
        self.content[id(node)] = b"".join(piece if piece is not None else bytes(4096) for piece in node.reader(4096))[
            : node.size
        ]

    def of(self, tree: Tree, path: bytes) -> bytes:
        return self.content[id(tree.lookup(path))]


def names(tree: Tree) -> set[bytes]:
    return {path for path, _ in tree.walk()}


# ---------------------------------------------------------------------------------------------------------
# Whiteouts: three layers exercising every rule.

LAYER1 = layer_tar(
    directory("./", mode=0o755, mtime=1),
    directory("etc", mode=0o751, mtime=100),
    member("etc/a", b"a1"),
    member("etc/b", b"b1"),
    directory("opt"),
    member("opt/x", b"x1"),
    directory("opt/sub"),
    member("opt/sub/y", b"y1"),
    directory("usr"),
    directory("usr/bin"),
    member("usr/bin/tool", b"tool1", mode=0o4755),
    member("usr/bin/tool-link", kind=tarfile.LNKTYPE, linkname="usr/bin/tool"),
    directory("gone"),
    directory("gone/deep"),
    member("gone/deep/f", b"f1"),
    member("keep", b"k1"),
    member("sym", kind=tarfile.SYMTYPE, linkname="/usr/bin/tool"),
)
LAYER2 = layer_tar(  # no "etc/" member: etc is implied here
    member("etc/.wh.a", b""),
    member("etc/c", b"c2"),
    directory("opt", mode=0o700, mtime=200),
    member("opt/.wh..wh..opq", b""),
    member("opt/new", b"n2"),
    member("usr/bin/tool", b"tool2", mode=0o755),
    member(".wh.gone", b""),
    member("z", b"z2"),
    member(".wh.z", b""),  # a whiteout never hides its own layer's entry
    member(".wh..wh.plnk", b""),  # AUFS bookkeeping: ignored
)
LAYER3 = layer_tar(
    member(".wh.keep", b""),
    member("etc/.wh.b", b""),
    directory("gone", mode=0o711, mtime=300),
    member("gone/new", b"g3"),
    member("opt/again", b"o3"),  # opt implied here, and deleted below by the whiteout that follows
    member(".wh.opt", b""),
)
LAYERS = [(TAR_GZIP, LAYER1), (TAR_ZSTD, LAYER2), (TAR, LAYER3)]


def test_flatten_applies_whiteouts_and_opaque_directories(tmp_path):
    layout = single_image(tmp_path, *LAYERS)
    collect = Collect()
    tree = walk_oci(layout.root, on_file=collect)
    assert names(tree) == {
        b"", b"etc", b"etc/c", b"opt", b"opt/again", b"usr", b"usr/bin", b"usr/bin/tool", b"usr/bin/tool-link",
        b"gone", b"gone/new", b"sym", b"z",
    }  # fmt: skip
    assert collect.of(tree, b"usr/bin/tool") == b"tool2" and collect.of(tree, b"usr/bin/tool-link") == b"tool1"
    assert collect.of(tree, b"z") == b"z2" and collect.of(tree, b"gone/new") == b"g3"
    etc, opt, gone = tree.lookup(b"etc"), tree.lookup(b"opt"), tree.lookup(b"gone")
    assert (etc.mode, etc.mtime_ns) == (stat.S_IFDIR | 0o751, 100 * 10**9)  # implied above: layer 1's attributes
    assert (opt.mode, opt.mtime_ns) == (stat.S_IFDIR | 0o755, 0)  # deleted, then only implied: defaults
    assert (gone.mode, tree.root.mtime_ns) == (stat.S_IFDIR | 0o711, 10**9)
    assert tree.lookup(b"usr/bin/tool").mode == stat.S_IFREG | 0o755
    assert tree.lookup(b"usr/bin/tool-link").nlink == 1  # finished: its other name was replaced
    # Every regular file of every layer went through on_file while it streamed, deleted ones too.
    assert sorted(collect.sources) == sorted([
        "etc/a", "etc/b", "opt/x", "opt/sub/y", "usr/bin/tool", "gone/deep/f", "keep",
        "etc/c", "opt/new", "usr/bin/tool", "z", "gone/new", "opt/again",
    ])  # fmt: skip


def test_layers_as_overlay_lower_layers(tmp_path):
    layout = single_image(tmp_path, *LAYERS)
    layer1, layer2, layer3 = walk_oci(layout.root, on_file=Collect(), flatten=False)
    assert names(layer1) == names(walk_tar(io.BytesIO(LAYER1), on_file=None))
    for tree, path in ((layer2, b"etc/a"), (layer2, b"gone"), (layer3, b"keep"), (layer3, b"etc/b")):
        node = tree.lookup(path)
        assert (node.mode, node.rdev) == (stat.S_IFCHR, 0), path
    assert layer2.lookup(b"z").is_reg  # not whited out by its own layer
    assert layer2.lookup(b".wh..wh.plnk") is None and layer2.lookup(b"opt/.wh..wh..opq") is None
    assert layer2.lookup(b"opt").xattrs == {OVERLAY_OPAQUE_XATTR: b"y"}
    assert OVERLAY_OPAQUE_XATTR not in layer1.lookup(b"opt").xattrs
    # Deleted below and made again in the same layer: opaque, and nothing to inherit from below.
    opt3 = layer3.lookup(b"opt")
    assert (opt3.xattrs, opt3.mode, opt3.mtime_ns) == ({OVERLAY_OPAQUE_XATTR: b"y"}, stat.S_IFDIR | 0o755, 0)
    # Directories a layer only implies carry the attributes of the layers below (they win in overlay).
    assert (layer2.lookup(b"etc").mode, layer2.lookup(b"etc").mtime_ns) == (stat.S_IFDIR | 0o751, 100 * 10**9)
    assert layer3.root.mtime_ns == 10**9 and layer3.lookup(b"etc").mode == stat.S_IFDIR | 0o751


def materialize(tree: Tree, content: dict[int, bytes], dest: bytes) -> None:
    """Write a Tree to disk with every attribute (needs root: chown, mknod, trusted.* xattrs)."""
    first: dict[int, bytes] = {}
    directories = []
    for path, node in tree.walk():
        full = os.path.join(dest, path) if path else dest
        if node.is_dir:
            os.mkdir(full)
            directories.append((full, node))
            continue
        if id(node) in first:
            os.link(first[id(node)], full)
            continue
        first[id(node)] = full
        if node.is_reg:
            with open(full, "wb") as f:
                f.write(content[id(node)])
        elif node.is_symlink:
            os.symlink(node.target, full)
        else:
            os.mknod(full, node.mode, node.rdev)
        set_attributes(full, node)
    for full, node in reversed(directories):  # children first: creating entries changes a directory's mtime
        set_attributes(full, node)


def set_attributes(path: bytes, node) -> None:
    os.chown(path, node.uid, node.gid, follow_symlinks=False)
    if not node.is_symlink:
        os.chmod(path, stat.S_IMODE(node.mode))
    for name, value in node.xattrs.items():
        os.setxattr(path, name, value, follow_symlinks=False)
    os.utime(path, ns=(node.mtime_ns, node.mtime_ns), follow_symlinks=False)


@pytest.mark.root
def test_overlayfs_stacking_the_layers_gives_the_flattened_tree(tmp_path):
    layout = single_image(tmp_path, *LAYERS)
    collect = Collect()
    flat = walk_oci(layout.root, on_file=collect)
    layers = walk_oci(layout.root, on_file=collect, flatten=False)
    base = os.fsencode(tmp_path)
    materialize(flat, collect.content, os.path.join(base, b"flat"))
    lowers = []
    for i, tree in enumerate(layers):
        lowers.append(os.path.join(base, b"layer%d" % i))
        materialize(tree, collect.content, lowers[-1])
    merged = os.path.join(base, b"merged")
    os.mkdir(merged)
    lowerdir = b":".join(reversed(lowers))  # top layer first
    with mounted("overlay", merged, "overlay", MS_RDONLY, b"lowerdir=" + lowerdir):
        assert_same_tree(snapshot(merged), snapshot(os.path.join(base, b"flat")))


# ---------------------------------------------------------------------------------------------------------
# Platforms.


def multi_platform(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path / "layout")
    amd64 = layout.image([(TAR_GZIP, layer_tar(member("arch", b"amd64")))])
    arm64 = layout.image([(TAR_GZIP, layer_tar(member("arch", b"arm64")))], arch="arm64")
    nested = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {**amd64, "platform": {"os": "linux", "architecture": "amd64"}},
        {**arm64, "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
        {**amd64, "platform": {"os": "unknown", "architecture": "unknown"}},  # like a buildx attestation
    ]}  # fmt: skip
    layout.index(layout.blob(json.dumps(nested).encode(), OCI_INDEX))
    return layout


@pytest.mark.parametrize("platform", ["linux/amd64", "linux/arm64", "linux/arm64/v8"])
def test_platform_is_chosen_from_nested_indexes(tmp_path, platform):
    collect = Collect()
    tree = walk_oci(multi_platform(tmp_path).root, on_file=collect, platform=platform)
    assert collect.of(tree, b"arch") == platform.split("/")[1].encode()


def test_missing_or_wrong_platform(tmp_path):
    layout = multi_platform(tmp_path)
    with pytest.raises(InputError, match=r"no image for platform linux/s390x.*linux/amd64.*linux/arm64/v8"):
        walk_oci(layout.root, on_file=None, platform="linux/s390x")
    with pytest.raises(InputError, match="no image"):
        walk_oci(layout.root, on_file=None, platform="linux/arm64/v7")
    with pytest.raises(InputError, match="os/architecture"):
        walk_oci(layout.root, on_file=None, platform="amd64")
    single = single_image(tmp_path / "single", (TAR, layer_tar(member("f", b""))), arch="arm64")
    with pytest.raises(InputError, match="for linux/arm64, not linux/amd64"):
        walk_oci(single.root, on_file=None)


def test_two_images_for_one_platform_are_ambiguous(tmp_path):
    layout = Layout(tmp_path / "layout")
    one = layout.image([(TAR, layer_tar(member("f", b"1")))])
    two = layout.image([(TAR, layer_tar(member("f", b"2")))])
    layout.index(one, two)
    with pytest.raises(InputError, match="2 different images"):
        walk_oci(layout.root, on_file=None)


# ---------------------------------------------------------------------------------------------------------
# Integrity.


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def manifest_of(layout: Layout) -> dict:
    index = json.loads((layout.root / "index.json").read_text())
    return json.loads(layout.path(index["manifests"][0]).read_text())


@pytest.mark.parametrize("media_type", [TAR, TAR_GZIP, TAR_ZSTD])
def test_a_tampered_layer_is_an_integrity_error_naming_it(tmp_path, media_type):
    layout = single_image(tmp_path, (media_type, layer_tar(member("f", os.urandom(3000)), member("g", b"g"))))
    layer = manifest_of(layout)["layers"][0]
    flip_byte(layout.path(layer), 1200)  # in the data of f (or wherever the compressor put it)
    with pytest.raises(IntegrityError) as exc:
        walk_oci(layout.root, on_file=Collect())
    assert layer["digest"] in str(exc.value)


def test_tampered_manifest_config_and_sizes(tmp_path):
    layout = single_image(tmp_path, (TAR, layer_tar(member("f", b"x"))))
    manifest = manifest_of(layout)
    config_path = layout.path(manifest["config"])
    original = config_path.read_bytes()
    config_path.write_bytes(original.replace(b"amd64", b"AMD64"))
    with pytest.raises(IntegrityError, match=manifest["config"]["digest"]):
        walk_oci(layout.root, on_file=None)
    config_path.write_bytes(original)

    layer_path = layout.path(manifest["layers"][0])
    layer_path.write_bytes(layer_path.read_bytes() + bytes(512))  # longer than its descriptor
    with pytest.raises(IntegrityError, match="descriptor says"):
        walk_oci(layout.root, on_file=None)

    index = json.loads((layout.root / "index.json").read_text())
    manifest_path = layout.path(index["manifests"][0])
    manifest_path.write_bytes(manifest_path.read_bytes().replace(b'"schemaVersion": 2', b'"schemaVersion":  2'))
    with pytest.raises(IntegrityError, match=index["manifests"][0]["digest"]):
        walk_oci(layout.root, on_file=None)


def test_layer_streams_verify_their_blobs(tmp_path):
    layout = single_image(tmp_path, *LAYERS)
    layers = oci_layer_streams(layout.root)
    assert [layer.digest for layer in layers] == [d["digest"] for d in manifest_of(layout)["layers"]]
    assert [layer.media_type for layer in layers] == [TAR_GZIP, TAR_ZSTD, TAR]
    with layers[2].open() as blob:
        assert names(walk_tar(blob, on_file=None)) >= {b".wh.keep", b"gone/new"}  # raw layer, whiteouts as is
    flip_byte(layout.path(manifest_of(layout)["layers"][2]), 1600)
    with pytest.raises(IntegrityError):
        with layers[2].open() as blob:
            walk_tar(blob, on_file=None)


def test_layer_errors_in_an_intact_blob_stay_input_errors(tmp_path, caplog):
    layout = single_image(tmp_path, (TAR_GZIP, layer_tar(member("../evil", b"e"), member("ok", b"ok"))))
    with pytest.raises(MemberError, match=r"'\.\.'"):
        walk_oci(layout.root, on_file=None)
    collect = Collect()
    tree = walk_oci(layout.root, on_file=collect, lenient=True)
    assert names(tree) == {b"", b"ok"} and collect.of(tree, b"ok") == b"ok"


# ---------------------------------------------------------------------------------------------------------
# What we refuse.


@pytest.mark.parametrize("change, error, message", [
    (lambda m: m["layers"][0].update(mediaType=TAR + "+bzip2"), UnsupportedError, "unknown media type"),
    (lambda m: m["layers"][0].update(mediaType="application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"),
     UnsupportedError, "foreign"),
    (lambda m: m["layers"][0].update(mediaType="application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"),
     UnsupportedError, "foreign"),
    (lambda m: m["config"].update(mediaType="application/vnd.cncf.helm.config.v1+json"), UnsupportedError, "config"),
    (lambda m: m["layers"][0].update(digest="sha512:" + "ab" * 64), UnsupportedError, "only sha256"),
    (lambda m: m["layers"][0].update(digest="sha256:XYZ"), InputError, "malformed digest"),
    (lambda m: m["layers"][0].update(size=-1), InputError, "negative size"),
    (lambda m: m["layers"][0].update(digest=sha256(b"nothing")), InputError, "missing"),
    (lambda m: m.pop("layers"), InputError, "'layers'"),
])  # fmt: skip
def test_refused_manifests(tmp_path, change, error, message):
    layout = Layout(tmp_path / "layout")
    descriptor = layout.image([(TAR_GZIP, layer_tar(member("f", b"x")))])
    manifest = json.loads(layout.path(descriptor).read_text())
    change(manifest)
    layout.index(layout.blob(json.dumps(manifest).encode(), OCI_MANIFEST))
    with pytest.raises(error, match=message) as exc:
        walk_oci(layout.root, on_file=None)
    assert str(layout.root) in str(exc.value)


def test_refused_layouts(tmp_path):
    with pytest.raises(InputError, match="no such"):
        walk_oci(tmp_path / "nothing", on_file=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="neither an OCI layout"):
        walk_oci(tmp_path / "empty", on_file=None)
    layout = single_image(tmp_path, (TAR, layer_tar(member("f", b""))))
    (layout.root / "oci-layout").write_text('{"imageLayoutVersion": "9.9.9"}')
    with pytest.raises(UnsupportedError, match="layout version"):
        walk_oci(layout.root, on_file=None)
    (layout.root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout.root / "index.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        walk_oci(layout.root, on_file=None)
    (layout.root / "index.json").write_text(json.dumps({"manifests": [{"mediaType": "text/plain",
                                                                       "digest": sha256(b""), "size": 0}]}))
    with pytest.raises(UnsupportedError, match="text/plain"):
        walk_oci(layout.root, on_file=None)


def test_bad_whiteout_names(tmp_path, caplog):
    layout = single_image(tmp_path, (TAR, layer_tar(member("d/.wh.", b""), member("ok", b""))))
    with pytest.raises(InputError, match="names no entry"):
        walk_oci(layout.root, on_file=None)
    assert b"ok" in names(walk_oci(layout.root, on_file=None, lenient=True))


# ---------------------------------------------------------------------------------------------------------
# docker-archive (docker save, skopeo) and layouts packed in a tar.


def tar_of(entries: dict[str, bytes]) -> bytes:
    return layer_tar(*(member(name, data) for name, data in entries.items()))


def docker_archive(layers: list[bytes], *, legacy: bool, arch: str = "amd64") -> dict[str, bytes]:
    config = json.dumps({"architecture": arch, "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [sha256(t) for t in layers]}}).encode()  # fmt: skip
    files = {f"{sha256(config)[7:]}.json": config}
    names = []
    for i, tar in enumerate(layers):
        name = f"{'%064x' % (i + 1)}/layer.tar" if legacy else f"{sha256(tar)[7:]}.tar"
        files[name] = tar
        names.append(name)
    manifest = [{"Config": f"{sha256(config)[7:]}.json", "RepoTags": ["img:1"], "Layers": names}]
    files["manifest.json"] = json.dumps(manifest).encode()
    return files


@pytest.mark.parametrize("legacy", [True, False], ids=["docker save (legacy)", "skopeo"])
def test_docker_archives_as_tar_and_directory(tmp_path, legacy):
    files = docker_archive([LAYER1, LAYER2, LAYER3], legacy=legacy)
    expected = names(walk_oci(single_image(tmp_path, *LAYERS).root, on_file=None))
    archive = tmp_path / "image.tar"
    archive.write_bytes(tar_of(files))
    collect = Collect()
    tree = walk_oci(archive, on_file=collect)
    assert names(tree) == expected and collect.of(tree, b"usr/bin/tool") == b"tool2"
    unpacked = tmp_path / "unpacked"
    for name, data in files.items():
        (unpacked / name).parent.mkdir(parents=True, exist_ok=True)
        (unpacked / name).write_bytes(data)
    assert names(walk_oci(unpacked, on_file=None)) == expected
    assert len(walk_oci(archive, on_file=None, flatten=False)) == 3


def test_docker_archive_integrity_and_refusals(tmp_path):
    tampered = docker_archive([LAYER1], legacy=True)
    layer = next(name for name in tampered if name.endswith("layer.tar"))
    data = bytearray(tampered[layer])
    data[700] ^= 0x01  # in etc/a's header name field... or data: either way the diff_id no longer matches
    tampered[layer] = bytes(data)
    (tmp_path / "t.tar").write_bytes(tar_of(tampered))
    with pytest.raises(IntegrityError, match=sha256(LAYER1)):
        walk_oci(tmp_path / "t.tar", on_file=None)

    two = docker_archive([LAYER1], legacy=False)
    images = json.loads(two["manifest.json"])
    two["manifest.json"] = json.dumps(images * 2).encode()
    (tmp_path / "two.tar").write_bytes(tar_of(two))
    with pytest.raises(InputError, match="exactly one image"):
        walk_oci(tmp_path / "two.tar", on_file=None)

    arm = docker_archive([LAYER1], legacy=False, arch="arm64")
    (tmp_path / "arm.tar").write_bytes(tar_of(arm))
    with pytest.raises(InputError, match="for linux/arm64"):
        walk_oci(tmp_path / "arm.tar", on_file=None)
    assert walk_oci(tmp_path / "arm.tar", on_file=None, platform="linux/arm64").lookup(b"etc/a") is not None

    (tmp_path / "gz.tar").write_bytes(gzip.compress(tar_of(arm)))
    with pytest.raises(InputError, match="uncompressed"):
        walk_oci(tmp_path / "gz.tar", on_file=None)


def test_oci_layout_packed_in_a_tar(tmp_path):
    """docker save since Docker 25 writes an OCI layout (plus manifest.json) into a tar."""
    layout = multi_platform(tmp_path)
    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as out:
        out.add(layout.root, arcname=".")
    collect = Collect()
    tree = walk_oci(archive, on_file=collect, platform="linux/arm64")
    assert collect.of(tree, b"arch") == b"arm64"


# ---------------------------------------------------------------------------------------------------------
# Tags of a layout: oci:DIR:TAG.


def two_tags(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path / "tagged")
    one = layout.image([(TAR, layer_tar(member("f", b"one")))])
    two = layout.image([(TAR, layer_tar(member("f", b"two")))])
    layout.index({**one, "annotations": {"org.opencontainers.image.ref.name": "v1"}},
                 {**two, "annotations": {"org.opencontainers.image.ref.name": "v2"}})
    return layout


@pytest.mark.parametrize("tag", ["v1", "v2"])
def test_a_tag_chooses_one_image_of_a_layout(tmp_path, tag):
    from erofs_builder.images import open_image
    from erofs_builder.walk_oci import walk_layers

    layout = two_tags(tmp_path)
    with pytest.raises(InputError, match=r"2 different images.*choose one of the tags \['v1', 'v2'\]"):
        walk_oci(layout.root, on_file=None)
    collect = Collect()
    tree = walk_layers(open_image(f"oci:{layout.root}:{tag}").layers, on_file=collect)
    assert collect.of(tree, b"f") == {"v1": b"one", "v2": b"two"}[tag]


def test_a_missing_tag_names_the_tags_there_are(tmp_path):
    from erofs_builder.images import open_image

    with pytest.raises(NotFoundError, match=r"no image tagged 'v3'; the tags are \['v1', 'v2'\]"):
        open_image(f"oci:{two_tags(tmp_path).root}:v3")


def test_layout_references_split_at_the_last_colon_without_a_slash():
    from erofs_builder.images import split_layout_ref

    assert split_layout_ref("oci:/a/b:v1") == ("/a/b", "v1")
    assert split_layout_ref("oci:/a/b") == ("/a/b", None)
    assert split_layout_ref("oci:/a:b/c") == ("/a:b/c", None)
    assert split_layout_ref("oci:rel:latest") == ("rel", "latest")
