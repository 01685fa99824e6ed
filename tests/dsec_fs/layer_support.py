"""Pretend layers for tests that need many published layers fast: a layer whose meta.erofs is any bytes
(its digest is their sha256), with a blob map and a manifest that describe them; nothing else reads it."""

from __future__ import annotations

from dsec_fs.digest import sha256
from dsec_fs.layer import Manifest, publish_layer

BLOBMAP = b"pretend blob map"


def publish_pretend_layer(store, meta: bytes) -> str:
    """Publish a layer whose meta.erofs is ``meta``; its digest."""
    digest = sha256(meta).hex()
    manifest = Manifest(layer=digest, blob_id=sha256(BLOBMAP).hex(), meta_size=len(meta), blobmap_size=len(BLOBMAP),
                        blobmap_sha256=sha256(BLOBMAP).hex(), chunk_size=1 << 20, block_size=4096, blob_blocks=0,
                        packs=[])
    return publish_layer(store, meta, BLOBMAP, manifest)


def two_layers_sharing_a_prefix(store, length: int = 4) -> tuple[str, str]:
    """Publish two pretend layers whose digests share their first ``length`` hex characters."""
    seen = {}
    for i in range(1 << (4 * length + 2)):
        meta = b"pretend meta.erofs " + i.to_bytes(8, "big")
        prefix = sha256(meta).hex()[:length]
        if prefix in seen:
            return publish_pretend_layer(store, seen[prefix]), publish_pretend_layer(store, meta)
        seen[prefix] = meta
    raise AssertionError("no two digests share a prefix")
