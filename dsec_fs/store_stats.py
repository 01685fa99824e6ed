"""What a store holds and how well it deduplicates: ``store_stats(store) -> dict``.

    logical_bytes   what the layers describe: the sum over published layers of their files' bytes
    unique_bytes    the distinct chunks behind them, uncompressed (each counted once however many packs
                    hold it)
    stored_bytes    the pack objects, as the store keeps them (compressed, with indexes and trailers)
    dedup_ratio     logical_bytes / unique_bytes: what content addressing saves
    storage_ratio   logical_bytes / stored_bytes: what dedup and compression save together

A layer's file bytes count holes too (they are never stored), so sparse files raise both ratios. Packs
count those in ``trash/`` (soft-deleted, still stored) as well; their chunks are not in ``unique_bytes``,
because no index lists them any more.

Reads every manifest and index object of the store (in parallel), and asks the store for the size of
packs whose index is missing. A plain blocking function, safe from any thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .chunks import INDEX_LOAD_THREADS, read_index_object
from .digest import is_hex_digest
from .errors import CorruptError, NotFoundError, UnsupportedError
from .gc import pack_size
from .layer import Manifest, list_refs, manifest_at
from .pack import PackEntry
from .store import keys
from .store.base import Store


def store_stats(store: Store) -> dict:
    manifests = _read_all(store, [k for k in store.list(keys.LAYERS) if k.endswith("/manifest.json")], _manifest)
    packs = _ids(store, keys.PACKS, keys.pack)
    indexes = _read_all(store, [keys.index(p) for p in _ids(store, keys.INDEX, keys.index)], _index)

    unique: dict[bytes, int] = {}
    stored = 0
    indexed = set()
    for key, entries in indexes.items():
        pack_id = keys.id_from_key(key)
        if entries is None or pack_id not in packs:
            continue
        indexed.add(pack_id)
        for entry in entries:
            unique[entry.digest] = entry.ulen
        stored += pack_size(entries)
    unindexed = sorted(packs - indexed)
    with ThreadPoolExecutor(max_workers=INDEX_LOAD_THREADS, thread_name_prefix="stats") as pool:
        stored += sum(pool.map(lambda p: _size(store, keys.pack(p)), unindexed))

    logical = sum(int(m.stats.get("bytes", 0)) for m in manifests.values() if m is not None)
    unique_bytes = sum(unique.values())
    return {
        "store": store.url,
        "layers": sum(m is not None for m in manifests.values()),
        "unreadable_manifests": sum(m is None for m in manifests.values()),
        "refs": len(list_refs(store)),
        "chunks": len(unique),
        "packs": len(packs),
        "trashed_packs": len(_ids(store, keys.TRASH, keys.trash) & packs),
        "unreadable_indexes": sum(e is None for e in indexes.values()),
        "leases": sum(1 for _ in store.list(keys.LEASES)),
        "logical_bytes": logical,
        "unique_bytes": unique_bytes,
        "stored_bytes": stored,
        "dedup_ratio": round(logical / unique_bytes, 3) if unique_bytes else None,
        "storage_ratio": round(logical / stored, 3) if stored else None,
    }


def _ids(store: Store, prefix: str, key_of) -> set[str]:
    ids = set()
    for key in store.list(prefix):
        pack_id = keys.id_from_key(key)
        if is_hex_digest(pack_id) and key == key_of(pack_id):
            ids.add(pack_id)
    return ids


def _read_all(store: Store, object_keys: list[str], parse) -> dict:
    """key -> parse(store, key) for every key, read in parallel; objects gone since the listing are left out."""
    with ThreadPoolExecutor(max_workers=INDEX_LOAD_THREADS, thread_name_prefix="stats") as pool:
        results = list(pool.map(lambda key: parse(store, key), object_keys))
    return {key: value for key, value in zip(object_keys, results) if value is not _GONE}


_GONE = object()


def _manifest(store: Store, key: str) -> Manifest | None | object:
    try:
        return manifest_at(store, key)
    except NotFoundError:
        return _GONE
    except (CorruptError, UnsupportedError):
        return None


def _index(store: Store, key: str) -> list[PackEntry] | None | object:
    try:
        return read_index_object(store, key)
    except NotFoundError:
        return _GONE
    except CorruptError:
        return None


def _size(store: Store, key: str) -> int:
    try:
        return store.size(key)
    except NotFoundError:
        return 0
