"""Searching fixed-width records for a field's bytes: the offsets where ``pattern`` stands in ``data`` at a
record's field, not across records by chance. Used on a blob map's entries (dsec_fs.blobmap: a digest) and
on an image's chunk indexes (erofs_builder.patch: a device and blkaddr). No state; any thread.
"""

from __future__ import annotations

from collections.abc import Iterator


def field_matches(data: bytes, pattern: bytes, *, origin: int, stride: int, phase: int,
                  start: int = 0) -> Iterator[int]:
    """Offsets, from ``start`` on and in order, where ``pattern`` stands in ``data`` at ``phase`` bytes
    into a record of ``stride`` bytes, records laid end to end from ``origin``."""
    at = data.find(pattern, max(start, origin))
    while at >= 0:
        if (at - origin) % stride == phase:
            yield at
        at = data.find(pattern, at + 1)
