"""dsecfs convert against a real registry (docker-registry + skopeo): the pushed image keeps the source's
config, names each dsecfs layer (digest, store) in its layer annotations with meta.erofs as the blob, and
converting again uploads no chunk and no blob."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from dsec_fs.errors import InputError, IntegrityError
from dsec_fs.layer import list_refs, open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder.build import build_image_layers
from erofs_builder.convert import (
    DSECFS_LAYER_TYPE, LAYER_ANNOTATION, SOURCE_DIGEST_ANNOTATION, STORE_ANNOTATION, convert_image,
)
from erofs_builder.registry import RegistryOptions

from ociimage import TAR, TAR_GZIP, TAR_ZSTD, directory, layer_tar, member, single_image
from registryserver import DockerRegistry, have_registry_tools

pytestmark = pytest.mark.skipif(not have_registry_tools(), reason="needs docker-registry, skopeo and htpasswd")

PLAIN = RegistryOptions(plain_http=True, auth_files=())
LAYERS = [
    (TAR_GZIP, layer_tar(directory("usr"), member("usr/lib.so", bytes(range(256)) * 3000),
                         member("usr/doc", b"converted " * 100))),
    (TAR_ZSTD, layer_tar(member("usr/.wh.doc", b""), member("app", b"#!/bin/sh\necho hi\n", mode=0o755))),
    (TAR, layer_tar(member("etc-conf", b"k=v\n"))),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with DockerRegistry(tmp_path_factory.mktemp("registry")) as server:
        yield server


def blob(registry, repository: str, digest: str) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{registry.address}/v2/{repository}/blobs/{digest}", timeout=10) as response:
        return response.read()


def test_convert_pushes_the_dsecfs_layers_under_the_source_config(registry, tmp_path):
    layout = single_image(tmp_path / "src", *LAYERS)
    registry.push(layout.root, "app/src:v1")
    store = FilesystemStore(str(tmp_path / "store"))
    source = f"docker://{registry.address}/app/src:v1"
    target = f"docker://{registry.address}/app/converted:v1"
    result = convert_image(source, target, store, registry=PLAIN, name="app:v1")

    source_manifest = registry.inspect_raw("app/src:v1")
    converted = registry.inspect_raw("app/converted:v1")
    assert result.target.endswith("@" + result.manifest_digest)
    assert registry.inspect_raw(f"app/converted@{result.manifest_digest}") == converted
    assert converted["config"] == source_manifest["config"]  # the same bytes: same digest and size
    assert blob(registry, "app/converted", converted["config"]["digest"]) == \
        blob(registry, "app/src", source_manifest["config"]["digest"])
    expected = [r.digest for r in build_image_layers(layout.root, FilesystemStore(str(tmp_path / "check")))]
    assert [r.digest for r in result.layers] == expected
    assert len(converted["layers"]) == len(LAYERS)
    for k, (descriptor, source_layer) in enumerate(zip(converted["layers"], source_manifest["layers"])):
        layer = open_layer(store, f"app:v1-l{k}")
        assert descriptor["mediaType"] == DSECFS_LAYER_TYPE
        assert descriptor["digest"] == "sha256:" + layer.digest and descriptor["size"] == len(layer.meta)
        assert descriptor["annotations"][LAYER_ANNOTATION] == layer.digest == expected[k]
        assert descriptor["annotations"][STORE_ANNOTATION] == store.url
        assert descriptor["annotations"][SOURCE_DIGEST_ANNOTATION] == source_layer["digest"]
        assert blob(registry, "app/converted", descriptor["digest"]) == layer.meta
    assert result.pushed_blobs == 1 + len(LAYERS)

    again = convert_image(source, target, store, registry=PLAIN)
    assert again.manifest_digest == result.manifest_digest
    assert again.pushed_blobs == 0
    assert again.layers[0].stats.new_chunks == 0 and again.layers[0].stats.new_bytes == 0


def test_convert_from_a_layout_tag_with_the_cli(registry, tmp_path):
    layout = single_image(tmp_path / "src", *LAYERS[:1])
    index = json.loads((layout.root / "index.json").read_text())
    index["manifests"][0]["annotations"] = {"org.opencontainers.image.ref.name": "stable"}
    (layout.root / "index.json").write_text(json.dumps(index))
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "convert", "--plain-http", "--json", "--store", str(tmp_path / "store"),
         f"oci:{layout.root}:stable", f"docker://{registry.address}/app/from-layout:stable"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    converted = registry.inspect_raw("app/from-layout:stable")
    assert converted["layers"][0]["annotations"][LAYER_ANNOTATION] == out["layers"][0]["layer"]
    assert out["target"].endswith("@" + out["manifest"])


def test_a_failed_conversion_pushes_no_manifest(registry, tmp_path):
    layout = single_image(tmp_path / "src", (TAR_GZIP, layer_tar(member("f", b"to be corrupted " * 500))))
    registry.push(layout.root, "app/corrupt:v1")
    digest = registry.inspect_raw("app/corrupt:v1")["layers"][0]["digest"]
    data = bytearray(registry.blob_path(digest).read_bytes())
    data[-20] ^= 0x40
    registry.blob_path(digest).write_bytes(bytes(data))
    store = FilesystemStore(str(tmp_path / "store"))
    target = f"docker://{registry.address}/app/out:v1"
    with pytest.raises(IntegrityError, match=digest):
        convert_image(f"docker://{registry.address}/app/corrupt:v1", target, store, registry=PLAIN, name="o:1")
    with pytest.raises(InputError, match="target must be a registry"):
        convert_image(f"oci:{layout.root}", "/tmp/somewhere", store, registry=PLAIN)
    assert list_refs(store) == {} and list(store.list("layers/")) == []
    with pytest.raises(subprocess.CalledProcessError):
        registry.inspect_raw("app/out:v1")


@pytest.mark.slow
def test_the_debian_rootfs_image_converts_and_its_next_version_uploads_only_new_chunks(registry, debian_rootfs,
                                                                                        tmp_path):
    base = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--format=posix", "-C",
                    debian_rootfs, "-cf", str(base), "."], check=True)
    app_v1 = layer_tar(member("opt/app/run", b"#!/bin/sh\necho v1\n", mode=0o755), member("opt/app/data", bytes(5000)))
    app_v2 = layer_tar(member("opt/app/run", b"#!/bin/sh\necho v2\n", mode=0o755), member("opt/app/data", bytes(5000)))
    store = FilesystemStore(str(tmp_path / "store"))
    results = {}
    for version, app in (("v1", app_v1), ("v2", app_v2)):
        layout = single_image(tmp_path / version, (TAR, base.read_bytes()), (TAR_ZSTD, app))
        registry.push(layout.root, f"debian/app:{version}")
        results[version] = convert_image(f"docker://{registry.address}/debian/app:{version}",
                                         f"docker://{registry.address}/debian/app:{version}-dsecfs", store,
                                         registry=PLAIN)
        expected = [r.digest for r in build_image_layers(layout.root, FilesystemStore(str(tmp_path / f"c{version}")))]
        assert [r.digest for r in results[version].layers] == expected
    v1, v2 = results["v1"], results["v2"]
    assert v1.layers[0].stats.files > 5000 and v1.layers[0].stats.new_bytes > 50 << 20
    # The converted images live beside their sources: the config blob is there already, only metas go up.
    assert v1.pushed_blobs == 2
    # v2 shares the rootfs layer: one new chunk (the new script), one new blob (the app layer's meta).
    assert v2.layers[0].digest == v1.layers[0].digest and v2.layers[1].digest != v1.layers[1].digest
    assert v2.layers[0].stats.new_chunks == 1 and v2.pushed_blobs == 1
    converted = registry.inspect_raw("debian/app:v2-dsecfs")
    assert [d["annotations"][LAYER_ANNOTATION] for d in converted["layers"]] == [r.digest for r in v2.layers]
