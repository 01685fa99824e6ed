"""Builder micro-benchmark: where a build's time goes, phase by phase, in this process.

For one source tree, runs ROUNDS times, alternating: a full build into a fresh store, a full build into
the same store (every chunk already there: read and hash only), and an incremental build
(``parent=`` the first build) after one file was changed. Prints the median wall and CPU time of each
kind and of each phase inside it, the peak RSS of the process, and the incremental build's time against
both full builds. Phases are timed by wrapping the functions that do them (no profiler, so the numbers
add up to the wall time).

    .venv/bin/python bench/bench_phases.py [--tree DIR] [--rounds 5] [--file REL_PATH]

The tree is copied first (``cp -a``) and left to age past incremental.RACY_NS, so the original is never
changed; the index mirror lives in the temporary directory too.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT)

from dsec_fs.chunks import ChunkUploader  # noqa: E402
from dsec_fs.index_mirror import INDEX_DIR_ENV, MirroredChunkIndex  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder import build  # noqa: E402
from erofs_builder.incremental import RACY_NS, ParentLayer  # noqa: E402

DEFAULT_FILE = "usr/lib/x86_64-linux-gnu/libc.so.6"
# (label, object, attribute): the functions whose time is a phase.
PHASES = [
    ("load parent", ParentLayer, "load"),
    ("walk", build, "walk_directory"),
    ("match parent", ParentLayer, "reusable_chunks"),
    ("index sync", build, "load_chunk_index"),
    ("read+hash+compress", build, "chunk_files"),
    ("flush uploads", ChunkUploader, "flush"),
    ("confirm packs", MirroredChunkIndex, "confirm"),
    ("write meta.erofs", build, "write_image"),
    ("encode build info", build, "encode_buildinfo"),
    ("publish", build, "publish_layer"),
]

spent: dict[str, float] = defaultdict(float)


def timed_phase(label: str, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
    return wrapper


def run(kind: str, results: dict, build_once) -> object:
    spent.clear()
    start, cpu = time.perf_counter(), time.process_time()
    result = build_once()
    results[kind]["wall"].append(time.perf_counter() - start)
    results[kind]["cpu"].append(time.process_time() - cpu)
    for label, seconds in spent.items():
        results[kind][label].append(seconds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default="/var/cache/dsecfs-test/debian-minbase")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--file", default=DEFAULT_FILE, help="the file to change, relative to the tree")
    args = parser.parse_args()
    for label, owner, name in PHASES:
        setattr(owner, name, timed_phase(label, getattr(owner, name)))

    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="dsecfs-phases-") as work:
        os.environ[INDEX_DIR_ENV] = os.path.join(work, "index")
        tree = os.path.join(work, "tree")
        subprocess.run(["cp", "-a", args.tree, tree], check=True)
        time.sleep(RACY_NS / 1e9 + 0.2)
        os.chmod(tree, os.stat(tree).st_mode & 0o7777)  # the root's ctime moves on: newer than every file
        same = FilesystemStore(os.path.join(work, "same"))
        parent = build.build_layer(tree, same)
        changed = os.path.join(tree, args.file)
        with open(changed, "r+b") as f:
            f.seek(os.path.getsize(changed) // 2)
            f.write(os.urandom(4096))
        build.build_layer(tree, same, parent=parent.digest)  # uploads the changed chunk once
        for round_number in range(args.rounds):
            fresh = FilesystemStore(os.path.join(work, f"fresh-{round_number}"))
            full = run("full, fresh store", results, lambda: build.build_layer(tree, fresh))
            again = run("full, same store", results, lambda: build.build_layer(tree, same))
            incremental = run("incremental", results, lambda: build.build_layer(tree, same, parent=parent.digest))
            assert full.digest == again.digest == incremental.digest, "the three builds differ"
            subprocess.run(["rm", "-rf", fresh.root], check=True)

    labels = ["wall", "cpu"] + [label for label, _owner, _name in PHASES]
    kinds = list(results)
    print(f"{'median seconds':<22}" + "".join(f"{kind:>20}" for kind in kinds))
    for label in labels:
        cells = [statistics.median(results[kind][label]) if results[kind].get(label) else None for kind in kinds]
        print(f"{label:<22}" + "".join(f"{'-' if c is None else f'{c:.3f}':>20}" for c in cells))
    incremental = statistics.median(results["incremental"]["wall"])
    for kind in ("full, fresh store", "full, same store"):
        print(f"incremental / {kind}: {incremental / statistics.median(results[kind]['wall']):.2f}")
    print(f"files {full.stats.files:,}, peak RSS of this process "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
