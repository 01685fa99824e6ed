"""Cold-start benchmark (issue 4): a sandbox's first commands on a lazily fetched layer against a full pull,
plus warm read throughput and a metadata walk against the same tree on local disk.

    .venv/bin/python bench/bench_coldstart.py [--rounds 3] [--warm-rounds 5] [--cache DIR] [--work DIR]
                                              [--miss-readahead SIZE] [--read-ahead SIZE]
                                              [--fuse-binding B] [--skip-cold]
                                              [--skip-warm]

The image: Debian bookworm minbase with python3 (mmdebstrap) plus a toolkit of real PyPI packages (numpy,
scipy, pandas, matplotlib, scikit-learn with pip --target, byte-compiled) under /opt/toolkit, built as ONE
layer (no OverlayFS stack) into a local FilesystemStore. Everything is made once and kept under
--cache (default /var/cache/dsecfs-test): the rootfs in debian-python3/, the packages in toolkit-pypi/,
and in coldstart/ the combined tree, a 500 MB random file, and the store (the layer, a layer holding only
the 500 MB file, and the tree as one tar.zst object). setup.json there says what was built; delete
coldstart/store to rebuild the layers (after a format change, say).

The remote store is emulated: the node daemon runs with ``--latency 20 --bandwidth 100MB`` (LatencyStore:
20 ms per request, one shared link of 100 MB/s), and the full pull reads its tarball through the same
LatencyStore in one GET. The store's files are on this machine's disk, and every cold run starts after
``drop_caches``, so both sides also pay real disk reads of the store.

Cold start, per round, each configuration in turn (the order rotates between rounds):

- ``full pull``: one GET of the tar.zst, ``tar --zstd -x`` into an empty directory (no fsync, as
  containerd's default), then the workload in a chroot of it. Timed from the GET to the workload's end.
- ``kernel`` / ``fuse``: a fresh daemon (empty chunk cache and state directory), drop_caches, then
  ``Node.mount`` and the workload in a chroot of the mountpoint. Timed from the mount call to the
  workload's end (the daemon is already running: a node runs one). Bytes fetched come from the daemon's
  status (uncompressed chunk bytes, against the layer's chunk bytes); with ``--miss-readahead SIZE`` they
  include what readahead brought along with the misses (up to SIZE of the chunks stored after each,
  lazy_fetch/blob_reader.py; off by default, as in the daemon).
- ``kernel+prefetch`` / ``fuse+prefetch``: the same, mounted with a prefetch list that ``dsecfs prefetch
  build`` learned from the trace of that mode's first cold run (round 0 of ``kernel`` / ``fuse``). The
  prefetch runs in the background; bytes are read when the workload ends and again once the prefetch
  is done.

The workload (read-only commands, so the read-only mounts need no writable upper layer; environment
PYTHONDONTWRITEBYTECODE=1 so the writable full-pull tree gets no .pyc files either):
``dpkg -l``, ``apt-get --version``, ``python3 -c "import json, sqlite3"``, ``python3 -c "import numpy,
pandas"`` (PYTHONPATH=/opt/toolkit). The commands' output is compared across configurations.

Warm (after the cold runs; one daemon, both layers mounted in both modes, the 500 MB file read once
through each mount first, so all its chunks are in the chunk cache; the walk reads metadata only, which
the daemon holds locally once mounted). The 500 MB file has a layer of its own so as not to swell the
layer the cold start runs on (its random bytes would more than triple the tarball):

- sequential read of the 500 MB file (1 MiB reads) on each mount, on local disk, and, for reference, on
  the kernel's EROFS mounted over the layer exported to local files (``dsecfs export``: meta.erofs and
  the materialised blob, no dsecfs in the way: what EROFS itself does here). ``dropped``: page cache
  dropped before each read (for kernel mode that is the EROFS -> FUSE blob -> chunk cache path; the
  daemon's 64 MiB memory cache keeps what it last served, about an eighth of the file); ``page cache``:
  read again right after, pages cached.
- ``find DIR -printf '%s %p\\n'`` over the layer's tree on each mount and on the local tree. ``dropped``:
  drop_caches (page, dentry and inode caches) before each walk; ``warm``: the median of five more walks right
  after.

Every comparison alternates its sides within a round; the tables give medians over rounds and ratios
against the goals (issue 4's: cold start at most 20% of the full pull and bytes fetched at most 15%, in
every configuration; warm kernel-mode reads, from the page cache as on local disk, at least 90% of
local disk; walks within 1.2x / 3x; reads with the page cache dropped are reported beside them). The
script exits 1 when a goal is missed. Needs root, /dev/fuse, mmdebstrap and
network access to Debian's mirror and PyPI the first time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsec_fs.client import Node  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from dsec_fs.store.wrappers import LatencyStore  # noqa: E402
from dsec_fs import mounts  # noqa: E402
from erofs_builder import build_layer  # noqa: E402
from erofs_builder.export import export_layer  # noqa: E402
from dsec_fs.api import BINDINGS  # noqa: E402
from lazy_fetch.trace import FLAG_MISS, FLAG_PREFETCH, read_trace  # noqa: E402
from benchlib import drop_caches, log  # noqa: E402

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
LATENCY_MS = 20.0
BANDWIDTH_MBPS = 100.0  # 10^6 bytes per second
TOOLKIT_PACKAGES = ("numpy", "scipy", "pandas", "matplotlib", "scikit-learn")
BIG_FILE_BYTES = 500 * 10**6
LAYER_REF = "bench/coldstart:1"
BIG_REF = "bench/bigfile:1"
TARBALL_KEY = "bench/coldstart.tar.zst"
SETUP_VERSION = 1  # bump when what setup() builds changes, so cached setups are rebuilt
READ_BUFFER = 1 << 20
WARM_WALKS = 5  # warm walks per round and side (their median counts): one takes under 0.1 s, so noise
PREFETCH_WAIT = 300.0  # seconds a prefetch may take to finish after the workload

ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
       "HOME": "/root", "PYTHONDONTWRITEBYTECODE": "1"}
WORKLOAD = (
    ("dpkg -l", ["dpkg", "-l"], {}),
    ("apt-get --version", ["apt-get", "--version"], {}),
    ("python3 import json, sqlite3", ["python3", "-c", "import json, sqlite3"], {}),
    ("python3 import numpy, pandas", ["python3", "-c", "import numpy, pandas; print(numpy.__version__, "
                                      "pandas.__version__)"], {"PYTHONPATH": "/opt/toolkit"}),
)
COLD_CONFIGS = ("full pull", "kernel", "fuse", "kernel+prefetch", "fuse+prefetch")

# Goals of issue 4.
GOAL_COLD_RATIO = 0.20  # cold start / full pull
GOAL_FETCHED_FRACTION = 0.15  # bytes fetched / layer
GOAL_KERNEL_READ = 0.90  # kernel-mode warm read throughput / local disk
GOAL_KERNEL_WALK = 1.2  # kernel-mode metadata walk / local disk
GOAL_FUSE_WALK = 3.0  # fuse-mode metadata walk / local disk

READ_SIDES = ["local", "erofs", "kernel", "fuse"]  # erofs: EROFS over the exported layer (local files)
WALK_SIDES = ["local", "kernel", "fuse"]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("stdout", subprocess.PIPE)
    result = subprocess.run(argv, stderr=subprocess.PIPE, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): "
                         f"{result.stderr.decode(errors='replace')[-2000:]}")
    return result


def tree_bytes(path: str) -> tuple[int, int]:
    """(entries, bytes of regular files) below ``path``."""
    entries = size = 0
    for dirpath, dirs, files in os.walk(path):
        entries += len(dirs) + len(files)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return entries, size


# ---- setup: made once, kept under --cache ---------------------------------------------------------------


def _made_atomically(path: str, make) -> None:
    """``make(tmp)`` then rename to ``path``, unless ``path`` exists."""
    if os.path.exists(path):
        return
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    os.rename(tmp, path)


def setup(cache: str) -> dict:
    """The rootfs, the toolkit, the combined tree, the big file and the store; returns setup.json."""
    rootfs, toolkit = os.path.join(cache, "debian-python3"), os.path.join(cache, "toolkit-pypi")
    base = os.path.join(cache, "coldstart")
    tree, big_dir, store_dir = (os.path.join(base, name) for name in ("tree", "big", "store"))
    info_path = os.path.join(base, "setup.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        if info.get("version") == SETUP_VERSION and os.path.isdir(store_dir):
            return info
    os.makedirs(base, exist_ok=True)

    def mmdebstrap(tmp: str) -> None:
        log(f"mmdebstrap bookworm with python3 into {rootfs}")
        run(["mmdebstrap", "--variant=minbase", "--include=python3", "bookworm", tmp])

    def pip_install(tmp: str) -> None:
        log(f"pip install {' '.join(TOOLKIT_PACKAGES)} into {toolkit}")
        run([sys.executable, "-m", "pip", "install", "--quiet", "--target", tmp, *TOOLKIT_PACKAGES])

    def combine(tmp: str) -> None:
        log(f"combining the rootfs and the toolkit into {tree}")
        run(["cp", "-a", rootfs, tmp])
        run(["cp", "-a", toolkit, os.path.join(tmp, "opt", "toolkit")])

    def big_file(tmp: str) -> None:
        log(f"writing {BIG_FILE_BYTES / 1e6:.0f} MB of random bytes into {big_dir}")
        os.makedirs(tmp)
        with open(os.path.join(tmp, "big.bin"), "wb") as f:
            for _ in range(BIG_FILE_BYTES // READ_BUFFER):
                f.write(os.urandom(READ_BUFFER))
            f.write(os.urandom(BIG_FILE_BYTES % READ_BUFFER))

    def store(tmp: str) -> None:
        with FilesystemStore(tmp) as st:
            log("building the layer")
            layer = build_layer(tree, st, name=LAYER_REF)
            log("building the big-file layer")
            big = build_layer(big_dir, st, name=BIG_REF)
            log("tar --zstd of the tree, stored as one object")
            tarball = run(["tar", "--zstd", "-cf", "-", "-C", tree, "."]).stdout
            st.put(TARBALL_KEY, tarball)
        with open(os.path.join(tmp, "layers.json"), "w") as f:
            json.dump({"layer": layer.digest, "layer_stats": layer.manifest.stats, "big": big.digest,
                       "tarball_bytes": len(tarball)}, f)

    _made_atomically(rootfs, mmdebstrap)
    _made_atomically(toolkit, pip_install)
    _made_atomically(tree, combine)
    _made_atomically(big_dir, big_file)
    _made_atomically(store_dir, store)
    with open(os.path.join(store_dir, "layers.json")) as f:
        layers = json.load(f)
    entries, size = tree_bytes(tree)
    toolkit_entries, toolkit_size = tree_bytes(toolkit)
    info = {
        "version": SETUP_VERSION, "tree": tree, "big_dir": big_dir, "store": store_dir, **layers,
        "tree_entries": entries, "tree_bytes": size, "toolkit_bytes": toolkit_size,
        "toolkit_packages": sorted(name.removesuffix(".dist-info") for name in os.listdir(toolkit)
                                   if name.endswith(".dist-info")),
    }
    with open(info_path, "w") as f:
        json.dump(info, f, indent=1)
    return info


# ---- the workload ---------------------------------------------------------------------------------------


def run_workload(root: str) -> tuple[dict[str, float], str]:
    """Each command in a chroot of ``root``: (seconds by command, sha256 of all their output)."""
    times, out = {}, hashlib.sha256()
    for name, argv, env in WORKLOAD:
        start = time.perf_counter()
        result = run(["chroot", root, *argv], env={**ENV, **env})
        times[name] = time.perf_counter() - start
        out.update(result.stdout)
    return times, out.hexdigest()


# ---- daemons --------------------------------------------------------------------------------------------


class Daemons:
    """Fresh daemons, each with its own empty state and cache directories under ``work``; ``stop_all``
    stops every one this object started (and so unmounts what they mounted)."""

    def __init__(self, work: str, store: str, miss_readahead: str, read_ahead: str, binding: str):
        self.work = work
        self.store = store
        self.miss_readahead = miss_readahead
        self.read_ahead = read_ahead
        self.binding = binding
        self.started = []
        self.count = 0

    def start(self):
        self.count += 1
        home = os.path.join(self.work, f"daemon-{self.count}")
        os.makedirs(home)
        daemon = Node.start_daemon(
            os.path.join(home, "api.sock"), state_dir=os.path.join(home, "state"),
            cache_dir=os.path.join(home, "cache"), store=self.store, latency_ms=LATENCY_MS,
            bandwidth_mbps=BANDWIDTH_MBPS, fetch_timeout=120, log_file=os.path.join(home, "daemon.log"),
            fuse_binding=self.binding,
            extra_args=["--miss-readahead", self.miss_readahead, "--read-ahead", self.read_ahead])
        self.started.append(daemon)
        return daemon

    def stop(self, daemon) -> None:
        status = daemon.stop()
        if status != 0:  # its directory goes with the work directory: quote the end of its log
            with open(daemon.log_file, errors="replace") as f:
                tail = f.read()[-4000:]
            raise SystemExit(f"daemon {daemon.pid} exited with status {status}; its log ends:\n{tail}")
        shutil.rmtree(os.path.dirname(daemon.log_file), ignore_errors=True)

    def stop_all(self) -> None:
        for daemon in self.started:
            if daemon.alive():
                daemon.stop()


def layer_status(node: Node, digest: str):
    for layer in node.status().layers:
        if layer.layer == digest:
            return layer
    raise SystemExit(f"the daemon reports nothing of layer {digest}")


def store_reads(node: Node, digest: str) -> int:
    """The daemon's dsecfs_fetch_store_reads_total for the layer: its fetcher's store reads, each one batch
    of chunks of one pack (one GET per run of neighbouring chunks in it)."""
    wanted = f'dsecfs_fetch_store_reads_total{{layer="{digest}"}}'
    for line in node.metrics_text().splitlines():
        if line.startswith(wanted):
            return int(float(line.split()[-1]))
    return 0


def trace_figures(path: str) -> dict:
    """What a mount's trace says about waiting: reads by readers, those that waited for the store and
    their summed wait (reads in parallel add up), and when the prefetcher's last group landed (seconds
    after the mount)."""
    records = read_trace(path).records
    reads = [r for r in records if not r.flags & FLAG_PREFETCH]
    misses = [r for r in reads if r.flags & FLAG_MISS]
    prefetched = [r.time_ns for r in records if r.flags & FLAG_PREFETCH]
    return {"reads": len(reads), "miss_reads": len(misses), "miss_wait_s": sum(r.latency_us for r in misses) / 1e6,
            "prefetch_done_s": max(prefetched) / 1e9 if prefetched else None}


def wait_for_prefetch(node: Node) -> dict:
    deadline = time.monotonic() + PREFETCH_WAIT
    while True:
        job = node.prefetches()[-1]
        if job.state != "running":
            return {"state": job.state, "chunks": job.chunks, "bytes": job.bytes, "done_bytes": job.done_bytes,
                    "failed_chunks": job.failed_chunks}
        if time.monotonic() > deadline:
            raise SystemExit(f"the prefetch did not finish within {PREFETCH_WAIT:g} s")
        time.sleep(0.1)


def cold_mount_run(daemons: Daemons, info: dict, mode: str, mountpoint: str, prefetch: str | None) -> dict:
    daemon = daemons.start()
    node = daemon.node
    try:
        drop_caches()
        start = time.perf_counter()
        mount = node.mount(LAYER_REF, mountpoint, mode=mode, prefetch_list=prefetch)
        mounted = time.perf_counter()
        commands, output = run_workload(mountpoint)
        end = time.perf_counter()
        at_end = layer_status(node, info["layer"])
        result = {
            "seconds": end - start, "mount_s": mounted - start, "commands": commands, "output": output,
            "bytes_fetched": at_end.bytes_fetched, "chunks_fetched": at_end.chunks_fetched,
            "bytes_used": at_end.used_bytes, "layer_bytes": at_end.data_bytes,
            "fetched_fraction": at_end.bytes_fetched / at_end.data_bytes,
            "store_reads": store_reads(node, info["layer"]),
            "read_errors": at_end.read_errors, "fetch_errors": at_end.fetch_errors,
        }
        if prefetch:
            result["prefetch"] = wait_for_prefetch(node)
            result["bytes_fetched_after_prefetch"] = layer_status(node, info["layer"]).bytes_fetched
        node.umount(mountpoint)
        if mount.trace:  # keep the trace: it may train a prefetch list
            kept = os.path.join(daemons.work, os.path.basename(mount.trace))
            shutil.copy(mount.trace, kept)
            result["trace"] = kept
            result.update(trace_figures(kept))
    finally:
        daemons.stop(daemon)
    return result


def full_pull_run(info: dict, dest: str) -> dict:
    os.makedirs(dest)
    try:
        drop_caches()
        start = time.perf_counter()
        with LatencyStore(FilesystemStore(info["store"], create=False), latency=LATENCY_MS / 1000,
                          bandwidth=BANDWIDTH_MBPS * 1e6) as store:
            tarball = store.get(TARBALL_KEY)
        fetched = time.perf_counter()
        run(["tar", "--zstd", "-xf", "-", "-C", dest], input=tarball)
        extracted = time.perf_counter()
        commands, output = run_workload(dest)
        end = time.perf_counter()
    finally:
        shutil.rmtree(dest)
    return {"seconds": end - start, "download_s": fetched - start, "extract_s": extracted - fetched,
            "commands": commands, "output": output, "bytes_fetched": len(tarball)}


def learn_prefetch_list(info: dict, trace: str, out: str) -> dict:
    result = run([DSECFS, "prefetch", "build", trace, "-o", out, "--store", info["store"], "--json"])
    return json.loads(result.stdout)


def bench_cold(info: dict, rounds: int, work: str, daemons: Daemons) -> dict:
    runs: dict[str, list[dict]] = {config: [] for config in COLD_CONFIGS}
    lists: dict[str, dict] = {}
    mountpoint = os.path.join(work, "mnt")
    os.makedirs(mountpoint)
    for r in range(rounds):
        # Round 0 runs in COLD_CONFIGS order, so its plain runs train the lists its prefetch runs use.
        order = COLD_CONFIGS[r % len(COLD_CONFIGS):] + COLD_CONFIGS[:r % len(COLD_CONFIGS)]
        for config in order:
            mode, _, prefetched = config.partition("+")
            if config == "full pull":
                result = full_pull_run(info, os.path.join(work, f"pull-{r}"))
            else:
                plist = lists[mode]["path"] if prefetched else None
                result = cold_mount_run(daemons, info, mode, mountpoint, plist)
                if not prefetched and mode not in lists:
                    lists[mode] = learn_prefetch_list(info, result["trace"], os.path.join(work, f"{mode}.plist"))
                    log(f"prefetch list for {mode} mode: {lists[mode]['chunks']} chunks, "
                        f"{lists[mode]['bytes'] / 1e6:.1f} MB")
            runs[config].append(result)
            log(f"round {r} {config}: {result['seconds']:.2f} s, fetched {result['bytes_fetched'] / 1e6:.1f} MB")
    outputs = {run_["output"] for results in runs.values() for run_ in results}
    if len(outputs) != 1:
        raise SystemExit(f"the workload's output differs between configurations: {runs}")
    return {"runs": runs, "prefetch_lists": lists}


# ---- warm: sequential read and metadata walk --------------------------------------------------------------


def read_sequentially(path: str) -> float:
    """Seconds to read ``path`` from start to end in READ_BUFFER pieces."""
    buffer = bytearray(READ_BUFFER)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def walk(path: str) -> float:
    start = time.perf_counter()
    run(["find", path, "-printf", "%s %p\n"], stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def listing(path: str) -> list[str]:
    """Type, mode, size (not of directories: ext4 and EROFS size them differently) and path of each entry."""
    lines = run(["find", path, "-printf", "%y %m %s %P\n"]).stdout.decode(errors="replace").splitlines()
    return sorted(f"d {mode} - {rest}" if kind == "d" else line
                  for line in lines for kind, mode, _size, rest in [line.split(" ", 3)])


def bench_warm(info: dict, rounds: int, work: str, daemons: Daemons) -> dict:
    log("exporting the 500 MB file's layer to local files (the EROFS reference)")
    exported = os.path.join(work, "big-export")
    export_layer(FilesystemStore(info["store"]), BIG_REF, exported)
    erofs_mountpoint = os.path.join(work, "big-erofs")
    os.makedirs(erofs_mountpoint)
    mounts.mount_erofs(os.path.join(exported, "meta.erofs"), erofs_mountpoint, [os.path.join(exported, "blob")])
    try:
        return _bench_warm_mounts(info, rounds, work, daemons, os.path.join(erofs_mountpoint, "big.bin"))
    finally:
        mounts.umount(erofs_mountpoint)


def _bench_warm_mounts(info: dict, rounds: int, work: str, daemons: Daemons, big_erofs: str) -> dict:
    daemon = daemons.start()
    node = daemon.node
    big_local = os.path.join(info["big_dir"], "big.bin")
    mounted = {}
    try:
        for mode in ("kernel", "fuse"):
            for ref, what in ((LAYER_REF, "tree"), (BIG_REF, "big")):
                mountpoint = os.path.join(work, f"warm-{mode}-{what}")
                os.makedirs(mountpoint)
                node.mount(ref, mountpoint, mode=mode)
                mounted[mode, what] = mountpoint
        log("warming the chunk cache: reading the 500 MB file")
        first_read = read_sequentially(os.path.join(mounted["kernel", "big"], "big.bin"))
        read_sequentially(os.path.join(mounted["fuse", "big"], "big.bin"))
        expected = listing(info["tree"])
        for mode in ("kernel", "fuse"):
            if listing(mounted[mode, "tree"]) != expected:
                raise SystemExit(f"the {mode}-mode mount does not list the same tree as {info['tree']}")

        big = {"local": big_local, "erofs": big_erofs, **{mode: os.path.join(mounted[mode, "big"], "big.bin")
                                                          for mode in ("kernel", "fuse")}}
        reads = {side: {"dropped": [], "page cache": []} for side in READ_SIDES}
        walks = {side: {"dropped": [], "warm": []} for side in WALK_SIDES}
        for r in range(rounds):
            for side in READ_SIDES[r % 4:] + READ_SIDES[:r % 4]:
                drop_caches()
                reads[side]["dropped"].append(BIG_FILE_BYTES / read_sequentially(big[side]) / 1e6)
                reads[side]["page cache"].append(BIG_FILE_BYTES / read_sequentially(big[side]) / 1e6)
            for side in WALK_SIDES[r % 3:] + WALK_SIDES[:r % 3]:
                path = info["tree"] if side == "local" else mounted[side, "tree"]
                drop_caches()
                walks[side]["dropped"].append(walk(path))
                walks[side]["warm"].append(statistics.median(walk(path) for _ in range(WARM_WALKS)))
            log(f"warm round {r}: read MB/s {({s: round(reads[s]['dropped'][-1]) for s in READ_SIDES})}, "
                f"walk s {({s: round(walks[s]['dropped'][-1], 2) for s in WALK_SIDES})}")
        status = layer_status(node, info["big"])
        for mountpoint in mounted.values():
            node.umount(mountpoint)
    finally:
        daemons.stop(daemon)
    return {"first_read_mbps": BIG_FILE_BYTES / first_read / 1e6, "big_bytes_fetched": status.bytes_fetched,
            "read_mbps": reads, "walk_s": walks, "walk_entries": len(expected)}


# ---- report ---------------------------------------------------------------------------------------------


def median(values) -> float:
    return statistics.median(values)


def summarize(info: dict, cold: dict | None, warm: dict | None) -> tuple[dict, list[str]]:
    """Medians, ratios and goals; the table as lines."""
    summary: dict = {"goals": {}}
    lines: list[str] = []
    missed = []

    def goal(name: str, value: float, limit: float, at_most: bool) -> str:
        met = value <= limit if at_most else value >= limit
        summary["goals"][name] = {"value": value, "limit": limit, "met": met}
        if not met:
            missed.append(name)
        return "met" if met else "MISSED"

    if cold:
        runs = cold["runs"]
        pull = median(r["seconds"] for r in runs["full pull"])
        layer_bytes = runs["kernel"][0]["layer_bytes"]
        summary["cold"] = {}
        lines.append(f"cold start: layer {layer_bytes / 1e6:.1f} MB of chunks, tar.zst {info['tarball_bytes'] / 1e6:.1f} "
                     f"MB; {LATENCY_MS:g} ms per request, {BANDWIDTH_MBPS:g} MB/s")
        lines.append(f"{'config':<17}{'total s':>9}{'mount s':>9}{'dpkg':>7}{'apt':>7}{'py':>7}{'numpy':>7}"
                     f"{'vs pull':>9}{'fetched MB':>12}{'of layer':>10}")
        for config, results in runs.items():
            row = {
                "seconds": median(r["seconds"] for r in results),
                "min_s": min(r["seconds"] for r in results), "max_s": max(r["seconds"] for r in results),
                "commands": {name: median(r["commands"][name] for r in results) for name, _, _ in WORKLOAD},
                "bytes_fetched": median(r["bytes_fetched"] for r in results),
            }
            row["vs_pull"] = row["seconds"] / pull
            first = "mount_s" if config != "full pull" else "download_s"
            row[first] = median(r[first] for r in results)
            if config == "full pull":
                row["extract_s"] = median(r["extract_s"] for r in results)
                fraction = ""
            else:
                row["fetched_fraction"] = row["bytes_fetched"] / layer_bytes
                fraction = f"{row['fetched_fraction'] * 100:>9.1f}%"
                if "+prefetch" in config:
                    row["bytes_fetched_after_prefetch"] = median(r["bytes_fetched_after_prefetch"] for r in results)
            summary["cold"][config] = row
            c = row["commands"]
            lines.append(f"{config:<17}{row['seconds']:>9.2f}{row[first]:>9.2f}"
                         + "".join(f"{c[name]:>7.2f}" for name, _, _ in WORKLOAD)
                         + f"{row['vs_pull']:>9.2f}{row['bytes_fetched'] / 1e6:>12.1f}{fraction:>10}")
        lines.append(f"{'where it waits':<17}{'reads':>7}{'missed':>8}{'waited s':>10}{'store reads':>13}"
                     f"{'prefetch done s':>17}")
        for config in COLD_CONFIGS[1:]:
            results, row = runs[config], summary["cold"][config]
            for name in ("reads", "miss_reads", "miss_wait_s", "store_reads"):
                row[name] = median(r[name] for r in results)
            done = [r["prefetch_done_s"] for r in results if r["prefetch_done_s"] is not None]
            row["prefetch_done_s"] = median(done) if done else None
            lines.append(f"{config:<17}{row['reads']:>7.0f}{row['miss_reads']:>8.0f}{row['miss_wait_s']:>10.2f}"
                         f"{row['store_reads']:>13.0f}" + (f"{row['prefetch_done_s']:>17.2f}" if done else ""))
        pull_row = summary["cold"]["full pull"]
        lines.append(f"full pull: download {pull_row['download_s']:.2f} s, extract {pull_row['extract_s']:.2f} s")
        for config in COLD_CONFIGS[1:]:
            row = summary["cold"][config]
            lines.append(f"  goal {config}: cold start {row['vs_pull'] * 100:.1f}% of the full pull (<= 20%): "
                         f"{goal(f'{config} cold/pull', row['vs_pull'], GOAL_COLD_RATIO, True)}; fetched "
                         f"{row['fetched_fraction'] * 100:.1f}% of the layer (<= 15%): "
                         f"{goal(f'{config} fetched', row['fetched_fraction'], GOAL_FETCHED_FRACTION, True)}")
        for mode, plist in cold["prefetch_lists"].items():
            lines.append(f"prefetch list ({mode} mode, one trace): {plist['chunks']} chunks, "
                         f"{plist['bytes'] / 1e6:.1f} MB")
    if warm:
        reads = {side: {kind: median(v) for kind, v in kinds.items()} for side, kinds in warm["read_mbps"].items()}
        walks = {side: {kind: median(v) for kind, v in kinds.items()} for side, kinds in warm["walk_s"].items()}
        summary["warm"] = {"read_mbps": reads, "walk_s": walks, "first_read_mbps": warm["first_read_mbps"],
                           "walk_entries": warm["walk_entries"]}
        lines.append("")
        lines.append(f"warm sequential read of {BIG_FILE_BYTES / 1e6:.0f} MB (chunk cache warm; first, cold read "
                     f"through the emulated store: {warm['first_read_mbps']:.0f} MB/s)")
        lines.append(f"{'side':<8}{'dropped MB/s':>14}{'vs local':>10}{'page cache MB/s':>17}{'vs local':>10}"
                     "   (erofs: the kernel's EROFS over the exported layer, local files, no dsecfs)")
        for side in READ_SIDES:
            lines.append(f"{side:<8}{reads[side]['dropped']:>14.0f}"
                         f"{reads[side]['dropped'] / reads['local']['dropped']:>10.2f}"
                         f"{reads[side]['page cache']:>17.0f}"
                         f"{reads[side]['page cache'] / reads['local']['page cache']:>10.2f}")
        lines.append(f"metadata walk, find -printf over {warm['walk_entries']:,} entries")
        lines.append(f"{'side':<8}{'dropped s':>11}{'vs local':>10}{'warm s':>9}{'vs local':>10}")
        for side in WALK_SIDES:
            lines.append(f"{side:<8}{walks[side]['dropped']:>11.3f}"
                         f"{walks[side]['dropped'] / walks['local']['dropped']:>10.2f}"
                         f"{walks[side]['warm']:>9.3f}{walks[side]['warm'] / walks['local']['warm']:>10.2f}")
        ratio = reads["kernel"]["page cache"] / reads["local"]["page cache"]
        lines.append(f"  goal kernel read (warm: page cache) {ratio * 100:.0f}% of local (>= 90%): "
                     f"{goal('kernel read', ratio, GOAL_KERNEL_READ, False)}; EROFS on local files "
                     f"{reads['erofs']['page cache'] / reads['local']['page cache'] * 100:.0f}%")
        ratio = reads["kernel"]["dropped"] / reads["local"]["dropped"]
        summary["kernel_read_dropped_vs_local"] = ratio
        lines.append(f"  kernel read with the page cache dropped (chunk cache warm; no goal): {ratio * 100:.0f}% of "
                     f"local, EROFS on local files {reads['erofs']['dropped'] / reads['local']['dropped'] * 100:.0f}%")
        for mode, limit in (("kernel", GOAL_KERNEL_WALK), ("fuse", GOAL_FUSE_WALK)):
            for kind in ("dropped", "warm"):
                ratio = walks[mode][kind] / walks["local"][kind]
                lines.append(f"  goal {mode} walk ({kind}) {ratio:.2f}x local (<= {limit}x): "
                             f"{goal(f'{mode} walk {kind}', ratio, limit, True)}")
    summary["missed"] = missed
    return summary, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the cold-start comparison")
    parser.add_argument("--warm-rounds", type=int, default=5, help="rounds of the warm read and walk")
    parser.add_argument("--cache", default="/var/cache/dsecfs-test", help="where the image and store are kept")
    parser.add_argument("--work", default="/var/tmp", help="scratch directory (extracted trees, daemons)")
    parser.add_argument("--miss-readahead", default="0", metavar="SIZE",
                        help="the daemons' --miss-readahead (e.g. 256KiB; default 0: fetch only what is read)")
    parser.add_argument("--read-ahead", default="1MiB", metavar="SIZE",
                        help="the daemons' --read-ahead (0: the kernel's default, 128 KiB)")
    parser.add_argument("--fuse-binding", default="raw", choices=BINDINGS, help="the daemons' FUSE binding")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (mount, chroot, drop_caches)")
    started = time.perf_counter()
    info = setup(args.cache)
    log(f"layer {info['layer'][:12]}: {info['tree_entries']:,} entries, {info['tree_bytes'] / 1e6:.0f} MB "
        f"(toolkit {info['toolkit_bytes'] / 1e6:.0f} MB); tar.zst {info['tarball_bytes'] / 1e6:.0f} MB")
    cold = warm = None
    with tempfile.TemporaryDirectory(prefix="dsecfs-cold-", dir=args.work) as work:
        daemons = Daemons(work, info["store"], args.miss_readahead, args.read_ahead, args.fuse_binding)
        try:
            if not args.skip_cold:
                cold = bench_cold(info, args.rounds, work, daemons)
            if not args.skip_warm:
                warm = bench_warm(info, args.warm_rounds, work, daemons)
        finally:
            daemons.stop_all()
    summary, lines = summarize(info, cold, warm)
    print("\n".join(lines))
    print(json.dumps({"setup": info, "summary": summary, "cold": cold, "warm": warm,
                      "wall_s": time.perf_counter() - started}, indent=1))
    if summary["missed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
