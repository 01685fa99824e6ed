"""A local LMDB mirror of a store's pack indexes: a build learns which chunks the store holds without
reading every index object of the store each time. The only module of dsec_fs that imports lmdb.

Where: one LMDB environment per store, in ``<root>/<sha256 hex of store_identity()>/``; the root is
$DSECFS_INDEX_DIR, else /var/cache/dsecfs/index for root, else $XDG_CACHE_HOME (~/.cache)/dsecfs/index.

Databases of the environment:

    packs    pack id (32 raw bytes) -> PACK_HEADER + count x pack.INDEX_ENTRY: the pack's index entries
    chunks   chunk digest (32 raw bytes) -> LOCATION, once per mirrored pack holding the chunk
             (dupsort, fixed-size values: a chunk two builds uploaded at once lives in two packs)
    trust    pack id (32 raw bytes) -> TRUSTED (every chunk its index claims was read and hashed, or this
             host uploaded it) or FORGED (a claimed chunk did not verify); no record: not checked yet
    meta     b"version" -> VERSION; b"store" -> store_identity() (UTF-8); b"synced" -> SYNCED

Sync (``IndexMirror.sync``, at the start of every build): list ``index/``, fetch in parallel the index
objects of packs not yet mirrored, then in one write transaction drop each mirrored pack whose index
object was not listed (gc soft-deleted it) and add the fetched ones.

Why the answers are safe to build on (see gc.py for the other side):
- A build's lease is written before it syncs, so every pack it sees must have been indexed after its lease
  began. Hence the freshness rule: ``synced`` is the time the newest committed sync began listing, and a
  sync that began before it commits nothing (a newer listing already shaped the mirror), so a slow sync
  never brings back a pack a newer one dropped. A pack a build uploads itself is added at once: it is
  surely indexed now; and a sync drops only packs added before its listing began.
- The mirror only ever says "this chunk exists, in that pack"; the layer records pack ids, and before
  publishing, ``MirroredChunkIndex.confirm`` (dedup_index.py, the chunk index a build uses) checks against the index objects themselves that the layer's
  packs hold every chunk of its blob map. A mirror that answered wrongly (damaged on disk, a bug) is then
  reset and the build fails before publishing anything.
- An index object says what its writer claims, and in a shared store a writer may lie: the mirror keeps
  every location of a chunk, and ``trust`` the verdicts of this host's checks; dedup_index.py answers a
  build only from trusted packs.
- A mirror whose files are not a sound LMDB environment, whose version is unknown or whose records do
  not decode is emptied and rebuilt from the store.

Threads and processes: LMDB may be opened only once per process, so every IndexMirror of one directory
shares one environment (``_Shared``, counted; ``_registry_lock`` guards the registry). Any thread may
call any method at the same time: each method is one LMDB transaction, writers are serialised by LMDB's
lock (across processes too: builds on one host share the mirror), readers never block.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import lmdb

from .chunks import INDEX_LOAD_THREADS, ChunkLocation, read_index_object
from .digest import DIGEST_SIZE, is_hex_digest, to_hex
from .errors import CorruptError, NotFoundError, UnavailableError
from .pack import INDEX_ENTRY, PackEntry
from .paths import default_dir
from .store import keys
from .store.base import Store

log = logging.getLogger(__name__)

INDEX_DIR_ENV = "DSECFS_INDEX_DIR"
MIRROR_VERSION = 1
# The map is a sparse file that grows as needed; its size only caps growth. About 150 bytes per chunk,
# so 16 GiB holds some hundred million chunks.
DEFAULT_MAP_SIZE = 1 << 34

PACK_HEADER = struct.Struct(
    "<"
    "Q"  # added: time.time_ns() when the pack was seen indexed (for a sync: when its listing began); a sync
    #      drops only packs added before it began, so it never drops one indexed after its listing
    "I"  # count: the pack.INDEX_ENTRY records that follow
)

LOCATION = struct.Struct(
    "<"
    f"{DIGEST_SIZE}s"  # pack id, raw
    "Q"  # offset of the chunk's frame in the pack
    "I"  # clen: bytes of the frame
    "I"  # ulen: bytes of the chunk
)

TRUSTED, FORGED = b"t", b"f"  # values of the trust database
VERSION = struct.Struct("<I")  # MIRROR_VERSION; any other value: the mirror is rebuilt
SYNCED = struct.Struct("<Q")  # time.time_ns() when the newest committed sync began listing index/

# lmdb errors that mean the files are not a sound LMDB environment (as opposed to full or busy).
_BROKEN = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
           lmdb.PanicError)


def default_index_root() -> str:
    return default_dir(INDEX_DIR_ENV, "/var/cache/dsecfs/index", "XDG_CACHE_HOME", "~/.cache", "index")


def mirror_path(store_id: str, root: str | None = None) -> str:
    return os.path.join(root or default_index_root(), hashlib.sha256(store_id.encode()).hexdigest())


def store_identity(store: Store) -> str:
    """What names a store's mirror: its URL, plus the endpoint of an S3 store (the same s3:// URL on two
    endpoints is two stores)."""
    backend = store
    while hasattr(backend, "inner"):
        backend = backend.inner  # a wrapper (retry, limits, ...) around the backend
    endpoint = getattr(backend, "endpoint_url", None)
    return f"{store.url} at {endpoint}" if endpoint else store.url


@dataclass
class SyncStats:
    listed: int = 0  # index objects in the store
    fetched: int = 0  # of them, read and added now
    dropped: int = 0  # mirrored packs whose index object is gone
    unreadable: int = 0  # index objects that did not decode (not used for deduplication)
    superseded: bool = False  # a sync that began later committed first; this one changed nothing
    rebuilt: bool = False  # the mirror was damaged and started again from empty


class _Shared:
    """One process's handle on one mirror directory: the environment and its named databases."""

    def __init__(self, path: str, map_size: int):
        self.path = path
        self.users = 0
        os.makedirs(path, exist_ok=True)
        # metasync=False: one flush a commit instead of two (the meta page is flushed with the next commit);
        # LMDB keeps the environment sound through a crash, which may undo the last commit: harmless in
        # a cache (the next sync fetches what it lost, a lost trust verdict is checked again).
        self.env = lmdb.open(path, map_size=map_size, max_dbs=4, readahead=False, metasync=False)
        self.packs = self.env.open_db(b"packs")
        self.chunks = self.env.open_db(b"chunks", dupsort=True, dupfixed=True)
        self.trust = self.env.open_db(b"trust")
        self.meta = self.env.open_db(b"meta")


_registry_lock = threading.Lock()
_registry: dict[str, _Shared] = {}


class IndexMirror:
    """The mirror of the pack indexes of the store ``store_id`` names (``store_identity``); ``close()``
    when done (or use ``with``)."""

    def __init__(self, store_id: str, *, path: str | None = None, map_size: int = DEFAULT_MAP_SIZE):
        self.store_id = store_id
        self.path = os.path.abspath(path or mirror_path(store_id))
        self._damaged = False  # a lookup met a record that does not decode; the next sync rebuilds
        self.rebuilt = False  # emptied since it was opened (reported by the next sync)
        self._shared = self._attach(map_size)
        if not self._stamped():
            self._rebuild()

    @classmethod
    def for_store(cls, store: Store, index_root: str | None = None) -> "IndexMirror":
        """The mirror of ``store`` under ``index_root`` (default: ``default_index_root()``)."""
        identity = store_identity(store)
        return cls(identity, path=mirror_path(identity, index_root))

    # -- opening, checking, rebuilding

    def _attach(self, map_size: int) -> _Shared:
        with _registry_lock:
            shared = _registry.get(self.path)
            if shared is None:
                try:
                    shared = _Shared(self.path, map_size)
                except _BROKEN as exc:
                    log.warning("index mirror %s is not a sound LMDB environment (%s); starting afresh", self.path, exc)
                    shutil.rmtree(self.path, ignore_errors=True)
                    shared = _Shared(self.path, map_size)
                    self.rebuilt = True
                except (lmdb.Error, OSError) as exc:
                    raise UnavailableError(f"cannot open the index mirror ({exc}); set ${INDEX_DIR_ENV} to a "
                                           "writable directory", where=self.path, transient=False) from None
                _registry[self.path] = shared
            shared.users += 1
            return shared

    def _stamped(self) -> bool:
        """Whether the mirror says it is one of ours, for this store, in this version; a new, empty
        environment is stamped so here (in one transaction, so two processes opening it agree)."""

        def check(txn: lmdb.Transaction) -> bool:
            version, store = txn.get(b"version", db=self._shared.meta), txn.get(b"store", db=self._shared.meta)
            if version is None and store is None and txn.stat(self._shared.packs)["entries"] == 0:
                self._stamp(txn)
                return True
            return version == VERSION.pack(MIRROR_VERSION) and store == self.store_id.encode()

        try:
            return self._write(check)
        except _BROKEN as exc:
            log.warning("index mirror %s: %s", self.path, exc)
            return False

    def _stamp(self, txn: lmdb.Transaction) -> None:
        txn.put(b"version", VERSION.pack(MIRROR_VERSION), db=self._shared.meta)
        txn.put(b"store", self.store_id.encode(), db=self._shared.meta)
        # As if a sync had just begun: a sync that began before this (and saw what we threw away) must
        # not commit; one that begins after does.
        txn.put(b"synced", SYNCED.pack(time.time_ns()), db=self._shared.meta)

    def _rebuild(self) -> None:
        """Empty every database and stamp the mirror as ours; the next sync fills it from the store."""
        log.warning("index mirror %s is damaged or foreign; rebuilding it from the store", self.path)

        def empty(txn: lmdb.Transaction) -> None:
            for db in (self._shared.packs, self._shared.chunks, self._shared.trust, self._shared.meta):
                txn.drop(db, delete=False)
            self._stamp(txn)

        self._write(empty)
        self._damaged = False
        self.rebuilt = True

    def reset(self) -> None:
        """Forget everything; the next sync reads every index object of the store again."""
        self._rebuild()

    def close(self) -> None:
        with _registry_lock:
            if self._shared is None:
                return
            self._shared.users -= 1
            if self._shared.users == 0:
                self._shared.env.close()
                del _registry[self.path]
            self._shared = None

    def __enter__(self) -> "IndexMirror":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sync

    def sync(self, store: Store) -> SyncStats:
        """Bring the mirror up to the store's current listing of ``index/`` (see the module docstring)."""
        stats = SyncStats(rebuilt=self.rebuilt)
        if self._damaged:
            self._rebuild()
            stats.rebuilt = True
        began = time.time_ns()
        listed = set()
        for key in store.list(keys.INDEX):
            pack_id = keys.id_from_key(key)
            if is_hex_digest(pack_id) and key == keys.index(pack_id):
                listed.add(pack_id)
        stats.listed = len(listed)
        fetched = self._fetch(store, sorted(listed - self.pack_ids()), stats)
        try:
            self._write(lambda txn: self._commit(txn, began, listed, fetched, stats))
        except CorruptError as exc:
            log.warning("%s; rebuilding the index mirror", exc)
            self._rebuild()
            return self.sync(store)
        return stats

    def _fetch(self, store: Store, pack_ids: list[str], stats: SyncStats) -> dict[bytes, list[PackEntry]]:
        def fetch(pack_id: str) -> list[PackEntry] | None:
            key = keys.index(pack_id)
            try:
                return read_index_object(store, key)
            except NotFoundError:
                return None  # soft-deleted since the listing
            except CorruptError as exc:
                log.warning("not deduplicating against pack %s: %s", pack_id, exc)
                stats.unreadable += 1
                return None

        with ThreadPoolExecutor(max_workers=INDEX_LOAD_THREADS, thread_name_prefix="mirror-fetch") as pool:
            results = list(pool.map(fetch, pack_ids))
        return {bytes.fromhex(p): entries for p, entries in zip(pack_ids, results) if entries is not None}

    def _commit(self, txn: lmdb.Transaction, began: int, listed: set[str],
                fetched: dict[bytes, list[PackEntry]], stats: SyncStats) -> None:
        synced = txn.get(b"synced", db=self._shared.meta)
        if synced is not None and SYNCED.unpack(synced)[0] > began:
            stats.superseded = True
            return
        listed_raw = {bytes.fromhex(p) for p in listed}
        gone = []
        for pack_id, record in txn.cursor(db=self._shared.packs):
            if pack_id not in listed_raw and self._decode_header(pack_id, record)[0] < began:
                gone.append((pack_id, record))
        for pack_id, record in gone:
            self._drop(txn, pack_id, record)
        stats.dropped = len(gone)
        for pack_id, entries in fetched.items():
            stats.fetched += self._add(txn, pack_id, _records_of(entries), added=began)
        txn.put(b"synced", SYNCED.pack(began), db=self._shared.meta)

    # -- reading and writing packs

    def add_pack(self, pack_id: str, entries: Iterable[PackEntry]) -> None:
        """Add a pack this host just uploaded (its index object is in the store), trusted. A pack already
        here keeps its entries. A failure is logged, not raised: the mirror is a cache, the next sync
        catches up."""
        self.add_pack_records(pack_id, _records_of(entries))

    def add_pack_records(self, pack_id: str, records: bytes) -> None:
        """``add_pack`` of the entries that ``records`` (INDEX_ENTRY records) hold."""
        raw = bytes.fromhex(pack_id)

        def add(txn: lmdb.Transaction) -> None:
            self._add(txn, raw, records, added=time.time_ns())
            txn.put(raw, TRUSTED, db=self._shared.trust)

        try:
            self._write(add)
        except (lmdb.Error, UnavailableError) as exc:
            log.warning("could not add pack %s to the index mirror: %s", pack_id, exc)

    def locations(self, digest: bytes) -> list[ChunkLocation]:
        """Every location the mirror knows for chunk ``digest``, in pack id order. A record that does not
        decode is left out, and the next sync rebuilds the mirror."""
        try:
            with self._shared.env.begin(db=self._shared.chunks) as txn:
                cursor = txn.cursor()
                values = list(cursor.iternext_dup()) if cursor.set_key(digest) else []
        except _BROKEN as exc:
            log.warning("index mirror %s: %s", self.path, exc)
            self._damaged = True
            return []
        locations = []
        for value in values:
            if len(value) != LOCATION.size:
                self._damaged = True
                continue
            pack_id, offset, clen, ulen = LOCATION.unpack(value)
            locations.append(ChunkLocation(to_hex(pack_id), offset, clen, ulen))
        return locations

    def trust(self, pack_id: str) -> bytes | None:
        """TRUSTED, FORGED, or None for a pack not checked yet (see the module docstring)."""
        with self._shared.env.begin(db=self._shared.trust) as txn:
            return txn.get(bytes.fromhex(pack_id))

    def set_trust(self, pack_id: str, verdict: bytes) -> None:
        self._write(lambda txn: txn.put(bytes.fromhex(pack_id), verdict, db=self._shared.trust))

    def pack_entries(self, pack_id: str) -> list[PackEntry] | None:
        """The mirrored index entries of a pack; None if it is not mirrored."""
        raw = bytes.fromhex(pack_id)
        with self._shared.env.begin(db=self._shared.packs) as txn:
            record = txn.get(raw)
        if record is None:
            return None
        self._decode_header(raw, record)
        return [PackEntry(*fields) for fields in INDEX_ENTRY.iter_unpack(record[PACK_HEADER.size:])]

    def pack_ids(self) -> set[str]:
        with self._shared.env.begin(db=self._shared.packs) as txn:
            return {to_hex(key) for key in txn.cursor().iternext(keys=True, values=False)}

    def chunk_count(self) -> int:
        """Chunk locations mirrored (a chunk held by two packs counts twice)."""
        with self._shared.env.begin(db=self._shared.chunks) as txn:
            return txn.stat(self._shared.chunks)["entries"]

    def _add(self, txn: lmdb.Transaction, pack_id: bytes, records: bytes, *, added: int) -> int:
        """Add a pack seen indexed at time ``added`` (a sync: when its listing began), its entries given
        as INDEX_ENTRY records."""
        if txn.get(pack_id, db=self._shared.packs) is not None:
            return 0
        txn.put(pack_id, PACK_HEADER.pack(added, len(records) // INDEX_ENTRY.size) + records, db=self._shared.packs)
        put, chunks, location = txn.put, self._shared.chunks, LOCATION.pack
        for digest, offset, clen, ulen in INDEX_ENTRY.iter_unpack(records):
            put(digest, location(pack_id, offset, clen, ulen), db=chunks)
        return 1

    def _drop(self, txn: lmdb.Transaction, pack_id: bytes, record: bytes) -> None:
        _added, count = self._decode_header(pack_id, record)
        for digest, offset, clen, ulen in INDEX_ENTRY.iter_unpack(record[PACK_HEADER.size:]):
            txn.delete(digest, LOCATION.pack(pack_id, offset, clen, ulen), db=self._shared.chunks)
        txn.delete(pack_id, db=self._shared.packs)
        txn.delete(pack_id, db=self._shared.trust)

    def _decode_header(self, pack_id: bytes, record: bytes) -> tuple[int, int]:
        """(added, count) of a pack record; CorruptError (which rebuilds the mirror) if it is malformed."""
        if len(pack_id) != DIGEST_SIZE or len(record) < PACK_HEADER.size:
            raise CorruptError("malformed pack record", where=f"{self.path}: pack {pack_id.hex()}")
        added, count = PACK_HEADER.unpack_from(record)
        if len(record) != PACK_HEADER.size + count * INDEX_ENTRY.size:
            raise CorruptError(f"pack record of {len(record)} bytes for {count} entries",
                               where=f"{self.path}: pack {pack_id.hex()}")
        return added, count

    def _write(self, fn):
        try:
            with self._shared.env.begin(write=True) as txn:
                return fn(txn)
        except lmdb.MapFullError:
            raise UnavailableError(f"the index mirror is full ({DEFAULT_MAP_SIZE} bytes); remove the directory",
                                   where=self.path, transient=False) from None


def _records_of(entries: Iterable[PackEntry]) -> bytes:
    return b"".join(INDEX_ENTRY.pack(*entry) for entry in entries)
