"""Build benchmark: `dsecfs build` against `mkfs.erofs --chunksize --blobdev`, side by side in one run.

For each source tree, runs each builder ROUNDS times, alternating (dsecfs, then each mkfs.erofs in the
order given, then dsecfs again; each round starts one builder further on), each in its own process, so
that peak RSS is that process's own (read with wait4) and a load change on the machine hits every
builder alike. Prints, per tree and builder,
the median wall time, CPU time (user + sys), peak RSS and bytes stored, and the wall-time and peak-RSS
ratios of dsecfs against each mkfs.erofs. Each dsecfs build goes into a fresh store, so nothing is
deduplicated against an earlier round; its stored bytes are the whole store directory (packs, indexes,
meta.erofs and blob map compressed, build info, manifest), mkfs.erofs's the image plus the blob.

    .venv/bin/python bench/bench_build.py [--rounds 3] [--tree DIR ...] [--synthetic-files 100000 ...]
        [--mkfs /opt/erofs-1.9.3/bin/mkfs.erofs ...] [--work DIR] [--tar] [--phases] [--baseline SRC]

Trees: the cached Debian minbase rootfs (unless --tree is given), plus a synthetic tree per
--synthetic-files count (default 100,000 and 1,000,000): files of 50 to 3,000 random bytes, 1,000 to a
directory, made once under --work and removed at the end. Builders: dsecfs, then every --mkfs (default
Debian's /usr/bin/mkfs.erofs). With --baseline SRC, the dsecfs of another source directory (the code
before a change) builds too, in the same rounds, with this venv's Python. With --tar, dsecfs also builds
from an uncompressed tar of each tree (made once with tar(1)), as a builder of its own in the same
rounds. With --phases, each tree is first built ROUNDS times more, each in a child process of this script
that times each phase of the build (wall, CPU of the process and of its main thread, RSS after it (of a
phase of many calls, after one of its last 4,096) and the process's peak so far; the phase functions of
erofs_builder.build wrapped), alternating with the baseline's code when --baseline is given; the
medians are printed as a table per checkout. Before the trees, the start of the command itself is
timed: `dsecfs --help` and `dsecfs build --help` (the interpreter and the imports every build pays),
median of 5 runs, for this checkout and the baseline.
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


def run_measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
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


def run_dsecfs(tree: str, work: str, label: str, source: str | None = None) -> tuple[float, float, int, int]:
    """One `dsecfs build`: this checkout's, or with ``source``, the dsecfs in that source directory (run with
    this venv's Python)."""
    store, index = os.path.join(work, "store"), os.path.join(work, "index")
    args = ["build", tree, "--store", store, "--name", f"bench/{label}", "--json"]
    # A fresh index mirror too, under the work directory, so that no round leaves one behind.
    wall, cpu, rss = run_measured([*dsecfs_argv(source), *args], env={**os.environ, "DSECFS_INDEX_DIR": index})
    stored = dir_bytes(store)
    shutil.rmtree(store)
    shutil.rmtree(index, ignore_errors=True)
    return wall, cpu, rss, stored


def dsecfs_argv(source: str | None) -> list[str]:
    """The command that runs this checkout's dsecfs, or with ``source`` the one in that source directory."""
    if source is None:
        return [DSECFS]
    return [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from cli.main import main; main()",
            source]


def bench_startup(baseline: str | None, runs: int = 5) -> dict:
    """Median wall and CPU of `dsecfs --help` and `dsecfs build --help`, alternating with the baseline."""
    sources = {"dsecfs": None, **({"dsecfs baseline": baseline} if baseline else {})}
    samples: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for _ in range(runs):
        for label, source in sources.items():
            for command in (["--help"], ["build", "--help"]):
                samples.setdefault((label, " ".join(command)), []).append(
                    run_measured([*dsecfs_argv(source), *command]))
    result = {}
    for (label, command), runs_ in samples.items():
        wall = statistics.median(run[0] for run in runs_)
        cpu = statistics.median(run[1] for run in runs_)
        result[f"{label}: {command}"] = {"wall_s": wall, "cpu_s": cpu}
        print(f"{label:<18}dsecfs {command:<14} wall {wall:.3f} s  cpu {cpu:.3f} s")
    return result


def make_tar(tree: str, work: str) -> str:
    tar = os.path.join(work, os.path.basename(tree.rstrip("/")) + ".tar")
    subprocess.run(["tar", "-cf", tar, "-C", tree, "."], check=True)
    return tar


# Phase functions of a build, wrapped by --phases: (label, module, owner attribute or None, function name).
PHASES = [
    ("walk (lstat, xattrs, nodes, limits)", "erofs_builder.build", None, "walk_directory"),
    ("list regular files", "erofs_builder.build", None, "regular_files"),
    ("index mirror sync", "erofs_builder.build", None, "load_chunk_index"),
    ("read, sha256, zstd, pack, upload", "erofs_builder.chunker", "Chunker", "add_file"),
    ("last uploads (flush)", "dsec_fs.chunks", "ChunkUploader", "flush"),
    ("packs of the layer", "erofs_builder.build", None, "packs_of"),
    ("confirm packs against the store", "dsec_fs.dedup_index", "MirroredChunkIndex", "confirm"),
    ("blob map, shared chunks", "erofs_builder.build", None, "lay_out_blob"),
    ("write meta.erofs (into a temporary file)", "erofs_builder.build", None, "spill_image"),
    ("build info", "erofs_builder.build", None, "encode_buildinfo"),
    ("publish (compress, put)", "erofs_builder.build", None, "publish_layer"),
    ("own packs into the mirror", "erofs_builder.build", None, "add_to_mirror"),
]


def phase_child(tree: str, work: str, source: str | None) -> None:
    """In a child process: build ``tree`` once with every phase function wrapped, with this checkout's code
    or, with ``source``, that source directory's; print one JSON line."""
    import functools
    import importlib
    import resource
    sys.path.insert(0, source or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dsec_fs.store import open_store

    rows: dict[str, list[float]] = {}

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def peak_mb() -> float:  # the process's peak RSS so far (VmHWM): the phase that sets it shows it first
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def wrapped(label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = rows.setdefault(label, [0.0, 0.0, 0.0, 0, 0.0, 0.0])
                row[0] += time.perf_counter() - wall
                row[1] += time.process_time() - cpu
                row[2] += time.thread_time() - own
                row[3] += 1
                if row[3] % 4096 == 1:  # the chunker's phase is a call a file: /proc reads would weigh on it
                    row[4] = rss_mb()
                row[5] = peak_mb()
        return timed

    for label, module, owner, name in PHASES:
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
        setattr(target, name, wrapped(label, getattr(target, name)))
    build = importlib.import_module("erofs_builder.build")
    store = open_store(os.path.join(work, "phase-store"), create=True)
    wall, cpu = time.perf_counter(), time.process_time()
    result = build.build_layer(tree, store)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"digest": result.digest, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": peak,
                      "phases": [{"phase": label, "wall_s": w, "cpu_s": c, "main_cpu_s": t, "calls": n,
                                  "rss_after_mb": m, "peak_after_mb": p}
                                 for label, (w, c, t, n, m, p) in rows.items()]}))


def phase_build(tree: str, work: str, source: str | None) -> dict:
    """One in-process build of ``tree`` timed phase by phase (``phase_child``), in a child process."""
    index = os.path.join(work, "phase-index")
    out = subprocess.run([sys.executable, __file__, "--phase-child", tree, "--work", work,
                          *(["--phase-source", source] if source else [])], check=True,
                         capture_output=True, text=True, env={**os.environ, "DSECFS_INDEX_DIR": index})
    shutil.rmtree(os.path.join(work, "phase-store"), ignore_errors=True)
    shutil.rmtree(index, ignore_errors=True)
    return json.loads(out.stdout.splitlines()[-1])


def run_phases(name: str, tree: str, work: str, rounds: int, baseline: str | None) -> dict:
    """The phases of ``rounds`` builds of ``tree`` by this checkout and, alternating, by ``baseline``:
    per phase the medians of wall, CPU of the process and CPU of the main thread (the one that walks,
    reads and writes meta.erofs), and the RSS of the last build."""
    sources = {"dsecfs": None, **({"dsecfs baseline": baseline} if baseline else {})}
    runs: dict[str, list[dict]] = {label: [] for label in sources}
    for _ in range(rounds):
        for label, source in sources.items():
            runs[label].append(phase_build(tree, work, source))
    result = {"tree": name, "rounds": rounds, "load": os.getloadavg()[0]}
    for label, builds in runs.items():
        last = builds[-1]
        phases = [{**row, **{key: statistics.median(build["phases"][k][key] for build in builds)
                             for key in ("wall_s", "cpu_s", "main_cpu_s")}}
                  for k, row in enumerate(last["phases"])]
        result[label] = {"digest": last["digest"], "peak_rss_mb": last["peak_rss_mb"], "phases": phases,
                         **{key: statistics.median(build[key] for build in builds) for key in ("wall_s", "cpu_s")}}
        print(f"phases of {label} building {name} (in-process, median of {rounds}; layer {last['digest'][:16]})")
        print(f"{'phase':<42}{'wall s':>8}{'cpu s':>8}{'main s':>8}{'calls':>8}{'RSS after MiB':>15}"
              f"{'peak so far':>13}")
        for row in phases:
            print(f"{row['phase']:<42}{row['wall_s']:>8.3f}{row['cpu_s']:>8.3f}{row['main_cpu_s']:>8.3f}"
                  f"{row['calls']:>8}{row['rss_after_mb']:>15.1f}{row['peak_after_mb']:>13.1f}")
        whole = result[label]
        print(f"{'whole build':<42}{whole['wall_s']:>8.3f}{whole['cpu_s']:>8.3f}{'':>16}"
              f"{whole['peak_rss_mb']:>15.1f} peak")
    return result


def run_mkfs(mkfs: str, tree: str, work: str) -> tuple[float, float, int, int]:
    img, blob = os.path.join(work, "mkfs.img"), os.path.join(work, "mkfs.blob")
    wall, cpu, rss = run_measured([mkfs, f"--chunksize={CHUNK_SIZE}", f"--blobdev={blob}", "-Enoinline_data", img, tree])
    stored = os.path.getsize(img) + os.path.getsize(blob)
    os.unlink(img)
    os.unlink(blob)
    return wall, cpu, rss, stored


def bench_tree(name: str, tree: str, rounds: int, mkfs_list: list[str], work: str, tar: str | None = None,
               baseline: str | None = None) -> dict:
    builders = (["dsecfs"] + (["dsecfs from tar"] if tar else []) + (["dsecfs baseline"] if baseline else [])
                + (["baseline from tar"] if tar and baseline else [])
                + [f"mkfs.erofs {mkfs_version(m)}" for m in mkfs_list])
    samples: dict[str, list[tuple[float, float, int, int]]] = {b: [] for b in builders}
    runs_of = {
        "dsecfs": lambda r: run_dsecfs(tree, work, f"{name}:r{r}"),
        "dsecfs from tar": lambda r: run_dsecfs(tar, work, f"{name}:tar{r}"),
        "dsecfs baseline": lambda r: run_dsecfs(tree, work, f"{name}:b{r}", baseline),
        "baseline from tar": lambda r: run_dsecfs(tar, work, f"{name}:btar{r}", baseline),
        **{builder: (lambda r, mkfs=mkfs: run_mkfs(mkfs, tree, work))
           for builder, mkfs in zip(builders[-len(mkfs_list):], mkfs_list)},
    }
    for r in range(rounds):
        # Each round starts one builder further on: none always runs right after another's writes (a
        # mkfs.erofs writes a 400 MB blob at 100,000 files, whose writeback slows the next build's fsyncs).
        for builder in builders[r % len(builders):] + builders[:r % len(builders)]:
            samples[builder].append(runs_of[builder](r))
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
    print("ratios are dsecfs / that builder (time: median wall; RSS: peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[])
    parser.add_argument("--synthetic-files", type=int, action="append", default=[],
                        help="a synthetic tree of this many small files (repeatable; 0 for none)")
    parser.add_argument("--mkfs", action="append", default=[], help="a mkfs.erofs to compare with (repeatable)")
    parser.add_argument("--work", default=None, help="where synthetic trees and outputs go (default: a temp dir)")
    parser.add_argument("--tar", action="store_true", help="also build each tree from a tar of it")
    parser.add_argument("--baseline", metavar="SRC", help="also build with the dsecfs of this source directory "
                        "(e.g. `git archive main | tar -x -C SRC`), side by side")
    parser.add_argument("--phases", action="store_true", help="first time each phase of ROUNDS builds per tree "
                        "(and of the baseline's, alternated)")
    parser.add_argument("--phase-child", metavar="TREE", help=argparse.SUPPRESS)
    parser.add_argument("--phase-source", metavar="SRC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase_child:
        phase_child(args.phase_child, args.work, args.phase_source)
        return
    trees = args.tree or [DEBIAN_ROOTFS]
    counts = [n for n in (args.synthetic_files or [100_000, 1_000_000]) if n]
    mkfs_list = args.mkfs or ["/usr/bin/mkfs.erofs"]
    results: list[dict] = []
    phases: list[dict] = []
    startup = bench_startup(args.baseline)
    with tempfile.TemporaryDirectory(prefix="dsecfs-bench-", dir=args.work) as work:
        def bench(name: str, tree: str) -> None:
            if args.phases:
                phases.append(run_phases(name, tree, work, args.rounds, args.baseline))
            tar = make_tar(tree, work) if args.tar else None
            results.append(bench_tree(name, tree, args.rounds, mkfs_list, work, tar, args.baseline))
            print_table(results[-1:])
            if tar:
                os.unlink(tar)

        for tree in trees:
            bench(os.path.basename(tree.rstrip("/")), tree)
        for count in counts:
            synth = os.path.join(work, f"synthetic-{count}")
            make_synthetic(synth, count)
            bench(f"small-{count}", synth)
            shutil.rmtree(synth)
    print()
    print_table(results)
    print(json.dumps({"startup": startup, "builds": results, "phases": phases}, indent=2))


if __name__ == "__main__":
    main()
