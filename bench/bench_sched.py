"""Scheduler benchmark: affinity against least-loaded and random placement, 1,000 nodes x 100,000 requests.

Replays one workload (overlay.sched_sim: Zipf popularity over base/workspace/toolkit combinations, bursts
of about two thousand starts) under each policy on the real Scheduler code, prints the comparison table
and checks the goals:

- affinity fetches at most half the bytes least-loaded fetches, at an equal or better p99 start latency;
- affinity makes at least 20,000 decisions per second (time inside Scheduler calls, in this process).

    .venv/bin/python bench/bench_sched.py [--nodes 1000] [--requests 100000] [--seed 0] [--json]

Exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overlay.sched_sim import SimConfig, compare, format_table  # noqa: E402

BYTES_CUT_GOAL = 0.50
DECISIONS_GOAL = 20_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--combinations", type=int, default=5000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    cfg = SimConfig(nodes=args.nodes, requests=args.requests, combinations=args.combinations, zipf=args.zipf,
                    seed=args.seed)
    start = time.perf_counter()
    results = compare(cfg)
    wall = time.perf_counter() - start
    by_policy = {r.policy: r for r in results}
    affinity, least_loaded = by_policy["affinity"], by_policy["least-loaded"]
    bytes_cut = 1 - affinity.bytes_fetched / least_loaded.bytes_fetched
    goals = {
        "bytes_cut_vs_least_loaded": {"value": bytes_cut, "goal": f">= {BYTES_CUT_GOAL:.0%}",
                                      "met": bytes_cut >= BYTES_CUT_GOAL},
        "p99_vs_least_loaded": {"value": [affinity.latency_p99, least_loaded.latency_p99], "goal": "<=",
                                "met": affinity.latency_p99 <= least_loaded.latency_p99},
        "affinity_decisions_per_s": {"value": affinity.decisions_per_s, "goal": f">= {DECISIONS_GOAL:,}",
                                     "met": affinity.decisions_per_s >= DECISIONS_GOAL},
    }
    ok = all(goal["met"] for goal in goals.values())

    if args.json:
        print(json.dumps({"config": vars(args), "wall_seconds": wall, "results": [r.to_dict() for r in results],
                          "goals": goals, "ok": ok}, indent=2))
    else:
        print(f"{cfg.nodes:,} nodes x {cfg.slots} slots, {cfg.requests:,} requests, {cfg.combinations:,} "
              f"combinations (Zipf {cfg.zipf}), bursts of ~{cfg.mean_burst:,} every {cfg.burst_interval:.0f} s, "
              f"mean lifetime {cfg.mean_lifetime:.0f} s, seed {cfg.seed}; {wall:.1f} s wall")
        print(format_table(results))
        print()
        mark = {True: "met", False: "MISSED"}
        print(f"bytes fetched, affinity vs least-loaded: {bytes_cut:.1%} less (goal >= {BYTES_CUT_GOAL:.0%}): "
              f"{mark[goals['bytes_cut_vs_least_loaded']['met']]}")
        print(f"p99 start latency: affinity {affinity.latency_p99:.3f} s, least-loaded "
              f"{least_loaded.latency_p99:.3f} s (goal: equal or better): {mark[goals['p99_vs_least_loaded']['met']]}")
        print(f"affinity decisions/s: {affinity.decisions_per_s:,.0f} (goal >= {DECISIONS_GOAL:,}): "
              f"{mark[goals['affinity_decisions_per_s']['met']]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
