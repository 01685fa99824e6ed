"""The blob map: layout rules, round trip, the read form's refusal of anything inconsistent, its answers
against a decoding into tuples (the reader before blobmap13), and its memory."""

from __future__ import annotations

import hashlib
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec_fs.errors import FormatError, InputError, NotFoundError
from dsec_fs.blobmap import BLOCK_SIZE, ENTRY, HEADER, BlobMap, EncodedBlobMap, check_chunk_size, header
from tests.dsec_fs.blobmap_support import TupleDecoding

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


def encoded(blob_map: BlobMap) -> EncodedBlobMap:
    return EncodedBlobMap(blob_map.encode(), source=SOURCE)


def test_locate_maps_every_block_to_its_chunk():
    blob_map = encoded(sample_map())
    expected = [0] * 16 + [1] + [2] + [3, 3] + [4, 4, 4, 4]
    assert [blob_map.locate(b) for b in range(blob_map.blocks)] == expected
    with pytest.raises(InputError):
        blob_map.locate(blob_map.blocks)


def test_entries_in_are_the_chunks_whose_data_a_range_overlaps():
    blob_map = encoded(sample_map())
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
    assert list(encoded(BlobMap(4096)).entries_in(0, 10)) == []


def test_round_trip_and_blob_id():
    blob_map = sample_map()
    data = blob_map.encode()
    again = EncodedBlobMap(data, source=SOURCE)
    assert again.entries == blob_map.entries
    assert again.blocks == blob_map.blocks and again.chunk_size == blob_map.chunk_size
    assert again.blob_id == blob_map.blob_id == hashlib.sha256(data).hexdigest()
    assert EncodedBlobMap(BlobMap(4096).encode(), source=SOURCE).blocks == 0


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
        EncodedBlobMap(bytes(data), source=SOURCE)
    assert info.value.where == f"{SOURCE}: blob map entry 2 at offset 104"


def test_a_chunk_named_twice_is_read_by_entry_number():
    """Not refused (that takes a set of every digest per mount: dsec_fs/blobmap.py); fsck reports it."""
    blob_map = BlobMap(4096)
    blob_map.add(digest(0), 10)
    blob_map.add(digest(1), 10)
    twice = EncodedBlobMap(blob_map.encode().replace(digest(1), digest(0)), source=SOURCE)
    assert list(twice.entries) == [(0, digest(0), 10), (1, digest(0), 10)]
    assert twice.index_of(digest(0)) == 0 and twice.indexes_of([digest(0)]) == {digest(0): 0}


def test_decode_refuses_trailing_bytes():
    with pytest.raises(FormatError):
        EncodedBlobMap(sample_map().encode() + b"\0", source=SOURCE)


ENCODED = sample_map().encode()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, len(ENCODED) - 1), xor=st.integers(1, 255))
def test_a_flipped_byte_gives_format_error_or_a_consistent_map(position, xor):
    data = bytearray(ENCODED)
    data[position] ^= xor
    try:
        blob_map = EncodedBlobMap(bytes(data), source=SOURCE)
    except FormatError:
        return
    # What still decodes (a flipped digest byte, a length with the same block count, a larger chunk size)
    # is a consistent layout; the manifest's sha256 of the map is what catches it.
    assert blob_map.encode() == data


@given(cut=st.integers(0, len(ENCODED) - 1))
def test_a_truncated_map_gives_format_error(cut):
    with pytest.raises(FormatError):
        EncodedBlobMap(ENCODED[:cut], source=SOURCE)


@given(lengths=st.lists(st.integers(1, 8192), max_size=40))
def test_any_layout_round_trips(lengths):
    blob_map = BlobMap(8192)
    for n, length in enumerate(lengths):
        blob_map.add(digest(n), length)
    assert EncodedBlobMap(blob_map.encode(), source=SOURCE).entries == blob_map.entries
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
    assert EncodedBlobMap(patched, source=SOURCE).entries == expected.entries


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


# ---- against the decoding into tuples (tests/dsec_fs/blobmap_support.py) ------------------------------


def assert_same_answers(data: bytes, probes: list[int]) -> None:
    """Every question a reader asks, answered by the read form as by the tuple decoding: the entries, by
    index, iteration and slice; locate of each chunk's first and last block; entries_in over ``probes``
    (byte offsets, as pairs); digest lookups and starting_at."""
    old, new = TupleDecoding(data), EncodedBlobMap(data, source=SOURCE)
    assert (len(new), new.blocks) == (len(old.entries), old.blocks)
    assert list(new.entries) == old.entries and list(new.lengths) == [n for _b, _d, n in old.entries]
    assert [new.entry(i) for i in range(len(new))] == [new.entries[i] for i in range(len(new))] == old.entries
    assert list(new.entries[len(new) // 2:]) == old.entries[len(old.entries) // 2:]
    assert list(new.digests()) == [d for _b, d, _n in old.entries]
    for index, (blkaddr, chunk_digest, length) in enumerate(old.entries):
        last_block = blkaddr + -(-length // BLOCK_SIZE) - 1
        assert new.locate(blkaddr) == new.locate(last_block) == old.locate(last_block) == index
        assert new.starting_at(blkaddr) == old.entries[index] and new.digest(index) == chunk_digest
        if index < 50:
            assert new.index_of(chunk_digest) == index
    assert new.indexes_of(d for _b, d, _n in old.entries[::7]) == {d: i * 7 for i, (_b, d, _n) in
                                                                   enumerate(old.entries[::7])}
    for offset, end in zip(probes[::2], probes[1::2]):
        offset, end = min(offset, end), max(offset, end)
        assert list(new.entries_in(offset, end)) == old.entries_in(offset, end), (offset, end)


def encode_lengths(chunk_bits: int, lengths: list[int], digests: list[bytes] | None = None) -> bytes:
    entries, blkaddr = [], 0
    for n, length in enumerate(lengths):
        entries.append(ENTRY.pack(blkaddr, length, digests[n] if digests else digest(n)))
        blkaddr += -(-length // BLOCK_SIZE)
    return header(chunk_bits, len(lengths), blkaddr) + b"".join(entries)


@settings(max_examples=200, deadline=None)
@given(chunk_bits=st.integers(12, 17), data=st.data())
def test_the_read_form_answers_as_the_tuple_decoding_on_any_map(chunk_bits, data):
    lengths = data.draw(st.lists(st.integers(1, 1 << chunk_bits), max_size=60))
    encoding = encode_lengths(chunk_bits, lengths)
    size = sum(-(-n // BLOCK_SIZE) for n in lengths) * BLOCK_SIZE
    probes = data.draw(st.lists(st.integers(0, size + 2 * BLOCK_SIZE), min_size=2, max_size=40))
    assert_same_answers(encoding, probes)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(ENCODED) - 1), xor=st.integers(1, 255))
def test_the_read_form_refuses_what_the_tuple_decoding_refused(position, xor):
    data = bytearray(ENCODED)
    data[position] ^= xor
    try:
        TupleDecoding(bytes(data))
    except (ValueError, struct.error):
        refused = True
    else:
        refused = False
    if refused:
        with pytest.raises(FormatError) as info:
            EncodedBlobMap(bytes(data), source=SOURCE)
        assert info.value.where.startswith(f"{SOURCE}: blob map ")
    else:
        assert list(EncodedBlobMap(bytes(data), source=SOURCE).entries) == TupleDecoding(bytes(data)).entries


def forged(lengths: list[int], **changes) -> bytearray:
    """The encoding of a map of ``lengths`` (chunk size 64 KiB) with fields set: (entry, field) -> value."""
    data = bytearray(encode_lengths(16, lengths))
    for (entry, field), value in changes.get("fields", {}).items():
        at = 16 if entry == "count" else 20 if entry == "blocks" else HEADER.size + entry * ENTRY.size + field
        struct.pack_into("<I", data, at, value)
    return data


@pytest.mark.parametrize("data, where, message", [
    (forged([4096] * 3, fields={("count", 0): 1 << 30}), "blob map header at offset 16", "entries need"),
    (forged([4096] * 3, fields={("count", 0): 0xFFFFFFFF}), "blob map header at offset 16", "entries need"),
    (forged([4096] * 3)[:-1], "blob map header at offset 16", "entries need"),
    (forged([4096] * 3)[:HEADER.size - 1], "blob map header at offset 0", "the header alone"),
    (forged([4096] * 3, fields={("blocks", 0): 2}), "blob map header at offset 16", "cannot fit in 2 blocks"),
    (forged([4096] * 3, fields={(2, 0): 1}), "blob map entry 2 at offset 104", "blkaddr 1, expected 2"),
    (forged([4096] * 3, fields={(0, 0): 5}), "blob map entry 0 at offset 24", "blkaddr 5, expected 0"),
    (forged([4096] * 3, fields={(1, 0): 0, (2, 0): 1}), "blob map entry 1 at offset 64", "expected 1"),
    (forged([4096] * 3, fields={(2, 4): 4097}), "blob map header at offset 20", "the entries fill 4"),
    (forged([4096] * 3, fields={(1, 4): 1 << 17}), "blob map entry 1 at offset 68", "outside 1..65536"),
    (forged([4096] * 3, fields={(1, 4): 0}), "blob map entry 1 at offset 68", "length 0 outside"),
    (forged([4096] * 3, fields={("blocks", 0): 7}), "blob map header at offset 20", "header says 7 blocks"),
], ids=["count-1G", "count-max", "truncated", "no-header", "count-past-blocks", "non-monotonic",
        "first-not-at-0", "overlapping", "length-past-blob", "length-over-chunk", "length-0", "blocks-past-end"])
def test_a_forged_map_is_a_format_error_naming_the_object_and_where(data, where, message):
    with pytest.raises(FormatError, match=message) as info:
        EncodedBlobMap(bytes(data), source=SOURCE)
    assert info.value.where == f"{SOURCE}: {where}"


def million_entry_map() -> bytes:
    """A map of 2**20 entries of 64 KiB chunks (40 MiB), made at C speed."""
    count = 1 << 20
    body = bytearray(count * ENTRY.size)
    words = memoryview(body).cast("I")
    words[0::ENTRY.size // 4] = memoryview(struct.pack(f"<{count}I", *range(0, 16 * count, 16))).cast("I")
    words[1::ENTRY.size // 4] = memoryview(struct.pack("<I", 1 << 16) * count).cast("I")
    for field in range(2, ENTRY.size // 4):  # a digest unlike any other: a different word per entry
        words[field::ENTRY.size // 4] = memoryview(struct.pack(f"<{count}I", *range(field, field + count))).cast("I")
    return header(16, count, 16 * count) + bytes(body)


def test_a_million_entry_map_holds_at_most_1_2x_its_encoding():
    data = million_entry_map()
    tracemalloc.start()
    try:
        blob_map = EncodedBlobMap(data, source=SOURCE)
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(blob_map) == 1 << 20 and blob_map.entries_in(5 << 16, 7 << 16) == range(5, 7)
    # held: what making it allocated and kept, on top of the encoding it reads in place (which open_layer
    # holds anyway); a decoding into tuples held 6x the encoding
    assert held + len(data) <= 1.2 * len(data), held


@pytest.mark.slow
def test_the_read_form_answers_as_the_tuple_decoding_on_the_debian_rootfs(debian_rootfs, tmp_path):
    from dsec_fs.layer import open_layer
    from dsec_fs.store import FilesystemStore
    from erofs_builder.build import build_layer

    store = FilesystemStore(str(tmp_path / "store"))
    for chunk_size in (1 << 20, 1 << 16):
        files = open_layer(store, build_layer(debian_rootfs, store, chunk_size=chunk_size).digest)
        old = TupleDecoding(files.blobmap)
        assert len(old.entries) > 1000
        size = old.blocks * BLOCK_SIZE
        # chunk starts and data ends and the bytes either side, of every 50th chunk, and the blob's end
        probes = sorted({edge + step for blkaddr, _d, length in old.entries[::50]
                         for edge in (blkaddr * BLOCK_SIZE, blkaddr * BLOCK_SIZE + length) for step in (-1, 0, 1)
                         if edge + step >= 0} | {size, size + 1})
        assert_same_answers(files.blobmap, [p for pair in zip(probes, reversed(probes)) for p in pair])
