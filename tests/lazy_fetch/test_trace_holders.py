"""Trace labels from a served blob's holders (lazy_fetch/trace_holders.py), segments joined back into one
trace (trace.join_segments), and the combination a profile object names (profile.py)."""

from __future__ import annotations

import pytest

from dsec_fs.errors import FormatError
from lazy_fetch import profile
from lazy_fetch.trace import Trace, TraceHeader, TraceRecord, join_segments
from lazy_fetch.trace_holders import Holder, Holders, combination_id

X = Holder("base", "os:1", combination_id(["a" * 64, "b" * 64]))
Y = Holder("base", "os:1", combination_id(["c" * 64, "b" * 64]))


def test_the_label_is_the_one_holder_or_shared_and_follows_the_holders():
    holders = Holders()
    assert holders.label() is None
    holders.add("/m", X)
    holders.add("/m", X)  # two sandboxes of one combination: still theirs
    alone = holders.label()
    assert (alone.holder, alone.holders, alone.combination) == (X, 1, X.combination)
    holders.add("/m", Y)
    shared = holders.label()
    assert (shared.holders, shared.combination, shared.holder.role, shared.holder.ref) == (2, "", "base", "os:1")
    holders.remove("/m", X)
    assert holders.label().holders == 2  # one X is left
    holders.remove("/m", X)
    assert (holders.label().holder, holders.label().holders) == (Y, 1)
    assert holders.label().since_ns >= alone.since_ns
    holders.remove("/m")
    assert holders.label() is None


def test_a_sandbox_holder_replaces_the_bare_holder_of_an_adopted_mount():
    holders = Holders()
    holders.add("/m", Holder(ref="os:1"))
    holders.add("/m", X)
    assert (holders.label().holder, holders.label().holders) == (X, 1)


def test_the_combination_id_depends_on_the_order():
    assert combination_id(["a" * 64, "b" * 64]) != combination_id(["b" * 64, "a" * 64])


def _trace(started_ns: int, *times: int) -> Trace:
    return Trace(f"t{started_ns}", TraceHeader(layer="ab" * 32, started_ns=started_ns),
                 [TraceRecord(t, 1, 0, 10, 0, 0, 0) for t in times])


def test_segments_join_on_the_first_ones_clock():
    joined = join_segments([_trace(1000, 5, 7), _trace(1500, 2)])
    assert [r.time_ns for r in joined.records] == [5, 7, 502]


def test_a_profile_names_its_combination_and_refuses_a_bad_one():
    p = profile.Profile(layer="ab" * 32, traces=1, entries=[], combination="cd" * 32)
    assert profile.Profile.decode(p.encode(), source="k").combination == "cd" * 32
    bad = profile.Profile(layer="ab" * 32, traces=1, entries=[], combination="not hex")
    with pytest.raises(FormatError, match="combination"):
        profile.Profile.decode(bad.encode(), source="k")
