"""Sandbox placement: which node should start a sandbox made of these layers?

A sandbox starts fast on a node that already has its layers' chunks in the local cache: nothing to fetch
from the store. Node daemons tell the scheduler how many sandbox slots they have, how many are running and,
per layer, how many of the layer's bytes they hold (lazily fetched layers are often cached only in part).
A ``Placement`` policy turns that into a decision:

- ``Affinity``: score = cached fraction of the request's bytes - ``load_weight`` x the node's load
  (running / capacity); highest score wins, the lower load breaks ties, then the node's registration order.
- ``LeastLoaded``: the node with the lowest load.
- ``Random``: any node with a free slot.

No policy places a sandbox on a full node; when every node is full, ``place`` raises UnavailableError
(transient: a slot frees when a sandbox ends).

Speed: a burst of thousands of starts must not wait for the scheduler, so a decision costs O(candidates),
not O(nodes). The scheduler keeps an inverted index, layer -> nodes holding some of its bytes, and a
lazy min-heap of node loads. Affinity scores only the nodes that hold one of the request's layers plus a
few least-loaded nodes; for a layer held by many nodes (a popular toolkit) it takes a rotating window of
its holders instead of all of them. A candidate's score is exact (its cached bytes of every requested
layer are counted): only the candidate set is bounded.

Layer sizes: the bytes a sandbox reads from a layer (its working set, not the whole image). The scheduler
learns them from ``set_layer_size``, from a request's ``sizes``, and from reports: a layer is at least as
big as the most any node has cached of it. A layer of unknown size counts for nothing in the score.

Threads: a Scheduler is not thread-safe; one thread at a time may call it (sched_service holds one lock
around every call).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Mapping, Sequence

from dsec_fs.errors import InputError, NotFoundError, UnavailableError

# The extender API's score range (k8s.io/kube-scheduler/extender/v1: MinExtenderPriority, MaxExtenderPriority).
MIN_EXTENDER_PRIORITY = 0
MAX_EXTENDER_PRIORITY = 10


class NodeState:
    """What the scheduler believes about one node."""

    __slots__ = ("name", "index", "capacity", "running", "load", "cached")

    def __init__(self, name: str, index: int, capacity: int):
        self.name = name
        self.index = index  # position in Scheduler.nodes: registration order, the last tie-breaker
        self.capacity = capacity  # sandbox slots
        self.running = 0
        self.load = 0.0  # running / capacity, kept in step with running (the heap orders by it)
        self.cached: dict[str, int] = {}  # layer -> bytes of it in the node's chunk cache

    def to_dict(self) -> dict:
        return {"name": self.name, "capacity": self.capacity, "running": self.running,
                "cached_layers": len(self.cached), "cached_bytes": sum(self.cached.values())}


class _Holders:
    """The nodes holding one layer: a list for windows, positions for O(1) swap-removal."""

    __slots__ = ("nodes", "pos", "cursor")

    def __init__(self):
        self.nodes: list[NodeState] = []
        self.pos: dict[NodeState, int] = {}
        self.cursor = 0  # where the next window starts, so successive windows cover every holder

    def add(self, node: NodeState) -> None:
        if node not in self.pos:
            self.pos[node] = len(self.nodes)
            self.nodes.append(node)

    def remove(self, node: NodeState) -> None:
        at = self.pos.pop(node, None)
        if at is None:
            return
        last = self.nodes.pop()
        if last is not node:
            self.nodes[at] = last
            self.pos[last] = at

    def window(self, size: int) -> list[NodeState]:
        start = self.cursor % len(self.nodes)
        self.cursor = start + size
        part = self.nodes[start:start + size]
        return part + self.nodes[:size - len(part)] if len(part) < size else part


class Placement:
    """A placement policy: picks a node with a free slot for a request, or None when there is none."""

    name = "placement"

    def choose(self, sched: "Scheduler", layers: Sequence[str]) -> NodeState | None:
        raise NotImplementedError


class Affinity(Placement):
    """Prefer nodes that hold the request's bytes, traded against their load.

    ``load_weight`` (w): a node holding everything the request reads beats a node holding nothing as long
    as it is less than 1/w of its slots ahead in load (at w = 4 and 16 slots: 4 sandboxes). A larger w
    spreads more and fetches more; the simulator (sched_sim) chose 4: below it, stacking starts on warm
    nodes lengthens the p99, above it the bytes fetched grow. ``scan``: a layer held by up to this many
    nodes has all of them scored, a more widely held layer a rotating window of ``scan`` of them.
    ``fallbacks``: least-loaded nodes always scored, so a request whose layers are nowhere (or only on
    full nodes) still lands well.
    """

    name = "affinity"

    def __init__(self, load_weight: float = 4.0, scan: int = 8, fallbacks: int = 2):
        if load_weight < 0 or scan < 1 or fallbacks < 1:
            raise InputError("load_weight must be >= 0, scan and fallbacks >= 1",
                             where=f"Affinity(load_weight={load_weight}, scan={scan}, fallbacks={fallbacks})")
        self.load_weight = load_weight
        self.scan = scan
        self.fallbacks = fallbacks

    def score(self, cached: int, total: int, load: float) -> float:
        """The placement score of a node holding ``cached`` of the request's ``total`` bytes."""
        return (cached / total if total else 0.0) - self.load_weight * load

    def extender_priority(self, score: float) -> int:
        """``score`` as a Kubernetes extender priority (0..10): 10 x the score, clamped to 0..1.

        Nodes whose load outweighs what they hold all get 0, and kube-scheduler's own scoring (which
        spreads load) decides among them.
        """
        span = MAX_EXTENDER_PRIORITY - MIN_EXTENDER_PRIORITY
        return MIN_EXTENDER_PRIORITY + round(span * min(1.0, max(0.0, score)))

    def choose(self, sched: "Scheduler", layers: Sequence[str]) -> NodeState | None:
        sizes = sched.layer_sizes
        total = 0
        cached: dict[NodeState, int] = {}  # candidate -> its cached bytes of the request's layers
        widely_held = []
        for layer in layers:
            total += sizes.get(layer, 0)
            holders = sched.holders.get(layer)
            if holders is None:
                continue
            if len(holders.nodes) <= self.scan:
                for node in holders.nodes:
                    cached[node] = cached.get(node, 0) + node.cached[layer]
            else:
                widely_held.append((layer, holders))
        # Nodes added from here on hold none of the fully scanned layers (or they would be in `cached`
        # already), so counting only the widely held layers for them below is exact.
        for _layer, holders in widely_held:
            for node in holders.window(self.scan):
                cached.setdefault(node, 0)
        for node in sched.least_loaded(self.fallbacks):
            cached.setdefault(node, 0)
        for layer, _holders in widely_held:
            for node in cached:
                cached[node] += node.cached.get(layer, 0)

        per_byte = 1.0 / total if total else 0.0
        weight = self.load_weight
        best = None
        best_score = best_load = 0.0
        for node, nbytes in cached.items():
            if node.running >= node.capacity:
                continue
            load = node.load
            score = nbytes * per_byte - weight * load
            if (best is None or score > best_score
                    or (score == best_score and (load, node.index) < (best_load, best.index))):
                best, best_score, best_load = node, score, load
        return best


class LeastLoaded(Placement):
    """The node with the lowest load (running / capacity); registration order breaks ties."""

    name = "least-loaded"

    def choose(self, sched: "Scheduler", layers: Sequence[str]) -> NodeState | None:
        found = sched.least_loaded(1)
        return found[0] if found else None


class Random(Placement):
    """Any node with a free slot, uniformly; seeded, so a simulation replays exactly."""

    name = "random"

    def __init__(self, seed: int | None = 0):
        self._rng = random.Random(seed)

    def choose(self, sched: "Scheduler", layers: Sequence[str]) -> NodeState | None:
        nodes = sched.nodes
        if not nodes:
            return None
        for _ in range(8):  # with free slots on most nodes, a few draws find one
            node = nodes[self._rng.randrange(len(nodes))]
            if node.running < node.capacity:
                return node
        free = [node for node in nodes if node.running < node.capacity]
        return self._rng.choice(free) if free else None


class Scheduler:
    """Node states, the layer -> holders index, the load heap, and one policy that uses them."""

    def __init__(self, policy: Placement | None = None):
        self.policy = policy if policy is not None else Affinity()
        self.nodes: list[NodeState] = []
        self.by_name: dict[str, NodeState] = {}
        self.holders: dict[str, _Holders] = {}
        self.layer_sizes: dict[str, int] = {}
        # (load, node index) entries; an entry is current while the node's load still equals it. Stale
        # entries are dropped when they surface, and the heap is rebuilt when they pile up.
        self._heap: list[tuple[float, int]] = []
        self.decisions = 0

    # --- what nodes tell us

    def register(self, name: str, capacity: int) -> NodeState:
        """Add a node, or update the capacity of a known one (a daemon restarting keeps its cache)."""
        if not isinstance(name, str) or not name or "/" in name:
            raise InputError("a node name must be a non-empty string without '/'", where=f"node {name!r}")
        _check_count(capacity, "capacity", name, minimum=1)
        node = self.by_name.get(name)
        if node is None:
            node = NodeState(name, len(self.nodes), capacity)
            self.nodes.append(node)
            self.by_name[name] = node
        else:
            node.capacity = capacity
        self._set_running(node, node.running)
        return node

    def report(self, name: str, *, capacity: int | None = None, running: int | None = None,
               cached: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None) -> None:
        """Replace what we know of a node with its own report; omitted fields are left as they are.

        ``cached`` is the node's whole cache (layer -> bytes held); layers not in it are dropped.
        ``running`` replaces the scheduler's count, which includes its own placements since the last report.
        """
        node = self.node(name)
        if capacity is not None:
            _check_count(capacity, "capacity", name, minimum=1)
        if running is not None:
            _check_count(running, "running", name, minimum=0)
        where = f"node {name!r}"
        sizes = _check_layer_bytes(sizes, "sizes", where) if sizes is not None else {}
        cached = _check_layer_bytes(cached, "cached", where) if cached is not None else None

        for layer, size in sizes.items():
            self.set_layer_size(layer, size)
        if cached is not None:
            for layer in [layer for layer in node.cached if layer not in cached]:
                self.cache_drop(name, layer)
            for layer, nbytes in cached.items():
                self.cache_add(name, layer, nbytes)
        if capacity is not None:
            node.capacity = capacity
        self._set_running(node, node.running if running is None else running)

    def cache_add(self, name: str, layer: str, nbytes: int) -> None:
        """Node ``name`` now holds ``nbytes`` of ``layer`` (0 drops it)."""
        if nbytes <= 0:
            self.cache_drop(name, layer)
            return
        node = self.node(name)
        node.cached[layer] = nbytes
        holders = self.holders.get(layer)
        if holders is None:
            holders = self.holders[layer] = _Holders()
        holders.add(node)
        if nbytes > self.layer_sizes.get(layer, 0):
            self.layer_sizes[layer] = nbytes

    def cache_drop(self, name: str, layer: str) -> None:
        """Node ``name`` no longer holds any of ``layer``."""
        node = self.node(name)
        if node.cached.pop(layer, None) is None:
            return
        holders = self.holders[layer]
        holders.remove(node)
        if not holders.nodes:
            del self.holders[layer]

    def set_layer_size(self, layer: str, size: int) -> None:
        """The bytes a sandbox reads from ``layer``; never below what a node has cached of it."""
        self.layer_sizes[layer] = max(size, self.layer_sizes.get(layer, 0))

    def release(self, name: str) -> None:
        """A sandbox on ``name`` ended."""
        node = self.node(name)
        if node.running > 0:
            self._set_running(node, node.running - 1)

    def node(self, name: str) -> NodeState:
        try:
            return self.by_name[name]
        except KeyError:
            raise NotFoundError("no such node registered", where=f"node {name!r}") from None

    # --- decisions

    def place(self, layers: Sequence[str], sizes: Mapping[str, int] | None = None) -> str:
        """Pick a node for a sandbox of ``layers``, count the sandbox as running there, return its name."""
        if sizes:
            for layer, size in _check_layer_bytes(sizes, "sizes", "placement request").items():
                self.set_layer_size(layer, size)
        node = self.policy.choose(self, layers)
        if node is None:
            raise UnavailableError(
                f"no node has a free slot ({len(self.nodes)} nodes registered)",
                where="scheduler", transient=True)
        self._set_running(node, node.running + 1)
        self.decisions += 1
        return node.name

    def cached_bytes(self, name: str, layers: Iterable[str]) -> int:
        cached = self.node(name).cached
        return sum(cached.get(layer, 0) for layer in layers)

    def request_bytes(self, layers: Iterable[str]) -> int:
        return sum(self.layer_sizes.get(layer, 0) for layer in layers)

    def least_loaded(self, count: int) -> list[NodeState]:
        """Up to ``count`` distinct nodes with free slots, lowest load first."""
        heap, nodes = self._heap, self.nodes
        found: list[tuple[float, int]] = []
        while heap and len(found) < count:
            load, i = heapq.heappop(heap)
            node = nodes[i]
            if node.load != load or node.running >= node.capacity or any(j == i for _l, j in found):
                continue  # stale, full (it re-enters when a slot frees), or a duplicate entry
            found.append((load, i))
        for entry in found:
            heapq.heappush(heap, entry)
        return [nodes[i] for _load, i in found]

    def _set_running(self, node: NodeState, running: int) -> None:
        node.running = running
        node.load = running / node.capacity
        if running < node.capacity:
            heapq.heappush(self._heap, (node.load, node.index))
            if len(self._heap) > 4 * len(self.nodes) + 64:
                self._heap = [(n.load, n.index) for n in self.nodes if n.running < n.capacity]
                heapq.heapify(self._heap)


def _check_count(value: object, field: str, node: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InputError(f"{field} must be an integer >= {minimum}, got {value!r}", where=f"node {node!r}")


def _check_layer_bytes(mapping: object, field: str, where: str) -> dict[str, int]:
    if not isinstance(mapping, Mapping):
        raise InputError(f"{field} must map layer -> bytes", where=where)
    for layer, nbytes in mapping.items():
        if not isinstance(layer, str) or not layer:
            raise InputError(f"{field}: a layer must be a non-empty string, got {layer!r}", where=where)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InputError(f"{field}[{layer}] must be an integer >= 0, got {nbytes!r}", where=where)
    return dict(mapping)
