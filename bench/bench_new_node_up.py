"""`sandbox up` on a node that has never seen the layers (issue 13, "another node"): seconds, store requests
and the store round trips waited for one after another, this tree's daemon and optionally another tree's
(``--baseline SRC``), taking turns.

    .venv/bin/python bench/bench_new_node_up.py [--rounds 6] [--workload numpy] [--store s3] [--baseline SRC]

On bench_sandbox_coldstart.py's layers (built by it, in /var/cache/dsecfs-test/sandbox-coldstart): the
Debian + python3 base and a toolkit, behind the daemon's LatencyStore (``s3``: 20 ms, 100 MB/s; ``3fs``:
1 ms, 1 GB/s). Two states of the store, each measured in its own part:

- ``no profile``: the store's profiles removed (a first start anywhere);
- ``profile``: one node first ran the workload's command in a sandbox and published its profiles.

Each start: a new daemon (new state, empty cache, page cache not dropped: `up` reads no layer data),
``sandbox_up(base, toolkit)`` timed, then /metrics read at once: ``dsecfs_store_requests_total`` and
``dsecfs_store_serial_round_trips`` (counted by our LatencyStore; a baseline without it shows "-"); the
profile's prefetch may have begun by then, so with a profile both counts include some of its chunk
reads. Then down and stop (nothing was read, so nothing is published and the store stays as it was).
Medians per daemon and part; ours/baseline as a ratio.
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

from dsec_fs.client import Node  # noqa: E402
from dsec_fs.sandbox_client import Sandbox  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from bench_sandbox_coldstart import ENV, STORES, WORKLOADS, _forget_profiles, setup  # noqa: E402
from benchlib import log  # noqa: E402


def start_daemon(work: str, store: str, store_name: str, source: str | None) -> object:
    latency, bandwidth = STORES[store_name]
    command = None
    if source:  # SRC first: before the current directory that ``-c`` puts first
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {source!r}); "
                   "from cli.main import main; sys.argv[0] = 'dsecfs'; main()"]
    return Node.start_daemon(os.path.join(work, "api.sock"), state_dir=os.path.join(work, "state"),
                             cache_dir=os.path.join(work, "cache"), store=store, latency_ms=latency,
                             bandwidth_mbps=bandwidth, log_file=os.path.join(work, "daemon.log"), command=command)


def metric_values(node: Node) -> tuple[float, float | None]:
    requests, depth = 0.0, None
    for family in text_string_to_metric_families(node.metrics_text()):
        for sample in family.samples:
            if sample.name == "dsecfs_store_requests_total":
                requests += sample.value
            elif sample.name == "dsecfs_store_serial_round_trips":
                depth = sample.value
    return requests, depth


def one_up(info: dict, toolkit: dict, store_name: str, source: str | None) -> dict:
    work = tempfile.mkdtemp(prefix="dsecfs-newup-")
    daemon = None
    try:
        daemon = start_daemon(work, info["store"], store_name, source)
        start = time.perf_counter()
        up = daemon.node.sandbox_up(info["base"]["ref"], toolkit=toolkit["ref"])
        seconds = time.perf_counter() - start
        requests, depth = metric_values(daemon.node)
        Sandbox(daemon.node, up.id).down()
        return {"seconds": seconds, "requests": requests, "round_trips": depth}
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def learn(info: dict, toolkit: dict, command: str) -> None:
    """One node runs the command and publishes its profiles (at its stop)."""
    work = tempfile.mkdtemp(prefix="dsecfs-newup-learn-")
    daemon = Node.start_daemon(os.path.join(work, "api.sock"), state_dir=os.path.join(work, "state"),
                               cache_dir=os.path.join(work, "cache"), store=info["store"],
                               log_file=os.path.join(work, "daemon.log"))
    try:
        with daemon.node.sandbox(base=info["base"]["ref"], toolkit=toolkit["ref"]) as sandbox:
            result = sandbox.exec(["python3", "-c", command], env=ENV)
            if result.exit_code != 0:
                raise SystemExit(f"the command failed: {result.stderr.decode(errors='replace')[-2000:]}")
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workload", default="numpy", choices=list(WORKLOADS))
    parser.add_argument("--store", default="s3", choices=list(STORES))
    parser.add_argument("--cache", default="/var/cache/dsecfs-test/sandbox-coldstart")
    parser.add_argument("--baseline", metavar="SRC", default=None, help="another tree of the project, side by side")
    args = parser.parse_args()
    info = setup(args.cache, [args.workload])
    toolkit, command = info[args.workload]["v1"], WORKLOADS[args.workload][1]
    sides = {"ours": None, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    report = {}
    for part in ("no profile", "profile"):
        _forget_profiles(info)
        if part == "profile":
            learn(info, toolkit, command)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                runs[side].append(one_up(info, toolkit, args.store, sides[side]))
        report[part] = {}
        for side, results in runs.items():
            depths = [r["round_trips"] for r in results if r["round_trips"] is not None]
            report[part][side] = {"up_s": statistics.median(r["seconds"] for r in results),
                                  "requests": statistics.median(r["requests"] for r in results),
                                  "round_trips": statistics.median(depths) if depths else None,
                                  "up_s_all": [round(r["seconds"], 3) for r in results]}
            log(f"{part}, {side}: up {report[part][side]['up_s']:.3f} s, {report[part][side]['requests']:.0f} "
                f"requests, {report[part][side]['round_trips']} round trips in a row")
        if "baseline" in runs:
            report[part]["ours/baseline"] = report[part]["ours"]["up_s"] / report[part]["baseline"]["up_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
