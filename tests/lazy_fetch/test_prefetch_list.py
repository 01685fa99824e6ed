"""prefetch_list.py: learning (threshold, order), scoring (hits, waste, saved waits), the file format and
its validation, and a list learned from real traces over a real layer (test_analysis's)."""

from __future__ import annotations

import json

import pytest

from dsec_fs.digest import sha256
from dsec_fs.errors import FormatError, InputError, IntegrityError, UnsupportedError
from dsec_fs.blobmap import BlobMap, EncodedBlobMap
from lazy_fetch.analysis import learn_prefetch_list
from lazy_fetch.prefetch_list import ChunkUse, Wait, evaluate, learn, load, save
from tests.lazy_fetch.analysis_support import CHUNK, CHUNK_BYTES, WORKLOAD, Read, write_trace

LENGTHS = [5000, 8192, 100, 65536, 777]


def read_form(blob_map: BlobMap) -> EncodedBlobMap:
    return EncodedBlobMap(blob_map.encode(), source="blobmap")


@pytest.fixture
def blob_map() -> EncodedBlobMap:
    blob_map = BlobMap(CHUNK)
    for i, length in enumerate(LENGTHS):
        blob_map.add(sha256(b"chunk %d" % i), length)
    return read_form(blob_map)


# First-read times (ns) of blob-map entries in three traces.
USES = [
    ChunkUse(first_read={0: 5000, 1: 10000, 2: 20000}),
    ChunkUse(first_read={1: 3000, 0: 8000, 3: 1000}),
    ChunkUse(first_read={0: 7000, 4: 2000}),
]
LAYER = "cd" * 32


@pytest.mark.parametrize("min_fraction, chunks", [
    (1.0, [0]),  # only chunk 0 is read by all three
    (0.5, [1, 0]),  # read by two or more; chunk 1's median first read (3 us) comes before chunk 0's (7 us)
    (0.0, [3, 4, 1, 0, 2]),  # every chunk read at all, by median first-read time
])
def test_learn_keeps_chunks_enough_traces_read_in_first_read_order(blob_map, min_fraction, chunks):
    plist = learn(USES, blob_map, layer=LAYER, min_fraction=min_fraction)
    assert [e.chunk for e in plist.entries] == chunks
    assert plist.traces == 3 and plist.layer == LAYER and plist.chunk_size == CHUNK
    assert plist.bytes == sum(LENGTHS[c] for c in chunks)
    first = plist.entries[0]
    blkaddr, digest, length = blob_map.entries[first.chunk]
    assert (first.offset, first.digest, first.length) == (blkaddr * 4096, digest, length)


def test_learn_records_median_time_and_readers(blob_map):
    plist = learn(USES, blob_map, layer=LAYER, min_fraction=0.5)
    assert [(e.chunk, e.first_read_us, e.traces) for e in plist.entries] == [(1, 3, 2), (0, 7, 3)]


def test_learn_refuses_a_fraction_outside_0_1(blob_map):
    with pytest.raises(InputError):
        learn(USES, blob_map, layer=LAYER, min_fraction=1.5)


def test_evaluate_counts_hits_waste_and_saved_waits(blob_map):
    plist = learn(USES, blob_map, layer=LAYER, min_fraction=0.5)  # chunks 1 and 0
    held_out = ChunkUse(first_read={0: 100, 2: 200}, waits=[
        Wait(end_ns=100, latency_us=100, nid=5, entries=(0,)),  # all on the list: saved
        Wait(end_ns=200, latency_us=200, nid=5, entries=(0, 2)),  # chunk 2 is not: not saved
        Wait(end_ns=300, latency_us=50, nid=5, entries=()),  # needed no chunk (a hole): not saved
    ])
    score = evaluate(plist, [held_out, ChunkUse(first_read={1: 1})], blob_map)
    assert score.traces == 2 and score.list_chunks == 2 and score.list_bytes == 5000 + 8192
    assert score.needed_bytes == 5000 + 100 + 8192
    assert score.hit_bytes == 5000 + 8192
    assert score.wasted_bytes == 2 * (5000 + 8192) - (5000 + 8192)
    assert score.coverage == (5000 + 8192) / (5000 + 100 + 8192)
    assert score.precision == 0.5
    assert (score.waits, score.wait_us, score.saved_waits, score.saved_wait_us) == (3, 350, 1, 100)
    assert score.saved_wait_fraction == 100 / 350


def test_save_load_round_trip_and_verify(tmp_path, blob_map):
    plist = learn(USES, blob_map, layer=LAYER, min_fraction=0.0)
    path = tmp_path / "list.json"
    save(plist, path)
    loaded = load(path)
    assert loaded == plist
    loaded.verify(blob_map, layer=LAYER)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_verify_refuses_another_layer_or_blob_map(tmp_path, blob_map):
    plist = learn(USES, blob_map, layer=LAYER, min_fraction=0.0)
    with pytest.raises(IntegrityError, match="not " + "ef" * 32):
        plist.verify(blob_map, layer="ef" * 32)
    other = BlobMap(CHUNK)
    for i, length in enumerate(LENGTHS):
        other.add(sha256(b"other %d" % i), length)
    with pytest.raises(IntegrityError, match="entry 0"):
        plist.verify(read_form(other), layer=LAYER)
    short = BlobMap(CHUNK)
    short.add(sha256(b"chunk 0"), LENGTHS[0])
    with pytest.raises(IntegrityError, match="past the blob map"):
        plist.verify(read_form(short), layer=LAYER)


def _saved(tmp_path, blob_map) -> tuple[dict, str]:
    path = tmp_path / "list.json"
    save(learn(USES, blob_map, layer=LAYER, min_fraction=0.0), path)
    return json.loads(path.read_text()), str(path)


@pytest.mark.parametrize("damage, message", [
    (lambda o: o.update(format="something else"), "not a prefetch list"),
    (lambda o: o.update(layer="XYZ"), "field 'layer'"),
    (lambda o: o.update(chunk_size=12345), "chunk size must be a power of two"),
    (lambda o: o.update(min_fraction=2), "field 'min_fraction'"),
    (lambda o: o.pop("entries"), "field 'entries'"),
    (lambda o: o["entries"][2].update(offset=123), "entry 2: offset 123 is not block aligned"),
    (lambda o: o["entries"][1].update(length=0), "entry 1: length 0"),
    (lambda o: o["entries"][0].update(digest="00"), "entry 0: digest"),
    (lambda o: o["entries"][0].pop("traces"), "entry 0: expected an object"),
    (lambda o: o["entries"][3].update(chunk=o["entries"][0]["chunk"]), "entry 3: chunk 3 is already entry 0"),
    (lambda o: o["entries"][0].update(traces=9), "entry 0: read by 9 traces of the 3"),
])
def test_load_names_the_file_and_entry_at_fault(tmp_path, blob_map, damage, message):
    obj, path = _saved(tmp_path, blob_map)
    damage(obj)
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(FormatError, match=message) as info:
        load(path)
    assert path in str(info.value)


def test_load_truncated_or_newer_files(tmp_path, blob_map):
    obj, path = _saved(tmp_path, blob_map)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(FormatError, match="not JSON") as info:
        load(path)
    assert path in str(info.value)
    obj["version"] = 2
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(UnsupportedError, match="version 2"):
        load(path)


def test_learned_from_traces_of_a_real_layer(layers, tmp_path):
    base = layers.base
    paths = [write_trace(tmp_path / f"t{i}.dtr", base, WORKLOAD + (
        [Read("usr/share/doc/unread", 0, 7000, 9000)] if i == 0 else [])) for i in range(3)]
    plist = learn_prefetch_list(paths, layers.store, min_fraction=0.5)
    assert plist.layer == base.digest and plist.traces == 3 and plist.bytes == CHUNK_BYTES
    # Chunks in first-read order: tool's four, libbig's (0, 1, then 8, 9), conf, sparse's two, readme.
    expected = ([("bin/tool", k) for k in range(4)] + [("lib/libbig.so", k) for k in (0, 1, 8, 9)]
                + [("etc/conf", 0), ("data/sparse", 0), ("data/sparse", 2), ("usr/share/doc/readme", 0)])
    assert [e.chunk for e in plist.entries] == [base.entry(path, k) for path, k in expected]
    plist.verify(base.blob_map, layer=base.digest)
    with pytest.raises(InputError, match="more than one layer"):
        learn_prefetch_list(paths + [write_trace(tmp_path / "w.dtr", layers.workspace, [])], layers.store)
