"""What every build path does last: the manifest of a finished layer, the steps after it is stored
(its packs' indexes restored, the ref), and which packs hold a set of chunks. build.py's full path and
patched_build.py's patch path share them. Calling thread only; no state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from dsec_fs.blobmap import BLOCK_SIZE
from dsec_fs.chunks import ChunkIndex
from dsec_fs.digest import to_hex
from dsec_fs.errors import NotFoundError
from dsec_fs.layer import Manifest, set_ref
from dsec_fs.pack_indexes import ensure_pack_indexes
from dsec_fs.store.base import Store

from .chunker import ChunkStats


@dataclass(frozen=True)
class BuildResult:
    digest: str  # the layer digest: sha256 hex of meta.erofs
    manifest: Manifest
    stats: ChunkStats


def layer_manifest(layer: str, meta_size: int, blob_id: str, blobmap_size: int, blob_blocks: int, packs: list[str],
              stats: ChunkStats, chunk_size: int, source: str) -> Manifest:
    return Manifest(layer=layer, blob_id=blob_id, meta_size=meta_size, blobmap_size=blobmap_size,
                    blobmap_sha256=blob_id, chunk_size=chunk_size, block_size=BLOCK_SIZE, blob_blocks=blob_blocks,
                    packs=packs, stats=dataclasses.asdict(stats), source=source)


def published(store: Store, manifest: Manifest, digest: str, name: str | None, stats: ChunkStats) -> BuildResult:
    """What follows a layer's manifest: its packs' indexes restored if a gc soft-deleted one meanwhile, then
    the ref (under the lease too: gc keeps an unnamed layer while a build may name it)."""
    ensure_pack_indexes(store, manifest.packs)
    if name is not None:
        set_ref(store, name, digest)
    return BuildResult(digest=digest, manifest=manifest, stats=stats)



def packs_of(digests: Iterable[bytes], index: ChunkIndex) -> list[str]:
    """Sorted ids of the packs holding the chunks ``digests`` (all in the index once the uploader flushed)."""
    packs = set()
    pack_of = index.pack_of
    for digest in digests:
        pack_id = pack_of(digest)
        if pack_id is None:
            raise NotFoundError("chunk is in neither the store nor this build", where=f"chunk {to_hex(digest)}")
        packs.add(pack_id)
    return sorted(packs)
