"""Build a layer: from a source directory (or a Tree made by any walker) to a layer published on a store.

Steps, each finished before the next starts:
1. walk the source into a Tree (metadata only; gives the total size for progress);
2. load the store's chunk index, so chunks the store already holds are neither compressed nor uploaded;
3. chunk every regular file and upload the new chunks in packs (chunker.py), then flush the uploader:
   every pack and pack index is in the store before anything names it;
4. write meta.erofs (writer.py) against the blob map the chunker filled;
5. publish: meta.erofs, blob map, then manifest.json (dsec_fs.layer.publish_layer), then the ref.

On any error before step 5 nothing of the layer is published: the packs already uploaded are
unreferenced and gc removes them. A ref name is checked before any work, so a bad name costs nothing.

Threads: build_layer and build_tree run in the calling thread; the chunker and the uploader run their own
worker threads for the duration of the call and stop them before returning (or raising).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from dsec_fs.chunks import ChunkIndex, ChunkUploader
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import NotFoundError
from dsec_fs.layer import Manifest, parse_ref, publish_layer, set_ref
from dsec_fs.store.base import Store

from .blobmap import BLOCK_SIZE, BlobMap, check_chunk_size
from .chunker import DEFAULT_CHUNK_SIZE, ChunkStats, Progress, chunk_tree
from .tree import Tree
from .walk_dir import walk_directory
from .writer import write_image


@dataclass(frozen=True)
class BuildResult:
    digest: str  # the layer digest: sha256 hex of meta.erofs
    manifest: Manifest
    stats: ChunkStats


def build_layer(
    source: str | bytes | os.PathLike,
    store: Store,
    *,
    name: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    workers: int | None = None,
) -> BuildResult:
    """Build and publish the layer of directory ``source``; with ``name`` ("name:tag"), point that ref at it."""
    _check_options(name, chunk_size)
    tree = walk_directory(os.fspath(source))
    return build_tree(
        tree, store, name=name, chunk_size=chunk_size, progress=progress, workers=workers,
        source=os.path.abspath(os.fsdecode(source)),
    )


def build_tree(
    tree: Tree,
    store: Store,
    *,
    name: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    workers: int | None = None,
    source: str = "",
) -> BuildResult:
    """Build and publish the layer of ``tree`` (from any walker); ``source`` is recorded in the manifest."""
    _check_options(name, chunk_size)
    index = ChunkIndex()
    index.load(store)
    with ChunkUploader(store, index) as uploader:
        blob_map, stats = chunk_tree(tree, uploader, index, chunk_size=chunk_size, workers=workers, progress=progress)
        uploader.flush()

    meta = write_image(tree, blob_map, chunk_size)
    blob_map_bytes = blob_map.encode()
    manifest = Manifest(
        layer=to_hex(sha256(meta)),
        blob_id=blob_map.blob_id,
        meta_size=len(meta),
        blobmap_size=len(blob_map_bytes),
        blobmap_sha256=to_hex(sha256(blob_map_bytes)),
        chunk_size=chunk_size,
        block_size=BLOCK_SIZE,
        blob_blocks=blob_map.blocks,
        packs=_packs_of(blob_map, index),
        stats=dataclasses.asdict(stats),
        source=source,
    )
    digest = publish_layer(store, meta, blob_map_bytes, manifest)
    if name is not None:
        set_ref(store, name, digest)
    return BuildResult(digest=digest, manifest=manifest, stats=stats)


def _check_options(name: str | None, chunk_size: int) -> None:
    if name is not None:
        parse_ref(name)
    check_chunk_size(chunk_size)


def _packs_of(blob_map: BlobMap, index: ChunkIndex) -> list[str]:
    """Sorted ids of the packs holding the blob map's chunks (all in the index once the uploader flushed)."""
    packs = set()
    for _blkaddr, digest, _length in blob_map.entries:
        location = index.get(digest)
        if location is None:
            raise NotFoundError("chunk is in neither the store nor this build", where=f"chunk {to_hex(digest)}")
        packs.add(location.pack_id)
    return sorted(packs)
