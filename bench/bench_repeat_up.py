"""A repeat `sandbox up` (issue 13, item 5): the same combination started again on the same node shortly
after its `down`, with the repeat-start machinery off (every up reads refs, manifests, meta.erofs, blob
maps, pack indexes and profiles from the store, and mounts its layers anew), with refs and metadata kept
but no idle grace (``copies``: a repeat after the grace ended), and on (the daemon's defaults: refs
cached for --ref-ttl, metadata kept by digest, idle layers kept for --idle-grace), side by side in one
run.

    .venv/bin/python bench/bench_repeat_up.py [--rounds 5] [--workloads numpy] [--stores s3,3fs]

Layers and stores as bench_sandbox_coldstart.py makes them (its ``setup``, its emulated stores: the
daemon's LatencyStore at 20 ms / 100 MB/s for ``s3``, 1 ms / 1 GB/s for ``3fs``; the store's files on
this machine's disk). For each store, the three daemons (a fresh state and cache each, profiles on, default
fill) run one first start (up, the workload's command, down), then ``--rounds`` repeats of that start,
taking turns so noise falls on all. Reported per daemon: the median seconds of ``up`` alone
and of up + command, and the store requests an ``up`` made (the daemon's dsecfs_store_requests_total);
the page cache is left as a repeat on a busy node finds it (not dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


from bench_sandbox_coldstart import ENV, STORES, WORKLOADS, setup  # noqa: E402
from benchlib import log, store_requests  # noqa: E402
from dsec_fs.client import Node  # noqa: E402

# off: what main did before; copies: refs cached and metadata kept, but the layers unmounted at down (a
# repeat after the idle grace); on: the daemon's defaults.
SETTINGS = {"off": ["--idle-grace", "0", "--ref-ttl", "0", "--meta-cache-size", "0"],
            "copies": ["--idle-grace", "0"], "on": []}


def fetched_bytes(node: Node) -> int:
    return sum(layer.bytes_fetched for layer in node.status().layers)


def start(node: Node, base: str, toolkit: str, command: str) -> dict:
    before, fetched_before = store_requests(node), fetched_bytes(node)
    began = time.perf_counter()
    sandbox = node.sandbox(base=base, toolkit=toolkit)
    up = time.perf_counter() - began
    requests = store_requests(node) - before
    try:
        result = sandbox.exec(["python3", "-c", command], env=ENV)
        total = time.perf_counter() - began
        if result.exit_code != 0:
            raise SystemExit(f"the command failed: {result.stderr.decode(errors='replace')[-2000:]}")
    finally:
        sandbox.down()
    return {"up_s": up, "total_s": total, "up_requests": requests,
            "start_requests": store_requests(node) - before, "fetched_bytes": fetched_bytes(node) - fetched_before}


def bench(info: dict, workload: str, store_name: str, work: str, rounds: int) -> dict:
    _packages, command = WORKLOADS[workload]
    base, toolkit = info["base"]["ref"], info[workload]["v1"]["ref"]
    latency, bandwidth = STORES[store_name]
    daemons, nodes = {}, {}
    try:
        for name, args in SETTINGS.items():
            home = os.path.join(work, name)
            os.makedirs(home)
            daemons[name] = Node.start_daemon(
                os.path.join(home, "api.sock"), state_dir=os.path.join(home, "state"),
                cache_dir=os.path.join(home, "cache"), store=info["store"], latency_ms=latency,
                bandwidth_mbps=bandwidth, fetch_timeout=120, log_file=os.path.join(home, "daemon.log"),
                extra_args=args)
            nodes[name] = daemons[name].node
            first = start(nodes[name], base, toolkit, command)
            log(f"{workload} {store_name} {name}: first start {first['total_s']:.2f} s, "
                f"{first['up_requests']} store requests in up")
        repeats: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for _ in range(rounds):
            for name in SETTINGS:
                repeats[name].append(start(nodes[name], base, toolkit, command))
    finally:
        for daemon in daemons.values():
            if daemon.alive():
                daemon.stop()
    row = {"workload": workload, "store": store_name, "rounds": repeats}
    for name in SETTINGS:
        row[name] = {key: statistics.median(r[key] for r in repeats[name]) for key in repeats[name][0]}
    for name in SETTINGS:
        row[name]["up_ratio"] = row[name]["up_s"] / row["off"]["up_s"]
        row[name]["total_ratio"] = row[name]["total_s"] / row["off"]["total_s"]
        log(f"{workload} {store_name} repeat, {name}: up {row[name]['up_s']:.3f} s ({row[name]['up_ratio']:.2f}x), "
            f"{row[name]['up_requests']:.0f} store requests; up + command {row[name]['total_s']:.2f} s "
            f"({row[name]['total_ratio']:.2f}x)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="numpy")
    parser.add_argument("--stores", default="s3,3fs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", default="/var/cache/dsecfs-test/sandbox-coldstart")
    args = parser.parse_args()
    workloads, stores = args.workloads.split(","), args.stores.split(",")
    info = setup(args.cache, workloads)
    work = tempfile.mkdtemp(prefix="dsecfs-repeat-")
    rows = []
    try:
        for workload in workloads:
            for store_name in stores:
                round_work = os.path.join(work, f"{workload}-{store_name}")
                os.makedirs(round_work)
                rows.append(bench(info, workload, store_name, round_work, args.rounds))
                shutil.rmtree(round_work, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
