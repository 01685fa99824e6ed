"""Prefetch lists: the chunks a layer's sandboxes are expected to read, in the order they first need them.

A list is learned from access traces (``learn``): a chunk goes on it when at least ``min_fraction`` of the
training traces read it, and the list is ordered by when readers first needed each chunk (the median,
over the traces that read it, of the time of its first read), so a prefetcher working down the list gets
the first-needed chunks first. The node daemon fetches a layer's list in the background when it mounts
the layer, behind on-demand reads.

The input to learning and scoring is a ``ChunkUse`` per trace: which blob-map entries its readers needed,
when each was first needed, and which reads had to wait for a fetch. lazy_fetch.analysis derives it from a
trace and the layer's image (``LayerIndex.access(trace).use``).

File format: versioned JSON, one object:

    format        "dsecfs-prefetch-list"
    version       1
    layer         digest of the layer the list was learned on (64 hex)
    chunk_size    that layer's chunk size
    block_size    its blob's block size (4096)
    traces        how many traces it was learned from
    min_fraction  the share of those traces that had to read a chunk for it to be listed
    created       ISO-8601 UTC
    entries       in prefetch order, each {chunk, digest, offset, length, first_read_us, traces}:
                  chunk      blob-map entry number
                  digest     sha256 hex of the chunk (its name in the store)
                  offset     byte offset of the chunk in the layer's virtual blob (block aligned)
                  length     bytes of chunk data
                  first_read_us  median time, after the mount, of the first read of the chunk
                  traces     training traces that read it

``load`` validates every field and names the file and the entry at fault (FormatError), and
``PrefetchList.verify(blob_map)`` checks a list against the layer it is about to be used on (every entry
is that blob-map entry: same offset, length and digest), so a list for another build is refused, not
half-applied.

``evaluate`` scores a list against what a trace read: hits, wasted bytes, and the fetch waits it would
have saved. Saved waits are an upper bound: they assume the prefetch finished before the read.

Threads: plain functions and values that are not changed after they are made; any thread.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsec_fs.digest import from_hex, is_hex_digest, short, to_hex
from dsec_fs.errors import FormatError, InputError, IntegrityError, UnsupportedError
from dsec_fs.files import write_atomic
from dsec_fs.layer import utc_now
from dsec_fs.blobmap import BLOCK_SIZE, EncodedBlobMap, check_chunk_size

FORMAT = "dsecfs-prefetch-list"
VERSION = 1
DEFAULT_MIN_FRACTION = 0.5
_ENTRY_FIELDS = ("chunk", "digest", "offset", "length", "first_read_us", "traces")


@dataclass(frozen=True, slots=True)
class Wait:
    """A read that had to fetch chunks from the store before it could be answered."""

    end_ns: int  # when it was answered, ns after the mount started
    latency_us: int  # how long it took
    nid: int  # the file read (for a kernel-mode read, the file that holds its first chunk)
    entries: tuple[int, ...]  # blob-map entries the read needed


@dataclass
class ChunkUse:
    """What one trace's readers needed of one layer's blob."""

    first_read: dict[int, int] = field(default_factory=dict)  # blob-map entry -> ns of its first read
    waits: list[Wait] = field(default_factory=list)  # reads that fetched, in trace order


@dataclass(frozen=True, slots=True)
class PrefetchEntry:
    chunk: int  # blob-map entry number
    digest: bytes
    offset: int  # byte offset in the virtual blob
    length: int  # bytes of chunk data
    first_read_us: int  # median first-read time over the training traces that read it
    traces: int  # training traces that read it


@dataclass
class PrefetchList:
    layer: str
    chunk_size: int
    traces: int
    min_fraction: float
    entries: list[PrefetchEntry]
    created: str = field(default_factory=utc_now)
    block_size: int = BLOCK_SIZE
    version: int = VERSION

    @property
    def bytes(self) -> int:
        return sum(entry.length for entry in self.entries)

    @property
    def chunks(self) -> frozenset[int]:
        return frozenset(entry.chunk for entry in self.entries)

    def to_json(self) -> bytes:
        obj = {
            "format": FORMAT, "version": self.version, "layer": self.layer, "chunk_size": self.chunk_size,
            "block_size": self.block_size, "traces": self.traces, "min_fraction": self.min_fraction,
            "created": self.created,
            "entries": [{"chunk": e.chunk, "digest": to_hex(e.digest), "offset": e.offset, "length": e.length,
                         "first_read_us": e.first_read_us, "traces": e.traces} for e in self.entries],
        }
        return (json.dumps(obj, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> PrefetchList:
        """Parse and validate; FormatError names ``source`` and the field or entry at fault."""

        def fail(structure: str, message: str) -> FormatError:
            return FormatError(structure, None, message, source=source)

        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise fail("prefetch list", f"not JSON: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise fail("prefetch list", f"not a prefetch list (no \"format\": \"{FORMAT}\")")
        version = obj.get("version")
        if type(version) is not int:
            raise fail("prefetch list field 'version'", f"expected an integer, got {version!r}")
        if version != VERSION:
            raise UnsupportedError(f"prefetch list version {version}, this reader knows only {VERSION}",
                                   where=source)
        for name, ok in (("layer", lambda v: isinstance(v, str) and is_hex_digest(v)),
                         ("chunk_size", lambda v: type(v) is int),
                         ("block_size", lambda v: v == BLOCK_SIZE),
                         ("traces", lambda v: type(v) is int and v >= 0),
                         ("min_fraction", lambda v: type(v) in (int, float) and 0 <= v <= 1),
                         ("created", lambda v: isinstance(v, str)),
                         ("entries", lambda v: isinstance(v, list))):
            if name not in obj or not ok(obj[name]):
                raise fail(f"prefetch list field {name!r}", f"missing or invalid: {obj.get(name)!r:.80}")
        try:
            check_chunk_size(obj["chunk_size"])
        except InputError as exc:
            raise fail("prefetch list field 'chunk_size'", exc.message) from None
        entries = [_entry_from_json(raw, i, obj, fail) for i, raw in enumerate(obj["entries"])]
        seen: dict[int, int] = {}
        for i, entry in enumerate(entries):
            if entry.chunk in seen:
                raise fail(f"prefetch list entry {i}", f"chunk {entry.chunk} is already entry {seen[entry.chunk]}")
            seen[entry.chunk] = i
        return cls(layer=obj["layer"], chunk_size=obj["chunk_size"], traces=obj["traces"],
                   min_fraction=float(obj["min_fraction"]), entries=entries, created=obj["created"])

    def verify(self, blob_map: EncodedBlobMap, *, layer: str) -> None:
        """IntegrityError unless every entry is exactly that entry of ``blob_map`` of layer ``layer``."""
        where = f"prefetch list for layer {self.layer[:12]}"
        if layer != self.layer:
            raise IntegrityError(f"the list is for layer {self.layer}, not {layer}", where=where)
        for i, entry in enumerate(self.entries):
            if entry.chunk >= len(blob_map.entries):
                raise IntegrityError(f"chunk {entry.chunk} is past the blob map's {len(blob_map)} entries",
                                     where=f"{where}: entry {i}")
            blkaddr, digest, length = blob_map.entries[entry.chunk]
            if (blkaddr * blob_map.block_size, digest, length) != (entry.offset, entry.digest, entry.length):
                raise IntegrityError(f"chunk {entry.chunk} is {short(digest)} ({length} bytes at block {blkaddr}) "
                                     f"in the blob map, the list says {short(entry.digest)} ({entry.length} bytes "
                                     f"at byte {entry.offset})", where=f"{where}: entry {i}")


def _entry_from_json(raw, index: int, obj: dict, fail) -> PrefetchEntry:
    structure = f"prefetch list entry {index}"
    if not isinstance(raw, dict) or sorted(raw) != sorted(_ENTRY_FIELDS):
        raise fail(structure, f"expected an object with exactly the fields {', '.join(_ENTRY_FIELDS)}")
    if not all(type(raw[name]) is int and raw[name] >= 0 for name in _ENTRY_FIELDS if name != "digest"):
        raise fail(structure, "chunk, offset, length, first_read_us and traces must be non-negative integers")
    if not isinstance(raw["digest"], str) or not is_hex_digest(raw["digest"]):
        raise fail(structure, f"digest is not 64 lowercase hex: {raw['digest']!r:.80}")
    if raw["offset"] % obj["block_size"]:
        raise fail(structure, f"offset {raw['offset']} is not block aligned")
    if not 1 <= raw["length"] <= obj["chunk_size"]:
        raise fail(structure, f"length {raw['length']} outside 1..{obj['chunk_size']}")
    if raw["traces"] > obj["traces"]:
        raise fail(structure, f"read by {raw['traces']} traces of the {obj['traces']} it was learned from")
    return PrefetchEntry(chunk=raw["chunk"], digest=from_hex(raw["digest"]), offset=raw["offset"],
                         length=raw["length"], first_read_us=raw["first_read_us"], traces=raw["traces"])


def learn(uses: Sequence[ChunkUse], blob_map: EncodedBlobMap, *, layer: str,
          min_fraction: float = DEFAULT_MIN_FRACTION) -> PrefetchList:
    """The chunks at least ``min_fraction`` of ``uses`` read (at least one), by median first-read time."""
    if not 0 <= min_fraction <= 1:
        raise InputError(f"min_fraction must be within 0..1, got {min_fraction}", where="prefetch list")
    times: dict[int, list[int]] = {}
    for use in uses:
        for chunk, first_ns in use.first_read.items():
            times.setdefault(chunk, []).append(first_ns)
    need = max(1, math.ceil(min_fraction * len(uses) - 1e-9))
    chosen = sorted((statistics.median_low(ns), -len(ns), chunk) for chunk, ns in times.items() if len(ns) >= need)
    entries = []
    for median_ns, minus_traces, chunk in chosen:
        blkaddr, digest, length = blob_map.entries[chunk]
        entries.append(PrefetchEntry(chunk=chunk, digest=digest, offset=blkaddr * blob_map.block_size,
                                     length=length, first_read_us=median_ns // 1000, traces=-minus_traces))
    return PrefetchList(layer=layer, chunk_size=blob_map.chunk_size, traces=len(uses), min_fraction=min_fraction,
                        entries=entries)


def save(plist: PrefetchList, path: str | os.PathLike) -> None:
    """Write atomically (temporary file, then rename), so the daemon never reads half a list."""
    write_atomic(path, plist.to_json(), mode=0o644, sync=False)


def load(path: str | os.PathLike) -> PrefetchList:
    path = os.fspath(path)
    with open(path, "rb") as f:
        return PrefetchList.from_json(f.read(), source=path)


@dataclass(frozen=True)
class PrefetchScore:
    """How a prefetch list did on held-out traces (sums over them; each trace starts with a cold cache)."""

    list_chunks: int
    list_bytes: int
    traces: int  # held-out traces scored
    needed_bytes: int  # bytes of the chunks the traces read
    hit_bytes: int  # of those, bytes on the list
    wasted_bytes: int  # bytes on the list that a trace did not read, summed over traces
    waits: int  # reads that waited for a fetch
    wait_us: int  # their latency
    saved_waits: int  # of those, reads whose every chunk was on the list
    saved_wait_us: int

    @property
    def coverage(self) -> float:
        """Share of the needed bytes that the list fetched ahead (recall)."""
        return self.hit_bytes / self.needed_bytes if self.needed_bytes else 0.0

    @property
    def precision(self) -> float:
        """Share of the prefetched bytes that were read."""
        prefetched = self.list_bytes * self.traces
        return self.hit_bytes / prefetched if prefetched else 0.0

    @property
    def saved_wait_fraction(self) -> float:
        return self.saved_wait_us / self.wait_us if self.wait_us else 0.0


def evaluate(plist: PrefetchList, uses: Sequence[ChunkUse], blob_map: EncodedBlobMap) -> PrefetchScore:
    """Score ``plist`` against held-out traces as if each had started with the list prefetched."""
    listed = plist.chunks
    lengths = blob_map.lengths
    needed = hit = waits = wait_us = saved = saved_us = 0
    for use in uses:
        needed += sum(lengths[c] for c in use.first_read)
        hit += sum(lengths[c] for c in use.first_read if c in listed)
        for wait in use.waits:
            waits += 1
            wait_us += wait.latency_us
            if wait.entries and listed.issuperset(wait.entries):
                saved += 1
                saved_us += wait.latency_us
    list_bytes = plist.bytes
    return PrefetchScore(list_chunks=len(plist.entries), list_bytes=list_bytes, traces=len(uses),
                         needed_bytes=needed, hit_bytes=hit, wasted_bytes=list_bytes * len(uses) - hit,
                         waits=waits, wait_us=wait_us, saved_waits=saved, saved_wait_us=saved_us)
