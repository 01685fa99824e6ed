"""Searching fixed-width records for a field's bytes: the offsets where ``pattern`` stands in ``data`` at a
record's field, not across records by chance. Used on a blob map's entries (dsec_fs.blobmap: a digest) and
on an image's chunk indexes (erofs_builder.patch: a device and blkaddr). No state; any thread.

The search looks for the pattern's longest run of non-zero bytes (its anchor), then checks the whole
pattern where the anchor stands. ``bytes.find`` skips ahead only past bytes the pattern lacks, and a
pattern holding a zero byte skips almost nowhere in data that is mostly zeros (an EROFS image: 72% of
Debian's meta.erofs): a chunk index (advise 0, device 1, a blkaddr under 2**24) searched whole took
2.2 ms over that image, its anchor (the blkaddr's two or three low bytes) 0.27 ms, for the same offsets
(docs/benchmarks.md, issue 17, rebuild14). A run shorter than MIN_ANCHOR would match too often to gain:
the whole pattern is searched then.
"""

from __future__ import annotations

from collections.abc import Iterator

MIN_ANCHOR = 2


def field_matches(data: bytes, pattern: bytes, *, origin: int, stride: int, phase: int,
                  start: int = 0) -> Iterator[int]:
    """Offsets, from ``start`` on and in order, where ``pattern`` stands in ``data`` at ``phase`` bytes
    into a record of ``stride`` bytes, records laid end to end from ``origin``."""
    skip, anchor = _anchor(pattern)
    at = data.find(anchor, max(start, origin) + skip)
    while at >= 0:
        first = at - skip
        if (first - origin) % stride == phase and (anchor is pattern or data.startswith(pattern, first)):
            yield first
        at = data.find(anchor, at + 1)


def _anchor(pattern: bytes) -> tuple[int, bytes]:
    """(offset in ``pattern``, bytes) of its longest run of non-zero bytes, the first of equal ones; the
    pattern itself (at 0) if it holds no zero byte or no run of MIN_ANCHOR bytes."""
    best_at, best = 0, b""
    at = 0
    for run in pattern.split(b"\0"):
        if len(run) > len(best):
            best_at, best = at, run
        at += len(run) + 1
    if len(best) == len(pattern) or len(best) < MIN_ANCHOR:
        return 0, pattern
    return best_at, best
