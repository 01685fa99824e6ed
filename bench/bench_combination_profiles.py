"""Combination profiles against layer profiles (issue 13, item 1): what a new node prefetches for a
sandbox when one base layer is shared by several toolkits.

    .venv/bin/python bench/bench_combination_profiles.py [--rounds 3] [--stores 3fs] [--workloads numpy,boto3]
                                                         [--cache DIR]

The layers are bench_sandbox_coldstart.py's (built there, kept under --cache): a Debian + python3 base
and the ``numpy`` and ``boto3`` toolkits. The store is a hard-linked copy of that store (so another run
of that benchmark, which removes profiles, cannot disturb this one), its profiles/ empty.

Learning: one daemon runs a sandbox of each toolkit over the base (``sandbox up``, the workload's first
command through runc, ``down``), then stops. The base's layer profile then holds what both workloads
read of it (each read by one of its two traces: at the prefetch threshold of half); each combination's
profile only what that workload read. The profiles/ objects are then kept, and put back before every
start below, so that no start learns from another.

Starts, per workload, each on a new daemon (new state, empty cache) with the page cache dropped,
``layer`` and ``combination`` side by side in each round (which goes first alternates by round):

- ``layer``: the combination objects removed: the base and the toolkit prefetch by their layer profiles
  (what main does);
- ``combination``: all objects there: both prefetch by the combination's.

Reported per workload and store (medians): seconds from ``up`` to the command's end, bytes the profiles
prefetched, of those the share never read, bytes fetched from the store; and the combination/layer
ratio of each, from the same rounds.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dsec_fs.store import FilesystemStore, keys  # noqa: E402
from bench_sandbox_coldstart import WORKLOADS, Node_, setup, start_sandbox  # noqa: E402
from benchlib import log  # noqa: E402

VARIANTS = ("layer", "combination")
COMBINATIONS = f"{keys.PROFILES}combinations/"


def _linked_store(source: str, dest: str) -> str:
    """A copy of ``source`` whose files are hard links (a store never rewrites a file in place), without
    its profiles."""
    subprocess.run(["cp", "-al", source, dest], check=True)
    shutil.rmtree(os.path.join(dest, keys.PROFILES), ignore_errors=True)
    return dest


def _put_profiles(store_dir: str, learned: dict[str, bytes], *, combinations: bool) -> None:
    with FilesystemStore(store_dir, fsync=False) as store:
        for key in list(store.list(keys.PROFILES)):
            store.delete(key)
        for key, data in learned.items():
            if combinations or not key.startswith(COMBINATIONS):
                store.put(key, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stores", default="3fs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--cache", default="/var/cache/dsecfs-test/sandbox-coldstart")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    info = setup(args.cache, list(WORKLOADS))
    work = tempfile.mkdtemp(prefix="dsecfs-combo-", dir=os.path.dirname(os.path.abspath(args.cache)))
    rows = []
    try:
        store_dir = _linked_store(info["store"], os.path.join(work, "store"))
        for store_name in args.stores.split(","):
            _put_profiles(store_dir, {}, combinations=True)
            learner = Node_(os.path.join(work, f"learn-{store_name}"), store_dir, store_name)
            try:
                node = learner.start()
                for workload in WORKLOADS:  # every one, whichever are measured
                    start_sandbox(node, info, info[workload]["v1"], WORKLOADS[workload][1])
            finally:
                learner.stop()  # the last profiles go out at the stop
            with FilesystemStore(store_dir) as store:
                learned = {key: store.get(key) for key in store.list(keys.PROFILES)}
            log(f"{store_name}: learned {len(learned)} profile objects "
                f"({sum(k.startswith(COMBINATIONS) for k in learned)} of combinations)")
            results: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in VARIANTS} for w in workloads}
            for r in range(args.rounds):
                for workload in workloads:
                    for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):  # no order effect
                        _put_profiles(store_dir, learned, combinations=variant == "combination")
                        fresh = Node_(os.path.join(work, f"{store_name}-{workload}-{variant}-{r}"), store_dir,
                                      store_name)
                        try:
                            result = start_sandbox(fresh.start(), info, info[workload]["v1"],
                                                   WORKLOADS[workload][1])
                        finally:
                            fresh.stop()
                        result["unread_bytes"] = result["unread_fraction"] * result["prefetched_bytes"]
                        results[workload][variant].append(result)
                        log(f"{store_name} {workload} {variant} round {r}: {result['seconds']:.2f} s, prefetched "
                            f"{result['prefetched_bytes'] / 1e6:.1f} MB, never read {result['unread_fraction']:.1%}, "
                            f"fetched {result['fetched_bytes'] / 1e6:.1f} MB")
            for workload in workloads:
                row = {"workload": workload, "store": store_name}
                for variant in VARIANTS:
                    runs = results[workload][variant]
                    row[variant] = {k: statistics.median(run[k] for run in runs)
                                    for k in ("seconds", "prefetched_bytes", "unread_bytes", "unread_fraction",
                                              "fetched_bytes")}
                row["ratio"] = {k: row["combination"][k] / row["layer"][k] if row["layer"][k] else None
                                for k in ("seconds", "prefetched_bytes", "unread_bytes", "fetched_bytes")}
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'workload':<8} {'store':<5} {'variant':<12} {'seconds':>8} {'prefetched MB':>14} {'never read':>11} "
          f"{'fetched MB':>11}")
    for row in rows:
        for variant in VARIANTS:
            v = row[variant]
            print(f"{row['workload']:<8} {row['store']:<5} {variant:<12} {v['seconds']:>8.2f} "
                  f"{v['prefetched_bytes'] / 1e6:>14.1f} {v['unread_fraction']:>10.1%} {v['fetched_bytes'] / 1e6:>11.1f}")
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
