"""Four builds of overlapping trees into one store at once, while gc runs again and again with no grace
period: every layer published must come out whole (fsck with every chunk fetched and hashed), before and
after later gc runs. The builds run as separate processes (sharing the host's index mirror through
LMDB) or as threads of this one; a deleted layer whose chunks they share gives gc something to trash
under their feet."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from treecmp import write_files

from dsec_fs.layer import delete_ref, list_refs
from dsec_fs.store import FilesystemStore, keys
from erofs_builder.build import build_layer
from tests.dsec_fs.gc_support import (
    CHUNK,
    assert_all_layers_ok,
    backdate_layer,
    build,
    published_layers,
    random_bytes,
    run_gc,
)

BUILDS = 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Bounds the gc loop if a build hangs; a build of these trees takes about a second.
MAX_GC_RUNS = 200

BUILD_SCRIPT = """
import sys
from dsec_fs.store import open_store
from erofs_builder.build import build_layer
with open_store(sys.argv[1]) as store:
    print(build_layer(sys.argv[2], store, name=sys.argv[3], chunk_size=int(sys.argv[4])).digest)
"""

SHARED_BY_ALL = {f"all/{i}": random_bytes(1000 + i, 4 * CHUNK) for i in range(12)}


def tree_of(build_number: int) -> dict[str, bytes]:
    """Chunks shared by every build, by neighbours (i and i+1), and a build's own."""
    mine = {f"own/{i}": random_bytes(2000 + 100 * build_number + i, 3 * CHUNK) for i in range(8)}
    left = {f"pair/{build_number}": random_bytes(3000 + build_number, 5 * CHUNK)}
    right = {f"pair/{(build_number + 1) % BUILDS}": random_bytes(3000 + (build_number + 1) % BUILDS, 5 * CHUNK)}
    return {**SHARED_BY_ALL, **mine, **left, **right}


@pytest.fixture
def index_root(tmp_path, monkeypatch):
    path = str(tmp_path / "index-mirror")
    monkeypatch.setenv("DSECFS_INDEX_DIR", path)
    return path


def start_process_builds(store, sources: list[str], index_root: str) -> tuple[list, callable]:
    env = {**os.environ, "DSECFS_INDEX_DIR": index_root, "PYTHONPATH": REPO}
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, store.url, src, f"t/build{i}", str(CHUNK)],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i, src in enumerate(sources)
    ]

    def running() -> bool:
        return any(p.poll() is None for p in procs)

    def finish() -> list[str]:
        errors = []
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                errors.append(f"build {i}: exit {proc.returncode}: {err.decode()[-2000:]}")
        return errors

    return running, finish


def start_thread_builds(store, sources: list[str], index_root: str):
    errors: list[str] = []

    def one(i: int, src: str) -> None:
        try:
            build_layer(src, store, name=f"t/build{i}", chunk_size=CHUNK)
        except Exception as exc:  # reported by finish(), so the test fails with the reason
            errors.append(f"build {i}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i, src)) for i, src in enumerate(sources)]
    for thread in threads:
        thread.start()

    def running() -> bool:
        return any(thread.is_alive() for thread in threads)

    def finish() -> list[str]:
        for thread in threads:
            thread.join(120)
        return errors

    return running, finish


@pytest.mark.parametrize("start_builds", [start_process_builds, start_thread_builds], ids=["processes", "threads"])
def test_concurrent_builds_and_gc_publish_only_whole_layers(tmp_path, index_root, start_builds):
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    old = build(store, tmp_path / "old", {**SHARED_BY_ALL, "old-only": random_bytes(9, 6 * CHUNK)}, "t/old")
    delete_ref(store, "t/old")
    # Published an hour ago: no build lease protects it, so gc deletes it (and trashes its pack, which the
    # builds deduplicate against) while they run.
    backdate_layer(store, old)
    sources = [write_files(tmp_path / f"src{i}", tree_of(i)) for i in range(BUILDS)]

    running, finish = start_builds(store, sources, index_root)
    runs = 0
    try:
        # For the most interleavings, gc starts once a build holds its lease (processes take a moment to
        # start); what the test checks does not depend on when it starts.
        while running() and not list(store.list(keys.LEASES)):
            time.sleep(0.01)
        while (running() or runs < 2) and runs < MAX_GC_RUNS:
            run_gc(store)
            runs += 1
    finally:
        errors = finish()
    assert not errors, errors

    assert sorted(list_refs(store)) == [f"t/build{i}:latest" for i in range(BUILDS)]
    assert old not in published_layers(store)
    assert_all_layers_ok(store)
    for _ in range(2):
        run_gc(store)
    assert_all_layers_ok(store)
    assert not list(store.list(keys.LEASES)) and not list(store.list(keys.GC_LOCKS))
    # Whatever gc trashed under the builds, what the layers need is indexed again and nothing is waiting.
    assert not set(store.list(keys.TRASH))
