"""Build a layer: from a directory, a tar stream or an OCI image to a layer published on a store.

Steps, each finished before the next starts:
1. walk the source into a Tree (metadata only; gives the total size for progress). A directory is
   walked first and its files read afterwards; a tar or an OCI image is a stream, so its files are
   chunked (step 3) as the walk passes them, inside the lease;
2. take a build lease (dsec_fs.leases: gc keeps every pack this build may see until it ends) and sync the
   store's local index mirror (dsec_fs.index_mirror), so chunks the store already holds are neither
   compressed nor uploaded;
3. chunk every regular file and upload the new chunks in packs (chunker.py), then flush the uploader:
   every pack and pack index is in the store before anything names it;
4. confirm against the store's own index objects that the layer's packs hold all its chunks (the mirror
   is a cache); the chunk index is dropped then;
5. lay out and encode the blob map (blob_layout.py: each file's chunk digests become blob blocks), and
   write meta.erofs (writer.py) against it, into an unnamed temporary file (dsec_fs.spill), from which
   step 6 hashes and compresses it a piece at a time; the file is gone when the build ends, whatever
   its outcome;
6. publish: the build info of a directory build (incremental.py; encoded before meta.erofs is written,
   named for the layer after), meta.erofs, blob map, then
   manifest.json (dsec_fs.layer.publish_layer); restore any pack index a concurrent gc soft-deleted
   meanwhile (dsec_fs.pack_indexes.ensure_pack_indexes); then the ref.

Memory: for a tree of many small files each step needs tens of MB besides the Tree, so they run one
after another (the flush of step 3 could run beside step 5, but their peaks would add up), the C heap's
free memory is handed back to the kernel between them (dsec_fs.heap: the chunking phase leaves it
fragmented, and the next steps' large buffers would come on top of it), and what one step holds per
chunk (the chunk index, the blob map) lives only as long as it is needed: steps 2 to 4 run in
``_chunk_trees``, whose chunk index, uploader and chunker are gone when it returns. The packs a build
uploads enter the store's index mirror when the build is over and its tree freed
(``_own_packs_mirrored``): the LMDB pages those writes touch would otherwise add to the peak.

Incremental builds: with ``parent`` (a layer built earlier from the same directory), a scan of the source
is compared with the parent's build info first (patch.py). If only regular files' contents changed, in
ways that keep the image's layout, steps 1, 3 and 5 shrink to that scan, reading the changed files, and
patching the parent's meta.erofs and blob map (patched_build.py; step 4 confirms the packs of the
new chunks, the parent's packs are only checked to exist, see patch.py); the layer is the one a full build
gives. Otherwise the build takes the steps above, and files whose stat identity has not changed since
the parent take their chunk lists from it without being read (incremental.py).

On any error before step 6 nothing of the layer is published: the packs already uploaded are
unreferenced and gc removes them. A ref name is checked before any work, so a bad name costs nothing.

Threads: build_layer and build_tree run in the calling thread; the chunker and the uploader run their own
worker threads for the duration of the call and stop them before returning (or raising); a rebuild with
a parent runs patched_build.py's threads, which it joins before returning. Python's cycle collector is
paused for the whole process while a build runs (see ``_cycle_collector_paused``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from dsec_fs.chunks import ChunkUploader
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import InputError
from dsec_fs.heap import release_free_memory
from dsec_fs.dedup_index import OwnPacks, add_to_mirror, load_chunk_index
from dsec_fs.layer import parse_ref, publish_layer
from dsec_fs.leases import Lease
from dsec_fs.spill import SpillFile
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from dsec_fs.blobmap import check_chunk_size
from .blob_layout import lay_out_blob
from .chunker import DEFAULT_CHUNK_SIZE, Chunker, ChunkStats, KnownChunks, Progress, regular_files
from .incremental import ParentLayer, encode_buildinfo, name_layer
from .layer_publish import BuildResult, layer_manifest, packs_of, published
from .tree import Node, Tree
from .walk_dir import listing_order, walk_directory
from .images import is_image_ref
from .limits import DEFAULT_LAYER_LIMITS, DEFAULT_LIMITS, LayerBudget, LayerLimits, TarLimits, check_tree
from .writer import spill_image

# Only the build of a tar, an image or with a parent needs these modules: imported where used, so that a
# directory build does not pay for importing them (see docs/benchmarks.md, issue 17, third session).
if TYPE_CHECKING:
    from .registry import RegistryOptions
    from .walk_oci import OciImage
    from .walk_tar import OnFile

log = logging.getLogger(__name__)


def build_layer(
    source: str | bytes | os.PathLike,
    store: Store,
    *,
    name: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    workers: int | None = None,
    parent: str | None = None,
    lenient: bool = False,
    platform: str = "linux/amd64",
    limits: LayerLimits = DEFAULT_LAYER_LIMITS,
    tar_limits: TarLimits = DEFAULT_LIMITS,
    registry: RegistryOptions | None = None,
) -> BuildResult:
    """Build and publish the layer of ``source``; with ``name`` ("name:tag"), point that ref at it.

    ``source`` is a directory, a tar file (plain, gzip or zstd; "-" reads standard input), or an OCI image
    (an image layout directory, an OCI or docker-archive tar, or a docker:// or oci:DIR:TAG reference, see
    images.py; ``registry`` says how to reach registries): ``source_kind`` tells which. An image's
    layers for ``platform`` are flattened, whiteouts applied; ``build_image_layers`` keeps one layer per
    image layer instead. Tar input is read as a stream, each file chunked as it goes past.

    ``parent`` (a ref or digest, directories only) makes the build incremental: unchanged files are not
    read. ``lenient`` skips hostile tar members with a warning instead of failing. ``limits`` bounds the
    layer, ``tar_limits`` the parsing of tar input (limits.py)."""
    _check_options(name, chunk_size)
    kind = source_kind(source)
    with _cycle_collector_paused(), _own_packs_mirrored(store) as own_packs:
        if kind == "dir":
            return _build_directory(source, store, name, chunk_size, progress, workers, parent, limits, own_packs)
        if parent is not None:
            raise InputError("--parent needs a directory source (tar and OCI input have no inode identities)",
                             where=os.fsdecode(source))
        if kind == "tar":
            from .walk_tar import walk_tar

            def walk(on_file: OnFile) -> list[Tree]:
                stream = sys.stdin.buffer if os.fsdecode(source) == "-" else source
                return [walk_tar(stream, on_file=on_file, lenient=lenient, limits=tar_limits,
                                 budget=LayerBudget(limits, chunk_size))]
        else:
            from .images import open_image
            from .walk_oci import walk_layers

            image = open_image(source, platform, registry)

            def walk(on_file: OnFile) -> list[Tree]:
                return [walk_layers(image.layers, on_file=on_file, lenient=lenient, limits=tar_limits,
                                    budget=LayerBudget(limits, chunk_size))]
        return _build_streamed(walk, store, [name], chunk_size, progress, workers, _describe(source),
                               own_packs)[0]


def _build_directory(source: str | bytes | os.PathLike, store: Store, name: str | None, chunk_size: int,
                     progress: Progress | None, workers: int | None, parent: str | None,
                     limits: LayerLimits, own_packs: OwnPacks) -> BuildResult:
    """build_layer for a directory, incremental with ``parent``: patched (patch.py) if the changes allow,
    else in full. Called with the cycle collector paused; what the build holds (the tree, the parent's
    image and build info) is freed when this returns, before the collector is back, so that its first
    run does not have to look at every object of it first."""
    described = os.path.abspath(os.fsdecode(source))
    base = None
    if parent is not None:
        from .patched_build import build_on_parent  # only a rebuild pays for importing the patch path

        patched, base = build_on_parent(source, store, parent, name, chunk_size, progress, workers, described)
        if patched:
            return patched
    scanned_at_ns = time.time_ns()
    tree = walk_directory(os.fspath(source), LayerBudget(limits, chunk_size))
    return _build_tree(tree, store, name, chunk_size, progress, workers, described, base, scanned_at_ns, own_packs)


def build_image_layers(
    source: str | os.PathLike | OciImage,
    store: Store,
    *,
    name: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
    workers: int | None = None,
    lenient: bool = False,
    platform: str = "linux/amd64",
    limits: LayerLimits = DEFAULT_LAYER_LIMITS,
    tar_limits: TarLimits = DEFAULT_LIMITS,
    registry: RegistryOptions | None = None,
) -> list[BuildResult]:
    """One dsecfs layer per layer of the OCI image ``source`` (as build_layer takes it, or opened already),
    bottom first, with OCI whiteouts turned into overlay whiteouts and opaque directories, so OverlayFS
    applies them when the layers are stacked. With ``name`` "NAME:TAG", layer k is published as
    "NAME:TAG-lK"."""
    from .images import open_image
    from .walk_oci import OciImage, walk_layers

    _check_options(name, chunk_size)
    image = source if isinstance(source, OciImage) else open_image(source, platform, registry)
    names = [None if name is None else f"{name}-l{k}" for k in range(len(image.layers))]
    for layer_name in names:
        if layer_name is not None:
            parse_ref(layer_name)

    def walk(on_file: OnFile) -> list[Tree]:
        return walk_layers(image.layers, on_file=on_file, flatten=False, lenient=lenient, limits=tar_limits,
                           budget=LayerBudget(limits, chunk_size))

    described = image.where if isinstance(source, OciImage) else _describe(source)
    with _cycle_collector_paused(), _own_packs_mirrored(store) as own_packs:
        return _build_streamed(walk, store, names, chunk_size, progress, workers, described, own_packs)


def source_kind(source: str | bytes | os.PathLike) -> str:
    """"dir", "tar" or "oci" for a build source; InputError naming it when it is none of them.

    A docker:// or oci: reference is an image (images.py). A directory with an ``oci-layout`` file is an
    OCI image layout. A file is an OCI or docker-archive tar when it is an uncompressed tar whose top
    level holds ``manifest.json`` or ``oci-layout`` (how `docker save` and `skopeo copy` write them); any
    other file, and "-", is a tar of a root filesystem.
    """
    path = os.fsdecode(source)
    if path == "-":
        return "tar"
    if is_image_ref(path):
        return "oci"
    if os.path.isdir(path):
        return "oci" if os.path.isfile(os.path.join(path, "oci-layout")) else "dir"
    if not os.path.exists(path):
        raise InputError("no such file or directory", where=path)
    if not os.path.isfile(path):
        raise InputError("not a directory, tar file or OCI image", where=path)
    from .archive_kind import is_image_archive

    return "oci" if is_image_archive(path) else "tar"


def _describe(source: str | bytes | os.PathLike) -> str:
    path = os.fsdecode(source)
    if is_image_ref(path):
        return path
    return "<stdin>" if path == "-" else os.path.abspath(path)


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
    limits: LayerLimits = DEFAULT_LAYER_LIMITS,
) -> BuildResult:
    """Build and publish the layer of a finished ``tree`` whose files can still be read (a directory walk);
    ``source`` is recorded in the manifest.

    For a walk_directory tree only: ``scanned_at_ns`` (wall clock when the walk started) gives the layer
    its build info, so that it can be a parent later; ``parent`` lends its chunk lists to unchanged files.
    ``limits``: the tree is refused (InputError) before any file is read if it exceeds them.
    """
    check_tree(tree, limits, chunk_size)
    with _cycle_collector_paused(), _own_packs_mirrored(store) as own_packs:
        return _build_tree(tree, store, name, chunk_size, progress, workers, source, parent, scanned_at_ns, own_packs)


def _build_tree(tree: Tree, store: Store, name: str | None, chunk_size: int, progress: Progress | None,
                workers: int | None, source: str, parent: ParentLayer | None, scanned_at_ns: int | None,
                own_packs: OwnPacks) -> BuildResult:
    """build_tree, with the packs it uploads left in ``own_packs``, of a tree within the layer's limits
    (checked by the caller: ``check_tree``, or the budget of the walk that made it)."""
    _check_options(name, chunk_size)
    known = parent.reusable_chunks(tree).get if parent is not None else None
    files = regular_files(tree)

    def feed(on_file: OnFile) -> list[Tree]:
        for node in files:
            on_file(node)
        return [tree]

    return _build_streamed(feed, store, [name], chunk_size, progress, workers, source, own_packs, known=known,
                           total_bytes=sum(node.size for node in files), scanned_at_ns=scanned_at_ns,
                           files=files)[0]


def _build_streamed(walk: Callable[[OnFile], list[Tree]], store: Store, names: list[str | None], chunk_size: int,
                    progress: Progress | None, workers: int | None, source: str, own_packs: OwnPacks, *,
                    known: KnownChunks | None = None, total_bytes: int = 0,
                    scanned_at_ns: int | None = None, files: list[Node] | None = None) -> list[BuildResult]:
    """Steps 2 to 6 for the trees ``walk`` makes, calling its ``on_file`` argument for each regular file
    while the file's content is readable; ``names[k]`` names the layer of tree k. The packs uploaded are
    left in ``own_packs``. ``files``: the regular files of the one tree, when the caller listed them
    already (a directory build: listing 100,000 files again costs 50 ms)."""
    # The lease is taken before the index is read: see dsec_fs/gc.py for why that keeps our packs alive.
    with Lease(store, purpose=f"build {names[0] or source}") as lease:
        stats, layers = _chunk_trees(walk, store, chunk_size, progress, workers, known, total_bytes, own_packs,
                                     files)
        return [_publish(store, lease, tree, files, packs, _layer_stats(stats, files, chunk_size, len(layers)),
                         name, chunk_size, source, scanned_at_ns)
                for (tree, files, packs), name in zip(layers, names)]


def _chunk_trees(walk: Callable[[OnFile], list[Tree]], store: Store, chunk_size: int, progress: Progress | None,
                 workers: int | None, known: KnownChunks | None, total_bytes: int, own_packs: OwnPacks,
                 listed: list[Node] | None) -> tuple[ChunkStats, list[tuple[Tree, list[Node], list[str]]]]:
    """Steps 2 to 4: chunk and upload the trees ``walk`` makes, and confirm their packs; returns the
    statistics and, per tree, (tree, regular files, sorted pack ids). The chunk index, the uploader and the
    chunker hold an object per chunk: they are gone when this returns, before blob maps and images are
    made (a function of its own, so that no name of the caller still holds them)."""
    with load_chunk_index(store, own_packs=own_packs) as index:
        with ChunkUploader(store, index) as uploader:
            with Chunker(uploader, index, chunk_size=chunk_size, workers=workers, progress=progress,
                         known=known, total_bytes=total_bytes) as chunker:
                trees = walk(chunker.add_file)
                stats = chunker.finish()
            uploader.flush()
        layers = []
        for tree in trees:
            files = listed if listed is not None and len(trees) == 1 else regular_files(tree)
            packs = packs_of(_digests(files), index)
            index.confirm(store, _digests(files), packs)
            layers.append((tree, files, packs))
    return stats, layers


def _layer_stats(build: ChunkStats, files: list[Node], chunk_size: int, trees: int) -> ChunkStats:
    """A layer's statistics: the build's, or, when one build made several layers, the layer's own counts
    of files, bytes, chunks and holes with the build's upload figures."""
    if trees == 1:
        return build
    own = dataclasses.replace(build, files=len(files), bytes=sum(node.size for node in files))
    own.chunks = sum(len(node.chunks) for node in files)
    own.hole_chunks = sum(1 for node in files for digest in node.chunks if digest is None)
    return own


def _publish(store: Store, lease: Lease, tree: Tree, files: list[Node], packs: list[str], stats: ChunkStats,
             name: str | None, chunk_size: int, source: str, scanned_at_ns: int | None) -> BuildResult:
    """Steps 5 and 6: blob map, meta.erofs, build info, manifest, ref. Each step's freed memory is handed
    back to the kernel before the next (dsec_fs.heap; see Memory above)."""
    release_free_memory()  # what chunking freed
    blob = lay_out_blob(files, chunk_size)  # the files' chunk lists hold blkaddrs from here on
    release_free_memory()  # the digests and chunk lists
    stats = dataclasses.replace(stats, distinct_chunks=len(blob))
    blob_map_bytes = blob.encoded
    info = None
    if scanned_at_ns is not None:  # before meta.erofs: its buffers are gone before the image is made
        entries = ((path, node.identity) for path, node in listing_order(tree))
        info = encode_buildinfo(entries, blob.shared, None, scanned_at_ns)
        release_free_memory()
    with spill_image(tree, blob, chunk_size, blob_id=to_hex(sha256(blob_map_bytes))) as meta:
        release_free_memory()  # the image's layout
        return _publish_layer(store, lease, meta, blob.blocks, blob_map_bytes, packs, stats, name, chunk_size,
                              source, None if info is None else functools.partial(name_layer, info))


def _publish_layer(store: Store, lease: Lease, meta: bytes | SpillFile, blob_blocks: int, blob_map_bytes: bytes,
                   packs: list[str], stats: ChunkStats, name: str | None, chunk_size: int, source: str,
                   buildinfo: Callable[[str], bytes] | None) -> BuildResult:
    """Step 6 for a finished meta.erofs and blob map: build info (made by ``buildinfo`` for the layer
    digest, directory builds only), manifest, ref."""
    blob_id = to_hex(sha256(blob_map_bytes))
    manifest = layer_manifest(to_hex(meta.sha256() if isinstance(meta, SpillFile) else sha256(meta)), len(meta), blob_id,
                         len(blob_map_bytes), blob_blocks, packs, stats, chunk_size, source)
    lease.check()

    def encoded_buildinfo() -> tuple[str, bytes]:  # while meta.erofs and the blob map are written
        return keys.layer_buildinfo(manifest.layer), buildinfo(manifest.layer)

    digest = publish_layer(store, meta, blob_map_bytes, manifest, also=encoded_buildinfo if buildinfo else None)
    return published(store, manifest, digest, name, stats)


def _digests(files: list[Node]) -> Iterator[bytes]:
    """Every non-hole chunk of the files (repeats included)."""
    return (digest for node in files for digest in node.chunks if digest is not None)


@contextlib.contextmanager
def _own_packs_mirrored(store: Store) -> Iterator[OwnPacks]:
    """Where the packs a build uploads wait (a temporary file), added to the store's index mirror when the
    block ends, whatever its outcome: by then the build's tree is freed (dsec_fs.dedup_index, Memory)."""
    with OwnPacks() as own_packs:
        try:
            yield own_packs
        finally:
            add_to_mirror(store, own_packs)


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
