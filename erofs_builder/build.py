"""Build a layer: from a source directory (or a Tree made by any walker) to a layer published on a store.

Steps, each finished before the next starts:
1. walk the source into a Tree (metadata only; gives the total size for progress);
2. take a build lease (dsec_fs.leases: gc keeps every pack this build may see until it ends) and sync the
   store's local index mirror (dsec_fs.index_mirror), so chunks the store already holds are neither
   compressed nor uploaded;
3. chunk every regular file and upload the new chunks in packs (chunker.py), then flush the uploader:
   every pack and pack index is in the store before anything names it;
4. confirm against the store's own index objects that the layer's packs hold all its chunks (the mirror
   is a cache); the chunk index is dropped then;
5. lay out and encode the blob map, and write meta.erofs (writer.py) against it;
6. publish: the build info of a directory build (incremental.py), meta.erofs, blob map, then
   manifest.json (dsec_fs.layer.publish_layer); restore any pack index a concurrent gc soft-deleted
   meanwhile (dsec_fs.gc.ensure_pack_indexes); then the ref.

Memory: for a tree of many small files each step needs tens of MB besides the Tree, so they run one
after another (the flush of step 3 could run beside step 5, but their peaks would add up), and what one
step holds per chunk (the chunk index, the blob map) lives only as long as it is needed.

Incremental builds: with ``parent`` (a layer built earlier from the same directory), files whose stat
identity has not changed since take their chunk lists from the parent without being read (incremental.py).

On any error before step 6 nothing of the layer is published: the packs already uploaded are
unreferenced and gc removes them. A ref name is checked before any work, so a bad name costs nothing.

Threads: build_layer and build_tree run in the calling thread; the chunker and the uploader run their own
worker threads for the duration of the call and stop them before returning (or raising). Python's cycle
collector is paused for the whole process while a build runs (see ``_cycle_collector_paused``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dsec_fs.chunks import ChunkIndex, ChunkUploader
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import NotFoundError
from dsec_fs.gc import ensure_pack_indexes
from dsec_fs.index_mirror import load_chunk_index
from dsec_fs.layer import Manifest, parse_ref, publish_layer, set_ref
from dsec_fs.leases import Lease
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .blobmap import BLOCK_SIZE, check_chunk_size
from .chunker import DEFAULT_CHUNK_SIZE, ChunkStats, KnownChunks, Progress, blob_map_of, chunk_files, regular_files
from .incremental import ParentLayer, encode_buildinfo
from .tree import Node, Tree
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
    parent: str | None = None,
) -> BuildResult:
    """Build and publish the layer of directory ``source``; with ``name`` ("name:tag"), point that ref at it.

    ``parent`` (a ref or digest) makes the build incremental: unchanged files are not read."""
    _check_options(name, chunk_size)
    with _cycle_collector_paused():
        base = ParentLayer.load(store, parent, chunk_size=chunk_size) if parent is not None else None
        scanned_at_ns = time.time_ns()
        tree = walk_directory(os.fspath(source))
        return build_tree(
            tree, store, name=name, chunk_size=chunk_size, progress=progress, workers=workers,
            source=os.path.abspath(os.fsdecode(source)), parent=base, scanned_at_ns=scanned_at_ns,
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
    parent: ParentLayer | None = None,
    scanned_at_ns: int | None = None,
) -> BuildResult:
    """Build and publish the layer of ``tree`` (from any walker); ``source`` is recorded in the manifest.

    For a walk_directory tree only: ``scanned_at_ns`` (wall clock when the walk started) gives the layer
    its build info, so that it can be a parent later; ``parent`` lends its chunk lists to unchanged files.
    """
    _check_options(name, chunk_size)
    with _cycle_collector_paused():
        return _build(tree, store, name, chunk_size, progress, workers, source, parent, scanned_at_ns)


def _build(tree: Tree, store: Store, name: str | None, chunk_size: int, progress: Progress | None,
           workers: int | None, source: str, parent: ParentLayer | None, scanned_at_ns: int | None) -> BuildResult:
    known = parent.reusable_chunks(tree).get if parent is not None else None
    # The lease is taken before the index is read: see dsec_fs/gc.py for why that keeps our packs alive.
    with Lease(store, purpose=f"build {name or source}") as lease:
        files, stats, packs = _upload_chunks(tree, store, chunk_size, workers, progress, known)
        blob_map = blob_map_of(files, chunk_size)
        stats.distinct_chunks = len(blob_map)
        blob_map_bytes = blob_map.encode()
        blob_id = to_hex(sha256(blob_map_bytes))  # blob_map.blob_id, without encoding the map again
        meta = write_image(tree, blob_map, chunk_size, blob_id=blob_id)
        manifest = Manifest(
            layer=to_hex(sha256(meta)),
            blob_id=blob_id,
            meta_size=len(meta),
            blobmap_size=len(blob_map_bytes),
            blobmap_sha256=blob_id,
            chunk_size=chunk_size,
            block_size=BLOCK_SIZE,
            blob_blocks=blob_map.blocks,
            packs=packs,
            stats=dataclasses.asdict(stats),
            source=source,
        )
        lease.check()
        if scanned_at_ns is not None:
            store.put(keys.layer_buildinfo(manifest.layer), encode_buildinfo(tree, manifest.layer, scanned_at_ns))
        digest = publish_layer(store, meta, blob_map_bytes, manifest)
        ensure_pack_indexes(store, manifest.packs)
        if name is not None:  # under the lease too: gc keeps an unnamed layer while a build may name it
            set_ref(store, name, digest)
    return BuildResult(digest=digest, manifest=manifest, stats=stats)


def _upload_chunks(tree: Tree, store: Store, chunk_size: int, workers: int | None, progress: Progress | None,
                   known: KnownChunks | None) -> tuple[list[Node], ChunkStats, list[str]]:
    """Steps 2 to 4: the tree's regular files (chunked), the statistics, and the sorted ids of the packs
    that hold the layer's chunks, confirmed. The chunk index holds an object per chunk: it is dropped
    when this returns, before the blob map and meta.erofs are made."""
    files = regular_files(tree)
    with load_chunk_index(store) as index:
        with ChunkUploader(store, index) as uploader:
            stats = chunk_files(files, uploader, index, chunk_size=chunk_size, workers=workers,
                                progress=progress, known=known)
            uploader.flush()
        packs = _packs_of(files, index)
        index.confirm(store, _digests(files), packs)
    return files, stats, packs


def _digests(files: list[Node]) -> Iterator[bytes]:
    """Every non-hole chunk of the files (repeats included)."""
    return (digest for node in files for digest in node.chunks if digest is not None)


@contextlib.contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector while a build runs.

    A build holds a few hundred bytes of objects per inode until it ends (the tree, the blob map, the
    chunk index), none of them in reference cycles, yet each time enough objects are new the collector
    scans all of them again: a fifth of the CPU time of a build of 100,000 small files. A build itself
    leaves only a few dozen objects in cycles, which the collector frees once it runs again. The
    collector is process-wide, so it is paused for the whole process while a build runs; it is turned
    back on only if it was on, so that nested and concurrent builds leave it as they found it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_options(name: str | None, chunk_size: int) -> None:
    if name is not None:
        parse_ref(name)
    check_chunk_size(chunk_size)


def _packs_of(files: list[Node], index: ChunkIndex) -> list[str]:
    """Sorted ids of the packs holding the files' chunks (all in the index once the uploader flushed)."""
    packs = set()
    for digest in _digests(files):
        location = index.get(digest)
        if location is None:
            raise NotFoundError("chunk is in neither the store nor this build", where=f"chunk {to_hex(digest)}")
        packs.add(location.pack_id)
    return sorted(packs)
