"""Convert an image to dsecfs and push it to a registry: the image a node pulls lazily.

``convert_image(SOURCE, TARGET, store)`` builds one dsecfs layer per image layer (build_image_layers:
overlay whiteouts, so the layers stack as the image's did) into ``store``, then pushes to TARGET
(``docker://...``) an OCI image manifest whose

- config is the source's, byte for byte (same digest: the container's settings, and the diff_ids that
  containerd derives its snapshot chain IDs from, stay those of the source image);
- layer k's blob is dsecfs layer k's meta.erofs (small: metadata only; its sha256 is the dsecfs layer
  digest), media type DSECFS_LAYER_TYPE, with annotations under ``containerd.io/snapshot/dsecfs.``
  naming the layer digest, the store that holds its chunks, and the source layer it came from.
  containerd passes these annotations to a remote snapshotter as ``containerd.io/snapshot/dsecfs.*``
  labels on Prepare, which is how a node finds the layer without downloading a blob.

Re-converting uploads only what is new: the chunks the store already holds are neither compressed nor
uploaded (the build's dedup), and blobs the target repository has (HEAD) are not pushed again. The
manifest goes last, so a failed conversion leaves no tag pointing at a half-pushed image; the store
URL is recorded as given (an s3:// URL holds no credentials: boto3 takes those from its environment).

Threads: the calling thread; the build runs its own workers (build.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dsec_fs.errors import InputError
from dsec_fs.layer import open_layer
from dsec_fs.store.base import Store

from .build import BuildResult, build_image_layers
from .chunker import DEFAULT_CHUNK_SIZE, Progress
from .images import REGISTRY_PREFIX, open_image
from .registry import RegistryClient, RegistryOptions, parse_image_ref
from .walk_oci import OCI_MANIFEST

DSECFS_LAYER_TYPE = "application/vnd.dsecfs.layer.meta.v1.erofs"
ANNOTATION_PREFIX = "containerd.io/snapshot/dsecfs."
LAYER_ANNOTATION = ANNOTATION_PREFIX + "layer"  # the dsecfs layer digest (hex sha256 of meta.erofs)
STORE_ANNOTATION = ANNOTATION_PREFIX + "store"  # the store URL holding the layer and its chunks
SOURCE_DIGEST_ANNOTATION = ANNOTATION_PREFIX + "source-digest"  # the source image's layer blob
SOURCE_TYPE_ANNOTATION = ANNOTATION_PREFIX + "source-media-type"
FORMAT_ANNOTATION = ANNOTATION_PREFIX + "format"  # on the manifest: which dsecfs image format
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class ConvertResult:
    target: str  # docker://HOST/REPO:TAG@sha256:... of the pushed manifest
    manifest_digest: str
    layers: list[BuildResult]  # bottom first
    pushed_blobs: int  # blobs uploaded to the target (config and meta.erofs files it did not have)


def convert_image(
    source: str | os.PathLike,
    target: str,
    store: Store,
    *,
    platform: str = "linux/amd64",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    registry: RegistryOptions | None = None,
    name: str | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
    lenient: bool = False,
) -> ConvertResult:
    """Build ``source`` (as build_layer takes an image) into dsecfs layers in ``store`` and push the
    converted image to ``target``; with ``name``, the layers also get refs NAME-l0, -l1, ..."""
    if not target.startswith(REGISTRY_PREFIX):
        raise InputError("the target must be a registry reference docker://HOST[:PORT]/REPO:TAG", where=target)
    target_ref = parse_image_ref(target)
    if target_ref.digest is not None:
        raise InputError("the target names a tag, not a digest (the digest is the pushed manifest's)", where=target)
    registry = registry or RegistryOptions()
    image = open_image(source, platform, registry)
    results = build_image_layers(image, store, name=name, chunk_size=chunk_size, progress=progress,
                                 workers=workers, lenient=lenient)
    client = RegistryClient(target_ref.host, registry)
    repository = target_ref.repository
    pushed = 0

    def push(data: bytes) -> str:
        nonlocal pushed
        digest, uploaded = client.push_blob(repository, data)
        pushed += uploaded
        return digest

    push(image.config_data)  # verified against image.config_digest when the image was opened
    config = {"mediaType": image.config_media_type, "digest": image.config_digest, "size": len(image.config_data)}
    layers = []
    for result, source_layer in zip(results, image.layers):
        meta = open_layer(store, result.digest).meta  # verified against the digest on the way
        layers.append({
            "mediaType": DSECFS_LAYER_TYPE, "digest": push(meta), "size": len(meta),
            "annotations": {
                LAYER_ANNOTATION: result.digest,
                STORE_ANNOTATION: store.url,
                SOURCE_DIGEST_ANNOTATION: source_layer.digest,
                SOURCE_TYPE_ANNOTATION: source_layer.media_type,
            },
        })
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config, "layers": layers,
                "annotations": {FORMAT_ANNOTATION: FORMAT_VERSION}}
    data = json.dumps(manifest, indent=None, separators=(",", ":"), sort_keys=True).encode()
    digest = client.put_manifest(repository, target_ref.reference, data, OCI_MANIFEST)
    return ConvertResult(str(target_ref.with_digest(digest)), digest, results, pushed)
