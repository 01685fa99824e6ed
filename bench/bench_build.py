"""Build benchmark: `dsecfs build` against `mkfs.erofs --chunksize --blobdev`, side by side in one run.

For each source tree, runs each builder ROUNDS times, alternating (dsecfs, then each mkfs.erofs in the
order given, then dsecfs again), each in its own process, so that peak RSS is that process's own (read
with wait4) and a load change on the machine hits every builder alike. Prints, per tree and builder,
the median wall time, CPU time (user + sys), peak RSS and bytes stored, and the wall-time and peak-RSS
ratios of dsecfs against each mkfs.erofs. Each dsecfs build goes into a fresh store, so nothing is
deduplicated against an earlier round; its stored bytes are the whole store directory (packs, indexes,
meta.erofs and blob map compressed, build info, manifest), mkfs.erofs's the image plus the blob.

    .venv/bin/python bench/bench_build.py [--rounds 3] [--tree DIR ...] [--synthetic-files 100000 ...]
        [--mkfs /opt/erofs-1.9.3/bin/mkfs.erofs ...] [--work DIR]

Trees: the cached Debian minbase rootfs (unless --tree is given), plus a synthetic tree per
--synthetic-files count (default 100,000 and 1,000,000): files of 50 to 3,000 random bytes, 1,000 to a
directory, made once under --work and removed at the end. Builders: dsecfs, then every --mkfs (default
Debian's /usr/bin/mkfs.erofs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
DEBIAN_ROOTFS = "/var/cache/dsecfs-test/debian-minbase"
CHUNK_SIZE = 1 << 20


def run_measured(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}): {err}")
    return wall, rusage.ru_utime + rusage.ru_stime, rusage.ru_maxrss * 1024


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def make_synthetic(root: str, files: int) -> None:
    """``files`` files of 50 to 3,000 random bytes (seeded: the same tree every run), 1,000 to a directory."""
    rng = random.Random(files)
    for i in range(files):
        d = os.path.join(root, f"d{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"f{i:07d}"), "wb") as f:
            f.write(rng.randbytes(rng.randint(50, 3000)))


def mkfs_version(mkfs: str) -> str:
    out = subprocess.run([mkfs, "--version"], capture_output=True, text=True)
    words = (out.stdout or out.stderr).splitlines()[0].split() if (out.stdout or out.stderr) else []
    return words[-1] if words else mkfs


def run_dsecfs(tree: str, work: str, label: str) -> tuple[float, float, int, int]:
    store = os.path.join(work, "store")
    wall, cpu, rss = run_measured([DSECFS, "build", tree, "--store", store, "--name", f"bench/{label}", "--json"])
    stored = dir_bytes(store)
    shutil.rmtree(store)
    return wall, cpu, rss, stored


def run_mkfs(mkfs: str, tree: str, work: str) -> tuple[float, float, int, int]:
    img, blob = os.path.join(work, "mkfs.img"), os.path.join(work, "mkfs.blob")
    wall, cpu, rss = run_measured([mkfs, f"--chunksize={CHUNK_SIZE}", f"--blobdev={blob}", "-Enoinline_data", img, tree])
    stored = os.path.getsize(img) + os.path.getsize(blob)
    os.unlink(img)
    os.unlink(blob)
    return wall, cpu, rss, stored


def bench_tree(name: str, tree: str, rounds: int, mkfs_list: list[str], work: str) -> dict:
    builders = ["dsecfs"] + [f"mkfs.erofs {mkfs_version(m)}" for m in mkfs_list]
    samples: dict[str, list[tuple[float, float, int, int]]] = {b: [] for b in builders}
    for r in range(rounds):
        samples["dsecfs"].append(run_dsecfs(tree, work, f"{name}:r{r}"))
        for builder, mkfs in zip(builders[1:], mkfs_list):
            samples[builder].append(run_mkfs(mkfs, tree, work))
    result = {"tree": name, "source_bytes": dir_bytes(tree), "rounds": rounds, "builders": {}}
    for builder, runs in samples.items():
        result["builders"][builder] = {
            "wall_s": statistics.median(run[0] for run in runs),
            "wall_s_all": [round(run[0], 3) for run in runs],
            "cpu_s": statistics.median(run[1] for run in runs),
            "peak_rss_mb": max(run[2] for run in runs) / 2**20,
            "stored_bytes": runs[-1][3],
        }
    ours = result["builders"]["dsecfs"]
    result["ratios"] = {
        builder: {"wall": ours["wall_s"] / theirs["wall_s"], "peak_rss": ours["peak_rss_mb"] / theirs["peak_rss_mb"]}
        for builder, theirs in result["builders"].items() if builder != "dsecfs"
    }
    return result


def print_table(results: list[dict]) -> None:
    print(f"{'tree':<18}{'builder':<18}{'wall s':>8}{'cpu s':>8}{'RSS MB':>9}{'stored MB':>11}"
          f"{'time ratio':>12}{'RSS ratio':>11}")
    for r in results:
        for builder, b in r["builders"].items():
            ratio = r["ratios"].get(builder)
            tail = f"{ratio['wall']:>12.2f}{ratio['peak_rss']:>11.2f}" if ratio else ""
            print(f"{r['tree']:<18}{builder:<18}{b['wall_s']:>8.2f}{b['cpu_s']:>8.2f}{b['peak_rss_mb']:>9.1f}"
                  f"{b['stored_bytes'] / 2**20:>11.1f}{tail}")
    print("ratios are dsecfs / that mkfs.erofs (time: median wall; RSS: peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[])
    parser.add_argument("--synthetic-files", type=int, action="append", default=[],
                        help="a synthetic tree of this many small files (repeatable; 0 for none)")
    parser.add_argument("--mkfs", action="append", default=[], help="a mkfs.erofs to compare with (repeatable)")
    parser.add_argument("--work", default=None, help="where synthetic trees and outputs go (default: a temp dir)")
    args = parser.parse_args()
    trees = args.tree or [DEBIAN_ROOTFS]
    counts = [n for n in (args.synthetic_files or [100_000, 1_000_000]) if n]
    mkfs_list = args.mkfs or ["/usr/bin/mkfs.erofs"]
    results = []
    with tempfile.TemporaryDirectory(prefix="dsecfs-bench-", dir=args.work) as work:
        for tree in trees:
            results.append(bench_tree(os.path.basename(tree.rstrip("/")), tree, args.rounds, mkfs_list, work))
            print_table(results[-1:])
        for count in counts:
            synth = os.path.join(work, f"synthetic-{count}")
            make_synthetic(synth, count)
            results.append(bench_tree(f"small-{count}", synth, args.rounds, mkfs_list, work))
            print_table(results[-1:])
            shutil.rmtree(synth)
    print()
    print_table(results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
