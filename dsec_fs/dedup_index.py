"""The chunk index a build deduplicates against: answered from the store's IndexMirror, trusting only
packs this host uploaded or verified.

An index object says what its writer claims; in a shared store a writer may lie (claim other layers'
chunks at offsets of its own pack). So a build deduplicates only against packs it trusts: packs uploaded
from this host, and packs whose every claimed chunk it has read and hashed (chunks.verify_pack, once per
pack, when a lookup first needs it; the verdict is kept in the mirror's ``trust`` database, so other
builds on this host do not read it again). A chunk whose mirrored packs are all forged is uploaded
again. Before a layer is published, ``confirm`` checks that every pack it names is trusted, which only
this host's own reads and uploads decide, and that the packs' index objects list its chunks: a forged
index costs a pack read, never a published layer that fails fsck. Reads of a pack to verify it are as
bounded as any chunk read (VERIFY_READ_BYTES a GET).

Memory: a build of many small files uploads a chunk per file, so what the index keeps per chunk of its
own packs is small and fixed: the pack of each digest in one dict (its values are the packs' id strings,
shared) and each pack's index entries as packed bytes (pack.INDEX_ENTRY), not a location object per
chunk. Its packs enter the mirror only when the index is closed, or, when the caller asks for it
(``load_chunk_index(own_packs=...)``), once the caller has freed its tree (``add_to_mirror``): every
LMDB page a write touches is mapped into the process, and at 1,000,000 chunks those pages are ~340 MB
on top of the tree. Until then an ``OwnPacks`` keeps their records in an unnamed temporary file, not in
memory (48 bytes a chunk, alive while the build lays out its blob and writes meta.erofs). Within the
build the mirror thus holds only what the sync found, and a mirror that held no chunk then is not asked
at all.

Threads: any thread may call any method. ChunkIndex's own lock guards the answers already given;
``_verify_lock`` the verdicts learnt and the own packs' records; each pack's own lock is held while that
pack is read to verify it, so lookups that need its verdict wait meanwhile, lookups of other packs and of
remembered answers do not. ``_own_chunks`` is read without the lock (a dict lookup is atomic) and
written under it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Collection, Iterable, Iterator

from .chunks import INDEX_LOAD_THREADS, ChunkIndex, ChunkLocation, verify_pack
from .digest import DIGEST_SIZE, to_hex
from .errors import CorruptError, NotFoundError
from .pack_indexes import restore_pack_index
from .index_mirror import FORGED, TRUSTED, IndexMirror

from .pack import INDEX_ENTRY, MAX_INDEX_BYTES, PackEntry, decode_index, index_of_records
from .store import keys
from .store.base import Store, get_small, side_by_side

log = logging.getLogger(__name__)

# A pack this build uploaded, not yet in the mirror: (pack id, its index entries as INDEX_ENTRY records).
OwnPack = tuple[str, bytes]


class OwnPacks:
    """The packs a build uploaded, waiting for ``add_to_mirror``: what ``load_chunk_index(own_packs=...)``
    is given (a list does as well). Their records go to an unnamed temporary file (the page cache, not
    the build's memory) and are read back one pack at a time; where no temporary file can be made they
    stay in memory. Used by one thread at a time; ``close`` (or the end of a ``with``) drops the file."""

    def __init__(self) -> None:
        self._packs: list[tuple[str, int, int]] = []  # (pack id, offset in the file, bytes)
        self._kept: list[OwnPack] = []  # records kept in memory (no temporary file)
        self._file = None  # the temporary file, once a pack is written
        self._end = 0

    def extend(self, packs: Iterable[OwnPack]) -> None:
        for pack_id, records in packs:
            try:
                if self._file is None:
                    self._file = tempfile.TemporaryFile(prefix="dsecfs-own-packs-")
                if os.pwrite(self._file.fileno(), records, self._end) != len(records):
                    raise OSError("short write to the temporary file of own packs")
            except OSError as exc:
                log.debug("keeping a pack's index records in memory: %s", exc)
                self._kept.append((pack_id, records))
                continue
            self._packs.append((pack_id, self._end, len(records)))
            self._end += len(records)

    def __len__(self) -> int:
        return len(self._packs) + len(self._kept)

    def __iter__(self) -> Iterator[OwnPack]:
        for pack_id, offset, size in self._packs:
            records = os.pread(self._file.fileno(), size, offset)
            if len(records) != size:
                raise OSError(f"temporary file of own packs: {len(records)} of {size} bytes at {offset}")
            yield pack_id, records
        yield from self._kept

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._packs, self._kept, self._end = [], [], 0

    def __enter__(self) -> "OwnPacks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MirroredChunkIndex(ChunkIndex):
    """A ChunkIndex answered from an IndexMirror: what ChunkUploader, the chunker and the builder use.

    Every answer the mirror gives is remembered, so the chunker, the uploader and the manifest see the
    same location for a chunk even if another process's sync changes the mirror meanwhile; packs this
    build uploads are answered from compact records and added to the mirror at ``close()`` (see Memory
    in the module docstring). Only locations in trusted packs are answered (see the module docstring): a
    pack not checked yet is verified against ``store`` when a lookup first needs it. ``close()`` releases
    the mirror.

    ``_verify_lock`` guards ``_verdicts`` (pack id -> TRUSTED or FORGED, as learnt by this object),
    ``_pack_locks`` and the own packs' records; a pack's own lock in ``_pack_locks`` is held while it is
    read, so each pack is read once and different packs side by side.
    """

    def __init__(self, mirror: IndexMirror, store: Store, own_packs: OwnPacks | list[OwnPack] | None = None):
        super().__init__()
        self.mirror = mirror
        self.store = store
        self._verify_lock = threading.Lock()
        self._verdicts: dict[str, bytes] = {}
        self._pack_locks: dict[str, threading.Lock] = {}
        self._own: set[str] = set()  # packs this build uploaded
        self._own_chunks: dict[bytes, str] = {}  # digest -> id of the own pack holding it
        self._own_records: dict[str, bytes] = {}  # own pack id -> its INDEX_ENTRY records
        self._deferred = own_packs  # where close() leaves the own packs for add_to_mirror; None: it adds them
        self._mirror_empty = mirror.chunk_count() == 0

    def get(self, digest: bytes) -> ChunkLocation | None:
        location = super().get(digest)
        if location is None:
            pack_id = self._own_chunks.get(digest)
            if pack_id is not None:
                return self._own_location(digest, pack_id)
            if self._mirror_empty:
                return None
            location = next((found for found in self.mirror.locations(digest)
                             if self._verdict(found.pack_id) == TRUSTED), None)
            if location is not None:
                super().add_pack(location.pack_id, [PackEntry(digest, location.offset, location.clen,
                                                              location.ulen)])
                location = super().get(digest)
        return location

    def _verdict(self, pack_id: str) -> bytes | None:
        """TRUSTED or FORGED, reading the pack now if no one has checked it; None if it is gone."""
        with self._verify_lock:
            verdict = self._verdicts.get(pack_id)
            if verdict is not None:
                return verdict
            pack_lock = self._pack_locks.setdefault(pack_id, threading.Lock())
        with pack_lock:  # one thread reads a pack; threads that need other packs read those meanwhile
            with self._verify_lock:
                verdict = self._verdicts.get(pack_id)
            if verdict is None:
                verdict = self.mirror.trust(pack_id) or self._verify(pack_id)
                if verdict is None:
                    return None
                with self._verify_lock:
                    self._verdicts[pack_id] = verdict
        return verdict

    def _verify(self, pack_id: str) -> bytes | None:
        """Read the pack and record the verdict in the mirror; None if it is gone."""
        entries = self.mirror.pack_entries(pack_id)
        if entries is None:
            return None  # dropped by a sync meanwhile
        try:
            verify_pack(self.store, pack_id, entries)
            verdict = TRUSTED
        except NotFoundError:
            return None  # gone (a gc); the next sync drops it
        except CorruptError as exc:
            log.warning("not deduplicating against pack %s: its index claims chunks it does not hold (%s)",
                        pack_id, exc)
            verdict = FORGED
        self.mirror.set_trust(pack_id, verdict)
        return verdict

    def _own_location(self, digest: bytes, pack_id: str) -> ChunkLocation:
        """The location of a chunk of an own pack, from the pack's records (a scan: rarely asked; the
        build asks ``pack_of``)."""
        records = self._own_records[pack_id]
        at = records.find(digest)
        while at % INDEX_ENTRY.size:
            at = records.find(digest, at + 1)
        _digest, offset, clen, ulen = INDEX_ENTRY.unpack_from(records, at)
        return ChunkLocation(pack_id, offset, clen, ulen)

    def pack_of(self, digest: bytes) -> str | None:
        pack_id = self._own_chunks.get(digest)
        return pack_id if pack_id is not None else super().pack_of(digest)

    def __contains__(self, digest: bytes) -> bool:
        if digest in self._own_chunks:
            return True
        # With an empty mirror only this build's own packs hold chunks (``get`` finds nothing else): asked
        # once for every chunk a build meets, so it is answered without the calls and the lock of ``get``.
        return not self._mirror_empty and self.get(digest) is not None

    def __len__(self) -> int:
        return self.mirror.chunk_count() + len(self._own_chunks)

    def add_pack(self, pack_id: str, entries: Iterable[PackEntry]) -> None:
        """Record a pack this build uploaded: trusted, its chunks answered from memory (see Memory above)."""
        self.add_pack_records(pack_id, b"".join(INDEX_ENTRY.pack(*entry) for entry in entries))

    def add_pack_records(self, pack_id: str, records: bytes, digests: Collection[bytes] | None = None) -> None:
        """``add_pack`` of the entries that ``records`` (INDEX_ENTRY records) hold, as they are. Keyed by
        ``digests`` where given (see ChunkIndex.add_pack_records: a copy of each would cost ~80 bytes a
        chunk while the build's chunk index lives, ~80 MB at 1,000,000 small files)."""
        if digests is None:
            digests = [records[at:at + DIGEST_SIZE] for at in range(0, len(records), INDEX_ENTRY.size)]
        with self._verify_lock:
            self._own.add(pack_id)
            self._verdicts[pack_id] = TRUSTED
            self._own_records[pack_id] = records
            own_chunks = self._own_chunks
            if own_chunks.keys().isdisjoint(digests):  # the usual case: one C call, not a setdefault a chunk
                own_chunks.update(dict.fromkeys(digests, pack_id))
            else:  # a chunk of an earlier own pack keeps that pack
                for digest in digests:
                    own_chunks.setdefault(digest, pack_id)

    def confirm(self, store: Store, digests: Iterable[bytes], pack_ids: Iterable[str]) -> list[str]:
        """Check against the store that the packs ``pack_ids`` exist and that their index objects list
        every chunk in ``digests``, before a layer naming them is published. An index object that is
        missing (soft-deleted by a gc meanwhile) or unreadable is put again from its pack. Returns the
        packs so restored.

        NotFoundError if a pack is gone; CorruptError, after resetting the mirror, if a chunk the mirror
        promised is in none of the packs, or if a pack is neither this build's own nor verified by this
        host (whatever an index object claims, that is decided here).
        """
        pack_ids = list(pack_ids)
        with self._verify_lock:
            untrusted = [p for p in pack_ids if p not in self._own and self._verdicts.get(p) != TRUSTED]
        if untrusted:
            self.mirror.reset()
            raise CorruptError(f"{len(untrusted)} of the layer's packs were never verified; the mirror was reset "
                               "and nothing was published: build again", where=keys.pack(untrusted[0]))

        # Memory: one set of the layer's distinct digests, which each pack's index, read and decoded one
        # at a time per thread, strikes out under ``lock``; no set of every pack's digests at once (at
        # 1,000,000 small files those sets and their union were the build's peak, ~230 MB). A chunk this
        # build uploaded is in its pack by construction (its index object is only read to see that it is
        # there), so the set holds only the chunks the mirror answered: none in a fresh store. Such an
        # index object is compared with the bytes this build wrote, not decoded entry by entry.
        own_chunks = self._own_chunks
        missing = {digest for digest in digests if digest not in own_chunks}
        lock = threading.Lock()
        with self._verify_lock:
            own_records = dict(self._own_records)

        def read(pack_id: str) -> bool:
            if not store.exists(keys.pack(pack_id)):
                raise NotFoundError("a pack this layer needs is gone; nothing was published",
                                    where=keys.pack(pack_id))
            key = keys.index(pack_id)
            records = own_records.get(pack_id)
            try:
                data = get_small(store, key, MAX_INDEX_BYTES, "pack index")
                if records is not None and data == index_of_records(records):
                    return False
                entries, restored = decode_index(data, source=key), False
            except (NotFoundError, CorruptError):
                entries, restored = restore_pack_index(store, pack_id), True
            held = [e.digest for e in entries]
            with lock:
                missing.difference_update(held)
            return restored

        results = side_by_side(store, read, pack_ids, threads=INDEX_LOAD_THREADS, name="confirm")
        if missing:
            self.mirror.reset()
            raise CorruptError(
                f"{len(missing)} chunks the index mirror said were stored are in none of the layer's packs; "
                "the mirror was reset and nothing was published: build again",
                where=f"chunk {to_hex(min(missing))}",
            )
        return [pack_id for pack_id, restored in zip(pack_ids, results) if restored]

    def close(self) -> None:
        """Release the mirror; the own packs are added to it now, or left in ``own_packs`` for the caller."""
        with self._verify_lock:
            own, self._own_records = list(self._own_records.items()), {}
            self._own_chunks = {}
        try:
            if self._deferred is None:
                _add_packs(self.mirror, own)
            else:
                self._deferred.extend(own)
        finally:
            self.mirror.close()

    def __enter__(self) -> "MirroredChunkIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_chunk_index(store: Store, *, index_root: str | None = None,
                     own_packs: OwnPacks | list[OwnPack] | None = None) -> MirroredChunkIndex:
    """Sync the store's index mirror and return a ChunkIndex answered from it; the caller closes it.
    With ``own_packs``, closing it appends the packs it uploaded there instead of adding them to the
    mirror: the caller then passes them to ``add_to_mirror`` (see Memory above)."""
    mirror = IndexMirror.for_store(store, index_root)
    try:
        mirror.sync(store)
        return MirroredChunkIndex(mirror, store, own_packs)
    except BaseException:
        mirror.close()
        raise


def add_to_mirror(store: Store, own_packs: OwnPacks | list[OwnPack], *, index_root: str | None = None) -> None:
    """Add packs a build uploaded (``load_chunk_index(own_packs=...)``) to the store's index mirror, trusted.
    Failures are logged, not raised: the mirror is a cache, and the next sync finds the packs (it then
    verifies them before deduplicating against them)."""
    if not own_packs:
        return
    try:
        mirror = IndexMirror.for_store(store, index_root)
    except Exception as exc:  # the build itself is done: a cache that cannot be opened costs only work
        log.warning("could not add %d packs to the index mirror: %s", len(own_packs), exc)
        return
    try:
        _add_packs(mirror, own_packs)
    except OSError as exc:  # reading the records back (OwnPacks): as above, the next sync finds the packs
        log.warning("could not add the packs of this build to the index mirror: %s", exc)
    finally:
        mirror.close()


def _add_packs(mirror: IndexMirror, own_packs: Iterable[OwnPack]) -> None:
    for pack_id, records in own_packs:
        mirror.add_pack_records(pack_id, records)
