"""Rebuilds of two checkouts alternated one at a time: the same tree, store and parent, so that a loaded
machine stretches both alike (bench_rebuild.py runs one checkout's rounds after the other's).

Copies the tree (``cp -a``), builds the parent with the first checkout, then a worker process per
checkout (each importing its own code, warm after its first rebuild) rebuilds it on the parent after new
bytes are written into one file, in turn, ROUNDS times each (the order flips every round). Prints each
checkout's median, quartile and minimum wall time and median CPU (all threads) of a rebuild, the first
two left out, and the load average.

    .venv/bin/python bench/bench_rebuild_ab.py [--rounds 40] [--tree DIR] BASELINE_DIR CHECKOUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHANGE_BYTES = 4096
DEFAULT_FILE = "usr/lib/x86_64-linux-gnu/libc.so.6"
RACY_S = 2.2  # erofs_builder.incremental.RACY_NS, and a little: the copy must age before the parent is built


def worker(project: str, tree: str, store_root: str, parent: str, changed: str) -> None:
    """Rebuild once per line on stdin; print [wall s, CPU s] of each."""
    sys.path.insert(0, project)
    from dsec_fs.store import FilesystemStore
    from erofs_builder.build import build_layer

    store = FilesystemStore(store_root)
    for _line in sys.stdin:
        size = os.path.getsize(changed)
        with open(changed, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(CHANGE_BYTES))
        wall, cpu = time.perf_counter(), time.process_time()
        build_layer(tree, store, parent=parent)
        print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu]), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(*sys.argv[2:7])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tree", default="/var/cache/dsecfs-test/debian-minbase")
    parser.add_argument("--file", default=DEFAULT_FILE, help="the file to change, relative to the tree")
    parser.add_argument("checkouts", nargs=2, help="two project directories (a baseline first)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsecfs-rebuild-ab-") as work:
        os.environ["DSECFS_INDEX_DIR"] = os.path.join(work, "index")
        tree, store_root = os.path.join(work, "tree"), os.path.join(work, "store")
        subprocess.run(["cp", "-a", args.tree, tree], check=True)
        time.sleep(RACY_S)
        os.chmod(tree, os.stat(tree).st_mode & 0o7777)  # something newer than every entry
        parent = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from dsec_fs.store import "
             "FilesystemStore; from erofs_builder.build import build_layer; "
             "print(build_layer(sys.argv[2], FilesystemStore(sys.argv[3])).digest)",
             args.checkouts[0], tree, store_root], check=True, capture_output=True, text=True).stdout.strip()
        changed = os.path.join(tree, args.file)
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", project, tree, store_root, parent, changed],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for project in args.checkouts]
        times: list[list[list[float]]] = [[], []]
        try:
            for number in range(args.rounds):
                for k in ((0, 1) if number % 2 == 0 else (1, 0)):
                    workers[k].stdin.write("rebuild\n")
                    workers[k].stdin.flush()
                    times[k].append(json.loads(workers[k].stdout.readline()))
        finally:
            for process in workers:
                process.stdin.close()
                process.wait()
    for project, measured in zip(args.checkouts, times):
        walls = [wall for wall, _cpu in measured[2:]]
        cpus = [cpu for _wall, cpu in measured[2:]]
        print(f"{project}: wall median {statistics.median(walls) * 1e3:.1f} ms, first quartile "
              f"{statistics.quantiles(walls, n=4)[0] * 1e3:.1f}, minimum {min(walls) * 1e3:.1f}; "
              f"CPU median {statistics.median(cpus) * 1e3:.1f} ms ({len(walls)} rebuilds)")
    print("load average " + " ".join(f"{load:.2f}" for load in os.getloadavg()))


if __name__ == "__main__":
    main()
