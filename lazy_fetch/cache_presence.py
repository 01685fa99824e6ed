"""Presence counters: an in-memory answer to "is this chunk surely not cached?" (``ChunkCache.lacks``),
so that a miss need not wait for a worker thread and an index transaction to learn it.

A byte per slot; a digest's slot comes from its first bytes (digests are sha256: uniform). Each slot
counts the indexed chunks whose digests fall in it, kept in step with every change of the index: built
at open, counted up by put, down by eviction and drops. A slot at zero means no indexed chunk has that
slot, so the chunk is surely absent. A non-zero slot (another chunk's, or one whose count stuck at
STUCK) only means "look it up": the answer is never wrong the other way, except about a chunk being put
at that moment, which costs one store read that the put then finds cached.

Size: SLOTS_PER_BYTE slots per byte of the cache's bound (a slot per 4 KiB: a full cache of chunks of
40 KiB or more takes at most one slot in ten), rounded up to a power of two, within SLOTS_MIN and
SLOTS_MAX (4 Mi slots, 4 MiB of memory, which the default 10 GiB bound gets).

Threads: ``count`` is called by one thread at a time (the cache's, under its ``_lock``, or at open);
``surely_absent`` by any thread without a lock (a byte read is atomic).
"""

from __future__ import annotations

from collections.abc import Iterable

SLOTS_PER_BYTE = 1 / 4096
SLOTS_MIN = 1 << 12
SLOTS_MAX = 1 << 22
# A count that reached this may have lost count: it stays, and its slot always says "look it up".
STUCK = 255


class PresenceCounters:
    def __init__(self, max_bytes: int):
        wanted = max(SLOTS_MIN, min(SLOTS_MAX, int(max_bytes * SLOTS_PER_BYTE)))
        self._slots = bytearray(1 << (wanted - 1).bit_length())
        self._mask = len(self._slots) - 1

    def surely_absent(self, digest: bytes) -> bool:
        return not self._slots[self._slot(digest)]

    def count(self, digests: Iterable[bytes], step: int) -> None:
        """Count ``digests``: newly indexed (``step`` +1) or no longer indexed (-1)."""
        slots = self._slots
        for digest in digests:
            slot = self._slot(digest)
            if slots[slot] != STUCK:
                slots[slot] = max(0, slots[slot] + step)

    def _slot(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "little") & self._mask
