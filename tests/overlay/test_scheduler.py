"""Placement decisions of overlay.scheduler: affinity against load, capacity, the index behind the speed."""

from __future__ import annotations

import random

import pytest

from dsec_fs.errors import InputError, NotFoundError, UnavailableError
from overlay.scheduler import (MAX_EXTENDER_PRIORITY, MIN_EXTENDER_PRIORITY, Affinity, LeastLoaded, Random,
                               Scheduler)

MiB = 1 << 20
REQUEST = ("base-a", "workspace-a", "toolkit-a")
SIZES = {"base-a": 64 * MiB, "workspace-a": 128 * MiB, "toolkit-a": 96 * MiB}


def cluster(policy=None, nodes: int = 4, capacity: int = 4) -> Scheduler:
    sched = Scheduler(policy if policy is not None else Affinity())
    for i in range(nodes):
        sched.register(f"n{i}", capacity)
    for layer, size in SIZES.items():
        sched.set_layer_size(layer, size)
    return sched


def test_prefers_the_node_holding_the_layers():
    sched = cluster()
    for layer, size in SIZES.items():
        sched.cache_add("n2", layer, size)
    assert sched.place(REQUEST) == "n2"
    assert sched.node("n2").running == 1


def test_more_cached_bytes_win_and_partial_caches_count():
    sched = cluster()
    sched.cache_add("n0", "toolkit-a", 96 * MiB)
    sched.cache_add("n1", "workspace-a", 100 * MiB)  # part of the workspace's 128 MiB, still more bytes
    sched.cache_add("n3", "base-a", 64 * MiB)
    assert sched.place(REQUEST) == "n1"


def test_load_breaks_ties():
    sched = cluster(capacity=16)
    for name in ("n1", "n2"):
        for layer, size in SIZES.items():
            sched.cache_add(name, layer, size)
    sched.report("n1", running=2)
    sched.report("n2", running=1)
    assert sched.place(REQUEST) == "n2"
    # Nothing cached anywhere: the least loaded node; equal loads go to the first registered.
    fresh = cluster()
    fresh.report("n0", running=1)
    assert fresh.place(("other",)) == "n1"


def test_a_warm_node_loses_to_a_cold_one_when_far_more_loaded():
    sched = cluster(Affinity(load_weight=4.0), nodes=2, capacity=16)
    for layer, size in SIZES.items():
        sched.cache_add("n0", layer, size)
    sched.report("n0", running=2)  # 1 - 4 * 2/16 = 0.5 > 0: warm wins
    assert sched.place(REQUEST) == "n0"
    sched.report("n0", running=6)  # 1 - 4 * 6/16 = -0.5 < 0: cold and idle wins
    assert sched.place(REQUEST) == "n1"


@pytest.mark.parametrize("policy", [Affinity(), LeastLoaded(), Random(seed=1)], ids=lambda p: p.name)
def test_never_over_capacity_and_a_full_cluster_is_unschedulable(policy):
    sched = cluster(policy, nodes=3, capacity=2)
    for layer, size in SIZES.items():
        sched.cache_add("n0", layer, size)  # everyone would like n0
    for _ in range(6):
        sched.place(REQUEST)
        assert all(node.running <= node.capacity for node in sched.nodes)
    assert [node.running for node in sched.nodes] == [2, 2, 2]
    with pytest.raises(UnavailableError) as err:
        sched.place(REQUEST)
    assert err.value.transient and "free slot" in str(err.value)
    sched.release("n1")
    assert sched.place(REQUEST) == "n1"


def test_dropped_layers_leave_the_index():
    sched = cluster()
    sched.report("n3", cached=dict(SIZES))
    assert sched.place(REQUEST) == "n3"
    sched.report("n3", cached={"unrelated": 5 * MiB}, running=0)
    assert "workspace-a" not in sched.holders
    assert sched.place(REQUEST) == "n0"  # all idle but n0 first: n3's old cache no longer counts


def test_widely_held_layers_are_counted_exactly_for_every_candidate():
    sched = cluster(Affinity(load_weight=1.0, scan=4, fallbacks=2), nodes=40, capacity=16)
    for i in range(40):
        sched.cache_add(f"n{i}", "toolkit-a", 96 * MiB)  # held by ten times `scan` nodes
        sched.cache_add(f"n{i}", "base-a", 64 * MiB)
        sched.report(f"n{i}", running=4)
    sched.report("n37", running=0)
    # n37 is in no window of the widely held layers, only a least-loaded fallback; its bytes of them
    # count all the same, so it beats the busier holders the windows brought in.
    assert sched.place(REQUEST) == "n37"
    # The one rare layer has all its holders scored: n21 is neither in a window nor a fallback.
    sched.cache_add("n21", "workspace-a", 128 * MiB)
    assert sched.place(REQUEST) == "n21"


def brute_force(sched: Scheduler, policy: Affinity, layers) -> str | None:
    total = sched.request_bytes(layers)
    best = None
    for node in sched.nodes:
        if node.running >= node.capacity:
            continue
        key = (policy.score(sched.cached_bytes(node.name, layers), total, node.load), -node.load, -node.index)
        if best is None or key > best[0]:
            best = (key, node.name)
    return best[1] if best else None


def test_affinity_matches_brute_force_when_every_holder_is_scanned():
    rng = random.Random(7)
    policy = Affinity(scan=1000, fallbacks=30)
    layers = [f"layer-{i}" for i in range(12)]
    for _ in range(200):
        sched = Scheduler(policy)
        for i in range(rng.randint(1, 30)):
            sched.register(f"n{i}", rng.randint(1, 8))
            sched.report(f"n{i}", running=rng.randint(0, sched.nodes[-1].capacity),
                         cached={layer: rng.randint(1, 100) * MiB for layer in rng.sample(layers, 4)})
        request = rng.sample(layers, 3)
        expected = brute_force(sched, policy, request)
        if expected is None:
            with pytest.raises(UnavailableError):
                sched.place(request)
        else:
            assert sched.place(request) == expected


def test_least_loaded_uses_load_not_running_count():
    sched = Scheduler(LeastLoaded())
    sched.register("small", 2)
    sched.register("big", 10)
    sched.report("small", running=1)  # 50 %
    sched.report("big", running=4)  # 40 %
    assert sched.place(["x"]) == "big"


def test_random_is_seeded_and_spreads():
    def picks(seed):
        sched = cluster(Random(seed), nodes=10, capacity=100)
        return [sched.place(["x"]) for _ in range(50)]

    assert picks(3) == picks(3)
    assert picks(3) != picks(4)
    assert len(set(picks(3))) > 5


def test_reports_are_validated_and_unknown_nodes_named():
    sched = cluster()
    with pytest.raises(InputError):
        sched.register("", 4)
    with pytest.raises(InputError):
        sched.register("n9", 0)
    with pytest.raises(InputError):
        sched.report("n0", running=-1)
    with pytest.raises(InputError):
        sched.report("n0", cached={"layer": "many"})
    assert sched.node("n0").cached == {}  # a rejected report changes nothing
    with pytest.raises(NotFoundError) as err:
        sched.report("nope", running=1)
    assert "nope" in str(err.value)
    sched.register("n0", 9)  # a daemon restarting: same node, new capacity
    assert len(sched.nodes) == 4 and sched.node("n0").capacity == 9


def test_layer_sizes_never_below_what_a_node_holds():
    sched = Scheduler()
    sched.register("n0", 1)
    sched.set_layer_size("l", 10)
    sched.cache_add("n0", "l", 30)
    assert sched.layer_sizes["l"] == 30
    sched.set_layer_size("l", 20)
    assert sched.layer_sizes["l"] == 30


def test_extender_priority_range():
    policy = Affinity(load_weight=4.0)
    assert policy.extender_priority(policy.score(10, 10, 0.0)) == MAX_EXTENDER_PRIORITY
    assert policy.extender_priority(policy.score(5, 10, 0.0)) == 5
    assert policy.extender_priority(policy.score(0, 10, 0.5)) == MIN_EXTENDER_PRIORITY
    assert policy.extender_priority(policy.score(0, 0, 0.0)) == MIN_EXTENDER_PRIORITY
