"""``dsecfs image pull``: a converted image (erofs_builder/convert.py) into containerd, unpacked by the
dsecfs snapshotter without downloading a layer.

containerd 1.6's ``ctr images pull`` fetches every layer blob and unpacks each itself, so it never asks a
snapshotter for a remote snapshot. This pull does what containerd's own unpacker does for remote
snapshotters, through containerd's API (containerd_client.py), inside a lease:

1. resolve the reference at the registry (an index followed to the platform's manifest) and read the
   manifest and config (verified against their digests);
2. put the config and the manifest into containerd's content store, with the gc labels that tie them
   together (manifest -> config, config -> the top snapshot), so the image record holds them after the
   lease is gone; no layer blob is fetched or stored;
3. for each layer, bottom first, with its chain ID (from the config's diff_ids): unless the snapshotter
   has it already (Stat), Prepare ``extract-<random>-<chainID>`` over the layer below with the layer's
   ``containerd.io/snapshot/*`` annotations and ``containerd.io/snapshot.ref`` = chain ID as labels; the
   dsecfs snapshotter mounts the dsecfs layer and answers ALREADY_EXISTS, and containerd records the
   committed snapshot under the chain ID;
4. create (or repoint) the image record.

An image that is not converted (a layer without the dsecfs annotations) is refused before anything is
written: pull it with ``ctr images pull --snapshotter dsecfs``, which unpacks it into the snapshotter's
ordinary snapshots. Threads: the calling thread.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from dsec_fs.errors import ConflictError, InputError, NotFoundError, UnsupportedError
from erofs_builder.convert import LAYER_ANNOTATION, STORE_ANNOTATION
from erofs_builder.registry import RegistryOptions, parse_image_ref
from erofs_builder.walk_oci import parse_descriptor, parse_json
from erofs_builder.walk_registry import resolve_manifest

from .containerd_api import types_pb2
from .containerd_client import ContainerdClient
from .snapshotter import TARGET_LABEL

INHERITED_LABEL_PREFIX = "containerd.io/snapshot/"  # layer annotations containerd passes to Prepare


@dataclass(frozen=True)
class PullResult:
    name: str  # the image's name in containerd
    manifest_digest: str
    chain_ids: list[str]  # the layers' snapshots, bottom first
    prepared: int  # layers the snapshotter mounted now (the others it had)


def chain_ids(diff_ids: list[str]) -> list[str]:
    """containerd's (the OCI image spec's) ChainID of each layer: the stack of layers up to it."""
    chain: list[str] = []
    for diff_id in diff_ids:
        chain.append(diff_id if not chain else "sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def pull_image(ref: str, containerd: ContainerdClient, *, snapshotter: str = "dsecfs",
               platform: str = "linux/amd64", registry: RegistryOptions | None = None) -> PullResult:
    image_ref = parse_image_ref(ref)
    source, descriptor = resolve_manifest(image_ref, platform, registry or RegistryOptions())
    where = f"{source.where}: manifest {descriptor.digest}"
    manifest_data = source.read_document(descriptor, f"manifest {descriptor.digest}")
    manifest = parse_json(manifest_data, where)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise InputError("the manifest has no layer list", where=where)
    config = parse_descriptor(manifest.get("config"), where)
    config_data = source.read_blob(config, f"config {config.digest}")
    diff_ids = (parse_json(config_data, f"{where}: config").get("rootfs") or {}).get("diff_ids")
    layers = manifest["layers"]
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or not layers:
        raise InputError(f"{len(layers)} layers but diff_ids {str(diff_ids)[:80]} in the config", where=where)
    annotations = []
    for k, layer in enumerate(layers):
        labels = layer.get("annotations") if isinstance(layer, dict) else None
        if not isinstance(labels, dict) or LAYER_ANNOTATION not in labels or STORE_ANNOTATION not in labels:
            raise UnsupportedError(f"layer {k} is not a dsecfs layer (no {LAYER_ANNOTATION} annotation): pull an "
                                   "image that is not converted with `ctr images pull --snapshotter dsecfs`",
                                   where=where)
        annotations.append({key: str(value) for key, value in labels.items() if key.startswith(INHERITED_LABEL_PREFIX)})
    chain = chain_ids([str(d) for d in diff_ids])
    name = f"{image_ref.host}/{image_ref.repository}" + (f":{image_ref.tag}" if image_ref.tag else
                                                          f"@{descriptor.digest}")
    prepared = 0
    with containerd.lease():
        containerd.write_content(config.digest, config_data,
                                 {f"containerd.io/gc.ref.snapshot.{snapshotter}": chain[-1]})
        containerd.write_content(descriptor.digest, manifest_data, {"containerd.io/gc.ref.content.config": config.digest})
        for k, chain_id in enumerate(chain):
            if _has_snapshot(containerd, snapshotter, chain_id):
                continue
            key = f"extract-{secrets.token_hex(6)}-{chain_id}"
            labels = {**annotations[k], TARGET_LABEL: chain_id}
            try:
                containerd.prepare(snapshotter, key, chain[k - 1] if k else "", labels)
            except ConflictError:
                prepared += 1
                continue
            containerd.remove(snapshotter, key)  # an ordinary active snapshot: not what we asked for
            raise UnsupportedError(f"snapshotter {snapshotter!r} unpacks layer {k} instead of mounting it: is it "
                                   "dsecfs, allowed to read the layer's store?", where=where)
        target = types_pb2.Descriptor(media_type=descriptor.media_type, digest=descriptor.digest,
                                      size=len(manifest_data))
        containerd.put_image(name, target)
    return PullResult(name, descriptor.digest, chain, prepared)


def _has_snapshot(containerd: ContainerdClient, snapshotter: str, key: str) -> bool:
    try:
        containerd.stat(snapshotter, key)
    except NotFoundError:
        return False
    return True
