"""What several benchmarks need of this machine: timestamped progress lines and a cold page cache.

Benchmarks run as scripts (``python bench/bench_x.py``), so their directory is on sys.path and they
``import benchlib``.
"""

from __future__ import annotations

import os
import sys
import time

from prometheus_client.parser import text_string_to_metric_families


def log(message: str) -> None:
    """A progress line on stderr (stdout is the benchmark's result)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    """Write back, then drop the page, dentry and inode caches (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def store_requests(node) -> int:
    """The requests a daemon's stores answered so far (its dsecfs_store_requests_total, all operations)."""
    return daemon_metric(node, "dsecfs_store_requests_total")


def daemon_metric(node, name: str) -> int:
    """The sum of a daemon's /metrics samples named ``name`` (say dsecfs_store_serial_round_trips: with an
    emulated store, the round trips waited for one after another so far)."""
    return int(sum(sample.value for family in text_string_to_metric_families(node.metrics_text())
                   for sample in family.samples if sample.name == name))
