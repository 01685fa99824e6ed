"""``dsecfs image pull``: an image into containerd, unpacked by the dsecfs snapshotter; the layers of a
converted image (erofs_builder/convert.py) are mounted without downloading them.

containerd 1.6's ``ctr images pull`` fetches every layer blob and unpacks each itself, so it never asks a
snapshotter for a remote snapshot. This pull does what containerd's own unpacker does, through
containerd's API (containerd_client.py), inside a lease:

1. resolve the reference at the registry (an index followed to the platform's manifest) and read the
   manifest and config (verified against their digests);
2. put the config and the manifest into containerd's content store, with the gc labels that tie them
   together (manifest -> config and the ordinary layers' blobs, config -> the top snapshot), so the image
   record holds them after the lease is gone;
3. for each layer, bottom first, with its chain ID (from the config's diff_ids), unless the snapshotter
   has it already (Stat): Prepare ``extract-<random>-<chainID>`` over the layer below with the layer's
   ``containerd.io/snapshot/*`` annotations and ``containerd.io/snapshot.ref`` = chain ID as labels.
   For a dsecfs layer the snapshotter mounts it and answers ALREADY_EXISTS, and containerd records the
   committed snapshot under the chain ID: nothing is downloaded. An ordinary layer's blob is streamed
   from the registry into the content store, applied to the prepared snapshot by containerd's differ
   (the applied digest must be the layer's diff_id) and committed under the chain ID;
4. create (or repoint) the image record.

Threads: the calling thread.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from dsec_fs.errors import ConflictError, InputError, IntegrityError, NotFoundError, UnsupportedError
from erofs_builder.convert import DSECFS_LAYER_TYPE, LAYER_ANNOTATION, STORE_ANNOTATION
from erofs_builder.registry import RegistryOptions, parse_image_ref
from erofs_builder.walk_oci import Descriptor, parse_descriptor, parse_json
from erofs_builder.walk_registry import RegistrySource, resolve_manifest

from .containerd_api import types_pb2
from .containerd_client import ContainerdClient
from .snapshotter import TARGET_LABEL

INHERITED_LABEL_PREFIX = "containerd.io/snapshot/"  # layer annotations containerd passes to Prepare


@dataclass(frozen=True)
class PullResult:
    name: str  # the image's name in containerd
    manifest_digest: str
    chain_ids: list[str]  # the layers' snapshots, bottom first
    mounted: int  # dsecfs layers the snapshotter mounted now
    unpacked: int  # ordinary layers downloaded and unpacked now (the others were there already)


@dataclass(frozen=True)
class _Layer:
    descriptor: Descriptor
    labels: dict[str, str]  # the annotations containerd passes to Prepare
    remote: bool  # a dsecfs layer


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
    layers = [_layer(entry, where) for entry in manifest["layers"]]
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or not layers:
        raise InputError(f"{len(layers)} layers but diff_ids {str(diff_ids)[:80]} in the config", where=where)
    chain = chain_ids([str(d) for d in diff_ids])
    name = f"{image_ref.host}/{image_ref.repository}" + (f":{image_ref.tag}" if image_ref.tag else
                                                          f"@{descriptor.digest}")
    manifest_labels = {"containerd.io/gc.ref.content.config": config.digest}
    manifest_labels.update({f"containerd.io/gc.ref.content.l.{k}": layer.descriptor.digest
                            for k, layer in enumerate(layers) if not layer.remote})
    mounted = unpacked = 0
    with containerd.lease():
        containerd.write_content(config.digest, len(config_data), [config_data],
                                 {f"containerd.io/gc.ref.snapshot.{snapshotter}": chain[-1]})
        containerd.write_content(descriptor.digest, len(manifest_data), [manifest_data], manifest_labels)
        for k, (layer, chain_id) in enumerate(zip(layers, chain)):
            if _has_snapshot(containerd, snapshotter, chain_id):
                continue
            key = f"extract-{secrets.token_hex(6)}-{chain_id}"
            labels = {**layer.labels, TARGET_LABEL: chain_id}
            try:
                mounts = containerd.prepare(snapshotter, key, chain[k - 1] if k else "", labels)
            except ConflictError:
                mounted += 1  # the snapshotter has it now (a dsecfs layer: mounted, nothing downloaded)
                continue
            if layer.remote:
                containerd.remove(snapshotter, key)  # an ordinary active snapshot: not what we asked for
                raise UnsupportedError(f"snapshotter {snapshotter!r} unpacks dsecfs layer {k} instead of mounting "
                                       "it: is it dsecfs?", where=where)
            _unpack(containerd, source, snapshotter, layer.descriptor, key, mounts, chain_id, str(diff_ids[k]))
            unpacked += 1
        target = types_pb2.Descriptor(media_type=descriptor.media_type, digest=descriptor.digest,
                                      size=len(manifest_data))
        containerd.put_image(name, target)
    return PullResult(name, descriptor.digest, chain, mounted, unpacked)


def _layer(entry, where: str) -> _Layer:
    descriptor = parse_descriptor(entry, where)
    annotations = entry.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise InputError(f"layer {descriptor.digest}: annotations are not an object", where=where)
    labels = {key: str(value) for key, value in annotations.items() if key.startswith(INHERITED_LABEL_PREFIX)}
    remote = descriptor.media_type == DSECFS_LAYER_TYPE
    if remote and (LAYER_ANNOTATION not in labels or STORE_ANNOTATION not in labels):
        raise InputError(f"dsecfs layer {descriptor.digest} names no layer or store ({LAYER_ANNOTATION}, "
                         f"{STORE_ANNOTATION})", where=where)
    return _Layer(descriptor, labels, remote)


def _unpack(containerd: ContainerdClient, source: RegistrySource, snapshotter: str, layer: Descriptor, key: str,
            mounts: list, chain_id: str, diff_id: str) -> None:
    """An ordinary layer: its blob into the content store (streamed, verified on the way and by containerd),
    applied to the prepared snapshot ``key`` and committed as ``chain_id``; the snapshot is removed if any
    step fails."""
    try:
        if not containerd.has_content(layer.digest):
            with source.open_layer(layer) as blob:
                containerd.write_content(layer.digest, layer.size, iter(lambda: blob.read(1 << 20), b""), {})
        applied = containerd.apply(types_pb2.Descriptor(media_type=layer.media_type, digest=layer.digest,
                                                        size=layer.size), mounts)
        if applied.digest != diff_id:
            raise IntegrityError(f"layer {layer.digest} unpacks to {applied.digest}, the config's diff_id is "
                                 f"{diff_id}", where=source.where)
        containerd.commit(snapshotter, chain_id, key)
    except BaseException:
        containerd.remove(snapshotter, key)
        raise


def _has_snapshot(containerd: ContainerdClient, snapshotter: str, key: str) -> bool:
    try:
        containerd.stat(snapshotter, key)
    except NotFoundError:
        return False
    return True
