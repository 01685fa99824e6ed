"""A node-wide bound on the bytes of command output the daemon keeps at once.

Each of a command's streams keeps at most runtime.MAX_OUTPUT bytes (4 MiB), but a node runs up to
node_service.EXEC_THREADS (256) commands at once: 2 GiB of output kept, and about 2.7 GiB with the
answers being encoded, in the daemon's memory, which also serves every sandbox's reads. ``OutputBudget``
bounds what all of them keep together:

    budget = OutputBudget(EXEC_OUTPUT_BYTES)
    with budget.share() as keep:                  # one command's share
        result = run_in_rootfs(rootfs, argv, output_share=keep)
        answer = encode(result)                   # still counted while it is encoded
    # given back here

``keep(n)`` grants up to ``n`` bytes (fewer, or none, once the budget is spent); runtime._communicate
keeps only what it is granted and drops the rest, reading on, so the command is never blocked and its
result says ``truncated``. All a share took is given back when its block ends; a take after that (a
command abandoned by a daemon that stops) is granted nothing. The bound is on the bytes kept: an answer
leaving the daemon holds its encoding (base64, 4/3 of it) until its client has taken it (SEND_SECONDS at
most, lazy_fetch/http_api.py).

Threads: ``keep`` is called from the commands' worker threads, ``share`` from any thread; ``_lock`` guards
``used`` and each share's count.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class OutputBudget:
    """At most ``max_bytes`` of output kept by all the shares open at once."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def share(self) -> Iterator[Callable[[int], int]]:
        """One command's share of the budget: a ``keep(n)`` that grants up to ``n`` bytes of it; what it
        granted is given back when the block ends."""
        taken = [0, True]  # bytes granted, open

        def keep(wanted: int) -> int:
            with self._lock:
                granted = max(0, min(wanted, self.max_bytes - self.used)) if taken[1] else 0
                self.used += granted
                taken[0] += granted
            return granted

        try:
            yield keep
        finally:
            with self._lock:
                self.used -= taken[0]
                taken[:] = [0, False]
