"""The node daemon's own cost per miss (issue 13): what a read that misses the chunk cache costs beyond the
store read it waits for.

    .venv/bin/python bench/bench_miss_cost.py [--files 400] [--rounds 3] [--modes kernel,fuse]
                                              [--baseline-daemon PATH]

A layer of ``--files`` files of 256 KiB of random bytes (one chunk each, stored apart: MERGE_GAP is
smaller than a chunk, so no two share a GET) in a local store on this machine's disk. Per round, side by
side:

- ``store``: each chunk read straight from the store by ``dsec_fs.chunks.read_run`` in one thread (one
  ranged get, zstd decompression, sha256 check): the part of a miss that is the store's;
- ``cold``: a fresh daemon (empty cache, ``--fill none --no-profiles --miss-readahead 0``, no emulated
  latency), the layer mounted, each file read whole once, one after another: every read one miss;
- ``warm``: the same files read again through the same mount after drop_caches (the chunk cache full):
  the FUSE round trip and a cache read, no store.

With ``--baseline-daemon PATH`` (another checkout's ``dsecfs``, e.g. main's ``.venv/bin/dsecfs``) each
round also runs cold and warm with that daemon, alternating with this one.

The daemon's cost per miss is ``cold - store`` per file: the FUSE round trip, the thread hops, the cache
lookup that misses, and the flight's bookkeeping (the cache write follows after the reader has its bytes).
Set beside the round trip of the stores the issue emulates (20 ms and 1 ms), it says how much of a miss is
the daemon's. The daemon's CPU time per file (user + system of all its threads, from /proc/<pid>/stat,
the store read's decompression and check included) is given too: on a machine shared with other jobs it
varies less than the wall time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsec_fs.blobmap import EncodedBlobMap  # noqa: E402
from dsec_fs.chunks import ChunkIndex, plan_runs, read_run  # noqa: E402
from dsec_fs.client import Node  # noqa: E402
from dsec_fs.layer import open_layer  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder import build_layer  # noqa: E402
from benchlib import drop_caches, log  # noqa: E402

FILE_BYTES = 256 * 1024
CHUNK = 256 * 1024
REF = "bench/miss-cost:1"


def make_layer(work: str, files: int) -> tuple[str, list[str]]:
    tree = os.path.join(work, "tree")
    rng = random.Random(1)
    names = []
    for n in range(files):
        name = f"d{n % 16:02d}/f{n:05d}.bin"
        os.makedirs(os.path.join(tree, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(tree, name), "wb") as f:
            f.write(rng.randbytes(FILE_BYTES))
        names.append(name)
    store_dir = os.path.join(work, "store")
    build_layer(tree, FilesystemStore(store_dir), name=REF, chunk_size=CHUNK)
    return store_dir, names


def store_reads(store_dir: str) -> tuple[float, int]:
    """Seconds per chunk read straight from the store (get, decompress, verify), and how many."""
    store = FilesystemStore(store_dir, create=False)
    files = open_layer(store, REF)
    index = ChunkIndex()
    index.load_packs(store, files.manifest.packs)
    blob_map = EncodedBlobMap(files.blobmap, source="blobmap")
    items = [(digest, index.get(digest)) for _blkaddr, digest, _length in blob_map.entries]
    drop_caches()
    start = time.perf_counter()
    for digest, location in items:
        (run,) = plan_runs([(digest, location)])
        read_run(store, run)
    return (time.perf_counter() - start) / len(items), len(items)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_all(root: str, names: list[str], pid: int) -> tuple[float, float]:
    """Seconds per file of reading ``names`` whole, and the daemon's (``pid``) CPU seconds per file."""
    cpu = cpu_seconds(pid)
    start = time.perf_counter()
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            while f.read(1 << 20):
                pass
    return (time.perf_counter() - start) / len(names), (cpu_seconds(pid) - cpu) / len(names)


def daemon_reads(work: str, store_dir: str, names: list[str], mode: str, round_no: int,
                 command: list[str] | None) -> tuple[tuple[float, float], tuple[float, float]]:
    """(seconds, daemon CPU seconds) per file of the cold reads, and of the warm ones."""
    home = os.path.join(work, f"node-{mode}-{round_no}-{'baseline' if command else 'this'}")
    os.makedirs(home)
    daemon = Node.start_daemon(command=command,
                               socket_path=os.path.join(home, "api.sock"), state_dir=os.path.join(home, "state"),
                               cache_dir=os.path.join(home, "cache"), store=store_dir,
                               log_file=os.path.join(home, "daemon.log"),
                               extra_args=("--fill", "none", "--no-profiles", "--miss-readahead", "0"))
    mnt = os.path.join(home, "mnt")
    os.makedirs(mnt)
    try:
        node = daemon.node
        node.mount(REF, mnt, mode=mode)
        try:
            os.listdir(mnt)  # the metadata is not what is measured
            for directory in sorted({os.path.dirname(name) for name in names}):
                os.listdir(os.path.join(mnt, directory))
            cold = read_all(mnt, names, daemon.pid)
            drop_caches()
            warm = read_all(mnt, names, daemon.pid)
        finally:
            node.umount(mnt)
    finally:
        daemon.stop()
        shutil.rmtree(home, ignore_errors=True)
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="kernel,fuse")
    parser.add_argument("--baseline-daemon", default=None, metavar="PATH")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dsecfs-misscost-")
    try:
        store_dir, names = make_layer(work, args.files)
        rows: dict[str, dict[str, list[float]]] = {}
        for round_no in range(args.rounds):
            store_s, chunks = store_reads(store_dir)
            daemons = [("this", None)] + ([("baseline", [args.baseline_daemon])] if args.baseline_daemon else [])
            for mode, (label, command) in itertools.product(args.modes.split(","), daemons):
                (cold, cold_cpu), (warm, warm_cpu) = daemon_reads(work, store_dir, names, mode, round_no, command)
                row = rows.setdefault(f"{mode}, {label}", {"store": [], "cold": [], "warm": [], "cold_cpu": [],
                                                           "warm_cpu": []})
                for key, value in (("store", store_s), ("cold", cold), ("warm", warm), ("cold_cpu", cold_cpu),
                                   ("warm_cpu", warm_cpu)):
                    row[key].append(value)
                log(f"round {round_no} {mode}, {label}: store {store_s * 1e3:.2f} ms, cold {cold * 1e3:.2f} ms "
                    f"(daemon CPU {cold_cpu * 1e3:.2f} ms), warm {warm * 1e3:.2f} ms (CPU {warm_cpu * 1e3:.2f} ms) "
                    f"per file ({chunks} chunks)")
        print("| mode, daemon | store read | cold read (a miss) | warm read | daemon per miss (cold - store) | "
              "vs a 20 ms / 1 ms round trip | daemon CPU per cold / warm read |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode, row in rows.items():
            store_s, cold, warm, cold_cpu, warm_cpu = (statistics.median(row[k]) for k in
                                                       ("store", "cold", "warm", "cold_cpu", "warm_cpu"))
            own = cold - store_s
            print(f"| {mode} | {store_s * 1e3:.2f} ms | {cold * 1e3:.2f} ms | {warm * 1e3:.2f} ms | "
                  f"{own * 1e3:.2f} ms | {own / 0.020:.1%} / {own / 0.001:.0%} | "
                  f"{cold_cpu * 1e3:.2f} / {warm_cpu * 1e3:.2f} ms |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
