"""Presence counters (lazy_fetch/cache_presence.py): never "absent" for a counted digest, and a count
that overflowed stays put instead of wrapping back to "absent"."""

from hashlib import sha256

from lazy_fetch.cache_presence import SLOTS_MAX, SLOTS_MIN, STUCK, PresenceCounters


def digest(n: int) -> bytes:
    return sha256(str(n).encode()).digest()


def test_counted_digests_are_never_absent_and_uncounted_ones_are_again():
    presence = PresenceCounters(64 << 20)
    held = [digest(n) for n in range(100)]
    presence.count(held, +1)
    assert not any(presence.surely_absent(d) for d in held)
    presence.count(held[:50], -1)
    assert not any(presence.surely_absent(d) for d in held[50:])
    assert sum(presence.surely_absent(d) for d in held[:50]) >= 45  # a few share a slot with a held one


def test_a_count_that_reached_stuck_stays_looked_up():
    presence = PresenceCounters(0)
    one = digest(1)
    presence.count([one] * (STUCK + 10), +1)
    presence.count([one] * (STUCK + 10), -1)
    assert not presence.surely_absent(one)  # it may have lost count: "look it up", never "absent"


def test_slots_are_bounded_both_ways():
    assert len(PresenceCounters(0)._slots) == SLOTS_MIN
    assert len(PresenceCounters(1 << 50)._slots) == SLOTS_MAX
