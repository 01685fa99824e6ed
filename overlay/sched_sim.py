"""Replay a sandbox workload against the real Scheduler and compare placement policies.

The workload (``make_workload``, fixed by the seed, the same for every policy):

- layers: one base image per ten combinations, one workspace per two, one toolkit per fifty (at most 100),
  each with a working set (the bytes a sandbox reads from it: a few percent of the image) drawn from a
  log-normal around ``base_median``, ``workspace_median``, ``toolkit_median``;
- combinations: (base, workspace, toolkit) triples; bases and toolkits are picked with Zipf popularity, so
  a few are everywhere, and each workspace appears in about two combinations (one task, two agents);
- requests: a combination each, Zipf(``zipf``) over the combinations, arriving in bursts of about
  ``burst_size`` within ``burst_spread`` seconds, one burst every ``burst_interval`` seconds;
- lifetimes: exponential, with the mean that keeps ``utilization`` of the cluster's slots busy on average.

The cluster (``simulate``): ``nodes`` nodes of ``slots`` sandbox slots, each with a chunk cache of
``node_cache_bytes`` (LRU over layers' working sets). A start on a node:

- fetches every layer the node does not hold, one after another over the node's link (FIFO: a start
  queues behind the fetches already under way on that node): ``fetch_latency`` (the store's first byte)
  + bytes / ``bandwidth`` each;
- waits for a layer another start on the node is still fetching (one fetch per layer: single flight);
- then spends ``setup_time`` + ``setup_per_running`` x sandboxes already running there (mount, overlay,
  runtime; CPU contention grows with load).

Start latency runs from the request's arrival until the sandbox is set up, including any wait for a free
slot when the whole cluster is full (those requests queue FIFO). The store's aggregate bandwidth is not
modelled: it would only hurt the policies that fetch more.

Metrics per policy: bytes fetched from the store, warm starts (nothing fetched), start latency p50 / p99,
load imbalance (max / mean running, and the coefficient of variation, averaged over a sample taken at the
end of every burst), and decisions per second: decisions / seconds spent inside Scheduler calls (place,
release and the cache updates nodes report), measured on the real code.

The scheduler hears of a node's cache changes at once (as if every node reported after every change), so
the comparison is about the policies, not report staleness.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from dsec_fs.errors import InputError, UnavailableError

from .scheduler import Affinity, LeastLoaded, Placement, Random, Scheduler

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 1000
    slots: int = 16  # sandbox slots per node
    requests: int = 100_000
    combinations: int = 5000
    zipf: float = 1.1  # popularity exponent over combinations
    seed: int = 0
    burst_size: int | None = None  # mean requests per burst; default twice the node count
    burst_interval: float = 30.0  # seconds from one burst to the next
    burst_spread: float = 2.0  # seconds over which one burst's requests arrive
    utilization: float = 0.6  # mean fraction of slots busy; sets the mean sandbox lifetime
    node_cache_bytes: int = 20 * GiB
    bandwidth: float = 1.25e9  # bytes/s from the store to one node (10 Gbit/s)
    fetch_latency: float = 0.03  # seconds to the first byte of one layer's fetch
    setup_time: float = 0.1  # seconds to mount, stack and start once the layers are there
    setup_per_running: float = 0.01  # extra setup seconds per sandbox already running on the node
    base_median: int = 64 * MiB  # median working set of a base image
    workspace_median: int = 128 * MiB
    toolkit_median: int = 96 * MiB
    size_sigma: float = 0.8  # log-normal sigma of working-set sizes

    def __post_init__(self):
        for name in ("nodes", "slots", "requests", "combinations"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}", where="simulation config")
        if not 0 < self.utilization <= 1 or self.zipf < 0 or self.bandwidth <= 0:
            raise InputError("utilization must be in (0, 1], zipf >= 0, bandwidth > 0", where="simulation config")

    @property
    def mean_burst(self) -> int:
        return self.burst_size if self.burst_size is not None else max(10, 2 * self.nodes)

    @property
    def mean_lifetime(self) -> float:
        arrivals_per_second = self.mean_burst / self.burst_interval
        return self.utilization * self.nodes * self.slots / arrivals_per_second


@dataclass
class Workload:
    layer_sizes: dict[str, int]
    combinations: list[tuple[str, str, str]]  # (base, workspace, toolkit)
    arrivals: list[float]  # seconds, ascending
    combination_of: list[int]  # request -> index into combinations
    lifetimes: list[float]
    burst_ends: list[int]  # index of the last request of each burst


@dataclass
class SimResult:
    policy: str
    requests: int
    bytes_fetched: int
    warm_starts: float  # fraction of starts that fetched nothing
    latency_p50: float
    latency_p99: float
    imbalance: float  # max / mean running, averaged over burst ends
    load_cv: float  # coefficient of variation of running, averaged over burst ends
    queued: int  # requests that waited for a free slot
    decisions: int
    decisions_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _zipf_cumulative(count: int, exponent: float) -> list[float]:
    total, cumulative = 0.0, []
    for rank in range(1, count + 1):
        total += rank ** -exponent
        cumulative.append(total)
    return cumulative


def make_workload(cfg: SimConfig) -> Workload:
    rng = random.Random(cfg.seed)
    bases = max(1, cfg.combinations // 10)
    workspaces = max(1, cfg.combinations // 2)
    toolkits = max(1, min(100, cfg.combinations // 50))

    def sizes(kind: str, count: int, median: int) -> dict[str, int]:
        return {f"{kind}-{i}": max(MiB, int(rng.lognormvariate(math.log(median), cfg.size_sigma)))
                for i in range(count)}

    layer_sizes = {**sizes("base", bases, cfg.base_median), **sizes("workspace", workspaces, cfg.workspace_median),
                   **sizes("toolkit", toolkits, cfg.toolkit_median)}
    base_pick = rng.choices(range(bases), cum_weights=_zipf_cumulative(bases, 1.0), k=cfg.combinations)
    toolkit_pick = rng.choices(range(toolkits), cum_weights=_zipf_cumulative(toolkits, 1.0), k=cfg.combinations)
    workspace_order = list(range(workspaces))
    rng.shuffle(workspace_order)
    combinations = [(f"base-{base_pick[c]}", f"workspace-{workspace_order[c % workspaces]}",
                     f"toolkit-{toolkit_pick[c]}") for c in range(cfg.combinations)]

    combination_of = rng.choices(range(cfg.combinations), cum_weights=_zipf_cumulative(cfg.combinations, cfg.zipf),
                                 k=cfg.requests)
    arrivals: list[float] = []
    burst_ends: list[int] = []
    burst = 0
    while len(arrivals) < cfg.requests:
        size = rng.randint(max(1, cfg.mean_burst // 2), max(1, cfg.mean_burst * 3 // 2))
        size = min(size, cfg.requests - len(arrivals))
        start = burst * cfg.burst_interval
        arrivals.extend(sorted(start + rng.random() * cfg.burst_spread for _ in range(size)))
        burst_ends.append(len(arrivals) - 1)
        burst += 1
    lifetimes = [rng.expovariate(1.0 / cfg.mean_lifetime) for _ in range(cfg.requests)]
    return Workload(layer_sizes, combinations, arrivals, combination_of, lifetimes, burst_ends)


class _Node:
    """The simulated truth of one node: its LRU chunk cache, link and running count."""

    __slots__ = ("name", "cache", "cache_used", "ready_at", "link_free", "running")

    def __init__(self, name: str):
        self.name = name
        self.cache: OrderedDict[str, int] = OrderedDict()  # layer -> bytes, least recently used first
        self.cache_used = 0
        self.ready_at: dict[str, float] = {}  # layer -> when its fetch completes (single flight)
        self.link_free = 0.0  # when the node's link finishes the fetches queued so far
        self.running = 0


class _Stopwatch:
    """Calls a Scheduler method and adds up the seconds spent inside such calls."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - start


def simulate(cfg: SimConfig, policy: Placement, workload: Workload | None = None) -> SimResult:
    """Replay the workload with ``policy`` placing every request."""
    work = workload if workload is not None else make_workload(cfg)
    sched = Scheduler(policy)
    nodes: dict[str, _Node] = {}
    for i in range(cfg.nodes):
        name = f"node-{i:05d}"
        sched.register(name, cfg.slots)
        nodes[name] = _Node(name)
    # Every layer's size is known up front, as a store's manifests would tell.
    for layer, size in work.layer_sizes.items():
        sched.set_layer_size(layer, size)
    timed = _Stopwatch()

    latencies = [0.0] * cfg.requests
    fetched_by_request = [0] * cfg.requests
    departures: list[tuple[float, int, str]] = []  # (time, request, node)
    pending: deque[int] = deque()  # requests waiting for a free slot, FIFO
    queued = 0
    imbalance_samples: list[tuple[float, float]] = []
    next_burst_end = 0

    def start(request: int, now: float) -> bool:
        layers = work.combinations[work.combination_of[request]]
        try:
            name = timed(sched.place, layers)
        except UnavailableError:
            return False
        node = nodes[name]
        ready = now
        fetched = 0
        for layer in layers:
            if layer in node.cache:
                node.cache.move_to_end(layer)
                ready = max(ready, node.ready_at[layer])
                continue
            size = work.layer_sizes[layer]
            done = max(now, node.link_free) + cfg.fetch_latency + size / cfg.bandwidth
            node.link_free = done
            node.ready_at[layer] = done
            ready = max(ready, done)
            fetched += size
            node.cache[layer] = size
            node.cache_used += size
            timed(sched.cache_add, name, layer, size)
            while node.cache_used > cfg.node_cache_bytes:
                old, old_size = node.cache.popitem(last=False)
                node.cache_used -= old_size
                del node.ready_at[old]
                timed(sched.cache_drop, name, old)
        ready += cfg.setup_time + cfg.setup_per_running * node.running
        node.running += 1
        latencies[request] = ready - work.arrivals[request]
        fetched_by_request[request] = fetched
        heapq.heappush(departures, (ready + work.lifetimes[request], request, name))
        return True

    def end_sandboxes_until(now: float) -> None:
        while departures and departures[0][0] <= now:
            when, _request, name = heapq.heappop(departures)
            nodes[name].running -= 1
            timed(sched.release, name)
            while pending and start(pending[0], when):
                pending.popleft()

    for request, arrival in enumerate(work.arrivals):
        end_sandboxes_until(arrival)
        if pending or not start(request, arrival):
            pending.append(request)
            queued += 1
        if request == work.burst_ends[next_burst_end]:
            running = [node.running for node in nodes.values()]
            mean = sum(running) / len(running)
            if mean > 0:
                variance = sum((r - mean) ** 2 for r in running) / len(running)
                imbalance_samples.append((max(running) / mean, math.sqrt(variance) / mean))
            next_burst_end += 1
    end_sandboxes_until(math.inf)
    if pending:
        raise AssertionError(f"{len(pending)} requests never started although every sandbox ended")

    ordered = sorted(latencies)
    samples = max(1, len(imbalance_samples))
    return SimResult(
        policy=policy.name,
        requests=cfg.requests,
        bytes_fetched=sum(fetched_by_request),
        warm_starts=sum(1 for f in fetched_by_request if f == 0) / cfg.requests,
        latency_p50=_percentile(ordered, 0.50),
        latency_p99=_percentile(ordered, 0.99),
        imbalance=sum(s[0] for s in imbalance_samples) / samples,
        load_cv=sum(s[1] for s in imbalance_samples) / samples,
        queued=queued,
        decisions=sched.decisions,
        decisions_per_s=sched.decisions / timed.seconds if timed.seconds else math.inf,
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def compare(cfg: SimConfig, policies: list[Placement] | None = None) -> list[SimResult]:
    """Run the same workload under each policy (default: affinity, least-loaded, random)."""
    if policies is None:
        policies = [Affinity(), LeastLoaded(), Random(cfg.seed)]
    work = make_workload(cfg)
    return [simulate(cfg, policy, work) for policy in policies]


def format_table(results: list[SimResult]) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:,.1f} GiB"

    header = (f"{'policy':<14}{'fetched':>14}{'warm':>8}{'p50 s':>9}{'p99 s':>9}"
              f"{'max/mean':>10}{'cv':>7}{'queued':>8}{'decisions/s':>13}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r.policy:<14}{gib(r.bytes_fetched):>14}{r.warm_starts:>8.1%}{r.latency_p50:>9.3f}"
                     f"{r.latency_p99:>9.3f}{r.imbalance:>10.2f}{r.load_cv:>7.2f}{r.queued:>8,}"
                     f"{r.decisions_per_s:>13,.0f}")
    return "\n".join(lines)

