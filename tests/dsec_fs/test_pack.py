import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec_fs import compress
from dsec_fs.digest import sha256
from dsec_fs.errors import ConflictError, FormatError
from dsec_fs.pack import (
    INDEX_ENTRY,
    INDEX_HEADER,
    PACK_TRAILER,
    PackEntry,
    PackWriter,
    decode_index,
    encode_index,
    index_from_pack,
)

SOURCE = "index/ab/abcd"


def make_pack(chunks: list[bytes]) -> tuple[str, bytes, bytes, list[PackEntry]]:
    writer = PackWriter()
    for chunk in chunks:
        writer.add(sha256(chunk), compress.compress(chunk), len(chunk))
    entries = writer.entries
    pack_id, pack, index = writer.finish()
    return pack_id, pack, index, entries


CHUNKS = [b"alpha" * 1000, os.urandom(3000), b"", b"\0" * 65536, b"omega"]
PACK_ID, PACK, INDEX, ENTRIES = make_pack(CHUNKS)


def test_pack_round_trip():
    assert PACK_ID == sha256(PACK).hex()
    assert decode_index(INDEX, source=SOURCE, pack_size=len(PACK)) == ENTRIES
    assert index_from_pack(PACK, source="packs/x") == ENTRIES
    assert encode_index(ENTRIES) == INDEX
    # The pack's own index is byte for byte the separate index object.
    assert PACK[-PACK_TRAILER.size - len(INDEX) : -PACK_TRAILER.size] == INDEX
    for chunk, entry in zip(CHUNKS, ENTRIES):
        assert entry.digest == sha256(chunk)
        frame = PACK[entry.offset : entry.offset + entry.clen]
        assert compress.decompress(frame, entry.ulen, what="test") == chunk


def test_frames_are_back_to_back():
    end = 0
    for entry in ENTRIES:
        assert entry.offset == end
        end += entry.clen
    assert end == len(PACK) - len(INDEX) - PACK_TRAILER.size


def test_writer_counts_and_size():
    writer = PackWriter()
    assert (writer.count, writer.size) == (0, 0)
    writer.add(b"\1" * 32, b"frame-one", 100)
    writer.add(b"\2" * 32, b"two", 50)
    assert (writer.count, writer.size) == (2, 12)


def test_empty_pack_round_trips():
    pack_id, pack, index, entries = make_pack([])
    assert entries == []
    assert index_from_pack(pack, source="p") == []
    assert decode_index(index, source=SOURCE) == []


def test_writer_refuses_the_same_chunk_twice():
    writer = PackWriter()
    writer.add(b"\1" * 32, b"frame", 5)
    with pytest.raises(ConflictError):
        writer.add(b"\1" * 32, b"frame", 5)


def test_chunks_added_many_at_a_time_make_the_pack_added_one_at_a_time():
    frames = [compress.compress(chunk) for chunk in CHUNKS]
    writer = PackWriter()
    writer.add(sha256(b"first"), compress.compress(b"first"), 5)
    writer.add_many([sha256(chunk) for chunk in CHUNKS[:2]], frames[:2], [len(chunk) for chunk in CHUNKS[:2]])
    writer.add_many([sha256(chunk) for chunk in CHUNKS[2:]], frames[2:], [len(chunk) for chunk in CHUNKS[2:]])
    assert (writer.count, writer.size) == (6, len(compress.compress(b"first")) + sum(map(len, frames)))
    assert writer.digests == {sha256(b"first"), *map(sha256, CHUNKS)}
    assert writer.finish() == make_pack([b"first", *CHUNKS])[:3]


@pytest.mark.parametrize("twice", ["in the batch", "added before"])
def test_chunks_added_many_at_a_time_refuse_the_same_chunk_twice_naming_it(twice):
    writer = PackWriter()
    writer.add(b"\1" * 32, b"frame", 5)
    again = b"\2" * 32 if twice == "in the batch" else b"\1" * 32
    with pytest.raises(ConflictError) as info:
        writer.add_many([b"\2" * 32, b"\3" * 32, again], [b"two", b"three", b"again"], [3, 5, 5])
    assert info.value.where == f"chunk {again.hex()}"


@settings(max_examples=300)
@given(position=st.integers(min_value=0, max_value=len(INDEX) - 1), xor=st.integers(min_value=1, max_value=255))
def test_any_flipped_index_byte_is_a_format_error(position, xor):
    data = bytearray(INDEX)
    data[position] ^= xor
    with pytest.raises(FormatError) as info:
        decode_index(bytes(data), source=SOURCE)
    assert SOURCE in str(info.value)


@given(length=st.integers(min_value=0, max_value=len(INDEX) - 1))
def test_any_truncated_index_is_a_format_error(length):
    with pytest.raises(FormatError):
        decode_index(INDEX[:length], source=SOURCE)


@given(extra=st.binary(min_size=1, max_size=100))
def test_trailing_garbage_after_an_index_is_a_format_error(extra):
    with pytest.raises(FormatError):
        decode_index(INDEX + extra, source=SOURCE)


@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_are_a_format_error(data):
    with pytest.raises(FormatError):
        decode_index(data, source=SOURCE)


@settings(max_examples=300)
@given(back=st.integers(min_value=1, max_value=len(INDEX) + PACK_TRAILER.size), xor=st.integers(1, 255))
def test_any_flipped_byte_in_a_packs_index_or_trailer_is_a_format_error(back, xor):
    data = bytearray(PACK)
    data[len(PACK) - back] ^= xor
    with pytest.raises(FormatError):
        index_from_pack(bytes(data), source="packs/x")


@given(length=st.integers(min_value=0, max_value=len(PACK) - 1))
def test_any_truncated_pack_is_a_format_error(length):
    with pytest.raises(FormatError):
        index_from_pack(PACK[:length], source="packs/x")


def entry_offset(number: int) -> int:
    return INDEX_HEADER.size + number * INDEX_ENTRY.size


def test_overlapping_frames_are_rejected_naming_the_entry():
    a, b = ENTRIES[0], ENTRIES[1]
    bad = encode_index([a, b._replace(offset=a.offset + a.clen - 1)])
    with pytest.raises(FormatError) as info:
        decode_index(bad, source=SOURCE)
    assert info.value.offset == entry_offset(1)
    assert "entry 1" in str(info.value) and b.digest.hex() in str(info.value)


def test_entries_out_of_offset_order_are_rejected():
    with pytest.raises(FormatError) as info:
        decode_index(encode_index([ENTRIES[1], ENTRIES[0]]), source=SOURCE)
    assert info.value.offset == entry_offset(1)


def test_duplicate_chunk_is_rejected():
    a = ENTRIES[0]
    with pytest.raises(FormatError, match="already listed as entry 0"):
        decode_index(encode_index([a, a._replace(offset=a.offset + a.clen)]), source=SOURCE)


def test_empty_frame_is_rejected():
    with pytest.raises(FormatError, match="empty frame"):
        decode_index(encode_index([ENTRIES[0]._replace(clen=0)]), source=SOURCE)


def test_a_frame_longer_than_zstd_makes_for_its_chunk_is_rejected_naming_the_entry():
    """A lying index may give a chunk of a few bytes a frame of gigabytes, which a reader would fetch
    whole in one ranged GET (the pack's writer can make the pack that long too)."""
    last = ENTRIES[-1]
    bad = encode_index([*ENTRIES[:-1], last._replace(clen=1 << 30)])  # for a chunk of 5 bytes
    with pytest.raises(FormatError, match="longer than zstd makes") as info:
        decode_index(bad, source=SOURCE)
    assert info.value.offset == entry_offset(len(ENTRIES) - 1) and last.digest.hex() in str(info.value)


def test_a_chunk_bigger_than_any_layers_chunk_is_rejected_naming_the_entry():
    """A forger's index may claim a GiB for a chunk whose frame of zeros declares it: gc's repack, which
    has no blob map to check the claim against, decompressed to it (zstd allocates the size first)."""
    last = ENTRIES[-1]
    bad = encode_index([*ENTRIES[:-1], last._replace(ulen=(1 << 24) + 1)])
    with pytest.raises(FormatError, match="more than any layer's chunk") as info:
        decode_index(bad, source=SOURCE)
    assert info.value.offset == entry_offset(len(ENTRIES) - 1) and last.digest.hex() in str(info.value)
    assert decode_index(encode_index([*ENTRIES[:-1], last._replace(ulen=1 << 24)]), source=SOURCE)[-1].ulen == 1 << 24


@pytest.mark.parametrize("size", [0, 1, 5000, 128 << 10, 1 << 20])
def test_frame_bound_holds_for_incompressible_data(size):
    assert len(compress.compress(os.urandom(size))) <= compress.frame_bound(size)


def test_frame_past_the_end_of_the_pack_is_rejected_when_the_pack_size_is_known():
    last = ENTRIES[-1]
    bad = encode_index([*ENTRIES[:-1], last._replace(clen=last.clen + 1)])
    decode_index(bad, source=SOURCE)  # without the pack size nothing shows the problem
    with pytest.raises(FormatError, match="runs past the frame area") as info:
        decode_index(bad, source=SOURCE, pack_size=len(PACK))
    assert info.value.offset == entry_offset(len(ENTRIES) - 1)


def test_errors_in_a_packs_index_give_pack_offsets():
    data = bytearray(PACK)
    index_at = len(PACK) - PACK_TRAILER.size - len(INDEX)
    data[index_at] ^= 0xFF  # first magic byte
    with pytest.raises(FormatError, match="bad magic") as info:
        index_from_pack(bytes(data), source="packs/x")
    assert info.value.offset == index_at
