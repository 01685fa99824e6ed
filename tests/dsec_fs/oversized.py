"""Store objects a lying writer grew to any size, for the tests of bounded reads (test_oversized_objects.py,
tests/erofs_builder/test_incremental.py, test_layer_figures.py): ``grow`` makes one sparse (a GiB costs
nothing on disk), ``peak_allocated`` measures what Python allocated meanwhile (tracemalloc), so a test
tells a bounded read from one that took the whole object into memory.
"""

from __future__ import annotations

import contextlib
import os
import tracemalloc

from dsec_fs.store import keys

GROWN = 2 << 30
# What a bounded read of any of these objects may allocate at most: far below GROWN.
BOUNDED = 64 << 20


def grow(store, key: str, size: int = GROWN) -> None:
    """Object ``key`` of a FilesystemStore, extended with zeros to ``size`` bytes (sparse)."""
    os.truncate(os.path.join(store.root, *key.split("/")), size)


@contextlib.contextmanager
def peak_allocated():
    """Yields a list that holds, once the block is left, the peak of bytes allocated in it."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def first_pack(store) -> str:
    return keys.id_from_key(next(iter(store.list(keys.INDEX))))
