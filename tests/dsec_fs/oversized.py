"""Store objects a lying writer grew to any size, for the tests of bounded reads (test_oversized_objects.py,
tests/erofs_builder/test_incremental.py, test_layer_figures.py): ``grow`` makes one sparse (a GiB costs
nothing on disk), ``peak_allocated`` measures what Python allocated meanwhile (tracemalloc), so a test
tells a bounded read from one that took the whole object into memory; ``overgrow_blob_map`` gives a
layer a blob map of more entries than its meta.erofs can name, consistently (its manifest says so);
``lie_about_meta_size`` gives one a manifest that lies about meta.erofs's size to vouch for a huge map.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tracemalloc

from dsec_fs import compress
from dsec_fs.blobmap import ENTRY, HEADER
from dsec_fs.digest import sha256, to_hex
from dsec_fs.layer import BLOBMAP, open_layer
from dsec_fs.store import keys

GROWN = 2 << 30
# What a bounded read of any of these objects may allocate at most: far below GROWN.
BOUNDED = 64 << 20


def grow(store, key: str, size: int = GROWN) -> None:
    """Object ``key`` of a FilesystemStore, extended with zeros to ``size`` bytes (sparse)."""
    os.truncate(os.path.join(store.root, *key.split("/")), size)


@contextlib.contextmanager
def peak_allocated():
    """Yields a list that holds, once the block is left, the peak of bytes allocated in it."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def first_pack(store) -> str:
    return keys.id_from_key(next(iter(store.list(keys.INDEX))))


def overgrow_blob_map(store, digest: str) -> int:
    """Republish layer ``digest``'s blob map with one-block chunks appended until it holds one entry more
    than its meta.erofs can name (one per 8-byte chunk index: meta_size / 8), and its manifest's blob map
    fields and blob size to match: a map that reads as sound and that the manifest vouches for. Its size
    in bytes."""
    files = open_layer(store, digest)
    manifest = json.loads(store.get(keys.layer_manifest(digest)))
    count, blocks = struct.unpack_from("<II", files.blobmap, 16)
    extra = manifest["meta_size"] // 8 + 1 - count
    appended = b"".join(ENTRY.pack(blocks + i, 1, sha256(b"extra %d" % i)) for i in range(extra))
    data = (files.blobmap[:16] + struct.pack("<II", count + extra, blocks + extra) + files.blobmap[HEADER.size:]
            + appended)
    republish_blob_map(store, digest, data)
    return len(data)


def republish_blob_map(store, digest: str, data: bytes) -> None:
    """Put ``data`` as layer ``digest``'s blob map, its manifest's blob map fields and blob size set to match."""
    manifest = json.loads(store.get(keys.layer_manifest(digest)))
    frame = compress.compress(data)
    store.put(keys.layer_blobmap(digest), frame)
    manifest.update(blobmap_size=len(data), blobmap_sha256=to_hex(sha256(data)), blob_id=to_hex(sha256(data)),
                    blob_blocks=struct.unpack_from("<I", data, 20)[0])
    manifest["stored"][BLOBMAP] = {"encoding": "zstd", "size": len(frame), "sha256": to_hex(sha256(frame))}
    store.put(keys.layer_manifest(digest), json.dumps(manifest, sort_keys=True).encode())


LYING_MAP_BYTES = 256 << 20


def lie_about_meta_size(store, digest: str) -> None:
    """Give layer ``digest`` a manifest that says its meta.erofs is 4 GiB and its blob is 2^32 - 1 blocks,
    which lets its blob map be LYING_MAP_BYTES (zeros: a 32 KiB zstd frame, put as the map)."""
    manifest = json.loads(store.get(keys.layer_manifest(digest)))
    frame = compress.compress(bytes(LYING_MAP_BYTES))
    store.put(keys.layer_blobmap(digest), frame)
    manifest.update(meta_size=4 << 30, blob_blocks=0xFFFFFFFF, blobmap_size=LYING_MAP_BYTES)
    manifest["stored"][BLOBMAP] = {"encoding": "zstd", "size": len(frame), "sha256": to_hex(sha256(frame))}
    store.put(keys.layer_manifest(digest), json.dumps(manifest).encode())
