"""Calls on one thing (a mountpoint, a layer, a blob) take turns, calls on different things run at once.

    turns = Turns()
    async with turns.take(("mountpoint", path), ("layer", digest)):
        ...  # no other holder of either key until this block ends

Used where one big lock made every mount wait for every other (the daemon's and the mounter's mount and
unmount: docs/benchmarks.md, issue 13, "mount14"), and by the sandboxes' layer provider. A key's lock is
made when first taken and dropped when no caller holds or waits for it, so the table stays as small as
the calls under way. ``take`` of several keys takes them in the order given: callers that take more than
one take them in one order (mountpoint before layer before blob) so that no two wait for each other.

Threads: one trio loop (the daemon's); trio.Lock is not thread-safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

import trio


@dataclass
class _Turn:
    lock: trio.Lock = field(default_factory=trio.Lock)
    callers: int = 0  # holding or waiting for the lock


class Turns:
    """One trio.Lock per key, made on demand, gone when unused."""

    def __init__(self) -> None:
        self._turns: dict[Hashable, _Turn] = {}

    def __len__(self) -> int:
        """Keys held or waited for now."""
        return len(self._turns)

    def callers(self, key: Hashable) -> int:
        """How many callers hold or wait for ``key``."""
        turn = self._turns.get(key)
        return 0 if turn is None else turn.callers

    @contextlib.asynccontextmanager
    async def take(self, *keys: Hashable) -> AsyncIterator[None]:
        """Hold each of ``keys``, taken in the order given, until the block ends."""
        async with contextlib.AsyncExitStack() as held:
            for key in keys:
                await held.enter_async_context(self._take_one(key))
            yield

    @contextlib.asynccontextmanager
    async def _take_one(self, key: Hashable) -> AsyncIterator[None]:
        turn = self._turns.setdefault(key, _Turn())
        turn.callers += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.callers -= 1
            if not turn.callers:
                del self._turns[key]
