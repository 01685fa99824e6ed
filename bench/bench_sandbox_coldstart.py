"""Cold starts on the sandbox path (issue 13): `sandbox up` + a real first command, against pulling the
same layers, for several workloads and two emulated stores, in the series a platform sees.

    .venv/bin/python bench/bench_sandbox_coldstart.py [--rounds 1] [--workloads numpy,boto3,sympy]
                                                      [--stores s3,3fs] [--cache DIR] [--work DIR]
                                                      [--series 'first-ever;first-ever, fill none']
                                                      [--variant 'main=dsecfs=/work/main/.venv/bin/dsecfs']
                                                      [--variant 'small=chunk=256KiB --read-ahead 128KiB']
                                                      [--baseline SRC]

``--variant`` runs the series once more per variant, side by side in each round (their order turning
round by round): the daemon's arguments, layers built in chunks of another size, another checkout's
daemon as the baseline. Store requests: the daemon's dsecfs_store_requests_total over the start; serial
round trips its dsecfs_store_serial_round_trips over the start (the round trips waited for one after
another: behind the 20 ms store, what a start waits for, and a count that the machine's load moves little).
``--baseline SRC``: another tree of this project (say ``git archive main | tar -x -C SRC``) whose daemon
runs every series too, as a variant named ``baseline`` (its daemons run on this Python with SRC first on
the path); every other row also gets the ratio of its seconds to the baseline's.

Layers (built once, kept under --cache, default /var/cache/dsecfs-test/sandbox-coldstart):

- base: Debian bookworm minbase with python3 (mmdebstrap; shared with bench_coldstart.py's
  debian-python3/);
- a toolkit per workload, real PyPI packages installed with pip --target under /opt/toolkit:
  ``numpy``: numpy and pandas, first command ``import numpy, pandas`` and a small DataFrame sum;
  ``boto3``: boto3 (botocore: thousands of small JSON and .py files), first command an S3 client made
  (it loads the service model);
  ``sympy``: sympy (pure Python, about a thousand modules), first command an integral;
  each toolkit also as ``:2``, a new release: the same tree with one module's source changed.

Stores, emulated by the daemon's LatencyStore (and the pull's): ``s3`` 20 ms per request and one 100 MB/s
link; ``3fs`` 1 ms and 1 GB/s; the link shared equally by the transfers on it, as a real one is by its
flows. The store's files are on this machine's disk.

Pull (the baseline): each layer's tar.zst streamed from the same emulated store, base then toolkit, into
``tar --zstd -x`` of each in turn into one directory, then the same command with the same runtime
(overlay.runtime.run_in_rootfs, runc). Streamed: read in PULL_RANGE ranges, PULL_RANGES_IN_FLIGHT side by
side, so the link stays busy as under one long GET (only the first range waits a round trip with the link
idle), by a thread of its own that runs ahead of the extraction by up to PULL_BUFFER_RANGES ranges (so
the toolkit downloads while the base extracts, as containerd's downloads run ahead of its unpacking).

Series, each start with an empty node cache (a fresh daemon, a new cache directory) and dropped page cache:

- ``first-ever``: no profile anywhere (the store's profiles/ removed first);
- ``same node``: the daemon of first-ever restarted on its state directory with an empty cache;
- ``other node``: a new daemon, new state and cache: what it knows comes from the store only;
- ``repeat (idle mounts)``: the other node's daemon again, its layers still mounted (idle, within
  ``--idle-grace``): a repeat start, not a cold one;
- ``warm``: a new daemon over the other node's cache (every chunk the command reads is in it, and the
  node's metadata copies) with a new state directory (no layer mounted), page cache dropped;
- ``new release``: a new daemon, the toolkit's ``:2`` (its digest has no profile; its name has);
- ``first-ever, fill none``: first-ever again (profiles removed) with fill ``none``: what the command
  itself makes the node fetch (the bytes goal).

And with every pull, the command alone in the pulled tree (through runc, as the pull ran it; not part
of the pull's seconds): ``command alone, page cache warm`` right after the pull's own run, the floor
under any start, which the goal of 0.20x the pull is to be read against; ``command alone, page cache
dropped`` after a drop, the floor of a start with every byte on the node's disk (``warm``'s).

A drop of the page cache that cannot finish within DROP_PATIENCE (its sync hangs behind another process's
stuck mount) is given up on, and the report counts those starts.

Each start: ``Node.sandbox_up(base, toolkit)`` then ``exec`` of the command (runc), timed from the up call
to the command's end, then ``down``. Reported per workload and store: seconds, ratio to the pull, bytes
fetched from the store by the command's end (of the layers' chunk bytes), and of what the profile
prefetched, the share never read. Goals (issue 13): first-ever at most 1.0x the pull; another node at most
0.20x on numpy and within 1.5x of warm on every workload; fetched at most 15% of the layers with fill
``none``; prefetched-but-never-read at most 20%. The daemons run with ``--fill`` (default: the daemon's
own default), but for the last series.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsec_fs.client import Node  # noqa: E402
from dsec_fs.store import FilesystemStore, keys  # noqa: E402
from dsec_fs.store.wrappers import LatencyStore  # noqa: E402
from erofs_builder import build_layer  # noqa: E402
from erofs_builder.chunker import DEFAULT_CHUNK_SIZE  # noqa: E402
from overlay.runtime import run_in_rootfs  # noqa: E402
from benchlib import daemon_metric, drop_caches, log, store_requests  # noqa: E402
from dsec_fs.units import parse_size  # noqa: E402

STORES = {"s3": (20.0, 100.0), "3fs": (1.0, 1000.0)}  # ms per request, MB/s
WORKLOADS = {
    "numpy": (("numpy", "pandas"),
              "import numpy, pandas; print(pandas.DataFrame({'a': numpy.arange(10)}).a.sum())"),
    "boto3": (("boto3",),
              "import boto3; print(boto3.session.Session().client('s3', region_name='us-east-1').meta.region_name)"),
    "sympy": (("sympy",),
              "import sympy; x = sympy.Symbol('x'); print(sympy.integrate(x * sympy.sin(x), x))"),
}
CHANGED_MODULE = {"numpy": "pandas/__init__.py", "boto3": "botocore/__init__.py", "sympy": "sympy/__init__.py"}
SERIES = ("first-ever", "same node", "other node", "repeat (idle mounts)", "warm", "new release",
          "first-ever, fill none")
PULL_RANGE = 4 << 20
PULL_RANGES_IN_FLIGHT = 2
PULL_BUFFER_RANGES = 16
COMMAND_WARM = "command alone, page cache warm"  # in the pulled tree, right after the pull's own run
COMMAND_DROPPED = "command alone, page cache dropped"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
       "HOME": "/root", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": "/opt/toolkit"}
GOAL_FIRST = 1.0
GOAL_OTHER_NUMPY = 0.20
GOAL_OTHER_WARM = 1.5
GOAL_FETCHED = 0.15
SERIAL_ROUND_TRIPS = "dsecfs_store_serial_round_trips"
GOAL_UNREAD = 0.20
# A sync (drop_caches) waits for every superblock, so it hangs while any process's mount is stuck (a FUSE
# server stopped under a debugger, say): after this long a start goes on with the page cache as it is,
# and the report counts it.
DROP_PATIENCE = 20.0
undropped = 0


def drop_page_cache() -> None:
    global undropped
    done = threading.Event()
    threading.Thread(target=lambda: (drop_caches(), done.set()), daemon=True).start()
    if not done.wait(DROP_PATIENCE):
        undropped += 1
        log(f"the page cache could not be dropped within {DROP_PATIENCE:g} s (sync hangs); going on")


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("stdout", subprocess.PIPE)
    result = subprocess.run(argv, stderr=subprocess.PIPE, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.decode(errors='replace')[-2000:]}")
    return result


def _made(path: str, make) -> None:
    if not os.path.exists(path):
        tmp = f"{path}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make(tmp)
        os.rename(tmp, path)


def setup(cache: str, workloads: list[str], chunk_size: int = DEFAULT_CHUNK_SIZE) -> dict:
    """Trees, the store with every layer and each layer's tar.zst; returns what was built. Layers of
    another chunk size than the build's default get a store (and a layers file) of their own."""
    os.makedirs(cache, exist_ok=True)
    rootfs = os.path.join(os.path.dirname(cache), "debian-python3")
    _made(rootfs, lambda tmp: run(["mmdebstrap", "--variant=minbase", "--include=python3", "bookworm", tmp]))
    suffix = "" if chunk_size == DEFAULT_CHUNK_SIZE else f"-{chunk_size >> 10}k"
    info_path = os.path.join(cache, f"layers{suffix}.json")
    info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    store_dir = os.path.join(cache, f"store{suffix}")
    with FilesystemStore(store_dir) as store:
        if "base" not in info:
            info["base"] = _layer(store, rootfs, "bench/base:1", chunk_size)
        for name in workloads:
            if name in info:
                continue
            packages, _command = WORKLOADS[name]
            tree = os.path.join(cache, f"toolkit-{name}")

            def install(tmp: str, packages=packages) -> None:
                target = os.path.join(tmp, "opt", "toolkit")
                run([sys.executable, "-m", "pip", "install", "--quiet", "--target", target, *packages])
                run([sys.executable, "-m", "compileall", "-q", target])

            _made(tree, install)
            release = f"{tree}-2"

            def change(tmp: str, tree=tree, name=name) -> None:
                run(["cp", "-a", tree, tmp])
                with open(os.path.join(tmp, "opt", "toolkit", CHANGED_MODULE[name]), "a") as f:
                    f.write("\n# release 2\n")

            _made(release, change)
            info[name] = {"v1": _layer(store, tree, f"bench/{name}:1", chunk_size),
                          "v2": _layer(store, release, f"bench/{name}:2", chunk_size)}
            with open(info_path, "w") as f:
                json.dump(info, f, indent=1)
    info["store"] = store_dir
    return info


def _layer(store: FilesystemStore, tree: str, ref: str, chunk_size: int) -> dict:
    log(f"building {ref} from {tree} in chunks of {chunk_size >> 10} KiB")
    start = time.perf_counter()
    layer = build_layer(tree, store, name=ref, chunk_size=chunk_size)
    manifest = layer.manifest
    log(f"built {ref} in {time.perf_counter() - start:.1f} s: meta.erofs {manifest.meta_size} bytes, blob map "
        f"{manifest.blobmap_size}, {manifest.stats.get('chunks', 0)} chunks, {len(manifest.packs)} packs")
    tar_key = f"bench/{layer.digest}.tar.zst"
    store.put(tar_key, run(["tar", "--zstd", "-cf", "-", "-C", tree, "."]).stdout)
    return {"ref": ref, "digest": layer.digest, "tar": tar_key, "chunk_bytes": int(layer.manifest.stats.get("bytes", 0))}


def pull(info: dict, toolkit: dict, command: str, store_name: str, dest: str) -> dict:
    """The pull's seconds, then the command alone in the pulled tree: once more right after (its page cache
    warm: the floor of any start) and once after a drop of the page cache (what a start that has every
    byte on the node's disk needs)."""
    latency, bandwidth = STORES[store_name]
    os.makedirs(dest)
    try:
        drop_page_cache()
        start = time.perf_counter()
        with LatencyStore(FilesystemStore(info["store"], create=False), latency=latency / 1000,
                          bandwidth=bandwidth * 1e6) as store:
            keys_ = [info["base"]["tar"], toolkit["tar"]]
            sizes = [store.size(key) for key in keys_]
            arrived: queue.Queue = queue.Queue(PULL_BUFFER_RANGES)
            downloader = threading.Thread(target=_download, args=(store, keys_, sizes, arrived), daemon=True)
            downloader.start()
            for size in sizes:
                tar = subprocess.Popen(["tar", "--zstd", "-xf", "-", "-C", dest], stdin=subprocess.PIPE)
                got = 0
                while got < size:
                    data = arrived.get()
                    if isinstance(data, BaseException):
                        raise SystemExit(f"the pull's download failed: {data}")
                    tar.stdin.write(data)
                    got += len(data)
                tar.stdin.close()
                if tar.wait() != 0:
                    raise SystemExit("tar -x failed")
            downloader.join()
        run_command(dest, command)
        seconds = time.perf_counter() - start
        warm = run_command(dest, command)
        drop_page_cache()
        return {"seconds": seconds, COMMAND_WARM: warm, COMMAND_DROPPED: run_command(dest, command)}
    finally:
        shutil.rmtree(dest)


def run_command(rootfs: str, command: str) -> float:
    """The seconds of the first command in the pulled tree, through runc as a sandbox runs it."""
    start = time.perf_counter()
    result = run_in_rootfs(rootfs, ["python3", "-c", command], runtime="runc", env=ENV)
    if result.exit_code != 0:
        raise SystemExit(f"the command failed after the pull: {result.stderr.decode(errors='replace')[-2000:]}")
    return time.perf_counter() - start


def _download(store: LatencyStore, keys_: list[str], sizes: list[int], arrived: queue.Queue) -> None:
    """Put the objects' bytes into ``arrived`` in order, in PULL_RANGE ranges read PULL_RANGES_IN_FLIGHT
    side by side (or the error that stopped it); waits while ``arrived`` is full."""
    ranges = [(key, offset, min(PULL_RANGE, size - offset)) for key, size in zip(keys_, sizes)
              for offset in range(0, size, PULL_RANGE)]
    try:
        with ThreadPoolExecutor(PULL_RANGES_IN_FLIGHT) as pool:
            reading: deque = deque()
            for key, offset, length in ranges:
                reading.append(pool.submit(store.get, key, offset, length))
                if len(reading) == PULL_RANGES_IN_FLIGHT:
                    arrived.put(reading.popleft().result())
            while reading:
                arrived.put(reading.popleft().result())
    except Exception as exc:  # the extraction reports it
        arrived.put(exc)


class Node_:
    """A daemon in ``home`` (its state kept across restarts, its cache made new by ``fresh_cache``)."""

    def __init__(self, home: str, store: str, store_name: str, extra_args: tuple[str, ...] = (),
                 command: tuple[str, ...] | None = None):
        self.home, self.store, self.store_name, self.extra_args = home, store, store_name, extra_args
        self.command = command  # the dsecfs command to run the daemon with (None: this checkout's)
        self.env = None
        self.cache = 0
        self.daemon = None

    @classmethod
    def of_source(cls, home: str, store: str, store_name: str, extra_args: tuple[str, ...], source: str) -> "Node_":
        """A daemon of another tree of the project (--baseline): SRC first on the path, before the current
        directory that ``-c`` puts first, and before our installed tree."""
        node = cls(home, store, store_name, extra_args,
                   (sys.executable, "-c", f"import sys; sys.path.insert(0, {source!r}); "
                    "from cli.main import main; sys.argv[0] = 'dsecfs'; main()"))
        node.env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        return node

    def start(self, *, fresh_cache: bool = True, state: str = "state") -> Node:
        if fresh_cache:
            self.cache += 1
        latency, bandwidth = STORES[self.store_name]
        os.makedirs(self.home, exist_ok=True)
        self.daemon = Node.start_daemon(
            os.path.join(self.home, "api.sock"), state_dir=os.path.join(self.home, state),
            cache_dir=os.path.join(self.home, f"cache-{self.cache}"), store=self.store, latency_ms=latency,
            bandwidth_mbps=bandwidth, fetch_timeout=120, log_file=os.path.join(self.home, "daemon.log"),
            extra_args=self.extra_args, command=self.command, env=self.env)
        return self.daemon.node

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.alive():
            self.daemon.stop()
        self.daemon = None


def start_sandbox(node: Node, info: dict, toolkit: dict, command: str) -> dict:
    drop_page_cache()
    before = {layer.layer: layer.bytes_fetched for layer in node.status().layers}
    requests_before = store_requests(node)
    serial_before = daemon_metric(node, SERIAL_ROUND_TRIPS)
    start = time.perf_counter()
    with node.sandbox(base=info["base"]["ref"], toolkit=toolkit["ref"]) as sandbox:
        result = sandbox.exec(["python3", "-c", command], env=ENV)
        seconds = time.perf_counter() - start
        if result.exit_code != 0:
            raise SystemExit(f"the command failed: {result.stderr.decode(errors='replace')[-2000:]}")
        layers = {layer.layer: layer for layer in node.status().layers}
        requests = store_requests(node) - requests_before
        serial = daemon_metric(node, SERIAL_ROUND_TRIPS) - serial_before
    digests = (info["base"]["digest"], toolkit["digest"])
    fetched = sum(layers[d].bytes_fetched - before.get(d, 0) for d in digests if d in layers)
    prefetched = sum(layers[d].prefetched_bytes for d in digests if d in layers)
    unread = sum(layers[d].prefetched_unread_bytes for d in digests if d in layers)
    total = sum(layers[d].data_bytes for d in digests if d in layers)
    return {"seconds": seconds, "fetched_bytes": fetched, "store_requests": requests, "serial_round_trips": serial,
            "layer_bytes": total,
            "fetched_fraction": fetched / total if total else 0.0, "prefetched_bytes": prefetched,
            "unread_fraction": unread / prefetched if prefetched else 0.0}


def _forget_profiles(info: dict) -> None:
    with FilesystemStore(info["store"]) as store:  # first-ever: nothing learned anywhere
        for key in list(store.list(keys.PROFILES)):
            store.delete(key)


def bench(info: dict, workload: str, store_name: str, work: str, fill: str | None, daemon_args: tuple[str, ...] = (),
          series: tuple[str, ...] = SERIES, daemon_command: tuple[str, ...] | None = None,
          source: str | None = None) -> dict:
    _packages, command = WORKLOADS[workload]
    v1, v2 = info[workload]["v1"], info[workload]["v2"]
    _forget_profiles(info)
    results = {"pull": pull(info, v1, command, store_name, os.path.join(work, "pull"))}
    extra = (*daemon_args, *(("--fill", fill) if fill else ()))

    def node(name: str, args: tuple[str, ...]) -> Node_:
        home = os.path.join(work, name)
        if source:
            return Node_.of_source(home, info["store"], store_name, args, source)
        return Node_(home, info["store"], store_name, args, daemon_command)

    first, other, fresh = node("node-a", extra), node("node-b", extra), node("node-c", extra)
    unfilled = node("node-d", (*daemon_args, "--fill", "none", "--no-profiles"))
    try:
        if "first-ever" in series:
            results["first-ever"] = start_sandbox(first.start(), info, v1, command)
            first.stop()  # publishes the profiles learned at down
        if "same node" in series:
            results["same node"] = start_sandbox(first.start(), info, v1, command)
            first.stop()
        if {"other node", "repeat (idle mounts)", "warm"} & set(series):
            started = other.start()
            results["other node"] = start_sandbox(started, info, v1, command)
            results["repeat (idle mounts)"] = start_sandbox(started, info, v1, command)
            other.stop()
            results["warm"] = start_sandbox(other.start(fresh_cache=False, state="state-warm"), info, v1, command)
            other.stop()
        if "new release" in series:
            results["new release"] = start_sandbox(fresh.start(), info, v2, command)
            fresh.stop()
        if "first-ever, fill none" in series:
            results["first-ever, fill none"] = start_sandbox(unfilled.start(), info, v1, command)
            unfilled.stop()
    finally:
        for n in (first, other, fresh, unfilled):
            n.stop()
    return results


def parse_variant(text: str) -> tuple[str, int, tuple[str, ...], tuple[str, ...] | None]:
    """``NAME=ARGS``: the daemon's extra arguments; among them ``chunk=SIZE`` for layers built in chunks
    of SIZE (a store of their own, built on first use) and ``dsecfs=PATH`` for the daemon run by another
    checkout's dsecfs (say main's, as the baseline)."""
    name, _, args = text.partition("=")
    chunk_size, daemon_args, command = DEFAULT_CHUNK_SIZE, [], None
    for arg in args.split():
        if arg.startswith("chunk="):
            chunk_size = parse_size(arg.removeprefix("chunk="))
        elif arg.startswith("dsecfs="):
            command = (arg.removeprefix("dsecfs="),)
        else:
            daemon_args.append(arg)
    return name, chunk_size, tuple(daemon_args), command


def _goals(workload: str, row: dict) -> list[tuple[str, bool]]:
    checks = []
    if "first-ever" in row:
        checks.append(("first-ever <= 1.0x pull", row["first-ever"]["ratio"] <= GOAL_FIRST))
    if "other node" in row:
        warm = row["warm"]["seconds"]
        checks += [("other node <= 1.5x warm", row["other node"]["seconds"] <= GOAL_OTHER_WARM * warm),
                   ("prefetched unread <= 20%", row["other node"]["unread_fraction"] <= GOAL_UNREAD)]
        if workload == "numpy":
            checks.append(("other node <= 0.20x pull", row["other node"]["ratio"] <= GOAL_OTHER_NUMPY))
    if "first-ever, fill none" in row:
        checks.append(("fetched <= 15%", row["first-ever, fill none"]["fetched_fraction"] <= GOAL_FETCHED))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cache", default="/var/cache/dsecfs-test/sandbox-coldstart")
    parser.add_argument("--work", default=None)
    parser.add_argument("--fill", choices=("none", "profile", "layer"), default=None,
                        help="the daemons' fill policy (default: the daemon's own)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="run the series also (in turns, each round) with these daemon arguments, and "
                             "chunk=SIZE for layers built in chunks of SIZE; e.g. 'old=--read-ahead 1MiB'")
    parser.add_argument("--baseline", metavar="SRC", default=None,
                        help="another tree of the project whose daemon runs the series too, side by side")
    parser.add_argument("--series", default=";".join(SERIES),
                        help="the series to run, separated by ';', of: " + "; ".join(SERIES))
    args = parser.parse_args()
    workloads, stores = args.workloads.split(","), args.stores.split(",")
    series = tuple(name.strip() for name in args.series.split(";") if name.strip())
    unknown = set(series) - set(SERIES)
    if unknown:
        parser.error(f"unknown series {', '.join(sorted(unknown))}")
    variants = [(*parse_variant(text), None) for text in args.variant]
    variants = variants or [("default", DEFAULT_CHUNK_SIZE, (), None, None)]
    if args.baseline:
        variants.append(("baseline", DEFAULT_CHUNK_SIZE, (), None, os.path.abspath(args.baseline)))
    infos = {chunk_size: setup(args.cache, workloads, chunk_size) for chunk_size in sorted({v[1] for v in variants})}
    work = args.work or tempfile.mkdtemp(prefix="dsecfs-sbcold-")
    rows, missed = [], []
    try:
        for workload in workloads:
            for store_name in stores:
                rounds: dict[str, list[dict]] = {variant[0]: [] for variant in variants}
                for r in range(args.rounds):
                    turn = variants if r % 2 == 0 else variants[::-1]
                    for name, chunk_size, daemon_args, command, source in turn:
                        round_work = os.path.join(work, f"{workload}-{store_name}-{name}-{r}")
                        os.makedirs(round_work)
                        rounds[name].append(bench(infos[chunk_size], workload, store_name, round_work, args.fill,
                                                  daemon_args, series, command, source))
                        shutil.rmtree(round_work, ignore_errors=True)
                baseline = _row(workload, store_name, "baseline", rounds["baseline"]) if args.baseline else None
                for name, chunk_size, daemon_args, command, _source in variants:
                    row = baseline if name == "baseline" else _row(workload, store_name, name, rounds[name], baseline)
                    row["chunk_size"], row["daemon_args"] = chunk_size, [*(command or ()), *daemon_args]
                    missed += [f"{workload}/{store_name}/{name}: {goal}" for goal, ok in row["goals"].items() if not ok]
                    rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"rows": rows, "missed": missed, "starts_with_page_cache_not_dropped": undropped}, indent=1))
    sys.exit(1 if missed else 0)


def _row(workload: str, store_name: str, variant: str, rounds: list[dict], baseline: dict | None = None) -> dict:
    pull_s = statistics.median(r["pull"]["seconds"] for r in rounds)
    row = {"workload": workload, "store": store_name, "variant": variant, "pull_s": pull_s}
    for alone in (COMMAND_WARM, COMMAND_DROPPED):
        seconds = statistics.median(r["pull"][alone] for r in rounds)
        row[alone] = {"seconds": seconds, "ratio": seconds / pull_s}
        log(f"{workload} {store_name} {variant} {alone}: {seconds:.2f} s ({seconds / pull_s:.2f}x the pull's "
            f"{pull_s:.2f} s)")
    for series in SERIES:
        if series not in rounds[0]:
            continue
        row[series] = {k: statistics.median(r[series][k] for r in rounds) for k in rounds[0][series]}
        row[series]["ratio"] = row[series]["seconds"] / pull_s
        versus = ""
        if baseline is not None:
            row[series]["baseline_s"] = baseline[series]["seconds"]
            row[series]["vs_baseline"] = row[series]["seconds"] / row[series]["baseline_s"]
            versus = f", baseline {row[series]['baseline_s']:.2f} s ({row[series]['vs_baseline']:.2f}x)"
        log(f"{workload} {store_name} {variant} {series}: {row[series]['seconds']:.2f} s "
            f"({row[series]['ratio']:.2f}x the pull's {pull_s:.2f} s), fetched "
            f"{row[series]['fetched_fraction']:.1%} ({row[series]['fetched_bytes'] / 1e6:.1f} MB), "
            f"store requests {row[series]['store_requests']}, serial round trips "
            f"{row[series]['serial_round_trips']}, prefetched unread {row[series]['unread_fraction']:.1%}"
            f"{versus}")
    row["goals"] = {goal: ok for goal, ok in _goals(workload, row)}
    return row


if __name__ == "__main__":
    main()
