"""The chunk fetcher's counters, one FetchStats per label (a layer, normally), and the buckets of its
store-read latency histogram; exported by the daemon's prometheus adapter (metrics.py).

Threads: a FetchStats is updated in the trio thread only (by ChunkFetcher and StoreReads), so it needs no
lock; readers may read it at any time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency histogram's buckets; the last catches everything.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, math.inf)
RECENT_LATENCIES = 1024


@dataclass
class FetchStats:
    """The counters of one label."""

    label: str
    hits: int = 0  # chunks found in the local cache
    misses: int = 0  # chunks not in the local cache, so read from the store
    coalesced: int = 0  # requests that joined a flight already in the air
    chunks_fetched: int = 0  # chunks read from the store, verified and delivered
    bytes_fetched: int = 0  # their uncompressed bytes
    store_reads: int = 0  # runs read from the store (each one ranged GET, unless a corrupt chunk splits it)
    readahead: int = 0  # chunks fetched as readahead (riding in the GET of a miss), not asked for
    errors: int = 0  # chunks whose fetch failed, for any reason
    corrupt: int = 0  # ... because the store returned bad bytes (CorruptError, IntegrityError)
    timeouts: int = 0  # ... because the store did not answer within the timeout
    refused: int = 0  # ... at once, because their store object (or the store) has too many reads stuck
    abandoned: int = 0  # store reads whose thread was still in the store at the deadline, left behind
    # Store read latency (queueing for a slot included): count per LATENCY_BUCKETS bucket (not
    # cumulative), their sum, and the most recent values.
    latency_counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    latency_sum: float = 0.0
    recent_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_LATENCIES))

    def observe_latency(self, seconds: float) -> None:
        bucket = next(i for i, bound in enumerate(LATENCY_BUCKETS) if seconds <= bound)
        self.latency_counts[bucket] += 1
        self.latency_sum += seconds
        self.recent_latencies.append(seconds)
