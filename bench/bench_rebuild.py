"""Rebuild benchmark: an incremental build (build_layer(parent=...)) against full builds, after changing one
file of a copy of the Debian rootfs, side by side in one run.

Steps: copy the tree with ``cp -a`` into a temporary directory, wait RACY_NS and touch the copy's root (an
entry younger than RACY_NS at build time is not trusted by the build info, see erofs_builder/incremental.py),
build the parent into a store, then for ROUNDS rounds, one after another: overwrite CHANGE_BYTES in the
middle of one large file with new random bytes, an incremental build on the parent into its store (what a
user's `dsecfs build --parent` after an edit does: it reads the changed file, uploads its new chunk and
publishes a new layer), a full build into a fresh, empty store (what the goal compares with: it
compresses and uploads everything) and a full build into the parent's store (every chunk already stored:
it reads and hashes every file). Each round checks that the three give one layer. The first incremental
build (before the rounds) counts too. Prints the medians, the ratios, the incremental build's phases
(from a profiled extra run), what the first incremental build uploaded against the size of the change,
the load average (the machine may be shared), and the same two builds through the CLI (a new process
each, start-up and imports included: what the user waits for), once compiling every module in each
process (PYTHONDONTWRITEBYTECODE, as set on the sessions' machine) and once with the bytecode kept in the
work directory (as an installed dsecfs has it).

    .venv/bin/python bench/bench_rebuild.py [--rounds 5] [--tree DIR] [--file REL_PATH]

Builds run in this process (the CLI costs both the same start-up); the page cache is warm for both.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT)

from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder.build import build_layer  # noqa: E402
from erofs_builder.incremental import RACY_NS  # noqa: E402

CHANGE_BYTES = 4096
DEFAULT_FILE = "usr/lib/x86_64-linux-gnu/libc.so.6"
# Phases of a build, by the function (or functions) that does each (for the profile breakdown); a
# patched rebuild's publish is store_metadata in a thread beside the pack's flush, then publish_stored
# (cProfile sees only the calling thread: the thread's part shows as 0). The full path's phases
# (walk_directory, reusable_chunks, write_image, ...) show 0 when the patch path was taken.
PHASES = {
    "load the parent": "load",
    "scan and compare": "scan_changes",
    "read, hash, upload": "add_file",
    "patch meta.erofs, blob map": "patch",
    "encode build info": "encode_rescanned",
    "publish": ("publish_layer", "store_metadata", "publish_stored"),
    "full path: walk": "walk_directory",
    "full path: write meta.erofs": "write_image",
}


def store_bytes(root: str) -> dict[str, int]:
    sizes = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            sizes[os.path.relpath(path, root)] = os.path.getsize(path)
    return sizes


def change(path: str, size: int) -> None:
    """Overwrite CHANGE_BYTES in the middle of ``path`` with new random bytes."""
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(CHANGE_BYTES))


def cli(*args: str, pycache: str | None = None) -> None:
    """Run ``dsecfs ARGS`` of this checkout in a new process, as a user does. With ``pycache``, bytecode is
    written and read there (PYTHONPYCACHEPREFIX), as an installed dsecfs has its modules compiled: without
    it, and with PYTHONDONTWRITEBYTECODE set (as on the sessions' machine), each process compiles every
    module of the project it imports (~40 ms of a rebuild's start)."""
    env = dict(os.environ)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {PROJECT!r}); from cli.main import main; "
                    "main()", *args], check=True, stdout=subprocess.DEVNULL, env=env)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def phases(fn) -> dict[str, float]:
    """Seconds per phase of one profiled call of ``fn`` (profiling slows everything about equally)."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    stats = pstats.Stats(profile).stats
    total = max(entry[3] for entry in stats.values())
    found = {"total (profiled)": total}
    for phase, function in PHASES.items():
        names = (function,) if isinstance(function, str) else function
        found[phase] = sum(entry[3] for (filename, _line, name), entry in stats.items()
                           if name in names and filename.startswith(PROJECT))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", default="/var/cache/dsecfs-test/debian-minbase")
    parser.add_argument("--file", default=DEFAULT_FILE, help="the file to change, relative to the tree")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dsecfs-rebuild-") as work:
        # Index mirrors under the work directory (one per store, so each fresh store starts with an empty
        # one), removed with it: none is left in the default directory.
        os.environ["DSECFS_INDEX_DIR"] = os.path.join(work, "index")
        tree = os.path.join(work, "tree")
        subprocess.run(["cp", "-a", args.tree, tree], check=True)
        time.sleep(RACY_NS / 1e9 + 0.2)
        os.chmod(tree, os.stat(tree).st_mode & 0o7777)
        store_root = os.path.join(work, "store")
        store = FilesystemStore(store_root)

        first_s, parent = timed(lambda: build_layer(tree, store))
        changed = os.path.join(tree, args.file)
        size = os.path.getsize(changed)
        change(changed, size)

        before = store_bytes(store_root)
        incremental_s, child = timed(lambda: build_layer(tree, store, parent=parent.digest))
        uploaded = {key: n for key, n in store_bytes(store_root).items() if before.get(key) != n}
        fresh_times, full_times, incremental_times = [], [], [incremental_s]
        for number in range(args.rounds):
            change(changed, size)  # new bytes: the rebuild reads, uploads and publishes something new
            seconds, again = timed(lambda: build_layer(tree, store, parent=parent.digest))
            incremental_times.append(seconds)
            fresh_root = os.path.join(work, f"fresh-{number}")
            seconds, fresh = timed(lambda: build_layer(tree, FilesystemStore(fresh_root)))
            fresh_times.append(seconds)
            shutil.rmtree(fresh_root)
            seconds, full = timed(lambda: build_layer(tree, store))
            full_times.append(seconds)
            assert again.digest == full.digest == fresh.digest != parent.digest, "incremental and full builds differ"
        change(changed, size)
        breakdown = phases(lambda: build_layer(tree, store, parent=parent.digest))
        cli_fresh, cli_incremental = [], []
        pycache = os.path.join(work, "pycache")
        cached_fresh, cached_incremental = [], []
        rebuild = ("build", "-q", tree, "--store", store_root, "--parent", parent.digest)
        cli(*rebuild, pycache=pycache)  # compiles what a rebuild imports, the standard library's included
        for number in range(args.rounds):
            for bytecode, fresh_s, incremental_s in ((None, cli_fresh, cli_incremental),
                                                     (pycache, cached_fresh, cached_incremental)):
                change(changed, size)
                incremental_s.append(timed(lambda: cli(*rebuild, pycache=bytecode))[0])
                fresh_root = os.path.join(work, f"cli-fresh-{number}")
                fresh_s.append(timed(lambda: cli("build", "-q", tree, "--store", fresh_root, pycache=bytecode))[0])
                shutil.rmtree(fresh_root)

    chunk_objects = sum(n for key, n in uploaded.items() if key.startswith(("packs", "index")))
    result = {
        "tree": args.tree,
        "files": child.stats.files,
        "bytes": child.stats.bytes,
        "changed_file": args.file,
        "change_bytes": CHANGE_BYTES,
        "first_build_s": first_s,
        "fresh_full_build_s": statistics.median(fresh_times),
        "full_rebuild_s": statistics.median(full_times),
        "incremental_s": statistics.median(incremental_times),
        "ratio": statistics.median(incremental_times) / statistics.median(fresh_times),
        "ratio_same_store": statistics.median(incremental_times) / statistics.median(full_times),
        "cli_fresh_full_build_s": statistics.median(cli_fresh),
        "cli_incremental_s": statistics.median(cli_incremental),
        "cli_ratio": statistics.median(cli_incremental) / statistics.median(cli_fresh),
        "cli_cached_fresh_full_build_s": statistics.median(cached_fresh),
        "cli_cached_incremental_s": statistics.median(cached_incremental),
        "cli_cached_ratio": statistics.median(cached_incremental) / statistics.median(cached_fresh),
        "load_average": os.getloadavg(),
        # __pycache__ directories in the checkout's packages (a test run may leave them): the CLI runs then
        # read bytecode instead of compiling
        "bytecode_in_tree": any(os.path.isdir(os.path.join(PROJECT, package, "__pycache__"))
                                for package in ("cli", "dsec_fs", "erofs_builder")),
        "reused_files": child.stats.reused_files,
        "new_chunk_bytes": child.stats.new_bytes,
        "uploaded_chunk_objects_bytes": chunk_objects,
        "uploaded_metadata_bytes": {key: n for key, n in uploaded.items() if not key.startswith(("packs", "index"))},
        "incremental_phases_s": breakdown,
    }
    print(f"tree            {args.tree}: {child.stats.files:,} files, {child.stats.bytes / 2**20:.1f} MiB")
    print(f"change          {CHANGE_BYTES:,} bytes in {args.file} ({size / 2**20:.1f} MiB)")
    print(f"first build     {first_s:.3f} s (empty store)")
    print(f"full build      {result['fresh_full_build_s']:.3f} s (median of {args.rounds}, each into a fresh store)")
    print(f"full rebuild    {result['full_rebuild_s']:.3f} s (median of {args.rounds}, chunks already stored)")
    print(f"incremental     {result['incremental_s']:.3f} s (median of {len(incremental_times)}), "
          f"{child.stats.reused_files:,} of {child.stats.files:,} files not read")
    print(f"ratio           {result['ratio']:.3f} of the fresh full build (goal: at most 0.05), "
          f"{result['ratio_same_store']:.3f} of the same-store one")
    compiled = "" if os.environ.get("PYTHONDONTWRITEBYTECODE") and not result["bytecode_in_tree"] else (
        " (not so: bytecode in the tree or written)")
    print(f"through the CLI {result['cli_incremental_s']:.3f} s against {result['cli_fresh_full_build_s']:.3f} s "
          f"(medians of {args.rounds}, a process each, each compiling its modules{compiled}): "
          f"{result['cli_ratio']:.3f}")
    print(f"  bytecode kept {result['cli_cached_incremental_s']:.3f} s against "
          f"{result['cli_cached_fresh_full_build_s']:.3f} s (as an installed dsecfs): {result['cli_cached_ratio']:.3f}")
    print("load average    " + " ".join(f"{load:.2f}" for load in result["load_average"]))
    print(f"uploaded        {child.stats.new_bytes:,} bytes of new chunks ({child.stats.new_chunks} chunk), "
          f"{chunk_objects:,} bytes of pack + index objects, "
          f"{sum(result['uploaded_metadata_bytes'].values()):,} bytes of layer metadata")
    print("phases of an incremental build (profiled):")
    for phase, seconds in breakdown.items():
        print(f"  {phase:<24}{seconds:>8.3f} s")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
