"""dsec_fs.aligned_search.field_matches: the offsets of a pattern at a record's field, found through the
pattern's longest non-zero run, are exactly those a byte-by-byte comparison gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec_fs.aligned_search import _anchor, field_matches


def _naive(data: bytes, pattern: bytes, origin: int, stride: int, phase: int, start: int) -> list[int]:
    return [at for at in range(max(start, origin), len(data) - len(pattern) + 1)
            if (at - origin) % stride == phase and data[at:at + len(pattern)] == pattern]


# Mostly zeros and a few byte values, as in an image: patterns recur, whole and in part.
_bytes = st.lists(st.sampled_from([0, 0, 0, 1, 2, 0x34, 0x12]), max_size=300).map(bytes)


@settings(max_examples=400, deadline=None)
@given(data=_bytes, pattern=st.lists(st.sampled_from([0, 1, 2, 0x34, 0x12]), min_size=1, max_size=8).map(bytes),
       origin=st.integers(0, 12), stride=st.integers(1, 16), phase=st.integers(0, 15), start=st.integers(0, 40))
def test_offsets_are_those_of_a_naive_search(data, pattern, origin, stride, phase, start):
    phase %= stride
    # planted at a field's place, so that most examples have matches to find
    planted = bytearray(data)
    at = origin + phase + stride * 3
    if at + len(pattern) <= len(planted):
        planted[at:at + len(pattern)] = pattern
    planted = bytes(planted)
    assert list(field_matches(planted, pattern, origin=origin, stride=stride, phase=phase, start=start)) == (
        _naive(planted, pattern, origin, stride, phase, start))


def test_a_chunk_index_is_found_by_its_blkaddr_and_checked_whole():
    # advise 0, device 1, blkaddr 0x1234: the anchor is the blkaddr's low bytes; the same bytes after
    # another device (or at another phase) are no match
    pattern = bytes.fromhex("0000010034120000")
    assert _anchor(pattern) == (4, b"\x34\x12")
    other_device = bytes.fromhex("0000020034120000")
    data = bytes(8) + other_device + bytes(3) + pattern + bytes(5) + pattern + bytes(8)
    assert list(field_matches(data, pattern, origin=0, stride=8, phase=0)) == [32]


def test_a_pattern_without_a_long_enough_run_is_searched_whole():
    assert _anchor(bytes.fromhex("0000010000000000")) == (0, bytes.fromhex("0000010000000000"))
    assert _anchor(b"\x07" * 32) == (0, b"\x07" * 32)
