"""Store policies as Stores that wrap a Store: retry, a concurrency limit, latency emulation, fault
injection and counting. Each does one thing, so they compose, and every backend gets the same policies.

    wrap_store(backend, retry=True, max_concurrent=32, faults="get:3-5:transient")

builds, from the inside out: backend -> FaultStore -> LatencyStore -> LimitStore -> RetryStore.
Faults sit on "the wire" so retries see them; emulated latency is paid by failed requests too; a limit
slot is held for the whole (emulated) request, or until it is stuck (LimitStore), but released while
RetryStore sleeps between attempts.
CountingStore is not part of that stack: wrap it wherever you want to count (outside RetryStore counts
what callers asked for, inside it counts requests the store saw).

Every wrapper derives from ``StoreWrapper``, which routes each operation through one method,
``_call(op, key, fn, sent)``: ``op`` is the method name, ``key`` the key (the prefix for ``list``), ``fn``
performs the call on the inner store, ``sent`` is the number of bytes a ``put`` carries. ``list`` is
materialised inside that call: a listing is either whole or an error, so it can be retried and it never
holds a limit slot while the caller iterates.

Verifying chunk content (sha256 after a get) is not a wrapper; it lives in chunks.py, where the expected
digest is known, and every chunk read does it.

Threads: any thread may call any wrapper at the same time. Each wrapper's lock guards only its own
counters or clock and is never held while the inner store is called or while sleeping.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..backoff import backoff_delay
from ..errors import InputError, NotFoundError, UnavailableError
from .base import Store

log = logging.getLogger(__name__)

# Seconds after which LimitStore stops counting a call still in the store: the node daemon's default fetch
# deadline (lazy_fetch.fetcher.DEFAULT_TIMEOUT); pass the deadline the callers really use.
DEFAULT_STUCK_AFTER = 30.0

S = TypeVar("S", bound=Store)


class StoreWrapper(Store):
    """A Store that forwards every operation to ``inner`` through ``_call``; subclasses override it."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url

    def _call(self, op: str, key: str, fn: Callable[[], Any], sent: int = 0) -> Any:
        return fn()

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key, offset, length))

    def get_at_most(self, key: str, limit: int) -> bytes:
        return self._call("get", key, lambda: self.inner.get_at_most(key, limit))

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._call("put", key, lambda: self.inner.put(key, data), sent=memoryview(data).nbytes)

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def size(self, key: str) -> int:
        return self._call("size", key, lambda: self.inner.size(key))

    def mtime(self, key: str) -> float:
        return self._call("mtime", key, lambda: self.inner.mtime(key))

    def list(self, prefix: str) -> Iterator[str]:
        return iter(self._call("list", prefix, lambda: [*self.inner.list(prefix)]))

    def list_at_most(self, prefix: str, limit: int) -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list_at_most(prefix, limit))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.inner!r}>"


class RetryStore(StoreWrapper):
    """Retry ``UnavailableError(transient=True)`` with jittered exponential backoff.

    Attempt n (from 1) that fails transiently is followed by a sleep drawn uniformly from
    [d/2, d] with d = min(max_delay, base_delay * 2**(n-1)), up to ``attempts`` attempts in all, and never
    past ``deadline`` seconds after the call began (None: no deadline). Permanent UnavailableError,
    NotFoundError, CorruptError and InputError pass through at once. Every operation is safe to repeat:
    puts are atomic replacements and deleting a missing key succeeds.

    ``retries`` counts the extra attempts made, ``gave_up`` the calls that failed after retrying; the lock
    guards both.
    """

    def __init__(
        self,
        inner: Store,
        attempts: int = 5,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        deadline: float | None = None,
    ):
        super().__init__(inner)
        if attempts < 1:
            raise InputError(f"attempts must be at least 1, got {attempts}", where="RetryStore")
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.deadline = deadline
        self.retries = 0
        self.gave_up = 0
        self._lock = threading.Lock()

    def _call(self, op, key, fn, sent=0):
        start = time.monotonic()
        attempt = 1
        while True:
            try:
                return fn()
            except UnavailableError as exc:
                if not exc.transient:
                    raise
                delay = backoff_delay(attempt, self.base_delay, self.max_delay)
                out_of_time = self.deadline is not None and time.monotonic() + delay - start > self.deadline
                if attempt == self.attempts or out_of_time:
                    with self._lock:
                        self.gave_up += 1
                    log.warning("%s %s failed %d times, giving up: %s", op, key, attempt, exc)
                    raise UnavailableError(
                        f"{exc.message} (gave up after {attempt} attempts)", where=exc.where, transient=True
                    ) from exc
                with self._lock:
                    self.retries += 1
                log.info("%s %s failed (%s), retrying in %.3fs", op, key, exc, delay)
                time.sleep(delay)
                attempt += 1


class LimitStore(StoreWrapper):
    """At most ``max_concurrent`` calls in the inner store at once; further callers block until a slot
    frees. A call that has been in the store for ``stuck_after`` seconds (None: never) is stuck and holds
    its slot no more: its caller gave up at its own deadline (lazy_fetch/fetcher.py abandons such a
    thread), and one object that never answers must not block every other call, in every thread, for
    good. ``_room`` (a Condition) guards ``_started``, the start time of each call in the store."""

    def __init__(self, inner: Store, max_concurrent: int, stuck_after: float | None = DEFAULT_STUCK_AFTER):
        super().__init__(inner)
        if max_concurrent < 1:
            raise InputError(f"max_concurrent must be at least 1, got {max_concurrent}", where="LimitStore")
        if stuck_after is not None and stuck_after <= 0:
            raise InputError(f"stuck_after must be positive, got {stuck_after}", where="LimitStore")
        self.max_concurrent = max_concurrent
        self.stuck_after = stuck_after
        self._room = threading.Condition()
        self._started: dict[object, float] = {}  # a token per call in the store -> monotonic start, oldest first

    def _call(self, op, key, fn, sent=0):
        token = object()
        with self._room:
            while (wait := self._wait_for_slot()) > 0:
                self._room.wait(None if math.isinf(wait) else wait)
            self._started[token] = time.monotonic()
        try:
            return fn()
        finally:
            with self._room:
                del self._started[token]
                self._room.notify()

    def _wait_for_slot(self) -> float:
        """With ``_room`` held: 0 when a call may start now, else how long until one may by becoming stuck
        (infinity: only when one ends)."""
        if len(self._started) < self.max_concurrent:
            return 0.0
        if self.stuck_after is None:
            return math.inf
        now = time.monotonic()
        running = [start for start in self._started.values() if now - start < self.stuck_after]
        if len(running) < self.max_concurrent:
            return 0.0
        return running[0] + self.stuck_after - now


class LatencyStore(StoreWrapper):
    """Make a fast store behave like a remote one, for benchmarks.

    Every request waits ``latency`` seconds (requests overlap, like round trips on many connections).
    The bytes of gets and puts then cross one shared link of ``bandwidth`` bytes per second (None:
    unlimited), shared equally by the transfers on it at each moment (processor sharing, the fluid model
    of TCP flows on one bottleneck): 16 parallel reads of 4 MiB on a 100 MB/s link take about 0.7 s in
    all, as they would on a real one, and a 64 KiB read that starts beside two 1 MiB ones takes about
    2 ms (a third of the link), not the 21 ms it would if it waited for them to finish first.

    ``serial_round_trips``: how many round trips callers waited for one after another, at most, so far: a
    request's depth is one more than that of the deepest request that had ended when it started, and this
    is the greatest depth of any request that ended. Requests made side by side share a depth; a request
    made with what another returned comes after it. On a remote store this count, not the number of
    requests, is what a start waits for.

    The link is kept in virtual time: ``_served`` is the bytes each transfer on the link has received
    since the link was last idle, growing at ``bandwidth / len(_finishing)``; a transfer that starts is
    done when ``_served`` reaches what it was at its start plus its size. ``_link`` (a condition) guards
    ``_served``, ``_served_at`` and ``_finishing`` (the ``_served`` value each transfer on it ends at),
    and wakes the others when a transfer starts or ends (their share changes); ``_lock`` guards
    ``serial_round_trips``.
    """

    def __init__(self, inner: Store, latency: float = 0.02, bandwidth: float | None = 100e6):
        super().__init__(inner)
        self.latency = latency
        self.bandwidth = bandwidth
        self.serial_round_trips = 0
        self._lock = threading.Lock()
        self._link = threading.Condition(threading.Lock())
        self._served = 0.0
        self._served_at = 0.0
        self._finishing: list[float] = []

    def _call(self, op, key, fn, sent=0):
        with self._lock:
            depth = self.serial_round_trips + 1
        try:
            time.sleep(self.latency)
            if sent:
                self._transfer(sent)
            result = fn()
            if op == "get":
                self._transfer(len(result))
            return result
        finally:
            with self._lock:
                self.serial_round_trips = max(self.serial_round_trips, depth)

    def _transfer(self, nbytes: int) -> None:
        if not self.bandwidth:
            return
        with self._link:
            self._advance()
            end = self._served + nbytes
            self._finishing.append(end)
            self._link.notify_all()
            while (left := end - self._served) > 0:
                self._link.wait(left * len(self._finishing) / self.bandwidth)
                self._advance()
            self._finishing.remove(end)
            self._link.notify_all()

    def _advance(self) -> None:
        """Bring ``_served`` up to now (``_link`` held)."""
        now = time.monotonic()
        if self._finishing:
            self._served += (now - self._served_at) * self.bandwidth / len(self._finishing)
        else:
            self._served = 0.0
        self._served_at = now


class CountingStore(StoreWrapper):
    """Count calls, errors and payload bytes per operation, and the most calls ever in flight at once.

    ``calls[op]``, ``errors[op]``, ``nbytes[op]`` (bytes returned by get, bytes sent by put),
    ``in_flight`` and ``max_in_flight``; ``snapshot()`` copies them, ``reset()`` zeroes them. The lock
    guards all of them.
    """

    def __init__(self, inner: Store):
        super().__init__(inner)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls: Counter[str] = Counter()
            self.errors: Counter[str] = Counter()
            self.nbytes: Counter[str] = Counter()
            self.in_flight = 0
            self.max_in_flight = 0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": dict(self.calls),
                "errors": dict(self.errors),
                "nbytes": dict(self.nbytes),
                "max_in_flight": self.max_in_flight,
            }

    def _call(self, op, key, fn, sent=0):
        with self._lock:
            self.calls[op] += 1
            if sent:
                self.nbytes[op] += sent
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            result = fn()
        except Exception:
            with self._lock:
                self.errors[op] += 1
            raise
        finally:
            with self._lock:
                self.in_flight -= 1
        if op == "get":
            with self._lock:
                self.nbytes[op] += len(result)
        return result


# -- fault injection

OPS = ("get", "put", "exists", "size", "mtime", "list", "delete")
ERROR_ACTIONS = ("transient", "permanent", "notfound")
ACTIONS = (*ERROR_ACTIONS, "corrupt", "truncate", "slow", "stall")
# How often a stalled call looks for the file that releases it.
STALL_POLL = 0.05


@dataclass(frozen=True)
class FaultRule:
    """One rule of a FaultStore; see FaultStore for the text form.

    ``op`` is an operation name or "*"; calls are selected by number (``first``..``last``, 1-based,
    counted over the calls this rule's op sees; ``last`` None means no end) or, when ``prefix`` is not
    None, by key prefix. ``arg`` is the action's parameter: seconds for slow, a byte count for truncate,
    a (start, end) byte range for corrupt, the path of the release file for stall.
    """

    op: str
    action: str
    first: int = 1
    last: int | None = None
    prefix: str | None = None
    arg: Any = None

    @classmethod
    def parse(cls, text: str) -> "FaultRule":
        where = f"fault rule {text!r}"
        op, sep1, rest = text.strip().partition(":")
        selector, sep2, action_text = rest.rpartition(":")
        if not (sep1 and sep2 and selector):
            raise InputError("expected OP:SELECTOR:ACTION", where=where)
        if op != "*" and op not in OPS:
            raise InputError(f"unknown operation {op!r} (one of {', '.join(OPS)} or *)", where=where)
        action, _, arg_text = action_text.partition("=")
        if action not in ACTIONS:
            raise InputError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})", where=where)
        try:
            arg = _parse_arg(action, arg_text)
            first, last, prefix = _parse_selector(selector)
        except ValueError as exc:
            raise InputError(str(exc), where=where) from None
        if action in ("corrupt", "truncate") and op not in ("get", "put"):
            raise InputError(f"{action} applies to get or put, not {op}", where=where)
        return cls(op=op, action=action, first=first, last=last, prefix=prefix, arg=arg)

    def applies(self, key: str, number: int) -> bool:
        """Whether this rule fires for call ``number`` (of the calls this rule's op sees) on ``key``."""
        if self.prefix is not None:
            return key.startswith(self.prefix)
        return self.first <= number and (self.last is None or number <= self.last)


def _parse_selector(text: str) -> tuple[int, int | None, str | None]:
    if text == "*":
        return 1, None, None
    first_text, dash, last_text = text.partition("-")
    if first_text.isdigit() and (not dash or last_text == "" or last_text.isdigit()):
        first = int(first_text)
        last = first if not dash else (int(last_text) if last_text else None)
        if first < 1 or (last is not None and last < first):
            raise ValueError(f"bad call range {text!r} (calls count from 1)")
        return first, last, None
    return 1, None, text


def _parse_arg(action: str, text: str) -> Any:
    if action == "slow":
        if not text:
            raise ValueError("slow needs seconds: slow=0.5")
        return float(text)
    if action == "stall":
        if not text.startswith("/"):
            raise ValueError("stall needs the absolute path of the file that ends it: stall=/run/release")
        return text
    if action == "truncate":
        return int(text) if text else None
    if action == "corrupt":
        if not text:
            return (0, 1)
        start, _, end = text.partition("-")
        if not (start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ValueError(f"corrupt takes a byte range A-B with A < B, got {text!r}")
        return (int(start), int(end))
    if text:
        raise ValueError(f"{action} takes no argument")
    return None


def parse_faults(spec: str) -> list[FaultRule]:
    """Rules from their text form, separated by commas (see FaultStore)."""
    return [FaultRule.parse(part) for part in spec.split(",") if part.strip()]


def _flip_bits(data: bytes, start: int, end: int) -> bytes:
    """Flip the lowest bit of every byte in [start, end) that ``data`` has."""
    out = bytearray(data)
    for i in range(start, min(end, len(out))):
        out[i] ^= 0x01
    return bytes(out)


class FaultStore(StoreWrapper):
    """Inject failures, following rules, for tests (and, through an environment variable, daemons).

    A rule is ``OP:SELECTOR:ACTION``; several are joined with commas:

        OP        get | put | exists | size | mtime | list | delete | *
        SELECTOR  N      the Nth call of OP through this store (counting from 1)
                  N-M    calls N through M (a burst)
                  N-     call N and every later one
                  *      every call
                  other  every call whose key starts with this text (for list: whose prefix does);
                         it may contain ':' (refs/name:tag) but not ','
        ACTION    transient        raise UnavailableError(transient=True)
                  permanent        raise UnavailableError(transient=False)
                  notfound         raise NotFoundError
                  corrupt[=A-B]    flip the low bit of bytes [A, B) (default [0, 1)) of what get
                                   returns, or of what put stores
                  truncate[=N]     keep only the first N bytes (default: half) of what get returns or
                                   put stores
                  slow=S           sleep S seconds, then perform the call
                  stall=PATH       hold the call until the file PATH exists, then perform it: a
                                   store that stops answering and comes back when the test (or an
                                   operator) says so, from any process; PATH holds no ':' or ','

    Examples: ``get:3-5:transient`` (a burst of three transient failures), ``*:packs/:permanent``,
    ``get:packs/ab/ab12:corrupt=100-104``, ``put:*:slow=0.2``. A call may match several rules: all sleeps
    happen, the first error raises, byte changes apply in order. A failing call does not reach the inner
    store. Each rule counts the calls of its own op (all calls for "*").

    ``injected[action]`` counts faults fired; the lock guards it and the per-rule call counters.
    """

    def __init__(self, inner: Store, rules: str | Sequence[FaultRule]):
        super().__init__(inner)
        self.rules = parse_faults(rules) if isinstance(rules, str) else list(rules)
        self.injected: Counter[str] = Counter()
        self._seen = [0] * len(self.rules)
        self._lock = threading.Lock()

    def _call(self, op, key, fn, sent=0):
        firing = self._fire(op, key)
        result = fn()
        if op == "get":
            for rule in firing:
                result = _damage(rule, result)
        return result

    def put(self, key: str, data: bytes | memoryview) -> None:
        # Overridden rather than routed through _call: the damage applies to the bytes handed in.
        for rule in self._fire("put", key):
            data = _damage(rule, bytes(data))
        self.inner.put(key, data)

    def _fire(self, op: str, key: str) -> list[FaultRule]:
        """Count the call, sleep and raise as the matching rules say; return them for byte changes."""
        firing = []
        with self._lock:
            for i, rule in enumerate(self.rules):
                if rule.op in ("*", op):
                    self._seen[i] += 1
                    if rule.applies(key, self._seen[i]):
                        firing.append(rule)
                        self.injected[rule.action] += 1
        for rule in firing:
            if rule.action == "slow":
                time.sleep(rule.arg)
            elif rule.action == "stall":
                while not os.path.exists(rule.arg):
                    time.sleep(STALL_POLL)
        for rule in firing:
            if rule.action in ERROR_ACTIONS:
                raise self._error(rule, op, key)
        return [rule for rule in firing if rule.action in ("corrupt", "truncate")]

    def _error(self, rule: FaultRule, op: str, key: str) -> Exception:
        message = f"injected {rule.action} fault on {op}"
        if rule.action == "notfound":
            return NotFoundError(message, where=key)
        return UnavailableError(message, where=key, transient=rule.action == "transient")

    def __repr__(self) -> str:
        return f"<FaultStore {len(self.rules)} rules {self.inner!r}>"


def _damage(rule: FaultRule, data: bytes) -> bytes:
    if rule.action == "truncate":
        return data[: len(data) // 2 if rule.arg is None else rule.arg]
    return _flip_bits(data, *rule.arg)


def find_wrapper(store: Store, kind: type[S]) -> S | None:
    """The outermost ``kind`` in the chain of wrappers ``store`` is the top of (the backend at its bottom
    included); None if there is none."""
    while not isinstance(store, kind):
        if not isinstance(store, StoreWrapper):
            return None
        store = store.inner
    return store


def wrap_store(
    store: Store,
    *,
    retry: bool = True,
    max_concurrent: int | None = None,
    stuck_after: float | None = DEFAULT_STUCK_AFTER,
    latency: float | None = None,
    bandwidth: float | None = None,
    faults: str | Sequence[FaultRule] | None = None,
) -> Store:
    """Compose the policies in the order the module docstring explains. ``retry`` uses RetryStore's
    defaults; ``stuck_after`` is LimitStore's; ``latency`` or ``bandwidth`` turns on LatencyStore (the other
    then defaults to none)."""
    if faults:
        store = FaultStore(store, faults)
    if latency is not None or bandwidth is not None:
        store = LatencyStore(store, latency=latency or 0.0, bandwidth=bandwidth)
    if max_concurrent is not None:
        store = LimitStore(store, max_concurrent, stuck_after)
    if retry:
        store = RetryStore(store)
    return store
