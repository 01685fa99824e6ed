"""A pack's index object put back from the copy embedded in the pack: how a build and gc settle a pack
gc soft-deleted (its index object gone) that a layer still names (gc.py, "Why a build running meanwhile
loses nothing", 2.). Apart from gc.py so that a build imports only this half of the collector.

Threads: both functions may be called from any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .chunks import MAX_PACK_BYTES
from .digest import sha256, to_hex
from .errors import IntegrityError
from .pack import PackEntry, encode_index, index_from_pack
from .store import keys
from .store.base import Store, get_small, side_by_side

log = logging.getLogger(__name__)

CHECK_THREADS = 8  # stat calls of index objects side by side (a remote store's round trips overlap)


def restore_pack_index(store: Store, pack_id: str) -> list[PackEntry]:
    """Put the index object of pack ``pack_id`` again, from the copy embedded in the pack; return its
    entries. The pack is checked against its id first: a damaged pack is never indexed again."""
    key = keys.pack(pack_id)
    data = get_small(store, key, MAX_PACK_BYTES, "pack")
    if to_hex(sha256(data)) != pack_id:
        raise IntegrityError("pack bytes do not hash to the pack id; not restoring its index", where=key)
    entries = index_from_pack(data, source=key)
    store.put(keys.index(pack_id), encode_index(entries))
    log.info("restored index of pack %s", pack_id)
    return entries


def ensure_pack_indexes(store: Store, pack_ids: Iterable[str]) -> list[str]:
    """Restore the index of every listed pack whose index object is missing; return their ids.

    A build calls this after publishing its manifest: a gc that soft-deleted one of the layer's packs
    while the build ran either saw the manifest (and restores the index itself) or is seen here.
    """
    def check(pack_id: str) -> str | None:
        if store.exists(keys.index(pack_id)):
            return None
        restore_pack_index(store, pack_id)
        return pack_id

    restored = side_by_side(store, check, pack_ids, threads=CHECK_THREADS, name="index-check")
    return [pack_id for pack_id in restored if pack_id is not None]
