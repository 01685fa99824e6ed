"""Store policies: retry, limits, fault injection, counting, latency, and their composition. Faults come
from FaultStore over a real directory store, or from a real moto server and a real dead port."""

from __future__ import annotations

import threading
import time

import pytest

from dsec_fs.errors import CorruptError, InputError, NotFoundError, UnavailableError
from dsec_fs.store import FilesystemStore
from dsec_fs.store.s3 import S3Store
from dsec_fs.store.wrappers import (
    CountingStore,
    FaultRule,
    FaultStore,
    LatencyStore,
    LimitStore,
    RetryStore,
    StoreWrapper,
    parse_faults,
    wrap_store,
)
from tests.s3server import MotoServer, free_port

DATA = bytes(range(32))


@pytest.fixture
def base(tmp_path):
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    store.put("obj", DATA)
    return store


def fast_retry(inner, attempts=5):
    return RetryStore(inner, attempts=attempts, base_delay=0.001, max_delay=0.005)


# -- RetryStore


def test_retry_succeeds_through_a_transient_burst(base):
    faults = FaultStore(base, "get:1-3:transient")
    store = fast_retry(faults, attempts=5)
    assert store.get("obj") == DATA
    assert store.retries == 3
    assert store.gave_up == 0
    assert faults.injected["transient"] == 3


def test_retry_gives_up_after_the_attempts(base):
    counting = CountingStore(FaultStore(base, "get:*:transient"))
    store = fast_retry(counting, attempts=3)
    with pytest.raises(UnavailableError) as info:
        store.get("obj")
    assert info.value.transient
    assert "gave up after 3 attempts" in str(info.value)
    assert counting.calls["get"] == 3
    assert (store.retries, store.gave_up) == (2, 1)


@pytest.mark.parametrize(
    "rules, call, error",
    [
        ("get:*:permanent", lambda s: s.get("obj"), UnavailableError),
        ("", lambda s: s.get("missing"), NotFoundError),
        ("", lambda s: s.get("obj", len(DATA) - 1, 5), CorruptError),
        ("get:*:notfound", lambda s: s.get("obj"), NotFoundError),
    ],
)
def test_retry_passes_other_errors_through_at_once(base, rules, call, error):
    counting = CountingStore(FaultStore(base, rules))
    store = fast_retry(counting)
    with pytest.raises(error) as info:
        call(store)
    assert not getattr(info.value, "transient", False)
    assert counting.calls["get"] == 1
    assert store.retries == 0


def test_retry_respects_the_deadline(base):
    counting = CountingStore(FaultStore(base, "get:*:transient"))
    # The first backoff (at least 5 s) would end past the 0.5 s deadline, so there is no second attempt.
    store = RetryStore(counting, attempts=5, base_delay=10.0, max_delay=10.0, deadline=0.5)
    with pytest.raises(UnavailableError):
        store.get("obj")
    assert counting.calls["get"] == 1


def test_retry_covers_every_operation(base):
    store = fast_retry(FaultStore(base, "*:1-2:transient"))
    store.put("other", b"x")
    assert store.exists("other")
    assert sorted(store.list("")) == ["obj", "other"]
    assert store.size("obj") == len(DATA)
    store.delete("other")
    assert store.retries == 2


@pytest.mark.s3
def test_missing_bucket_is_permanent_and_named(s3_url):
    counting = CountingStore(S3Store.from_url("s3://dsecfs-no-such-bucket/some/prefix"))
    store = RetryStore(counting)
    for call in (
        lambda: store.get("packs/ab/ab01"),
        lambda: store.get("packs/ab/ab01", 10, 20),
        lambda: store.put("packs/ab/ab01", b"data"),
        lambda: store.exists("packs/ab/ab01"),
        lambda: store.size("packs/ab/ab01"),
        lambda: list(store.list("packs/")),
    ):
        with pytest.raises(UnavailableError) as info:
            call()
        assert not info.value.transient
        assert "bucket dsecfs-no-such-bucket does not exist" in str(info.value)
    assert store.retries == 0
    assert sum(counting.calls.values()) == 6


@pytest.mark.s3
def test_rejected_credentials_are_permanent(monkeypatch):
    with MotoServer(server_env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as server:  # moto checks keys
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        store = RetryStore(S3Store.from_url("s3://dsecfs-test/p"))
        for call in (lambda: store.get("k"), lambda: store.put("k", b"x"), lambda: store.exists("k")):
            with pytest.raises(UnavailableError) as info:
                call()
            assert not info.value.transient
            assert "credentials rejected" in str(info.value) or "access denied to bucket dsecfs-test" in str(info.value)
            assert "testing" not in str(info.value)
        assert store.retries == 0


@pytest.mark.s3
def test_missing_credentials_are_permanent(s3_url, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with pytest.raises(UnavailableError) as info:
        S3Store.from_url(s3_url).get("k")
    assert not info.value.transient
    assert "no usable S3 credentials" in str(info.value)


@pytest.mark.s3
def test_dead_endpoint_is_transient_and_retried(s3_url):
    dead = S3Store("dsecfs-test", "x", endpoint_url=f"http://127.0.0.1:{free_port()}", connect_timeout=2)
    store = fast_retry(dead, attempts=2)
    with pytest.raises(UnavailableError) as info:
        store.get("obj")
    assert info.value.transient
    assert store.retries == 1
    assert "testing" not in str(info.value)  # the fake credentials never reach a message


# -- LimitStore


class Gate(StoreWrapper):
    """Holds every call until ``release`` is set, so calls pile up inside on purpose."""

    def __init__(self, inner):
        super().__init__(inner)
        self.release = threading.Event()

    def _call(self, op, key, fn, sent=0):
        assert self.release.wait(timeout=30), "gate never opened"
        return fn()


def test_limit_bounds_calls_in_flight(base):
    gate = Gate(base)
    counting = CountingStore(gate)
    store = LimitStore(counting, max_concurrent=3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(store.get("obj"))) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while counting.in_flight < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # room for a broken limit to let a fourth call in
        assert counting.in_flight == 3
    finally:
        gate.release.set()
        for t in threads:
            t.join()
    assert results == [DATA] * 8
    assert counting.max_in_flight == 3


def test_limit_refuses_a_zero_limit(base):
    with pytest.raises(InputError):
        LimitStore(base, 0)
    with pytest.raises(InputError):
        LimitStore(base, 1, stuck_after=0)


def test_calls_stuck_in_the_store_give_their_slot_back(base, tmp_path):
    # Two calls that never return (until the end of the test) fill a limit of two; a third one gets in
    # once they have been stuck for stuck_after, and the limit still holds among the calls that move.
    release = tmp_path / "release"
    store = LimitStore(FaultStore(base, f"get:stuck:stall={release}"), max_concurrent=2, stuck_after=0.3)
    base.put("stuck", b"late")
    stuck = [threading.Thread(target=store.get, args=("stuck",)) for _ in range(2)]
    try:
        for thread in stuck:
            thread.start()
        time.sleep(0.05)
        started = time.monotonic()
        assert store.get("obj") == DATA
        assert 0.2 < time.monotonic() - started < 5
    finally:
        release.touch()
        for thread in stuck:
            thread.join()


# -- FaultStore


def test_fault_rules_parse():
    rules = parse_faults("get:3-5:transient, get:packs/:corrupt,*:refs/base/debian:12:notfound,put:2-:slow=0.5")
    assert rules == [
        FaultRule(op="get", action="transient", first=3, last=5),
        FaultRule(op="get", action="corrupt", prefix="packs/", arg=(0, 1)),
        FaultRule(op="*", action="notfound", prefix="refs/base/debian:12"),
        FaultRule(op="put", action="slow", first=2, last=None, arg=0.5),
    ]
    assert parse_faults("get:7:truncate=3") == [FaultRule(op="get", action="truncate", first=7, last=7, arg=3)]


@pytest.mark.parametrize(
    "text",
    ["get:3", "fetch:1:transient", "get:1:explode", "get:5-3:transient", "get:0:transient",
     "list:*:corrupt", "get:*:slow", "get:*:corrupt=4-2", "get:*:transient=1", "get:*:stall",
     "get:*:stall=relative/path"],
)
def test_bad_fault_rules_are_refused(text):
    with pytest.raises(InputError) as info:
        parse_faults(text)
    assert text in str(info.value)


def test_fault_on_the_nth_call_only(base):
    store = FaultStore(base, "get:2:transient")
    assert store.get("obj") == DATA
    with pytest.raises(UnavailableError):
        store.get("obj")
    assert store.get("obj") == DATA


def test_fault_from_the_nth_call_on_and_across_ops(base):
    store = FaultStore(base, "exists:2-:permanent,*:4:notfound")
    assert store.exists("obj")  # call 1 of all
    with pytest.raises(UnavailableError):
        store.exists("obj")  # exists call 2
    assert store.size("obj") == len(DATA)  # call 3 of all
    with pytest.raises(NotFoundError):
        store.get("obj")  # call 4 of all


def test_fault_by_key_prefix(base):
    base.put("packs/ab/ab01", b"pack")
    base.put("refs/app:1", b"ref")
    store = FaultStore(base, "*:packs/:permanent")
    for call in (
        lambda: store.get("packs/ab/ab01"),
        lambda: store.exists("packs/ab/ab01"),
        lambda: list(store.list("packs/")),
    ):
        with pytest.raises(UnavailableError) as info:
            call()
        assert not info.value.transient
    assert store.get("refs/app:1") == b"ref"
    assert sorted(store.list("refs/")) == ["refs/app:1"]


def test_fault_corruption_is_visible(base):
    store = FaultStore(base, "get:obj:corrupt=2-4")
    damaged = store.get("obj")
    assert len(damaged) == len(DATA)
    assert [i for i in range(len(DATA)) if damaged[i] != DATA[i]] == [2, 3]
    assert bytes(a ^ b for a, b in zip(damaged, DATA)) == b"\0\0\1\1" + b"\0" * (len(DATA) - 4)
    assert base.get("obj") == DATA  # only the answer was damaged


def test_fault_truncation_and_corrupted_writes(base):
    assert FaultStore(base, "get:*:truncate=5").get("obj") == DATA[:5]
    assert FaultStore(base, "get:*:truncate").get("obj") == DATA[:16]
    writer = FaultStore(base, "put:*:corrupt")
    writer.put("written", memoryview(b"abc"))
    assert base.get("written") == b"`bc"


def test_fault_stall_holds_calls_until_its_file_exists(base, tmp_path):
    release = tmp_path / "release"
    store = FaultStore(base, f"get:obj:stall={release}")
    assert parse_faults(f"get:obj:stall={release}")[0].arg == str(release)
    results = []
    thread = threading.Thread(target=lambda: results.append(store.get("obj")))
    thread.start()
    try:
        thread.join(0.3)
        assert thread.is_alive() and not results  # stalled
        assert base.get("obj") == DATA  # the store itself answers
    finally:
        release.touch()
        thread.join(5)
    assert results == [DATA] and store.injected["stall"] == 1
    assert store.get("obj") == DATA  # released: later calls go straight through


def test_fault_slow_still_answers(base):
    store = FaultStore(base, "get:*:slow=0.01")
    assert store.get("obj") == DATA
    assert store.injected["slow"] == 1


# -- CountingStore and LatencyStore


def test_counting_counts_calls_bytes_and_errors(base):
    store = CountingStore(base)
    store.put("a", b"x" * 10)
    store.put("b", memoryview(b"y" * 20))
    assert store.get("b", 5, 5) == b"y" * 5
    assert store.get("b") == b"y" * 20
    with pytest.raises(NotFoundError):
        store.get("missing")
    assert store.exists("a")
    assert sorted(store.list("")) == ["a", "b", "obj"]
    assert store.snapshot() == {
        "calls": {"put": 2, "get": 3, "exists": 1, "list": 1},
        "errors": {"get": 1},
        "nbytes": {"put": 30, "get": 25},
        "max_in_flight": 1,
    }
    store.reset()
    assert store.snapshot()["calls"] == {}


def test_latency_store_passes_data_through(base):
    store = LatencyStore(base, latency=0.001, bandwidth=1e9)
    store.put("big", b"z" * 100_000)
    assert store.get("big", 10, 10) == b"z" * 10
    assert store.size("big") == 100_000
    unlimited = LatencyStore(base, latency=0.0, bandwidth=None)
    assert unlimited.get("obj") == DATA


def test_latency_store_shares_its_link_among_the_transfers_on_it(base):
    # Two reads of 1 MB on a 10 MB/s link, and a small one started beside them: the link is shared, as a
    # real one is by its flows, so the small read is done in about three times its own transfer (3 ms),
    # long before the big ones; a link that let each transfer wait for the ones before it made the small
    # read wait for both (0.2 s). Two side by side still take the link's time for both bytes (0.2 s).
    base.put("big", b"b" * 1_000_000)
    base.put("small", b"s" * 10_000)
    store = LatencyStore(base, latency=0.0, bandwidth=10e6)
    done: dict[str, float] = {}

    def read(name: str, key: str) -> None:
        store.get(key)
        done[name] = time.monotonic()

    started = time.monotonic()
    threads = [threading.Thread(target=read, args=(f"big{n}", "big")) for n in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.02)
    read("small", "small")
    for thread in threads:
        thread.join()
    assert done["small"] - started < 0.1 < min(done["big0"], done["big1"]) - started
    assert 0.19 < max(done["big0"], done["big1"]) - started < 0.5


# -- composition


def test_wrap_store_order_and_faults_are_retried(base):
    store = wrap_store(base, max_concurrent=4, latency=0.0, faults="get:1-2:transient")
    chain = []
    layer = store
    while isinstance(layer, StoreWrapper):
        chain.append(type(layer))
        layer = layer.inner
    assert chain == [RetryStore, LimitStore, LatencyStore, FaultStore]
    assert layer is base
    assert store.url == base.url
    assert store.get("obj") == DATA
    assert store.retries == 2


def test_wrap_store_with_nothing_to_do(base):
    assert wrap_store(base, retry=False) is base
