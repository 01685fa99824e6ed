"""What several benchmarks need of this machine: timestamped progress lines and a cold page cache.

Benchmarks run as scripts (``python bench/bench_x.py``), so their directory is on sys.path and they
``import benchlib``.
"""

from __future__ import annotations

import os
import sys
import time


def log(message: str) -> None:
    """A progress line on stderr (stdout is the benchmark's result)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    """Write back, then drop the page, dentry and inode caches (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
