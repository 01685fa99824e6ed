"""The placement simulator: its workload, its latency model, determinism, and the policies compared."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from click.testing import CliRunner

from cli.sched_cmds import sched
from dsec_fs.errors import InputError
from overlay.sched_sim import SimConfig, compare, format_table, make_workload, simulate
from overlay.scheduler import Affinity, LeastLoaded

SMALL = SimConfig(nodes=20, slots=8, requests=3000, combinations=300, burst_size=60, seed=5)


def without_timing(result) -> dict:
    data = result.to_dict()
    del data["decisions_per_s"]
    return data


def test_same_seed_same_results_other_seed_other_results():
    first = [without_timing(r) for r in compare(SMALL)]
    again = [without_timing(r) for r in compare(SMALL)]
    other = [without_timing(r) for r in compare(replace(SMALL, seed=6))]
    assert first == again
    assert first != other


def test_affinity_fetches_less_than_least_loaded_and_random():
    affinity, least_loaded, rand = compare(SMALL)
    assert (affinity.policy, least_loaded.policy, rand.policy) == ("affinity", "least-loaded", "random")
    assert affinity.bytes_fetched < 0.7 * least_loaded.bytes_fetched
    assert affinity.bytes_fetched < 0.7 * rand.bytes_fetched
    assert affinity.warm_starts > least_loaded.warm_starts
    for r in (affinity, least_loaded, rand):
        assert r.decisions == SMALL.requests and r.decisions_per_s > 0
        assert 0 < r.latency_p50 <= r.latency_p99
        assert r.imbalance >= 1.0 and r.load_cv >= 0.0
    assert least_loaded.load_cv < rand.load_cv  # least-loaded is the balanced one


def test_workload_is_zipf_popular_and_bursty():
    work = make_workload(SMALL)
    counts = Counter(work.combination_of)
    assert counts[0] > 10 * max(1, counts[SMALL.combinations // 2])  # rank 1 against the median rank
    assert len(work.arrivals) == SMALL.requests
    assert work.arrivals == sorted(work.arrivals)
    # Every burst arrives within burst_spread of its start, and bursts are burst_interval apart.
    starts = [work.arrivals[0]] + [work.arrivals[end + 1] for end in work.burst_ends[:-1]]
    ends = [work.arrivals[end] for end in work.burst_ends]
    assert all(end - start < SMALL.burst_spread for start, end in zip(starts, ends))
    assert all(b - a > SMALL.burst_interval - SMALL.burst_spread for a, b in zip(starts, starts[1:]))
    mean_lifetime = sum(work.lifetimes) / len(work.lifetimes)
    assert 0.8 * SMALL.mean_lifetime < mean_lifetime < 1.2 * SMALL.mean_lifetime
    for base, workspace, toolkit in work.combinations:
        assert base.startswith("base-") and workspace.startswith("workspace-") and toolkit.startswith("toolkit-")


def test_one_cold_start_costs_fetches_plus_setup():
    cfg = SimConfig(nodes=1, slots=1, requests=1, combinations=1)
    work = make_workload(cfg)
    layers = work.combinations[0]
    total = sum(work.layer_sizes[layer] for layer in layers)
    result = simulate(cfg, Affinity(), work)
    expected = 3 * cfg.fetch_latency + total / cfg.bandwidth + cfg.setup_time
    assert result.bytes_fetched == total
    assert result.latency_p50 == pytest.approx(expected)
    assert result.warm_starts == 0.0


def test_a_full_cluster_queues_requests_until_slots_free():
    cfg = replace(SMALL, nodes=4, slots=2, requests=400, burst_size=40, utilization=1.0)
    result = simulate(cfg, LeastLoaded())  # raises if any request never started
    assert result.queued > 0
    assert result.decisions == cfg.requests
    assert result.latency_p99 > cfg.burst_interval / 10  # queued starts waited for sandboxes to end


def test_bad_configs_are_input_errors():
    with pytest.raises(InputError):
        SimConfig(nodes=0)
    with pytest.raises(InputError):
        SimConfig(utilization=1.5)


def test_table_and_cli_json():
    table = format_table(compare(replace(SMALL, requests=300)))
    assert table.splitlines()[0].split()[:3] == ["policy", "fetched", "warm"]
    assert len(table.splitlines()) == 5
    run = CliRunner().invoke(sched, ["simulate", "--nodes", "10", "--requests", "500", "--combinations", "100",
                                     "--seed", "2", "--json"])
    assert run.exit_code == 0, run.output
    data = json.loads(run.output)
    assert [r["policy"] for r in data["results"]] == ["affinity", "least-loaded", "random"]
    assert data["config"]["nodes"] == 10 and all(r["requests"] == 500 for r in data["results"])
    text = CliRunner().invoke(sched, ["simulate", "--nodes", "10", "--requests", "200", "--combinations", "50"])
    assert text.exit_code == 0 and "least-loaded" in text.output
