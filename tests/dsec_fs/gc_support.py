"""Helpers of the gc tests, shared with test_index_mirror.py and test_concurrent_builds.py: ``build`` (a
tree published as a layer, ``CHUNK`` = 4 KiB chunks), ``run_gc`` (no grace period unless asked),
``assert_all_layers_ok`` (fsck of every published layer, every chunk fetched and hashed),
``backdate_layer``, and ``PausingStore``, which pauses one store call so a test can run something at
exactly that point of another thread's work.

Import it as ``tests.dsec_fs.gc_support`` (not through conftest: pytest loads every directory's conftest
under the one name "conftest").
"""

from __future__ import annotations

import os
import random
import threading
import time

from treecmp import write_files

from dsec_fs.gc import gc
from dsec_fs.layer import list_refs
from dsec_fs.store import keys
from dsec_fs.store.wrappers import StoreWrapper
from erofs_builder.build import build_layer
from erofs_builder.fsck import fsck_layer

CHUNK = 4096


def random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def build(store, root, files: dict[str, bytes], name: str | None = None) -> str:
    return build_layer(write_files(root, files), store, name=name, chunk_size=CHUNK).digest


def run_gc(store, **options):
    options.setdefault("grace_seconds", 0)
    return gc(store, **options)


def published_layers(store) -> set[str]:
    return {key.split("/")[1] for key in store.list(keys.LAYERS) if key.endswith("/manifest.json")}


def assert_all_layers_ok(store) -> None:
    """Every published layer, and every ref's layer, passes fsck with every chunk fetched and hashed."""
    layers = published_layers(store)
    assert set(list_refs(store).values()) <= layers
    for digest in layers:
        report = fsck_layer(store, digest, check_chunks=True)
        assert report.ok, [str(p) for p in report.problems]


def backdate_layer(store, digest: str, seconds: float = 3600) -> None:
    """Make a layer's objects look written ``seconds`` ago (a filesystem store), so that no build lease
    that begins now is old enough to protect it (gc allows leases.CLOCK_SKEW of clock disagreement)."""
    then = time.time() - seconds
    for key in store.list(f"{keys.LAYERS}{digest}/"):
        os.utime(os.path.join(store.root, key), (then, then))


class PausingStore(StoreWrapper):
    """Stops the first ``op`` on a key ``matches`` accepts until ``proceed`` is set: lets a test run
    something at exactly that point of another thread's work. A fault a real store cannot make on cue.
    Used as a context manager, it lets the paused call go on exit, so a failing test does not hang."""

    def __init__(self, inner, op: str, matches):
        super().__init__(inner)
        self.op = op
        self.matches = matches
        self.reached = threading.Event()
        self.proceed = threading.Event()
        self._lock = threading.Lock()

    def _call(self, op, key, fn, sent=0):
        if op == self.op and self.matches(key):
            with self._lock:
                first = not self.reached.is_set()
                self.reached.set()
            if first and not self.proceed.wait(60):
                raise AssertionError(f"nobody let {op} {key} proceed")
        return fn()

    def put(self, key, data):
        self._call("put", key, lambda: None)
        self.inner.put(key, data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proceed.set()
