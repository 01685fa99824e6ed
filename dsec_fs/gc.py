"""Garbage collection of a store, safe against builds running at the same time; repair of pack indexes.

What is live (the mark): every layer a ref names, and every other published layer younger than the grace
period or published after a still-running build began (it may be about to get its ref), or every layer at
all with ``keep_unreferenced_layers``; the packs their manifests list; and, from their blob maps, which
chunks of each such pack they use (only repacking needs that). Any other published layer is "dangling"
and deleted, manifest first, so that it is unpublished before its parts go; so is a layer directory
without a manifest (a publish that crashed) once neither of those reasons to wait holds for it.

What one run does with each pack P (the sweep):

    P is live, its index is present, no trash marker     keep it
    P is live, index missing or unreadable, or marked    restore: put the index again from P's embedded copy,
                                                         then drop the marker (a build raced a soft delete)
    P is unreferenced and indexed                        soft-delete it if it is older than the grace period:
                                                         delete index/P, then write trash/P with the time
                                                         (taken after the delete). A marker found next to an
                                                         index is void (a build restored the index) and dropped
    P is unreferenced, unindexed, unmarked               write a marker now (a gc crashed between its two
                                                         steps, or an upload has not put the index yet)
    P is unreferenced, unindexed and marked              hard-delete P, then the marker, once the marker is
                                                         older than the grace period and no live lease started
                                                         before it (leases.py); right before the delete, check
                                                         again that the index is still absent and that P was
                                                         not written again after the marker
    there is no P, only its index or marker              drop them (a problem is reported if a layer names P),
                                                         unless P exists when checked again (uploaded since
                                                         the listing)

Why a build running meanwhile loses nothing:
1. A build takes its lease (leases.py) before it lists the pack indexes. A pack it may deduplicate
   against was therefore indexed after its lease began and trashed later still, so its lease blocks the
   hard delete until it ends, and by then its layer is published and names the pack.
2. Such a layer may name a pack whose index gc has just deleted. Two checks in opposite orders settle it:
   gc, after deleting indexes, reads every manifest again and restores the index of any trashed pack one
   names; the build, after publishing its manifest, restores any missing index of its packs
   (pack_indexes.ensure_pack_indexes). Whichever runs second sees the other's write. Before publishing, the build
   also confirms against the index objects themselves that its packs hold its chunks (dedup_index.py).
3. One gc at a time: a run holds an exclusive lease under ``gc-locks/``.
Times of leases and markers come from different hosts' clocks; "started before" always allows
``leases.CLOCK_SKEW`` of disagreement in the safe direction.

Repacking: a live pack whose live bytes are below ``repack_threshold`` of its chunk bytes has its live
chunks copied (read, verified, recompressed) into new packs, the manifests of the layers that list it are
rewritten with the new pack list (manifest.json is not part of the layer digest, and a put replaces it
atomically), and then it is soft-deleted like any unreferenced pack.

Known limits: (a) a build that re-uploads a byte-identical copy of a trashed pack (same chunks, same
order) in the milliseconds between gc's last check and its delete would lose that pack; its pre-publish
check catches the loss unless it runs in that same window too. (b) Readers (node daemons) hold no
leases: a layer deleted or repacked while mounted keeps working for the grace period only; its old
manifest names packs whose indexes are gone at once after a repack. (c) Someone pointing a ref (by hand,
not a build) at a dangling layer older than the grace period while gc deletes it gets a ref to nothing.

Threads: ``gc`` runs in the calling thread and reads objects through a private pool it joins before
returning; the pool's workers only read the store, fill in the ``_Layer`` each was handed, and append to
``report.problems`` (list.append is atomic).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import compress
from .blobmap import EncodedBlobMap
from .chunks import DEFAULT_PACK_TARGET, ChunkIndex, ChunkLocation, ChunkUploader, read_chunks, read_index_object
from .digest import is_hex_digest
from .errors import CorruptError, DsecError, FormatError, InputError, NotFoundError, UnsupportedError
from .layer import Manifest, list_refs, manifest_at, read_blobmap_alone
from .leases import CLOCK_SKEW, DEFAULT_MAX_AGE, LeaseInfo, exclusive_lease, list_leases
from .pack import PACK_TRAILER, PackEntry, index_size
from .pack_indexes import restore_pack_index
from .store import keys
from .store.base import Store, get_small
from .store.filesystem import FilesystemStore
from .store.wrappers import find_wrapper

log = logging.getLogger(__name__)

# Store reads (manifests, blob maps, indexes, sizes) are small; several at once hide request latency.
READ_THREADS = 8
# A temporary file younger than this may belong to a put still in progress, whatever the grace period.
TEMP_FILE_MIN_AGE = 3600.0
# A trash marker is {"trashed": <time>}: one larger than this was grown by a store writer, and is not read.
MAX_MARKER_BYTES = 4096

# Given the bytes of a layer's blob map and its key: the digests of the chunks it names (CorruptError if
# malformed). The blob map format belongs to erofs_builder, which dsec_fs may not import.


@dataclass
class Tally:
    packs: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.packs += 1
        self.bytes += size

    def remove(self, size: int) -> None:
        self.packs -= 1
        self.bytes -= size


@dataclass
class GcReport:
    """What a run did (or, with dry_run, would do). Pack tallies count packs and their object sizes."""

    dry_run: bool = False
    refs: int = 0
    layers_kept: int = 0
    layers_deleted: list[str] = field(default_factory=list)  # digests of dangling or incomplete layers
    kept: Tally = field(default_factory=Tally)  # live packs, and unreferenced ones younger than grace
    trashed: Tally = field(default_factory=Tally)  # soft-deleted by this run
    waiting: Tally = field(default_factory=Tally)  # trashed earlier, not yet deletable (grace or a lease)
    deleted: Tally = field(default_factory=Tally)  # hard-deleted by this run
    restored: Tally = field(default_factory=Tally)  # trashed or unindexed packs a layer names, indexed again
    repacked: Tally = field(default_factory=Tally)  # packs whose live chunks were copied (then trashed)
    written: Tally = field(default_factory=Tally)  # the new packs those chunks went into (dry run: bytes)
    leases_removed: int = 0  # stale leases and gc locks
    temp_files_removed: int = 0  # left by interrupted writes to a filesystem store
    problems: list[str] = field(default_factory=list)  # damage found; nothing gc could safely fix

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        verb = "would be " if self.dry_run else ""

        def line(name: str, tally: Tally) -> str:
            return f"{name:<10}{tally.packs:>8,} packs {tally.bytes:>16,} bytes"

        lines = [
            "dry run: nothing was changed" if self.dry_run else "gc done",
            f"refs      {self.refs:>8,}",
            f"layers    {self.layers_kept:>8,} kept, {len(self.layers_deleted):,} {verb}deleted",
            line("kept", self.kept), line("trashed", self.trashed), line("waiting", self.waiting),
            line("deleted", self.deleted), line("restored", self.restored), line("repacked", self.repacked),
            line("written", self.written),
            f"leases    {self.leases_removed:>8,} stale {verb}removed",
            f"temp files{self.temp_files_removed:>8,} {verb}removed",
        ]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def gc(
    store: Store,
    *,
    grace_seconds: float,
    dry_run: bool = False,
    repack_threshold: float = 0.5,
    keep_unreferenced_layers: bool = False,
    lease_max_age: float = DEFAULT_MAX_AGE,
    pack_target: int = DEFAULT_PACK_TARGET,
) -> GcReport:
    """Collect garbage in ``store`` (see the module docstring). ConflictError if another gc is running;
    with ``dry_run`` nothing is written, not even the gc lock."""
    if grace_seconds < 0:
        raise InputError(f"grace period must not be negative, got {grace_seconds}", where="gc")
    if not 0 <= repack_threshold <= 1:
        raise InputError(f"repack threshold must be in [0, 1], got {repack_threshold}", where="gc")
    report = GcReport(dry_run=dry_run)
    lock = None if dry_run else exclusive_lease(store, keys.GC_LOCKS, purpose="gc", max_age=lease_max_age)
    try:
        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="gc-read") as pool:
            _Run(store, report, pool, grace=grace_seconds, repack_threshold=repack_threshold,
                 keep_unreferenced_layers=keep_unreferenced_layers,
                 lease_max_age=lease_max_age, pack_target=pack_target).run()
    finally:
        if lock is not None:
            lock.release()
    return report


def pack_size(entries: Iterable[PackEntry]) -> int:
    """Bytes of the pack object an index describes: PackWriter lays frames out densely, then the index
    and the trailer. Saves asking the store for the size of every pack."""
    entries = list(entries)
    frames_end = max((e.offset + e.clen for e in entries), default=0)
    return frames_end + index_size(len(entries)) + PACK_TRAILER.size


@dataclass
class _Layer:
    digest: str
    keys: list[str]  # every object under layers/<digest>/
    manifest: Manifest | None = None  # None: not published, or unreadable (then ``problem`` says why)
    problem: DsecError | None = None
    referenced: bool = False
    live: bool = False


@dataclass(frozen=True)
class _Marker:
    key: str
    trashed: float  # gc host's clock when the pack's index was gone


class _Run:
    """One gc run: the listings, the mark, then the sweep. Used once, by the thread that called gc()."""

    def __init__(self, store: Store, report: GcReport, pool: ThreadPoolExecutor, *, grace: float,
                 repack_threshold: float, keep_unreferenced_layers: bool,
                 lease_max_age: float, pack_target: int):
        self.store = store
        self.report = report
        self.pool = pool
        self.grace = grace
        self.repack_threshold = repack_threshold
        self.keep_unreferenced_layers = keep_unreferenced_layers
        self.lease_max_age = lease_max_age
        self.pack_target = pack_target
        self.dry_run = report.dry_run
        self.now = time.time()
        self.leases: list[LeaseInfo] = []
        self.packs: set[str] = set()  # ids with a packs/ object
        self.indexed: set[str] = set()  # ids with an index/ object
        self.markers: dict[str, _Marker] = {}
        self.entries: dict[str, dict[bytes, PackEntry]] = {}  # packs whose index decoded
        self.layers: dict[str, _Layer] = {}
        self.live_packs: set[str] = set()
        self.live_chunks: dict[str, set[bytes]] = defaultdict(set)  # pack -> chunks live layers use from it
        self.pinned: set[str] = set()  # live packs whose chunk use is unknown: never repacked

    def run(self) -> None:
        # Leases first: a build whose lease is gone by now has published before the mark below reads.
        self.leases = list_leases(self.store, keys.LEASES) + list_leases(self.store, keys.GC_LOCKS)
        self.packs = self._list_ids(keys.PACKS, keys.pack)
        self.indexed = self._list_ids(keys.INDEX, keys.index)
        self.markers = self._read_markers()
        self.entries = self._read_indexes(self.indexed)
        self._mark()
        self._delete_dead_layers()
        soft, orphans = self._sweep()
        soft += self._repack()
        self._soft_delete(soft, orphans)
        self._remove_stale_leases()
        self._remove_temp_files()
        self.report.problems = list(dict.fromkeys(self.report.problems))  # the second look repeats some

    # -- listings

    def _list_ids(self, prefix: str, key_of: Callable[[str], str]) -> set[str]:
        ids = set()
        for key in self.store.list(prefix):
            pack_id = keys.id_from_key(key)
            if is_hex_digest(pack_id) and key == key_of(pack_id):
                ids.add(pack_id)
            else:
                self.report.problems.append(f"{key}: not a key gc knows; left alone")
        return ids

    def _read_markers(self) -> dict[str, _Marker]:
        def read(pack_id: str) -> _Marker | None:
            key = keys.trash(pack_id)
            try:
                data = get_small(self.store, key, MAX_MARKER_BYTES, "trash marker")
            except NotFoundError:
                return None
            except FormatError:  # grown past any marker's size by a store writer: unreadable, as below
                data = b""
            try:
                trashed = json.loads(data)["trashed"]
                if type(trashed) in (int, float):
                    return _Marker(key, float(trashed))
            except (ValueError, TypeError, KeyError):
                pass
            # Unreadable: the store's own time of the marker is the best we know, and errs late.
            self.report.problems.append(f"{key}: unreadable trash marker; dated by its store time")
            return _Marker(key, self.store.mtime(key))

        ids = self._list_ids(keys.TRASH, keys.trash)
        return {pack_id: m for pack_id, m in zip(ids, self.pool.map(read, ids)) if m is not None}

    def _read_indexes(self, pack_ids: Iterable[str]) -> dict[str, dict[bytes, PackEntry]]:
        def read(pack_id: str) -> dict[bytes, PackEntry] | None:
            key = keys.index(pack_id)
            try:
                return {e.digest: e for e in read_index_object(self.store, key)}
            except NotFoundError:
                return None
            except CorruptError as exc:
                self.report.problems.append(f"{key}: {exc}")
                return None

        pack_ids = list(pack_ids)
        return {p: e for p, e in zip(pack_ids, self.pool.map(read, pack_ids)) if e is not None}

    # -- mark

    def _mark(self) -> None:
        refs = list_refs(self.store)
        self.report.refs = len(refs)
        self.layers = self._list_layers()
        self.report.problems += [str(layer.problem) for layer in self.layers.values() if layer.problem is not None]
        for ref, digest in sorted(refs.items()):
            layer = self.layers.get(digest)
            if layer is None or (layer.manifest is None and layer.problem is None):
                self.report.problems.append(f"ref {ref}: names layer {digest}, which is not published")
            else:
                layer.referenced = True
        for layer in self.layers.values():
            published = layer.manifest is not None or layer.problem is not None
            layer.live = published and (layer.referenced or self.keep_unreferenced_layers
                                        or self._maybe_in_progress([keys.layer_manifest(layer.digest)]))
            if layer.live and layer.problem is not None:
                # Which packs it needs is unknowable, so nothing may be swept until a person looks.
                raise CorruptError(f"a live layer's manifest cannot be read, so gc stops: {layer.problem.message}",
                                   where=keys.layer_manifest(layer.digest))
        live = [layer for layer in self.layers.values() if layer.live]
        for layer in live:
            self.live_packs.update(layer.manifest.packs)
        self.report.layers_kept = len(live)
        if self.repack_threshold > 0:
            for layer, digests in zip(live, self.pool.map(self._layer_chunks, live)):
                self._mark_chunks(layer, digests)

    def _list_layers(self) -> dict[str, _Layer]:
        layers: dict[str, _Layer] = {}
        for key in self.store.list(keys.LAYERS):
            digest = key[len(keys.LAYERS):].split("/", 1)[0]
            if not is_hex_digest(digest):
                self.report.problems.append(f"{key}: not a key gc knows; left alone")
                continue
            layers.setdefault(digest, _Layer(digest, [])).keys.append(key)
        published = [layer for layer in layers.values() if keys.layer_manifest(layer.digest) in layer.keys]
        for _ in self.pool.map(self._read_manifest, published):
            pass
        return layers

    def _read_manifest(self, layer: _Layer) -> None:
        key = keys.layer_manifest(layer.digest)
        try:
            layer.manifest = manifest_at(self.store, key)
        except NotFoundError:
            pass  # deleted since the listing
        except (CorruptError, UnsupportedError) as exc:  # damaged, or written by a newer dsecfs
            layer.problem = exc
        if layer.manifest is not None and layer.manifest.layer != layer.digest:
            layer.problem = CorruptError(f"manifest describes layer {layer.manifest.layer}", where=key)
            layer.manifest = None

    def _age(self, key: str) -> float:
        """Seconds since ``key`` was written; 0 if it is gone (it cannot be older than what we saw)."""
        try:
            return self.now - self.store.mtime(key)
        except NotFoundError:
            return 0.0

    def _maybe_in_progress(self, layer_keys: list[str]) -> bool:
        """Whether these objects of a layer no ref names may be a build's work in progress (a publish
        under way, or a manifest whose ref is about to be set): the youngest is younger than the grace
        period, or a build that is still running began before it was written."""
        youngest = min(self._age(key) for key in layer_keys)
        written = self.now - youngest
        return youngest < self.grace or any(lease.started < written + CLOCK_SKEW for lease in self._live_leases())

    def _layer_chunks(self, layer: _Layer) -> set[bytes] | None:
        key = keys.layer_blobmap(layer.digest)
        try:
            blob_map = EncodedBlobMap(read_blobmap_alone(self.store, layer.manifest), source=key)
            return {digest for _blkaddr, digest, _length in blob_map.entries}
        except DsecError as exc:
            self.report.problems.append(f"{key}: {exc}; its packs are not repacked")
            return None

    def _mark_chunks(self, layer: _Layer, digests: set[bytes] | None) -> None:
        if digests is None:
            self.pinned.update(layer.manifest.packs)
            return
        found: set[bytes] = set()
        for pack_id in layer.manifest.packs:
            entries = self.entries.get(pack_id)
            if entries is None:
                self.pinned.add(pack_id)
                continue
            used = digests.intersection(entries.keys())
            self.live_chunks[pack_id] |= used
            found |= used
        if len(found) != len(digests) and not self.pinned.intersection(layer.manifest.packs):
            self.report.problems.append(
                f"layer {layer.digest}: {len(digests) - len(found)} chunks are in none of its packs' indexes")

    # -- sweep

    def _delete_dead_layers(self) -> None:
        for layer in sorted(self.layers.values(), key=lambda layer: layer.digest):
            if layer.live:
                continue
            published = layer.manifest is not None or layer.problem is not None
            if not published and self._maybe_in_progress(layer.keys):
                continue
            self.report.layers_deleted.append(layer.digest)
            if self.dry_run:
                continue
            manifest_key = keys.layer_manifest(layer.digest)
            # Unpublish first, so no reader opens a layer whose parts are going.
            for key in sorted(layer.keys, key=lambda key: key != manifest_key):
                self.store.delete(key)

    def _sweep(self) -> tuple[list[str], list[str]]:
        """Act on every pack whose state is settled; return the packs to soft-delete and the unindexed,
        unmarked ones to mark, which _soft_delete handles after repacking."""
        soft: list[str] = []
        orphans: list[str] = []
        for pack_id in sorted(self.packs | self.indexed | set(self.markers) | self.live_packs):
            marker = self.markers.get(pack_id)
            if pack_id not in self.packs:
                self._drop_remains(pack_id, marker)
            elif pack_id in self.live_packs:
                if pack_id not in self.entries or marker is not None:
                    # An index that is missing or does not decode is put again from the pack.
                    self._restore(pack_id, marker, reindex=pack_id not in self.entries)
                self.report.kept.add(self._size(pack_id))
            elif pack_id in self.indexed:
                if marker is not None:
                    self._delete(marker.key)  # void: the index came back (a build restored it)
                if self._age(keys.pack(pack_id)) >= self.grace:
                    soft.append(pack_id)
                else:
                    self.report.kept.add(self._size(pack_id))
            elif marker is None:
                if self._age(keys.pack(pack_id)) >= self.grace:
                    orphans.append(pack_id)
                else:
                    self.report.kept.add(self._size(pack_id))
            elif self._may_hard_delete(marker):
                self._hard_delete(pack_id, marker)
            else:
                self.report.waiting.add(self._size(pack_id))
        return soft, orphans

    def _drop_remains(self, pack_id: str, marker: _Marker | None) -> None:
        if pack_id in self.live_packs:
            self.report.problems.append(f"{keys.pack(pack_id)}: missing, and a live layer names it")
            return
        # Packs are listed before indexes, and an upload puts the pack before its index: a pack uploaded
        # between the two listings looks like an index without its pack. Look again; the next run sees it.
        if self.store.exists(keys.pack(pack_id)):
            return
        if pack_id in self.indexed:
            self.report.problems.append(f"{keys.index(pack_id)}: indexes a pack that does not exist; removed")
            self._delete(keys.index(pack_id))
        if marker is not None:
            self._delete(marker.key)

    def _restore(self, pack_id: str, marker: _Marker | None, *, reindex: bool) -> None:
        """Index a pack a layer names again (``reindex``) and drop its trash marker, in that order."""
        self.report.restored.add(self._size(pack_id))
        if self.dry_run:
            return
        if reindex:
            try:
                self.entries[pack_id] = {e.digest: e for e in restore_pack_index(self.store, pack_id)}
            except CorruptError as exc:
                self.report.problems.append(f"{keys.pack(pack_id)}: a live layer names it, but {exc}")
                return
        if marker is not None:
            self.store.delete(marker.key)

    def _may_hard_delete(self, marker: _Marker) -> bool:
        if self.now - marker.trashed < self.grace:
            return False
        # A build that began before the pack was trashed may have seen its index: it may still name it.
        return not any(lease.started < marker.trashed + CLOCK_SKEW for lease in self._live_leases())

    def _live_leases(self) -> list[LeaseInfo]:
        return [lease for lease in self.leases if lease.key.startswith(keys.LEASES)
                and not lease.is_stale(self.now, self.lease_max_age)]

    def _hard_delete(self, pack_id: str, marker: _Marker) -> None:
        size = self._size(pack_id)
        if self.dry_run:
            self.report.deleted.add(size)
            return
        pack_key = keys.pack(pack_id)
        # Checked again right before the delete: the listing is seconds to minutes old by now.
        try:
            rewritten = self.store.mtime(pack_key) > self.store.mtime(marker.key)
        except NotFoundError:
            rewritten = False  # one of them went since the listing: the delete below is harmless
        if rewritten or self.store.exists(keys.index(pack_id)):
            self.report.waiting.add(size)  # uploaded or restored again: the next run looks afresh
            return
        self.store.delete(pack_key)
        self.store.delete(marker.key)
        self.report.deleted.add(size)

    # -- repack

    def _repack(self) -> list[str]:
        """Copy the live chunks of sparse packs into new ones and point manifests at those; return the
        packs emptied, to be soft-deleted."""
        sparse = [p for p in sorted(self.live_packs & self.packs) if self._is_sparse(p)]
        if not sparse:
            return []
        for pack_id in sparse:
            self.report.repacked.add(self._size(pack_id))
        if self.dry_run:
            self.report.written.bytes = sum(self.entries[p][d].clen for p in sparse for d in self.live_chunks[p])
            return self._empty(sparse)
        new_index = ChunkIndex()
        copied: set[str] = set()
        with ChunkUploader(self.store, new_index, pack_target=self.pack_target) as uploader:
            for pack_id in sparse:
                try:
                    self._copy_live_chunks(pack_id, uploader)
                    copied.add(pack_id)
                except DsecError as exc:
                    self.report.problems.append(f"{keys.pack(pack_id)}: not repacked: {exc}")
            new_packs = uploader.flush()
        for pack_id in new_packs:
            self.report.written.add(self.store.size(keys.pack(pack_id)))
        kept_back = self._rewrite_manifests(copied, new_index)
        return self._empty(sorted(copied - kept_back))

    def _empty(self, pack_ids: list[str]) -> list[str]:
        """Packs no manifest names any more, after repacking: no longer live or kept."""
        for pack_id in pack_ids:
            self.report.kept.remove(self._size(pack_id))  # counted as trashed from now on
        self.live_packs.difference_update(pack_ids)
        return pack_ids

    def _is_sparse(self, pack_id: str) -> bool:
        entries = self.entries.get(pack_id)
        if entries is None or pack_id in self.pinned or self._age(keys.pack(pack_id)) < self.grace:
            return False
        total = sum(e.clen for e in entries.values())
        live = sum(entries[d].clen for d in self.live_chunks[pack_id])
        return live < self.repack_threshold * total

    def _copy_live_chunks(self, pack_id: str, uploader: ChunkUploader) -> None:
        entries = self.entries[pack_id]
        wanted = [(d, ChunkLocation(pack_id, entries[d].offset, entries[d].clen, entries[d].ulen))
                  for d in self.live_chunks[pack_id]]
        for digest, data in read_chunks(self.store, wanted).items():  # each chunk re-hashed on the way
            uploader.add(digest, len(data), compress.compress(data))

    def _rewrite_manifests(self, copied: set[str], new_index: ChunkIndex) -> set[str]:
        """Point every live layer that lists a copied pack at the new packs instead. Return the copied
        packs that must stay: a layer whose manifest changed since the mark still lists them."""
        kept_back: set[str] = set()
        for layer in sorted(self.layers.values(), key=lambda layer: layer.digest):
            if not layer.live or not copied.intersection(layer.manifest.packs):
                continue
            key = keys.layer_manifest(layer.digest)
            try:
                current = manifest_at(self.store, key)
            except DsecError as exc:
                self.report.problems.append(f"{key}: not rewritten: {exc}")
                current = None
            digests = self._layer_chunks(layer)
            if current is None or current.packs != layer.manifest.packs or digests is None:
                # Changed since the mark (a rebuild of the same layer) or unreadable: leave it as it is.
                kept_back |= copied.intersection(layer.manifest.packs + (current.packs if current else []))
                continue
            needed = set()
            for pack_id in copied.intersection(current.packs):
                for digest in digests & self.live_chunks[pack_id]:
                    needed.add(new_index.get(digest).pack_id)
            packs = sorted((set(current.packs) - copied) | needed)
            self.store.put(key, dataclasses.replace(current, packs=packs).to_json())
            layer.manifest = dataclasses.replace(current, packs=packs)
        return kept_back

    # -- soft delete and the second look

    def _soft_delete(self, soft: list[str], orphans: list[str]) -> None:
        for pack_id in soft + orphans:
            self.report.trashed.add(self._size(pack_id))
        if self.dry_run or not (soft or orphans):
            return
        for pack_id in soft:
            self.store.delete(keys.index(pack_id))
        trashed = time.time()  # after every delete: a lease that began later cannot have seen them
        body = json.dumps({"trashed": trashed}).encode()
        for pack_id in soft + orphans:
            self.store.put(keys.trash(pack_id), body)
        # The second look: a layer published (or rewritten by a rebuild) since the mark may name one of
        # them. Unreadable manifests were reported by the mark; nothing better can be done for them here.
        candidates = set(soft) | set(orphans)
        named = set()
        for layer in self._list_layers().values():
            if layer.manifest is not None:
                named |= candidates.intersection(layer.manifest.packs)
        for pack_id in sorted(named):
            self.report.trashed.remove(self._size(pack_id))
            self._restore(pack_id, _Marker(keys.trash(pack_id), trashed), reindex=True)

    # -- housekeeping

    def _remove_stale_leases(self) -> None:
        for lease in self.leases:
            if lease.is_stale(self.now, self.lease_max_age):
                self.report.leases_removed += 1
                self._delete(lease.key)

    def _remove_temp_files(self) -> None:
        store = find_wrapper(self.store, FilesystemStore)  # the backend under wrappers (retry, limits, ...)
        if store is None:
            return
        min_age = max(self.grace, TEMP_FILE_MIN_AGE)
        for path, mtime in store.temp_files():
            if self.now - mtime < min_age:
                continue
            self.report.temp_files_removed += 1
            if not self.dry_run:
                store.remove_temp_file(path)

    # -- helpers

    def _delete(self, key: str) -> None:
        if not self.dry_run:
            self.store.delete(key)

    def _size(self, pack_id: str) -> int:
        """Bytes of the pack object: from its index when we have it, else asked of the store."""
        entries = self.entries.get(pack_id)
        if entries:
            return pack_size(entries.values())
        try:
            return self.store.size(keys.pack(pack_id))
        except NotFoundError:
            return 0
