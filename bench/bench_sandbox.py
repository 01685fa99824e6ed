"""Sandbox start benchmark (issue 6): `sandbox up` to the end of a first command, over 50 sandboxes, against
extracting a tar of each layer into a fresh directory per sandbox.

    .venv/bin/python bench/bench_sandbox.py [--sandboxes 50] [--concurrency 10] [--skip-remote] [--work DIR]

The layers, built once per run into a local FilesystemStore in a scratch directory: base = the cached
Debian minbase rootfs, a toolkit (a script and 2 MiB of data under /opt/toolkit), and one small workspace
per sandbox (distinct files plus content every workspace shares, under /workspace). The baseline's tars
(uncompressed, one per layer, made from the same trees) are made once too, outside the timing.

A sandbox, timed from t0 to the end of its first command (``first command`` below):

- ``dsecfs``: ``Node.sandbox_up(base, workspace_k, toolkit)`` on a running daemon, then ``exec`` of
  FIRST_COMMAND (runc). Then ``down``, timed apart (teardown).
- ``baseline``: ``tar -x`` of the base, the workspace and the toolkit tars, in that order, into one fresh
  directory, then the same command with the same runtime (overlay.runtime.run_in_rootfs, runc). Then
  ``rm -rf`` of the directory, timed apart (teardown).

Every sandbox checks the command's exit code and that ``ls /workspace`` lists its own workspace.

Series, N sandboxes each:

- side by side, one at a time: dsecfs (a fresh daemon reading the store from this machine's disk) and
  the baseline alternate sandbox by sandbox, which side goes first alternating too, so both see the same
  load from the rest of the machine. ``cold``: the daemon's chunk cache and state directory empty, and
  ``drop_caches`` (page, dentry and inode caches) before each side's first sandbox only. The layers are
  shared, so only the first sandboxes are really cold (``first`` is reported apart); for the baseline
  "cold" means the tars and the host's binaries out of the page cache. ``warm``: the same series again
  right after (the daemon's chunk cache full, the tars in the page cache). One at a time, each sandbox
  is followed by an untimed sync.
- ``dsecfs remote`` (unless --skip-remote): the same cold and warm series on a second fresh daemon that
  reads the store through LatencyStore (``--latency 20 --bandwidth 100MB``: 20 ms per request, one 100 MB/s
  link), emulating a remote store. The baseline's tars stay local, which favours it.
- with ``--concurrency C``: every series again, C sandboxes at a time, each side on its own.

p99 is nearest-rank: over 50 samples it is the slowest sandbox. Needs root and runc.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsec_fs.client import Node  # noqa: E402
from dsec_fs.mounts import mounts_below  # noqa: E402
from dsec_fs.sandbox_client import Sandbox  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder import build_layer  # noqa: E402
from overlay.runtime import run_in_rootfs  # noqa: E402
from benchlib import drop_caches, log  # noqa: E402

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
DEBIAN_ROOTFS = "/var/cache/dsecfs-test/debian-minbase"
BASE_REF, TOOLKIT_REF = "bench/base:1", "bench/toolkit:1"
FIRST_COMMAND = ["/bin/sh", "-c", "cat /etc/os-release >/dev/null; ls /workspace"]
LATENCY_MS = 20.0
BANDWIDTH_MBPS = 100.0  # 10^6 bytes per second
TOOLKIT_DATA_FILES = 16
TOOLKIT_DATA_BYTES = 128 << 10  # each
SHARED_WORKSPACE_BYTES = 256 << 10  # the same file in every workspace (deduplicated in the store)


def write_files(root: str, files: dict[str, bytes]) -> str:
    for path, content in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(content)
    return root


def workspace_ref(k: int) -> str:
    return f"bench/ws{k:02d}:1"


def workspace_listing(k: int) -> list[str]:
    """What ``ls /workspace`` prints in sandbox ``k``, sorted."""
    return sorted(["README.md", "data", "src", f"task{k:02d}.txt"])


# ---- setup: layers and tars, once per run ---------------------------------------------------------------


def setup(work: str, sandboxes: int) -> dict:
    """Build the layers into work/store and the tars into work/tars; returns what was made."""
    rng = random.Random(6)
    sources = os.path.join(work, "sources")
    toolkit = write_files(os.path.join(sources, "toolkit"), {
        "opt/toolkit/bin/tk": b"#!/bin/sh\necho toolkit 1\n",
        **{f"opt/toolkit/lib/data{i:02d}.bin": rng.randbytes(TOOLKIT_DATA_BYTES) for i in range(TOOLKIT_DATA_FILES)},
    })
    shared = rng.randbytes(SHARED_WORKSPACE_BYTES)
    workspaces = []
    for k in range(sandboxes):
        workspaces.append(write_files(os.path.join(sources, f"ws{k:02d}"), {
            "workspace/README.md": b"# task\nRun make test.\n",
            "workspace/data/shared.bin": shared,
            f"workspace/task{k:02d}.txt": f"task {k}\n".encode(),
            "workspace/src/main.py": f"print('task {k}')\n".encode() * (1 + k),
            "workspace/src/util.py": rng.randbytes(2048).hex().encode(),
        }))
        os.chmod(os.path.join(workspaces[-1], "workspace/src/main.py"), 0o755)
    store_dir = os.path.join(work, "store")
    started = time.perf_counter()
    with FilesystemStore(store_dir, fsync=False) as store:
        base_layer = build_layer(DEBIAN_ROOTFS, store, name=BASE_REF)
        build_layer(toolkit, store, name=TOOLKIT_REF)
        for k, source in enumerate(workspaces):
            build_layer(source, store, name=workspace_ref(k))
    build_s = time.perf_counter() - started
    tars = os.path.join(work, "tars")
    os.makedirs(tars)
    started = time.perf_counter()
    for name, source in [("base", DEBIAN_ROOTFS), ("toolkit", toolkit),
                         *((f"ws{k:02d}", source) for k, source in enumerate(workspaces))]:
        run(["tar", "--numeric-owner", "-cf", os.path.join(tars, f"{name}.tar"), "-C", source, "."])
    tar_s = time.perf_counter() - started
    return {"store": store_dir, "tars": tars, "base_layer": base_layer.digest,
            "base_file_bytes": base_layer.stats.bytes, "base_stored_bytes": base_layer.stats.stored_bytes, "build_s": build_s, "tar_s": tar_s,
            "base_tar_bytes": os.path.getsize(os.path.join(tars, "base.tar")),
            "toolkit_tar_bytes": os.path.getsize(os.path.join(tars, "toolkit.tar")),
            "workspace_tar_bytes": os.path.getsize(os.path.join(tars, "ws00.tar"))}


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): "
                         f"{result.stderr.decode(errors='replace')[-2000:]}")


def check_output(k: int, exit_code: int, stdout: bytes, stderr: bytes, side: str) -> None:
    if exit_code != 0 or sorted(stdout.decode().split()) != workspace_listing(k):
        raise SystemExit(f"{side} sandbox {k}: exit {exit_code}, stdout {stdout!r}, stderr {stderr[-500:]!r}")


# ---- one sandbox, each side -----------------------------------------------------------------------------


def dsecfs_sandbox(node: Node, k: int) -> dict:
    start = time.perf_counter()
    info = node.sandbox_up(BASE_REF, workspace_ref(k), TOOLKIT_REF)
    try:
        up = time.perf_counter()
        result = Sandbox(node, info.id, info=info).exec(FIRST_COMMAND, runtime="runc")
        end = time.perf_counter()
        check_output(k, result.exit_code, result.stdout, result.stderr, "dsecfs")
    finally:
        down_start = time.perf_counter()
        Sandbox(node, info.id).down()
        teardown = time.perf_counter() - down_start
    return {"seconds": end - start, "prepare_s": up - start, "command_s": end - up, "teardown_s": teardown}


def baseline_sandbox(tars: str, scratch: str, k: int) -> dict:
    root = os.path.join(scratch, f"sb{k:02d}")
    start = time.perf_counter()
    try:
        os.mkdir(root)
        for name in ("base", f"ws{k:02d}", "toolkit"):  # bottom first, so the toolkit ends on top
            run(["tar", "--numeric-owner", "-xpf", os.path.join(tars, f"{name}.tar"), "-C", root])
        extracted = time.perf_counter()
        result = run_in_rootfs(root, FIRST_COMMAND, runtime="runc")
        end = time.perf_counter()
        check_output(k, result.exit_code, result.stdout, result.stderr, "baseline")
    finally:
        rm_start = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        teardown = time.perf_counter() - rm_start
    return {"seconds": end - start, "prepare_s": extracted - start, "command_s": end - extracted,
            "teardown_s": teardown}


def settled(result: dict) -> dict:
    """Sync (untimed) after a sandbox run one at a time, so the next one does not pay for the writeback of
    what this one wrote: the baseline's extracted trees, a GB every six sandboxes, would otherwise reach
    the dirty limits mid-series and make the timings depend on the order."""
    os.sync()
    return result


# ---- the runs -------------------------------------------------------------------------------------------


class Daemon:
    """A fresh daemon on its own empty directories below ``work``; ``stop`` checks that it exited cleanly."""

    def __init__(self, work: str, store: str, name: str, remote: bool):
        self.home = os.path.join(work, f"daemon-{name}")
        os.makedirs(self.home)
        self.socket_dir = tempfile.mkdtemp(prefix="dsb-", dir="/tmp")  # a socket path holds at most 107 bytes
        self.log_file = os.path.join(self.home, "daemon.log")
        self.process = None
        self.process = Node.start_daemon(
            os.path.join(self.socket_dir, "api.sock"), state_dir=os.path.join(self.home, "state"),
            cache_dir=os.path.join(self.home, "cache"), store=store, log_file=self.log_file, fetch_timeout=60,
            latency_ms=LATENCY_MS if remote else None, bandwidth_mbps=BANDWIDTH_MBPS if remote else None,
            command=[DSECFS])

    @property
    def node(self) -> Node:
        return self.process.node

    def stop(self) -> None:
        try:
            status = self.process.stop()
            if status != 0:
                with open(self.log_file, errors="replace") as f:
                    tail = f.read()[-4000:]
                raise SystemExit(f"daemon {self.process.pid} exited with status {status}; its log ends:\n{tail}")
        finally:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def bench_side_by_side(setup_info: dict, work: str, sandboxes: int) -> dict:
    """Cold then warm, each a series of ``sandboxes`` one at a time, dsecfs (a fresh local daemon) and the
    baseline alternating sandbox by sandbox (which goes first alternates too), so both see the same load
    from the rest of the machine. Cold: drop_caches before each side's first sandbox."""
    scratch = os.path.join(work, "baseline")
    os.makedirs(scratch)
    runs: dict = {}
    daemon = Daemon(work, setup_info["store"], "local", remote=False)
    try:
        node = daemon.node
        sides = {"dsecfs local": lambda k: dsecfs_sandbox(node, k),
                 "baseline": lambda k: baseline_sandbox(setup_info["tars"], scratch, k)}
        for temperature in ("cold", "warm"):
            for side in sides:
                runs[f"{side} {temperature}"] = []
            for k in range(sandboxes):
                order = list(sides) if k % 2 == 0 else list(reversed(sides))
                for side in order:
                    if temperature == "cold" and k == 0:
                        drop_caches()
                    runs[f"{side} {temperature}"].append(settled(sides[side](k)))
            for side in sides:
                key = f"{side} {temperature}"
                log(f"{key}: median {statistics.median(r['seconds'] for r in runs[key]):.3f} s")
        runs["dsecfs local cache"] = dataclasses.asdict(node.cache_stats())
        if node.sandboxes():
            raise SystemExit(f"sandboxes left on the daemon: {node.sandboxes()}")
    finally:
        daemon.stop()
    return runs


def bench_dsecfs(setup_info: dict, work: str, name: str, remote: bool, sandboxes: int, concurrency: int) -> dict:
    """dsecfs alone: cold then warm on one fresh daemon, ``concurrency`` sandboxes at a time."""
    runs: dict = {}
    daemon = Daemon(work, setup_info["store"], f"{name}-c{concurrency}", remote)
    try:
        node = daemon.node
        for temperature in ("cold", "warm"):
            key = f"dsecfs {name} {temperature}" + (f" c{concurrency}" if concurrency > 1 else "")
            if temperature == "cold":
                drop_caches()
            if concurrency == 1:
                runs[key] = [settled(dsecfs_sandbox(node, k)) for k in range(sandboxes)]
            else:
                with ThreadPoolExecutor(concurrency) as pool:
                    runs[key] = list(pool.map(lambda k: dsecfs_sandbox(node, k), range(sandboxes)))
            log(f"{key}: median {statistics.median(r['seconds'] for r in runs[key]):.3f} s")
        runs[f"dsecfs {name} cache" + (f" c{concurrency}" if concurrency > 1 else "")] = \
            dataclasses.asdict(node.cache_stats())
        if node.sandboxes():
            raise SystemExit(f"sandboxes left on the daemon: {node.sandboxes()}")
    finally:
        daemon.stop()
    return runs


def bench_baseline_concurrent(setup_info: dict, work: str, sandboxes: int, concurrency: int) -> dict:
    scratch = os.path.join(work, f"baseline-c{concurrency}")
    os.makedirs(scratch)
    runs = {}
    for temperature in ("cold", "warm"):
        key = f"baseline {temperature} c{concurrency}"
        if temperature == "cold":
            drop_caches()
        with ThreadPoolExecutor(concurrency) as pool:
            runs[key] = list(pool.map(lambda k: baseline_sandbox(setup_info["tars"], scratch, k), range(sandboxes)))
        os.sync()
        log(f"{key}: median {statistics.median(r['seconds'] for r in runs[key]):.3f} s")
    return runs


# ---- report ---------------------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summarize(runs: dict) -> tuple[dict, list[str]]:
    summary = {}
    lines = [f"{'series':<26}{'p50 s':>8}{'p99 s':>8}{'mean s':>8}{'first s':>9}{'prepare p50':>13}"
             f"{'command p50':>13}{'teardown p50':>14}"]
    for key, results in runs.items():
        if not isinstance(results, list):
            continue
        seconds = [r["seconds"] for r in results]
        row = {"p50_s": statistics.median(seconds), "p99_s": percentile(seconds, 99), "mean_s": statistics.mean(seconds),
               "first_s": seconds[0], "max_s": max(seconds),
               **{f"{part}_p50_s": statistics.median(r[f"{part}_s"] for r in results)
                  for part in ("prepare", "command", "teardown")}}
        summary[key] = row
        lines.append(f"{key:<26}{row['p50_s']:>8.3f}{row['p99_s']:>8.3f}{row['mean_s']:>8.3f}{row['first_s']:>9.3f}"
                     f"{row['prepare_p50_s']:>13.3f}{row['command_p50_s']:>13.3f}{row['teardown_p50_s']:>14.3f}")
    return summary, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=50)
    parser.add_argument("--concurrency", type=int, action="append", default=[],
                        help="also run every series this many sandboxes at a time (repeatable)")
    parser.add_argument("--skip-remote", action="store_true", help="no daemon behind the emulated remote store")
    parser.add_argument("--work", default="/var/tmp", help="scratch directory (store, tars, daemons, extractions)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (mount, runc, drop_caches)")
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="dsecfs-sandbox-", dir=args.work)
    try:
        setup_info = setup(work, args.sandboxes)
        log(f"layers built in {setup_info['build_s']:.1f} s, tars in {setup_info['tar_s']:.1f} s "
            f"(base tar {setup_info['base_tar_bytes'] / 1e6:.0f} MB)")
        runs = bench_side_by_side(setup_info, work, args.sandboxes)
        if not args.skip_remote:
            runs.update(bench_dsecfs(setup_info, work, "remote", True, args.sandboxes, 1))
        for concurrency in args.concurrency:
            runs.update(bench_dsecfs(setup_info, work, "local", False, args.sandboxes, concurrency))
            if not args.skip_remote:
                runs.update(bench_dsecfs(setup_info, work, "remote", True, args.sandboxes, concurrency))
            runs.update(bench_baseline_concurrent(setup_info, work, args.sandboxes, concurrency))
    finally:
        left = mounts_below(work)
        if left:  # never rmtree through a mount: leave the directory for a look
            log(f"mounts left below {work}, not removed: {left}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary, lines = summarize(runs)
    print(f"{args.sandboxes} sandboxes per series; c = sandboxes at a time; first command: {' '.join(FIRST_COMMAND)}; "
          f"remote = LatencyStore {LATENCY_MS:g} ms, {BANDWIDTH_MBPS:g} MB/s; p99 nearest-rank")
    print("\n".join(lines))
    print(json.dumps({"setup": setup_info, "summary": summary, "runs": runs,
                      "wall_s": time.perf_counter() - started}, indent=1))


if __name__ == "__main__":
    main()
