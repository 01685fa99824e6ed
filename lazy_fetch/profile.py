"""Access profiles: what sandboxes of a layer read first, learned from every mount's trace and shared
through the store, so that a node that never ran a layer starts it with what other nodes learned.

A profile is content-keyed: its entries name chunks by digest (and the file and chunk-in-file they were
read in), never by position in one build's blob. So it carries over: to a new release of the layer
(unchanged chunks keep their digests; a changed file's chunks are found again by path and chunk number)
and to any stack the layer is part of. ``to_prefetch_list`` turns a profile into the PrefetchList of a
layer (the chunks of that layer it names, in first-read order); prefetcher.py fetches it.

In the store (dsec_fs/store/keys.py)::

    profiles/layers/<layer digest>/<node id>   what the node <node id> learned of that layer
    profiles/names/<sha256 of the ref name>/<node id>   the same, under the layer's name (any tag): what a
                                                 new tag starts from when its own digest has no profile
    profiles/combinations/<combination id>/<layer digest>/<node id>   the same, learned only from what
                                                 the layer read for sandboxes of that one stack of layers
                                                 (trace_holders.combination_id); the body names the
                                                 combination, and an object under another key is refused

One object per node and key, written only by that node (it merges what it learned before into it), so
two nodes publishing at once never lose each other's update; a reader merges the objects of every
node (at most MAX_PUBLISHERS). An object is JSON with the sha256 of its body, at most MAX_PROFILE_BYTES
with at most MAX_ENTRIES entries: anything else (corrupt, truncated, oversized, from another format, a
body that does not match its checksum) is refused with a FormatError or IntegrityError naming the key,
and the daemon goes on without it (a profile only ever speeds a mount up). One lookup decodes at most
MAX_LOADED_ENTRIES entries of all the objects it merges; one past that is skipped too (UnsupportedError).

Merging: an entry's traces add up; its first-read time is the traces-weighted mean. A long run publishes
while it goes on (profile_keeper.PublishedRun): each publish of it takes what it published before back
out of the node's object (``without``) before merging in what it learned since, so a run counts as one
trace however often it published. A prefetch list takes
the entries read by at least ``min_fraction`` of the traces (prefetch_list.DEFAULT_MIN_FRACTION), so
what one odd run read is not fetched for everyone.

Threads: plain functions on values; the store calls block and run in worker threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.digest import from_hex, is_hex_digest, to_hex
from dsec_fs.errors import DsecError, FormatError, IntegrityError, NotFoundError, UnsupportedError
from dsec_fs.layer import utc_now
from dsec_fs.store.base import Store

from .layer_index import LayerIndex
from .prefetch_list import DEFAULT_MIN_FRACTION, PrefetchEntry, PrefetchList

log = logging.getLogger(__name__)

FORMAT = "dsecfs-profile"
VERSION = 1
MAX_PROFILE_BYTES = 8 << 20
MAX_ENTRIES = 100_000  # 100 GB of 1 MiB chunks read at a start is far beyond any workload
MAX_PUBLISHERS = 32  # node objects merged per key
# Node objects listed per key, the first MAX_PUBLISHERS of them in key order merged: anyone may write under
# a key, and listing all that is there could take any time and memory.
MAX_LISTED = 1024
# Entries decoded in one ``load``, over all the node objects it merges: MAX_PUBLISHERS objects of
# MAX_ENTRIES each would be 3.2 million, which anyone who can write the store can put there, and a mount
# waits for its lookup (measured: 32 objects of 85,000 entries took 76 s of decoding and merging and
# 1.8 GB in the daemon, load 6). What a start reads is hundreds of chunks; a node's object holds one
# layer's. Objects past the budget are skipped, as a damaged one is.
MAX_LOADED_ENTRIES = 2 * MAX_ENTRIES
MAX_PATH = 4096


@dataclass(frozen=True, slots=True)
class ProfileEntry:
    digest: bytes  # the chunk's sha256
    length: int
    first_read_us: int  # after the mount
    traces: int  # traces that read it
    path: str = ""  # the file it was read in ("" for a blob read no file could be named for)
    file_chunk: int = 0  # which chunk of that file


@dataclass
class Profile:
    layer: str  # the digest of the layer it was learned on (the newest, once merged)
    traces: int
    entries: list[ProfileEntry]  # in first-read order
    updated: str = field(default_factory=utc_now)
    combination: str = ""  # the combination id it was learned in (trace_holders.py); "" for any

    def encode(self) -> bytes:
        body = {"layer": self.layer, "traces": self.traces, "updated": self.updated,
                **({"combination": self.combination} if self.combination else {}),
                "entries": [[to_hex(e.digest), e.length, e.first_read_us, e.traces, e.path, e.file_chunk]
                            for e in self.entries]}
        body_bytes = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        return json.dumps({"format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(body_bytes).hexdigest(),
                           "body": body_bytes.decode()}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, *, source: str, budget: EntryBudget | None = None) -> Profile:
        """``budget``: entries this decode may take from (``load``'s), checked before any is validated."""
        def fail(structure: str, message: str) -> FormatError:
            return FormatError(structure, None, message, source=source)

        if len(data) > MAX_PROFILE_BYTES:
            raise fail("profile", f"{len(data)} bytes, over the limit of {MAX_PROFILE_BYTES}")
        try:
            outer = json.loads(data)
            if not isinstance(outer, dict) or outer.get("format") != FORMAT or outer.get("version") != VERSION:
                raise fail("profile", f"not a {FORMAT} object of version {VERSION}")
            body_text = outer["body"]
            if not isinstance(body_text, str):
                raise fail("profile", "body is not a string")
            body_bytes = body_text.encode()
            if hashlib.sha256(body_bytes).hexdigest() != outer.get("sha256"):
                raise IntegrityError("the body does not match its sha256", where=source)
            body = json.loads(body_bytes)
            layer, traces, raw_entries = body["layer"], body["traces"], body["entries"]
            combination = body.get("combination", "")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise fail("profile", f"not a profile: {exc!r:.200}") from None
        if not (isinstance(layer, str) and is_hex_digest(layer)):
            raise fail("profile.layer", "not a layer digest")
        if combination != "" and not (isinstance(combination, str) and is_hex_digest(combination)):
            raise fail("profile.combination", "not a combination id (64 lowercase hex)")
        if type(traces) is not int or not 1 <= traces <= 1 << 40:
            raise fail("profile.traces", f"{traces!r:.40} is not a positive count")
        if not isinstance(raw_entries, list) or len(raw_entries) > MAX_ENTRIES:
            raise fail("profile.entries", f"not a list of at most {MAX_ENTRIES} entries")
        if budget is not None and not budget.take(len(raw_entries)):
            raise UnsupportedError(f"{len(raw_entries)} entries, over what is left of the {budget.total} a lookup "
                                   "decodes from all of a key's node objects", where=source)
        entries = []
        for index, raw in enumerate(raw_entries):
            where = f"profile.entries[{index}]"
            if not (isinstance(raw, list) and len(raw) == 6):
                raise fail(where, "not a list of 6 fields")
            digest, length, first_read_us, entry_traces, path, file_chunk = raw
            if not (isinstance(digest, str) and is_hex_digest(digest)):
                raise fail(where, "digest is not 64 lowercase hex")
            if not all(type(v) is int and v >= 0 for v in (length, first_read_us, entry_traces, file_chunk)):
                raise fail(where, "length, first_read_us, traces and file_chunk must be non-negative integers")
            if not 1 <= entry_traces <= traces or not isinstance(path, str) or len(path) > MAX_PATH:
                raise fail(where, "traces out of range, or a bad path")
            entries.append(ProfileEntry(from_hex(digest), length, first_read_us, entry_traces, path, file_chunk))
        return cls(layer=layer, traces=traces, entries=entries, updated=str(body.get("updated", "")),
                   combination=combination)


class EntryBudget:
    """Profile entries one ``load`` may still decode (MAX_LOADED_ENTRIES), taken by its threads."""

    def __init__(self, total: int):
        self.total = total
        self._left = total
        self._lock = threading.Lock()  # guards _left

    def take(self, count: int) -> bool:
        """Take ``count`` entries if that many are left."""
        with self._lock:
            if count > self._left:
                return False
            self._left -= count
            return True


def learned_from(layer: LayerIndex, first_read: dict[int, int], *, combination: str = "") -> Profile | None:
    """The profile of one trace of ``layer`` (learned in ``combination``, if one) whose readers (not the
    prefetcher) first read blob-map entry ``e`` at ``first_read[e]`` ns into it (``LayerIndex.access(trace)
    .use.first_read``), in first-read order; None if they read nothing."""
    if not first_read:
        return None
    entries = []
    for entry, first_ns in sorted(first_read.items(), key=lambda item: item[1]):
        _blkaddr, digest, length = layer.blob_map.entries[entry]
        owner = layer.owner[entry]
        path, file_chunk = ("", 0) if owner is None else (layer.files[owner[0]].path, owner[1] >> layer.chunk_bits)
        entries.append(ProfileEntry(digest, length, first_ns // 1000, 1, path, file_chunk))
    return Profile(layer=layer.digest, traces=1, entries=entries[:MAX_ENTRIES], combination=combination)


def merge(profiles: Iterable[Profile], *, layer: str | None = None) -> Profile | None:
    """One profile of what all of ``profiles`` saw (``layer``: the digest to name; default the first's;
    the combination is the first's)."""
    profiles = list(profiles)
    if not profiles:
        return None
    merged: dict[bytes, list] = {}  # digest -> [traces, sum of first_read_us * traces, length, path, chunk]
    for profile in profiles:
        for e in profile.entries:
            seen = merged.get(e.digest)
            if seen is None:
                merged[e.digest] = [e.traces, e.first_read_us * e.traces, e.length, e.path, e.file_chunk]
            else:
                seen[0] += e.traces
                seen[1] += e.first_read_us * e.traces
    traces = sum(p.traces for p in profiles)
    entries = sorted((ProfileEntry(digest, length, weighted // count, min(count, traces), path, chunk)
                      for digest, (count, weighted, length, path, chunk) in merged.items()),
                     key=lambda e: (e.first_read_us, -e.traces))
    if len(entries) > MAX_ENTRIES:  # keep what most traces read
        keep = set(sorted(entries, key=lambda e: -e.traces)[:MAX_ENTRIES])
        entries = [e for e in entries if e in keep]
    return Profile(layer=layer or profiles[0].layer, traces=traces, entries=entries,
                   combination=profiles[0].combination)


def without(profile: Profile, part: Profile) -> Profile | None:
    """``profile`` with ``part``, which was merged into it, taken out again (None if nothing is left):
    traces and the weighted first-read times subtract as they added. Exact unless a bound dropped
    entries of ``part`` from ``profile`` meanwhile (those are simply not there to take out)."""
    taken = {e.digest: e for e in part.entries}
    entries = []
    for e in profile.entries:
        t = taken.get(e.digest)
        if t is None:
            entries.append(e)
        elif e.traces > t.traces:
            traces = e.traces - t.traces
            first = max(0, (e.first_read_us * e.traces - t.first_read_us * t.traces) // traces)
            entries.append(ProfileEntry(e.digest, e.length, first, traces, e.path, e.file_chunk))
    traces = profile.traces - part.traces
    if traces <= 0 or not entries:
        return None
    entries.sort(key=lambda e: (e.first_read_us, -e.traces))
    return Profile(layer=profile.layer, traces=traces, entries=entries, combination=profile.combination)


def to_prefetch_list(profile: Profile, digest: str, blob_map: EncodedBlobMap, layer_index: Callable[[], LayerIndex], *,
                     min_fraction: float = DEFAULT_MIN_FRACTION) -> PrefetchList:
    """The chunks of layer ``digest`` that ``profile`` says at least ``min_fraction`` of its traces read,
    in first-read order: found by digest in ``blob_map``, else (the file changed since) by path and chunk
    number in ``layer_index()``, which is only built if some entry needs it (it walks the whole image)."""
    need = max(1, math.ceil(min_fraction * profile.traces - 1e-9))
    by_digest = blob_map.indexes_of(e.digest for e in profile.entries if e.traces >= need)
    by_path: dict[str, tuple[int | None, ...]] | None = None
    chosen: list[PrefetchEntry] = []
    seen: set[int] = set()
    for e in profile.entries:
        if e.traces < need:
            continue
        index = by_digest.get(e.digest)
        if index is None and e.path:
            if by_path is None:
                by_path = {file.path: file.chunks for file in layer_index().files.values()}
            chunks = by_path.get(e.path, ())
            index = chunks[e.file_chunk] if e.file_chunk < len(chunks) else None
        if index is None or index in seen:
            continue
        seen.add(index)
        blkaddr, chunk_digest, length = blob_map.entries[index]
        chosen.append(PrefetchEntry(chunk=index, digest=chunk_digest, offset=blkaddr * blob_map.block_size,
                                    length=length, first_read_us=e.first_read_us, traces=e.traces))
    return PrefetchList(layer=digest, chunk_size=blob_map.chunk_size, traces=profile.traces,
                        min_fraction=min_fraction, entries=chosen)


# ---- in the store ------------------------------------------------------------------------------------


def name_id(ref_name: str) -> str:
    """The store's name for a ref name (any characters, any length) in profile keys."""
    return hashlib.sha256(ref_name.encode()).hexdigest()


def fetch(store: Store, prefix: str, *, combination: str = "", layer: str = "") -> Profile | None:
    """The merged profile of every node's object under ``prefix`` (keys.*_profiles): ``listed`` then
    ``load``; None when there are none (or the store fails: a profile is only ever a help)."""
    names = listed(store, prefix)
    return load(store, names, combination=combination, layer=layer) if names else None


def listed(store: Store, prefix: str) -> list[str]:
    """The keys of the node objects under ``prefix`` (at most MAX_PUBLISHERS, of the first MAX_LISTED the
    store lists); [] if the store fails."""
    try:
        return sorted(store.list_at_most(prefix, MAX_LISTED))[:MAX_PUBLISHERS]
    except DsecError as exc:
        log.warning("cannot list the profiles under %s: %s", prefix, exc)
        return []


def load(store: Store, names: list[str], *, combination: str = "", layer: str = "") -> Profile | None:
    """The merged profile of the node objects ``names``, each read in one request, side by side; objects
    that do not decode, or (given ``combination`` and ``layer``) are not of that combination and layer,
    are logged and skipped; None when none is left."""

    budget = EntryBudget(MAX_LOADED_ENTRIES)

    def load_one(key: str) -> Profile | None:
        try:
            found = Profile.decode(store.get_at_most(key, MAX_PROFILE_BYTES), source=key, budget=budget)
            if combination and (found.combination, found.layer) != (combination, layer):
                raise FormatError("profile.combination", None, f"learned on layer {found.layer[:12]} in "
                                  f"combination {found.combination[:12] or '(none)'}, not this key's", source=key)
            return found
        except NotFoundError:
            return None
        except DsecError as exc:
            log.warning("ignoring the profile %s: %s", key, exc)
            return None

    if not names:
        return None
    with ThreadPoolExecutor(max_workers=min(8, len(names)), thread_name_prefix="profile") as pool:
        found = [p for p in pool.map(load_one, names) if p is not None]
    return merge(found) if found else None


def publish(store: Store, key: str, learned: Profile, *, replacing: Profile | None = None) -> Profile:
    """Merge ``learned`` into this node's object at ``key`` (what it published before, if readable) and
    write it back; returns what was written. ``replacing``: what the same run published at ``key`` before
    (``learned`` holds all of it and more), taken out first."""
    try:
        # At most MAX_PROFILE_BYTES read: anyone may write the key, and a node must not read a huge object.
        previous = Profile.decode(store.get_at_most(key, MAX_PROFILE_BYTES), source=key)
    except NotFoundError:
        previous = None
    except DsecError as exc:
        log.warning("replacing this node's unreadable profile %s: %s", key, exc)
        previous = None
    if previous is not None and previous.combination != learned.combination:
        log.warning("replacing this node's profile %s: it was of another combination", key)
        previous = None
    if previous is not None and replacing is not None:
        previous = without(previous, replacing)
    merged = merge([learned] + ([previous] if previous else []), layer=learned.layer)
    data = merged.encode()
    while len(data) > MAX_PROFILE_BYTES:  # many distinct paths: keep what the most traces read
        merged.entries = sorted(merged.entries, key=lambda e: -e.traces)[:len(merged.entries) // 2]
        merged.entries.sort(key=lambda e: (e.first_read_us, -e.traces))
        data = merged.encode()
    store.put(key, data)
    return merged
