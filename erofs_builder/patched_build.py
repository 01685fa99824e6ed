"""A ``--parent`` rebuild's patch path (patch.py says when it applies and what it changes): the parent
loaded while the source is scanned against its build info, each changed file read, hashed and compressed
as the scan finds it, then the parent's meta.erofs and blob map patched for them and published. None
when the change needs a full build (build.py's full path then runs, with the parent loaded here).

Threads: ``build_on_parent`` runs in the calling thread. The lease and the chunk index are taken in a
thread of their own while the parent is loaded and the source scanned (``_lease_and_index``); the scan's
lstat calls run in patch.SourceScan's; the chunker's workers hash and compress each changed file while
the calling thread goes on with the scan; meta.erofs, the blob map and the build info are compressed and
stored in a writer thread while the new pack is flushed, that thread then adding the new packs to the
index mirror while the manifest is written. Every one is joined before the call returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from dsec_fs.chunks import ChunkIndex, ChunkUploader, missing_packs
from dsec_fs.dedup_index import load_chunk_index
from dsec_fs.layer import publish_stored, store_metadata
from dsec_fs.leases import Lease
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .chunker import Chunker, ChunkStats, Progress
from .incremental import BuildInfo, ParentLayer, encode_rescanned, name_layer
from .layer_publish import BuildResult, layer_manifest, packs_of, published
from .patch import Patched, Rescan, SourceScan, scan_changes
from .tree import Node

log = logging.getLogger(__name__)


def build_on_parent(source: str | bytes | os.PathLike, store: Store, parent: str, name: str | None, chunk_size: int,
                    progress: Progress | None, workers: int | None,
                    described: str) -> tuple[BuildResult | None, ParentLayer]:
    """Load ``parent`` and build on the patch path if the changes allow: (the result, or None when nothing
    was published and a full build must follow; the parent, for that build's unchanged files)."""
    # The lease and chunk index are made beside loading the parent and the scan (a store write, a
    # listing, an LMDB commit: waits, mostly); unused if the build takes the full path.
    scans: list[SourceScan] = []

    def start_scan(info: BuildInfo) -> None:  # the lstat calls begin while the parent's image is read
        scans.append(SourceScan(source, info))
        scans[0].start()

    with _lease_and_index(store, f"build {name or described}") as leased, contextlib.ExitStack() as open_scans:
        open_scans.callback(lambda: [scan.close() for scan in scans])
        base = ParentLayer.load(store, parent, chunk_size=chunk_size, on_buildinfo=start_scan)
        patched = build_patched(base, scans[0] if scans else None, leased, store, name, chunk_size, progress,
                                workers, described)
    return patched, base


@contextlib.contextmanager
def _lease_and_index(store: Store, purpose: str) -> Iterator[Future[tuple[Lease, ChunkIndex]]]:
    """build.py's step 2 in a thread of its own: a lease, then the chunk index (synced after it, see dsec_fs/gc.py),
    while the block runs; the block gets their Future. Both are closed when it ends (the index first,
    if the block did not close it: ``_mirror_own_packs``), whatever its outcome. The packs uploaded
    through this index enter the store's index mirror when it closes, through the mirror it holds open
    (not deferred to ``add_to_mirror``, which opens the mirror again: a patched rebuild's tree is the
    parent's few objects, not the tree whose memory the deferral is for)."""

    def take() -> tuple[Lease, ChunkIndex]:
        lease = Lease(store, purpose=purpose).acquire()
        try:
            return lease, load_chunk_index(store)
        except BaseException:
            lease.release()
            raise

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="build-lease") as pool:
        taken = pool.submit(take)
        try:
            yield taken
        finally:
            if taken.exception() is None:  # waits; an error of its own was raised to whoever took it
                lease, index = taken.result()
                try:
                    index.close()
                finally:
                    lease.release()


def build_patched(parent: ParentLayer, scan: SourceScan | None, leased: Future[tuple[Lease, ChunkIndex]],
                   store: Store, name: str | None, chunk_size: int, progress: Progress | None,
                   workers: int | None, source: str) -> BuildResult | None:
    """Steps 1 to 6 on the patch path (patch.py): ``scan`` of the source against ``parent`` (None: the
    parent has no usable build info), reading and uploading each changed file as the scan finds it, then
    publish the parent's meta.erofs and blob map patched for them; None (nothing published) when the change needs the full path. ``leased``: the
    build's lease and chunk index (taken while the parent is loaded, ``_lease_and_index``). The layer's
    objects are written beside the new pack's, the manifest after both (the publish order of
    dsec_fs.layer: nothing names an object before it is durable)."""
    if scan is None or parent.info is None:  # no usable build info, or another chunk size (ParentLayer.load)
        log.info("rebuilding in full: the parent has no usable build info")
        return None
    missing = missing_packs(store, parent.manifest.packs)
    if missing:
        log.warning("the store lacks pack %s of the parent layer: rebuilding in full", missing[0])
        return None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-meta") as writer:
        with _OnDemandChunker(store, leased, chunk_size, workers, progress) as chunking:
            rescan = scan_changes(scan, parent, on_file=chunking.add_file)
            if rescan is None:
                return None
            uploader, read = chunking.finish()
            uploader.send()  # the new pack is written while the image is patched and the build info encoded
            patched = rescan.patch(chunk_size)
            if patched is None:
                return None
            # meta.erofs, the blob map and the build info, compressed and stored while the new pack is
            # flushed: nothing names them until the manifest, written once both are durable. The build
            # info is encoded here while the other two are compressed (zstd: no GIL) in the writer.
            encoded: Future[bytearray] = Future()
            stored = writer.submit(store_metadata, store, patched.meta, patched.blob_map_bytes,
                                   also=functools.partial(_named_buildinfo, encoded))
            try:
                encoded.set_result(encode_rescanned(parent.info, rescan.records, None, rescan.scanned_at_ns))
            except BaseException as exc:  # the writer waits for it: it must not wait forever
                encoded.set_exception(exc)
                raise
            uploader.flush()
        lease, index = leased.result()
        # Every other chunk of the layer is the parent's, in the parent's packs (see patch.py).
        new_packs = packs_of(patched.new_chunks, index)
        index.confirm(store, patched.new_chunks, new_packs)
        packs = sorted(set(parent.manifest.packs).union(new_packs))
        stats = _patched_stats(parent, rescan, read, patched)
        metadata = stored.result()
        # The patch keeps the blob map's layout: the parent's blocks and number of chunks.
        manifest = layer_manifest(metadata.layer, metadata.meta_size, metadata.blob_id, metadata.blobmap_size,
                             parent.blob_map.blocks, packs, stats, chunk_size, source)
        # The new packs enter the index mirror (an LMDB commit) while the manifest is written.
        mirrored = writer.submit(_mirror_own_packs, index)
        lease.check()
        result = published(store, manifest, publish_stored(store, manifest, metadata), name, stats)
        mirrored.result()
    log.info("patched parent layer %s: %d files read, %d new chunks", parent.digest, len(rescan.changes),
             stats.new_chunks)
    return result


def _mirror_own_packs(index: ChunkIndex) -> None:
    """Close ``index`` (a MirroredChunkIndex), adding the packs uploaded through it to the store's index
    mirror; a failure is logged, not raised, as ``add_to_mirror`` does (the mirror is a cache: the next
    sync finds the packs)."""
    try:
        index.close()
    except Exception as exc:
        log.warning("could not add the packs of this build to the index mirror: %s", exc)


class _OnDemandChunker:
    """The patch path's Chunker and ChunkUploader, made when the scan hands over the first changed file
    (or at ``finish``), so that the scan need not wait for the chunk index the lease thread syncs (see
    ``_lease_and_index``) unless there is something to read. A context manager: both are closed when it
    ends. Calling thread only."""

    def __init__(self, store: Store, leased: Future[tuple[Lease, ChunkIndex]], chunk_size: int,
                 workers: int | None, progress: Progress | None):
        self._store, self._leased = store, leased
        self._options = dict(chunk_size=chunk_size, workers=workers, progress=progress)
        self._stack = contextlib.ExitStack()
        self._uploader: ChunkUploader | None = None
        self._chunker: Chunker | None = None

    def __enter__(self) -> "_OnDemandChunker":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def add_file(self, node: Node) -> None:
        """Read ``node`` now and hand its pieces to the chunker's workers (Chunker.add_file)."""
        chunker = self._started()
        chunker.add_file(node)
        chunker.send()  # its last piece too, not held back for a batch: the scan goes on meanwhile

    def finish(self) -> tuple[ChunkUploader, ChunkStats]:
        """Wait for the files' chunks (Chunker.finish); the uploader, to flush, and what was read."""
        stats = self._started().finish()
        return self._uploader, stats

    def _started(self) -> Chunker:
        if self._chunker is None:
            _lease, index = self._leased.result()
            self._uploader = self._stack.enter_context(ChunkUploader(self._store, index))
            self._chunker = self._stack.enter_context(Chunker(self._uploader, index, **self._options))
        return self._chunker


def _named_buildinfo(info: Future[bytearray], layer: str) -> tuple[str, bytes]:
    """(key, data) of the build info ``info`` will hold (encoded with no layer) of ``layer``."""
    return keys.layer_buildinfo(layer), name_layer(info.result(), layer)


def _patched_stats(parent: ParentLayer, rescan: Rescan, read: ChunkStats, patched: Patched) -> ChunkStats:
    """A patched layer's statistics: the parent's counts, moved by what changed, and this build's uploads.
    Every non-hole chunk slot is either new or deduplicated, in the parent too."""
    was = parent.manifest.stats
    grew = sum(change.node.size - change.old.size for change in rescan.changes)
    # A replaced chunk and its replacement are each named once (patch.py).
    data_bytes = int(was.get("dedup_bytes", 0) + was.get("new_bytes", 0)) + patched.data_grew
    stats = dataclasses.replace(
        read,
        files=int(was.get("files", 0)),
        bytes=int(was.get("bytes", 0)) + grew,
        chunks=int(was.get("chunks", 0)),
        hole_chunks=int(was.get("hole_chunks", 0)),
        distinct_chunks=len(parent.blob_map),
        dedup_bytes=data_bytes - read.new_bytes,
    )
    stats.reused_files = stats.files - read.files
    stats.reused_bytes = stats.bytes - read.bytes
    return stats
