"""What a published layer is, measured from the layer itself (``dsecfs inspect``): its files, its chunks,
what they take in the store, and how much of that it shares with the store's other layers.

The manifest's ``stats`` are the figures of the build that made the layer (how much was new then, how
much was deduplicated against the store as it was); they say nothing about the layer once the store
has changed, and a rebuild that found every chunk already stored says ``stored_bytes 0``. These figures
come from the layer's image, its blob map and the indexes of its packs instead:

    files, bytes        regular files (hard links counted once) and their size, holes included
    entries, inodes     names in the image (the root included), and the inodes they name
    chunks, chunk_bytes the distinct chunks of the virtual blob and their plain size
    stored_bytes        their compressed size in the store's packs (missing_chunks: in none of its packs)
    shared_chunks, shared_stored_bytes   those chunks some other published layer also uses
    own_stored_bytes    stored_bytes - shared_stored_bytes: what removing only this layer would free

Every object is verified before use (the layer by open_layer; another layer's blob map against its
manifest). Reads the other layers' manifests and blob maps, and the layer's pack indexes, in parallel.
A plain blocking function, safe from any thread.
"""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.chunks import INDEX_LOAD_THREADS, read_index_object
from dsec_fs.errors import NotFoundError
from dsec_fs.layer import LayerFiles, layers_with_prefix, manifest_at, open_layer, read_blobmap_alone
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .reader import ErofsImage


@dataclass(frozen=True)
class LayerFigures:
    layer: str
    entries: int
    inodes: int
    files: int
    bytes: int
    chunks: int
    chunk_bytes: int
    stored_bytes: int
    missing_chunks: int
    shared_chunks: int
    shared_stored_bytes: int
    own_stored_bytes: int
    other_layers: int  # published layers compared with

    def to_dict(self) -> dict:
        return asdict(self)


def layer_figures(store: Store, ref_or_digest: str) -> tuple[LayerFiles, LayerFigures]:
    files = open_layer(store, ref_or_digest)
    image = ErofsImage(files.meta, source=f"layer {files.digest[:12]} meta.erofs")
    entries, sizes = 0, {}
    for _path, nid in image.walk():
        entries += 1
        st = image.stat(nid)
        if stat.S_ISREG(st.mode):
            sizes[nid] = st.size
    chunks = {digest: length for _blkaddr, digest, length in
              EncodedBlobMap(files.blobmap, source=keys.layer_blobmap(files.digest)).entries}

    others = [d for d in layers_with_prefix(store) if d != files.digest]
    with ThreadPoolExecutor(max_workers=INDEX_LOAD_THREADS, thread_name_prefix="inspect") as pool:
        indexes = list(pool.map(lambda pack_id: _index(store, pack_id), files.manifest.packs))
        shared = set()
        for digests in pool.map(lambda d: _chunks_of(store, d), others):
            shared |= digests & chunks.keys()
    stored_length = {}
    for entries_of_pack in indexes:
        for entry in entries_of_pack:
            if entry.digest in chunks:
                stored_length.setdefault(entry.digest, entry.clen)
    stored = sum(stored_length.values())
    shared_stored = sum(stored_length.get(d, 0) for d in shared)
    return files, LayerFigures(
        layer=files.digest, entries=entries, inodes=image.superblock.inos, files=len(sizes), bytes=sum(sizes.values()), chunks=len(chunks),
        chunk_bytes=sum(chunks.values()), stored_bytes=stored, missing_chunks=len(chunks) - len(stored_length),
        shared_chunks=len(shared), shared_stored_bytes=shared_stored, own_stored_bytes=stored - shared_stored,
        other_layers=len(others))


def _index(store: Store, pack_id: str) -> list:
    key = keys.index(pack_id)
    try:
        return read_index_object(store, key)
    except NotFoundError:
        return []  # soft-deleted by gc: its chunks count as missing


def _chunks_of(store: Store, digest: str) -> set[bytes]:
    """The chunk digests of another published layer, its blob map checked against its manifest (a layer
    removed since the listing has none)."""
    manifest_key = keys.layer_manifest(digest)
    try:
        manifest = manifest_at(store, manifest_key)
        data = read_blobmap_alone(store, manifest)  # stored compressed or not, verified against the manifest
    except NotFoundError:
        return set()
    return {chunk for _blkaddr, chunk, _length in EncodedBlobMap(data, source=keys.layer_blobmap(digest)).entries}
