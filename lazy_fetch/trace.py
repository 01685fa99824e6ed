"""Access traces: what one mount of one layer read, compactly, for prefetch lists and reports.

A trace file is a header followed by fixed-size records, appended while the mount lives:

    magic   8 bytes  b"DSECTRC1"
    length  le32     size of the JSON header that follows
    header  JSON     TraceHeader: layer digest, ref, role, sandbox combination, holders, mode, chunk size,
                     sizes, the profile its mount prefetched by
    records          RECORD entries, 40 bytes each, until the end of the file

Records are fixed-size so a trace cut short by a crash loses at most its last, partial record (reported,
not fatal, see ``read_trace(strict=False)``) and so a reader can seek. In fuse mode a record names the
file read (``nid``, offset within the file); in kernel mode the daemon only sees reads of the virtual
blob, so ``nid`` is 0 and ``offset`` is a blob offset; reports map blob ranges back to files through the
layer's image. ``chunk`` is the blob-map index of the first chunk the read touched (NO_CHUNK for a hole).

Retention. Trace files are named ``*.dtr`` (TRACE_SUFFIX) and pile up on a node as mounts come and go;
``prune_traces`` removes the oldest closed ones by age and by total size (the daemon runs it at start and
now and then, keeping its open traces; ``dsecfs trace prune`` runs it by hand).

Threads: a TraceWriter is used by one trio task (the mount's); writes go to a buffered file and are
flushed every FLUSH_RECORDS records and at close, so tracing adds no syscall per read. A write that fails
(a full disk) ends the trace, logged, never the read it records or the daemon. ``prune_traces``
touches only files and may run in any thread.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import BinaryIO

from dsec_fs.errors import FormatError, UnsupportedError
from dsec_fs.files import unlink_if_present

log = logging.getLogger(__name__)

MAGIC = b"DSECTRC1"
PREAMBLE = struct.Struct("<8sI")  # magic, header length
RECORD = struct.Struct(
    "<"
    "Q"  # 0 time_ns: nanoseconds since the trace started
    "Q"  # 8 nid: the inode read (fuse mode); 0 for a read of the virtual blob (kernel mode)
    "Q"  # 16 offset: within the file (fuse mode) or the blob (kernel mode)
    "I"  # 24 length: bytes asked for
    "I"  # 28 chunk: blob-map index of the first chunk touched; NO_CHUNK when the read hit only holes
    "I"  # 32 latency_us: time to answer the read, microseconds
    "B"  # 36 flags: FLAG_* below
    "3s"  # 37 reserved
)
assert RECORD.size == 40
NO_CHUNK = 0xFFFFFFFF
FLAG_MISS = 0x1  # at least one chunk had to be fetched from the store
FLAG_BLOB = 0x2  # a kernel-mode read of the virtual blob (nid is 0)
FLAG_ERROR = 0x4  # the read failed (EIO)
FLAG_PREFETCH = 0x8  # issued by the prefetcher, not by a reader
MAX_HEADER = 1 << 20
TRACE_SUFFIX = ".dtr"
FLUSH_RECORDS = 256
VERSION = 1


@dataclass
class TraceHeader:
    layer: str  # layer digest
    ref: str = ""  # NAME:TAG the layer was mounted as, if any
    role: str = ""  # base | workspace | toolkit | "" (a bare mount; or holders of several roles)
    combination: str = ""  # trace_holders.combination_id of the sandbox's stack; "" bare or shared
    holders: int = 1  # distinct holders (trace_holders.Label) sharing the blob while this was written
    prefetch: str = ""  # what the mount prefetched by: a list's path, "profile:layer|name|combination", ""
    profile_key: str = ""  # the store prefix of the profile it prefetched by
    mode: str = "kernel"  # kernel | fuse
    chunk_size: int = 0
    layer_bytes: int = 0  # sum of regular file sizes in the layer
    layer_files: int = 0
    blob_bytes: int = 0
    started_ns: int = field(default_factory=time.time_ns)  # wall clock at start, ns since the epoch
    version: int = VERSION


@dataclass(frozen=True, slots=True)
class TraceRecord:
    time_ns: int
    nid: int
    offset: int
    length: int
    chunk: int
    latency_us: int
    flags: int

    @property
    def miss(self) -> bool:
        return bool(self.flags & FLAG_MISS)


class TraceWriter:
    def __init__(self, path: str, header: TraceHeader, *, start_ns: int | None = None):
        """``start_ns``: the time.monotonic_ns() records count from (default: now); the header's
        ``started_ns`` should be the same moment on the wall clock."""
        self.path = path
        self.header = header
        self._start = time.monotonic_ns() if start_ns is None else start_ns
        self._pending: list[bytes] = []
        header_bytes = json.dumps(asdict(header), sort_keys=True).encode()
        self._file: BinaryIO = open(path, "wb")
        try:
            self._file.write(PREAMBLE.pack(MAGIC, len(header_bytes)) + header_bytes)
            self._file.flush()
        except OSError:
            self._give_up_quietly()
            raise

    def record(self, *, nid: int, offset: int, length: int, chunk: int, latency_us: int, flags: int,
               time_ns: int | None = None) -> None:
        """Append one read; ``time_ns`` (since the trace started) defaults to now, tools that replay or
        synthesise a workload pass their own."""
        elapsed = time.monotonic_ns() - self._start if time_ns is None else time_ns
        self._pending.append(RECORD.pack(elapsed, nid, offset, length, chunk, min(latency_us, 0xFFFFFFFF),
                                         flags, b"\0\0\0"))
        if len(self._pending) >= FLUSH_RECORDS:
            self.flush()

    def flush(self) -> None:
        if self._pending and not self._file.closed:
            try:
                self._file.write(b"".join(self._pending))
                self._file.flush()
            except OSError as exc:
                self._give_up(exc)
        self._pending.clear()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            try:
                self._file.close()
            except OSError as exc:
                self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        """A write failed (ENOSPC: the sandboxes' upper dirs share the state directory's disk; EIO): the
        trace ends here, and what reads it finds at most its last record cut short (``strict=False``)."""
        log.error("cannot write the trace %s: %s; it ends here, and the mount's reads go on untraced", self.path,
                  exc.strerror or exc)
        self._give_up_quietly()

    def _give_up_quietly(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # the buffer's flush failed again; the descriptor is closed all the same


@dataclass
class Trace:
    path: str
    header: TraceHeader
    records: list[TraceRecord]
    truncated: bool = False  # the file ended inside a record (a crash while writing)


def read_header(f: BinaryIO, path: str) -> TraceHeader:
    preamble = f.read(PREAMBLE.size)
    if len(preamble) < PREAMBLE.size:
        raise FormatError("trace preamble", 0, f"file is {len(preamble)} bytes, too short for a trace", source=path)
    magic, length = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise FormatError("trace preamble", 0, f"bad magic {magic!r}, expected {MAGIC!r}", source=path)
    if length > MAX_HEADER:
        raise FormatError("trace header", PREAMBLE.size, f"header length {length} exceeds {MAX_HEADER}", source=path)
    raw = f.read(length)
    if len(raw) != length:
        raise FormatError("trace header", PREAMBLE.size, "file ends inside the header", source=path)
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError("trace header", PREAMBLE.size, f"not JSON: {exc}", source=path) from None
    if not isinstance(fields, dict):
        raise FormatError("trace header", PREAMBLE.size, "header is not a JSON object", source=path)
    if fields.get("version") != VERSION:
        raise UnsupportedError(f"trace version {fields.get('version')!r}", where=path)
    known = TraceHeader.__dataclass_fields__
    try:
        header = TraceHeader(**{k: v for k, v in fields.items() if k in known})
    except TypeError as exc:
        raise FormatError("trace header", PREAMBLE.size, str(exc), source=path) from None
    for name, spec in known.items():
        expected = int if spec.type in ("int", int) else str
        if type(getattr(header, name)) is not expected:  # JSON true/false would pass isinstance(..., int)
            raise FormatError("trace header", PREAMBLE.size, f"field {name!r} is not {expected.__name__}",
                              source=path)
    return header


def iter_records(f: BinaryIO, path: str, data_offset: int) -> Iterator[TraceRecord]:
    """Records from the current position; a partial last record raises FormatError naming its index."""
    index = 0
    while True:
        raw = f.read(RECORD.size * 1024)
        if not raw:
            return
        whole = len(raw) - len(raw) % RECORD.size
        for fields in RECORD.iter_unpack(raw[:whole]):
            record = TraceRecord(*fields[:7])
            if record.flags & ~(FLAG_MISS | FLAG_BLOB | FLAG_ERROR | FLAG_PREFETCH):
                raise FormatError(f"trace record {index}", data_offset + index * RECORD.size,
                                  f"unknown flags {record.flags:#x}", source=path)
            yield record
            index += 1
        if whole != len(raw):
            raise FormatError(f"trace record {index}", data_offset + index * RECORD.size,
                              f"truncated: {len(raw) - whole} of {RECORD.size} bytes", source=path)


def read_trace(path: str, *, strict: bool = False, skip: int = 0) -> Trace:
    """Load a whole trace, or its records after the first ``skip`` (what a reader read before: a live
    trace's records are appended, never changed). A truncated last record is dropped (``truncated`` set)
    unless ``strict``."""
    with open(path, "rb") as f:
        header = read_header(f, path)
        data_offset = f.tell() + skip * RECORD.size
        f.seek(data_offset)
        records: list[TraceRecord] = []
        try:
            records.extend(iter_records(f, path, data_offset))
        except FormatError as exc:
            if strict or "truncated" not in exc.message:
                raise
            return Trace(path, header, records, truncated=True)
    return Trace(path, header, records)


def join_segments(traces: list[Trace]) -> Trace:
    """The segments of one served blob's trace (trace_holders.py), one after the other, as one trace on
    the time base of the first (their headers' ``started_ns`` say how far apart they start)."""
    first = traces[0]
    records: list[TraceRecord] = []
    for t in traces:
        shift = max(0, t.header.started_ns - first.header.started_ns)
        records += [replace(r, time_ns=r.time_ns + shift) for r in t.records] if shift else t.records
    return Trace(first.path, first.header, records, truncated=any(t.truncated for t in traces))


@dataclass(frozen=True)
class PruneResult:
    removed: list[str]  # paths, oldest first
    removed_bytes: int
    kept: int  # trace files left
    kept_bytes: int


def prune_traces(directory: str, *, max_bytes: int | None, max_age: float | None, keep: frozenset[str] = frozenset(),
                 now: float | None = None, dry_run: bool = False) -> PruneResult:
    """Remove the ``*.dtr`` files directly in ``directory`` that are older than ``max_age`` seconds (by
    mtime: when they were last written), then the oldest others until the rest fit in ``max_bytes``.
    Paths in ``keep`` (traces still being written) stay whatever their age. None means no such limit."""
    now = time.time() if now is None else now
    traces = []  # (mtime, path, size)
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(TRACE_SUFFIX) and entry.is_file(follow_symlinks=False):
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed meanwhile
                    continue
                traces.append((info.st_mtime, entry.path, info.st_size))
    traces.sort()
    total = sum(size for _mtime, _path, size in traces)
    removed, removed_bytes = [], 0
    for mtime, path, size in traces:
        too_old = max_age is not None and now - mtime > max_age
        too_big = max_bytes is not None and total > max_bytes
        if path in keep or not (too_old or too_big):
            continue
        if not dry_run:
            unlink_if_present(path)
        removed.append(path)
        removed_bytes += size
        total -= size
    return PruneResult(removed, removed_bytes, len(traces) - len(removed), total)
