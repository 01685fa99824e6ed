"""Build benchmark: `dsecfs build` against `mkfs.erofs --chunksize --blobdev`, side by side in one run.

For each source tree, runs each builder ROUNDS times, alternating, each in its own process (so peak RSS
is that process's own, read with wait4), and prints wall time, peak RSS and bytes stored. Each dsecfs
build goes into a fresh store, so nothing is deduplicated against an earlier round.

    .venv/bin/python bench/bench_build.py [--rounds 3] [--tree DIR ...] [--synthetic-files 100000]

Trees: the cached Debian minbase rootfs, plus a synthetic tree of many small files (to show that memory
does not grow with the number of files beyond the metadata itself).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")


def run_measured(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}): {err}")
    return wall, rusage.ru_maxrss * 1024


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def make_synthetic(root: str, files: int) -> None:
    """``files`` small files of distinct content in directories of 1,000."""
    for i in range(files):
        d = os.path.join(root, f"d{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"f{i:06d}"), "wb") as f:
            f.write(f"file {i}\n".encode() * (1 + i % 50))


def bench_tree(name: str, tree: str, rounds: int, work: str) -> dict:
    ours_t, ours_rss, theirs_t, theirs_rss = [], [], [], []
    ours_stored = theirs_stored = 0
    for r in range(rounds):
        store = os.path.join(work, f"store-{r}")
        wall, rss = run_measured([DSECFS, "build", tree, "--store", store, "--name", f"bench/{name}:r{r}",
                                  "--json"])
        ours_t.append(wall)
        ours_rss.append(rss)
        ours_stored = dir_bytes(store)
        shutil.rmtree(store)

        img, blob = os.path.join(work, "mkfs.img"), os.path.join(work, "mkfs.blob")
        wall, rss = run_measured(["mkfs.erofs", "--chunksize=1048576", f"--blobdev={blob}", "-Enoinline_data",
                                  img, tree])
        theirs_t.append(wall)
        theirs_rss.append(rss)
        theirs_stored = os.path.getsize(img) + os.path.getsize(blob)
        os.unlink(img)
        os.unlink(blob)
    return {
        "tree": name,
        "source_bytes": dir_bytes(tree),
        "dsecfs_s": statistics.median(ours_t),
        "mkfs_s": statistics.median(theirs_t),
        "time_ratio": statistics.median(ours_t) / statistics.median(theirs_t),
        "dsecfs_peak_rss_mb": max(ours_rss) / 2**20,
        "mkfs_peak_rss_mb": max(theirs_rss) / 2**20,
        "dsecfs_stored_bytes": ours_stored,
        "mkfs_stored_bytes": theirs_stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[])
    parser.add_argument("--synthetic-files", type=int, default=100_000)
    args = parser.parse_args()
    trees = args.tree or ["/var/cache/dsecfs-test/debian-minbase"]
    results = []
    with tempfile.TemporaryDirectory(prefix="dsecfs-bench-") as work:
        for tree in trees:
            results.append(bench_tree(os.path.basename(tree.rstrip("/")), tree, args.rounds, work))
        if args.synthetic_files:
            synth = os.path.join(work, "synthetic")
            make_synthetic(synth, args.synthetic_files)
            results.append(bench_tree(f"synthetic-{args.synthetic_files}", synth, args.rounds, work))
    print(f"{'tree':<22}{'dsecfs s':>10}{'mkfs s':>9}{'ratio':>7}{'RSS MB':>9}{'mkfs RSS':>10}"
          f"{'stored MB':>11}{'mkfs MB':>9}")
    for r in results:
        print(f"{r['tree']:<22}{r['dsecfs_s']:>10.2f}{r['mkfs_s']:>9.2f}{r['time_ratio']:>7.2f}"
              f"{r['dsecfs_peak_rss_mb']:>9.1f}{r['mkfs_peak_rss_mb']:>10.1f}"
              f"{r['dsecfs_stored_bytes'] / 2**20:>11.1f}{r['mkfs_stored_bytes'] / 2**20:>9.1f}")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
