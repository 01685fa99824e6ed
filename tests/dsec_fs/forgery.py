"""A writer of a shared store that lies (issue 14), for tests/dsec_fs/test_build_forged_index.py and
tests/lazy_fetch/test_daemon_forged_index.py: a pack and an index object of its own claiming other layers'
chunks (junk frames under their digests), named by the forger's layer manifest. The tests run on a
local store and on S3 (``store_url`` in tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import random

from dsec_fs import compress
from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.layer import open_layer
from dsec_fs.pack import PackWriter
from dsec_fs.store import keys

CHUNK = 64 << 10
def random_files(seed: int, count: int = 12) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"dir/file{i:02d}": rng.randbytes(rng.randrange(1, 3 * CHUNK)) for i in range(count)}


def forge(store, claimed: list[tuple[bytes, int]], forger_layer: str) -> str:
    """Put a pack of junk frames under the digests ``claimed`` ((digest, size) pairs), with its index
    object, and name it in ``forger_layer``'s manifest. Returns the pack id."""
    rng = random.Random(99)
    writer = PackWriter()
    for digest, size in claimed:
        writer.add(digest, compress.compress(rng.randbytes(size)), size)
    pack_id, pack_bytes, index_bytes = writer.finish()
    store.put(keys.pack(pack_id), pack_bytes)
    store.put(keys.index(pack_id), index_bytes)
    key = keys.layer_manifest(forger_layer)
    manifest = json.loads(store.get(key))
    manifest["packs"] = sorted(manifest["packs"] + [pack_id])
    store.put(key, json.dumps(manifest).encode())
    return pack_id


def chunks_of_layer(store, layer: str) -> list[tuple[bytes, int]]:
    files = open_layer(store, layer)
    blob_map = EncodedBlobMap(files.blobmap, source="test")
    return [(digest, length) for _blkaddr, digest, length in blob_map.entries]


def chunks_of_files(files: dict[str, bytes]) -> list[tuple[bytes, int]]:
    """The chunks a build of ``files`` makes: CHUNK-sized pieces, by sha256."""
    return [(hashlib.sha256(data[i:i + CHUNK]).digest(), len(data[i:i + CHUNK]))
            for data in files.values() for i in range(0, len(data), CHUNK)]




def forge_huge_claim(store, digest: bytes, claimed: int, pack_id: str | None = None) -> str:
    """Put a pack and its index object claiming that chunk ``digest`` is ``claimed`` bytes, with a frame
    (of zeros) that declares that size too, so only the claim itself can be caught before zstd allocates
    it: under ``pack_id`` if given (overwriting a layer's own pack and its index), else under the new
    pack's own id, named in no manifest. Returns the pack id."""
    import zstandard

    stream = zstandard.ZstdCompressor().compressobj(size=claimed)
    zeros = bytes(1 << 20)
    frame = b"".join(stream.compress(zeros) for _ in range(claimed >> 20)) + stream.flush()
    writer = PackWriter()
    writer.add(digest, frame, claimed)
    new_id, pack_bytes, index_bytes = writer.finish()
    pack_id = new_id if pack_id is None else pack_id
    store.put(keys.pack(pack_id), pack_bytes)
    store.put(keys.index(pack_id), index_bytes)
    return pack_id
