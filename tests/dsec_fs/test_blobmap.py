"""The blob map: layout rules, round trip, and decode's refusal of anything inconsistent."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec_fs.errors import FormatError, InputError, NotFoundError
from dsec_fs.blobmap import BLOCK_SIZE, HEADER, BlobMap, EncodedBlobMap, check_chunk_size

SOURCE = "layers/test/blobmap"


def digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def sample_map() -> BlobMap:
    blob_map = BlobMap(1 << 16)
    for n, length in enumerate([1 << 16, 1, 4096, 4097, 12345]):
        blob_map.add(digest(n), length)
    return blob_map


def test_layout_is_block_aligned_in_build_order():
    blob_map = sample_map()
    assert [(addr, length) for addr, _d, length in blob_map.entries] == [
        (0, 1 << 16), (16, 1), (17, 4096), (18, 4097), (20, 12345)
    ]
    assert blob_map.blocks == 24
    assert blob_map.blkaddr_of(digest(3)) == 18


def test_a_chunk_added_twice_keeps_its_place():
    blob_map = sample_map()
    assert blob_map.add(digest(1), 1) == 16
    assert len(blob_map) == 5 and blob_map.blocks == 24


def test_locate_maps_every_block_to_its_chunk():
    blob_map = sample_map()
    expected = [0] * 16 + [1] + [2] + [3, 3] + [4, 4, 4, 4]
    assert [blob_map.locate(b) for b in range(blob_map.blocks)] == expected
    with pytest.raises(InputError):
        blob_map.locate(blob_map.blocks)


def test_entries_in_are_the_chunks_whose_data_a_range_overlaps():
    blob_map = sample_map()
    size = blob_map.blocks * BLOCK_SIZE
    # every edge a walk can get wrong: chunk starts and data ends (and the bytes either side), padding,
    # the blob's end and past it
    edges = sorted({edge + step for addr, _d, length in blob_map.entries
                    for edge in (addr * BLOCK_SIZE, addr * BLOCK_SIZE + length) for step in (-1, 0, 1)
                    if edge + step >= 0} | {size, size + 1, size + 5000})
    for offset in edges:
        for end in edges:
            expected = [index for index, (addr, _digest, length) in enumerate(blob_map.entries)
                        if offset < end and addr * BLOCK_SIZE < end and offset < addr * BLOCK_SIZE + length]
            assert list(blob_map.entries_in(offset, end)) == expected, (offset, end)
    assert list(BlobMap(4096).entries_in(0, 10)) == []


def test_round_trip_and_blob_id():
    blob_map = sample_map()
    data = blob_map.encode()
    again = BlobMap.decode(data, source=SOURCE)
    assert again.entries == blob_map.entries
    assert again.blocks == blob_map.blocks and again.chunk_size == blob_map.chunk_size
    assert again.blob_id == blob_map.blob_id == hashlib.sha256(data).hexdigest()
    assert BlobMap.decode(BlobMap(4096).encode(), source=SOURCE).blocks == 0


def test_unknown_digest_and_bad_chunks_are_refused():
    blob_map = sample_map()
    with pytest.raises(NotFoundError):
        blob_map.blkaddr_of(digest(99))
    for length in (0, (1 << 16) + 1):
        with pytest.raises(InputError):
            blob_map.add(digest(99), length)


@pytest.mark.parametrize("size", [0, 1000, 2048, 3 << 20, 1 << 25, 1 << 11])
def test_chunk_size_must_be_a_power_of_two_from_4k_to_16m(size):
    with pytest.raises(InputError):
        check_chunk_size(size)
    assert check_chunk_size(4096) == 12 and check_chunk_size(16 << 20) == 24


def test_decode_names_source_entry_and_offset():
    data = bytearray(sample_map().encode())
    data[24 + 2 * 40] += 1  # entry 2's blkaddr
    with pytest.raises(FormatError) as info:
        BlobMap.decode(bytes(data), source=SOURCE)
    assert info.value.where == f"{SOURCE}: blob map entry 2 at offset 104"


def test_decode_refuses_a_duplicate_digest():
    blob_map = BlobMap(4096)
    blob_map.add(digest(0), 10)
    blob_map.add(digest(1), 10)
    data = blob_map.encode().replace(digest(1), digest(0))
    with pytest.raises(FormatError, match="already at entry 0"):
        BlobMap.decode(data, source=SOURCE)


def test_decode_refuses_trailing_bytes():
    with pytest.raises(FormatError):
        BlobMap.decode(sample_map().encode() + b"\0", source=SOURCE)


ENCODED = sample_map().encode()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, len(ENCODED) - 1), xor=st.integers(1, 255))
def test_a_flipped_byte_gives_format_error_or_a_consistent_map(position, xor):
    data = bytearray(ENCODED)
    data[position] ^= xor
    try:
        blob_map = BlobMap.decode(bytes(data), source=SOURCE)
    except FormatError:
        return
    # What still decodes (a flipped digest byte, a length with the same block count, a larger chunk size)
    # is a consistent layout; the manifest's sha256 of the map is what catches it.
    assert blob_map.encode() == data


@given(cut=st.integers(0, len(ENCODED) - 1))
def test_a_truncated_map_gives_format_error(cut):
    with pytest.raises(FormatError):
        BlobMap.decode(ENCODED[:cut], source=SOURCE)


@given(lengths=st.lists(st.integers(1, 8192), max_size=40))
def test_any_layout_round_trips(lengths):
    blob_map = BlobMap(8192)
    for n, length in enumerate(lengths):
        blob_map.add(digest(n), length)
    assert BlobMap.decode(blob_map.encode(), source=SOURCE).entries == blob_map.entries
    assert blob_map.blocks == sum(-(-length // BLOCK_SIZE) for length in lengths)


def test_a_replaced_encoding_is_the_map_built_with_the_new_chunks():
    blob_map = sample_map()
    encoded = blob_map.encode()
    patched = EncodedBlobMap(encoded, source=SOURCE).replaced({digest(1): (digest(10), 7),
                                                              digest(3): (digest(11), 8000)})
    expected = BlobMap(1 << 16)
    for n, length in [(0, 1 << 16), (10, 7), (2, 4096), (11, 8000), (4, 12345)]:
        expected.add(digest(n), length)
    assert bytes(patched) == expected.encode()
    assert blob_map.encode() == encoded  # the map itself is as it was
    assert BlobMap.decode(patched, source=SOURCE).entries == expected.entries


@pytest.mark.parametrize("replacements", [
    {digest(3): (digest(10), 4096)},  # one block fewer than the 4097 bytes it replaces
    {digest(1): (digest(2), 1)},  # a chunk the map holds already
    {digest(9): (digest(10), 1)},  # not in the map
    {digest(1): (digest(10), 0)},  # empty
    {digest(1): (digest(10), 1), digest(2): (digest(10), 4096)},  # one chunk in two places
])
def test_a_replacement_that_would_move_a_chunk_is_refused(replacements):
    blob_map = sample_map()
    with pytest.raises(InputError):
        EncodedBlobMap(blob_map.encode(), source=SOURCE).replaced(replacements)


def test_an_encoded_map_is_checked_as_decode_checks_its_header():
    encoded = sample_map().encode()
    with pytest.raises(FormatError, match="entries need"):
        EncodedBlobMap(encoded[:-1], source=SOURCE)
    with pytest.raises(FormatError, match="bad magic"):
        EncodedBlobMap(b"X" + encoded[1:], source=SOURCE)


def test_an_encoded_map_answers_as_the_decoded_one():
    blob_map = sample_map()
    encoded = EncodedBlobMap(blob_map.encode(), source=SOURCE)
    assert (len(encoded), encoded.blocks, encoded.chunk_size) == (len(blob_map), blob_map.blocks, blob_map.chunk_size)
    for index, entry in enumerate(blob_map.entries):
        assert encoded.entry(index) == entry
        assert encoded.starting_at(entry[0]) == entry
        assert encoded.index_of(entry[1]) == index and entry[1] in encoded
    assert encoded.starting_at(1) is None and encoded.starting_at(blob_map.blocks) is None
    assert digest(9) not in encoded
    # a digest's bytes found across two entries' fields are no entry's digest
    straddling = blob_map.encode()[HEADER.size + 20:HEADER.size + 20 + 32]
    assert encoded.index_of(straddling) is None
