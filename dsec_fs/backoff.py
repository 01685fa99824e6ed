"""Jittered exponential backoff: how long to wait before trying a failed call again.

Attempt n (from 1) that failed is followed by a sleep drawn uniformly from [d/2, d] with
d = min(max_delay, base_delay * 2**(n-1)): the jitter keeps clients that failed together from retrying
together. Used by the store's RetryStore and by the registry client.
"""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base_delay: float, max_delay: float) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1 for the first)."""
    return random.uniform(0.5, 1.0) * min(max_delay, base_delay * 2 ** (attempt - 1))
