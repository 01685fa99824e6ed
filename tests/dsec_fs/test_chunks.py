import os
import random
import threading
import tracemalloc
from collections import Counter

import pytest

from dsec_fs import compress
from dsec_fs.chunks import MERGE_GAP, ChunkIndex, ChunkUploader, plan_runs, read_chunk, read_chunks, read_run
from dsec_fs.digest import sha256
from dsec_fs.errors import CorruptError, FormatError, IntegrityError, UnavailableError
from dsec_fs.pack import index_from_pack
from dsec_fs.store import FilesystemStore, keys


class CountingStore(FilesystemStore):
    """A real directory store that counts requests by key kind (packs/, index/, ...)."""

    def __init__(self, root):
        super().__init__(str(root), fsync=False)
        self._count_lock = threading.Lock()
        self.puts: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()

    def _write_temp(self, dir_fd, data, key, *, sync):  # every object written, however it was put
        with self._count_lock:
            self.puts[key.split("/")[0]] += 1
        return super()._write_temp(dir_fd, data, key, sync=sync)

    def get(self, key, offset=0, length=None):
        with self._count_lock:
            self.gets[key.split("/")[0]] += 1
        return super().get(key, offset, length)

    def get_at_most(self, key, limit):
        with self._count_lock:
            self.gets[key.split("/")[0]] += 1
        return super().get_at_most(key, limit)


def chunk(n: int, size: int = 4096) -> bytes:
    return random.Random(n).randbytes(size)


def upload(store, chunks, **options) -> tuple[ChunkUploader, ChunkIndex, list[str]]:
    index = ChunkIndex()
    uploader = ChunkUploader(store, index, **options)
    for data in chunks:
        uploader.add(sha256(data), len(data), compress.compress(data))
    return uploader, index, uploader.flush()


@pytest.fixture
def store(tmp_path):
    return CountingStore(tmp_path / "store")


def test_upload_and_read_back(store):
    chunks = [chunk(n) for n in range(40)]
    uploader, index, pack_ids = upload(store, chunks, pack_target=32 * 1024)
    assert len(pack_ids) == uploader.packs > 1
    assert (uploader.new_chunks, uploader.new_bytes) == (40, 40 * 4096)
    assert uploader.stored_bytes == sum(index.get(sha256(c)).clen for c in chunks)
    for data in chunks:
        assert read_chunk(store, sha256(data), index.get(sha256(data))) == data


def test_one_put_per_pack_and_one_per_index(store):
    _, _, pack_ids = upload(store, [chunk(n) for n in range(40)], pack_target=32 * 1024)
    assert store.puts == Counter(packs=len(pack_ids), index=len(pack_ids))
    for pack_id in pack_ids:
        assert store.exists(keys.pack(pack_id)) and store.exists(keys.index(pack_id))


def test_a_fresh_index_loads_from_the_store(store):
    chunks = [chunk(n) for n in range(20)]
    _, written, pack_ids = upload(store, chunks, pack_target=16 * 1024)
    loaded = ChunkIndex()
    assert loaded.load(store) == len(pack_ids)
    assert len(loaded) == len(written) == 20
    for data in chunks:
        assert loaded.get(sha256(data)) == written.get(sha256(data))

    some = ChunkIndex()
    some.load_packs(store, pack_ids[:1])
    assert 0 < len(some) < 20
    assert sha256(b"never stored") not in some


def test_the_index_object_matches_the_packs_own_index(store):
    _, _, pack_ids = upload(store, [chunk(n) for n in range(5)])
    (pack_id,) = pack_ids
    pack = store.get(keys.pack(pack_id))
    assert sha256(pack).hex() == pack_id
    assert len(index_from_pack(pack, source=pack_id)) == 5


def test_same_chunk_twice_is_stored_once(store):
    data = chunk(1)
    index = ChunkIndex()
    uploader = ChunkUploader(store, index)
    assert uploader.add(sha256(data), len(data), compress.compress(data)) is True
    assert uploader.add(sha256(data), len(data), compress.compress(data)) is False
    (pack_id,) = uploader.flush()
    assert uploader.new_chunks == 1
    assert len(index_from_pack(store.get(keys.pack(pack_id)), source=pack_id)) == 1

    # A later session dedups against what the store already holds.
    known = ChunkIndex()
    known.load(store)
    again = ChunkUploader(store, known)
    assert again.add(sha256(data), len(data), compress.compress(data)) is False
    assert again.flush() == []
    assert store.puts["packs"] == 1


def test_a_chunk_is_claimed_once_then_added_by_its_claimer(store):
    data = chunk(2)
    digest = sha256(data)
    index = ChunkIndex()
    uploader = ChunkUploader(store, index)
    assert uploader.claim(digest) is True
    assert uploader.claim(digest) is False  # another thread met it meanwhile: it does not compress it again
    assert uploader.add(digest, len(data), compress.compress(data)) is False
    uploader.add_claimed(digest, len(data), compress.compress(data))
    (pack_id,) = uploader.flush()
    assert uploader.new_chunks == 1
    assert [entry.digest for entry in index_from_pack(store.get(keys.pack(pack_id)), source=pack_id)] == [digest]
    assert uploader.claim(digest) is False  # stored now: the index holds it


def test_claim_many_claims_each_chunk_neither_stored_nor_queued_once(store):
    stored, queued, new = (sha256(b"stored"), sha256(b"queued"), sha256(b"new"))
    index = ChunkIndex()
    uploader = ChunkUploader(store, index)
    uploader.add(stored, 6, compress.compress(b"stored"))
    uploader.flush()
    uploader = ChunkUploader(store, index)
    assert uploader.claim(queued)
    assert uploader.claim_many([stored, queued, new, new]) == [False, False, True, False]
    assert uploader.claim(new) is False


def test_chunks_added_many_at_a_time_fill_packs_as_one_at_a_time(tmp_path):
    """add_claimed_many across pack boundaries gives the packs add_claimed gives, chunk for chunk; and
    compress_many's frames are compress's."""
    chunks = [chunk(n, size=300 + 97 * n) for n in range(60)] + [b"x" * 5000, b"abc" * 999]
    frames = compress.frames_of(compress.compress_many(chunks))
    assert frames == [compress.compress(data) for data in chunks]
    packs = []
    for many in (False, True):
        store = CountingStore(tmp_path / f"store-{many}")
        uploader = ChunkUploader(store, ChunkIndex(), pack_target=8192)
        for data in chunks:
            assert uploader.claim(sha256(data))
        items = [(sha256(data), len(data), frame) for data, frame in zip(chunks, frames)]
        if many:
            uploader.add_claimed_many(items[:25])
            uploader.add_claimed_many(items[25:])
        else:
            for item in items:
                uploader.add_claimed(*item)
        ids = uploader.flush()
        assert len(ids) > 3 and uploader.new_chunks == len(chunks)
        packs.append(sorted(store.get(keys.pack(pack_id)) for pack_id in ids))
    assert packs[0] == packs[1]


def test_concurrent_adds_store_each_chunk_once(store):
    chunks = [chunk(n, size=1024) for n in range(200)]
    frames = [compress.compress(c) for c in chunks]
    index = ChunkIndex()
    uploader = ChunkUploader(store, index, pack_target=8 * 1024)
    accepted = Counter()
    start = threading.Barrier(4)

    def worker(seed):
        order = list(range(len(chunks)))
        random.Random(seed).shuffle(order)
        start.wait()
        for n in order:
            if uploader.add(sha256(chunks[n]), len(chunks[n]), frames[n]):
                accepted[n] += 1  # distinct n per True, so no two threads update the same key

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pack_ids = uploader.flush()

    assert sorted(accepted) == list(range(200)) and set(accepted.values()) == {1}
    assert uploader.new_chunks == 200
    stored = Counter()
    for pack_id in pack_ids:
        for entry in index_from_pack(store.get(keys.pack(pack_id)), source=pack_id):
            stored[entry.digest] += 1
    assert stored == Counter({sha256(c): 1 for c in chunks})
    assert store.puts == Counter(packs=len(pack_ids), index=len(pack_ids))


class GatedStore(FilesystemStore):
    """Holds every pack upload until the test opens the gate (to see that sealed packs are bounded)."""

    def __init__(self, root):
        super().__init__(str(root), fsync=False)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def _write_temp(self, dir_fd, data, key, *, sync):
        if key.startswith(keys.PACKS):
            self.waiting.set()
            self.gate.wait()
        return super()._write_temp(dir_fd, data, key, sync=sync)


def test_sealed_packs_in_flight_are_bounded(tmp_path):
    store = GatedStore(tmp_path / "store")
    uploader = ChunkUploader(store, ChunkIndex(), pack_target=1, upload_threads=1)
    added = []

    def producer():
        for n in range(10):
            data = chunk(n, size=100)
            uploader.add(sha256(data), len(data), compress.compress(data))
            added.append(n)

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        assert store.waiting.wait(10)
        thread.join(0.5)
        # One pack is stuck in its upload, the next one waits for the slot: the producer is held there.
        assert thread.is_alive() and len(added) == 1
    finally:
        store.gate.set()
        thread.join()
    assert len(uploader.flush()) == 10


class FailingStore(FilesystemStore):
    """Fails pack uploads: a store outage a real directory cannot produce on demand (we run as root)."""

    def _write_temp(self, dir_fd, data, key, *, sync):
        if key.startswith(keys.PACKS):
            raise UnavailableError("injected outage", where=key)
        return super()._write_temp(dir_fd, data, key, sync=sync)


def test_an_upload_error_is_raised_by_flush_and_nothing_is_indexed(tmp_path):
    store = FailingStore(str(tmp_path / "store"), fsync=False)
    index = ChunkIndex()
    uploader = ChunkUploader(store, index)
    data = chunk(1)
    uploader.add(sha256(data), len(data), compress.compress(data))
    with pytest.raises(UnavailableError, match="injected outage"):
        uploader.flush()
    assert len(index) == 0
    assert list(store.list(keys.INDEX)) == []


def test_after_an_upload_error_add_fails_fast(tmp_path):
    store = FailingStore(str(tmp_path / "store"), fsync=False)
    uploader = ChunkUploader(store, ChunkIndex(), pack_target=1)
    first, second = chunk(1), chunk(2)
    uploader.add(sha256(first), len(first), compress.compress(first))
    uploader.close()  # waits for the failed upload
    with pytest.raises(UnavailableError):
        uploader.add(sha256(second), len(second), compress.compress(second))


def test_adjacent_chunks_of_a_pack_are_fetched_with_one_get(store):
    chunks = [chunk(n) for n in range(30)]
    _, index, pack_ids = upload(store, chunks)
    store.gets.clear()
    wanted = [(sha256(c), index.get(sha256(c))) for c in chunks]
    random.Random(0).shuffle(wanted)
    got = read_chunks(store, wanted)
    assert got == {sha256(c): c for c in chunks}
    assert store.gets == Counter(packs=len(pack_ids)) == Counter(packs=1)


def test_read_chunks_merges_small_gaps_and_splits_large_ones(store):
    # Random chunks do not compress, so each frame is about as long as its chunk.
    small_gap, large_gap = MERGE_GAP // 2, MERGE_GAP * 2
    chunks = [chunk(0), chunk(1, size=small_gap), chunk(2), chunk(3, size=large_gap), chunk(4)]
    _, index, _ = upload(store, chunks)
    locations = {n: (sha256(c), index.get(sha256(c))) for n, c in enumerate(chunks)}

    store.gets.clear()
    assert read_chunks(store, [locations[0], locations[2]]) == {sha256(chunks[0]): chunks[0],
                                                                sha256(chunks[2]): chunks[2]}
    assert store.gets["packs"] == 1

    store.gets.clear()
    got = read_chunks(store, [locations[0], locations[2], locations[4]])
    assert got[sha256(chunks[4])] == chunks[4]
    assert store.gets["packs"] == 2


def test_read_chunks_spans_packs(store):
    chunks = [chunk(n) for n in range(12)]
    _, index, pack_ids = upload(store, chunks, pack_target=16 * 1024)
    store.gets.clear()
    got = read_chunks(store, [(sha256(c), index.get(sha256(c))) for c in chunks])
    assert got == {sha256(c): c for c in chunks}
    assert store.gets["packs"] == len(pack_ids) > 1


def pack_path(store, pack_id) -> str:
    return os.path.join(store.root, *keys.pack(pack_id).split("/"))


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_in_a_chunk_is_an_integrity_error_naming_the_chunk(store):
    data = chunk(7)  # random bytes: zstd stores them raw, so the flip survives decompression
    _, index, (pack_id,) = upload(store, [data])
    loc = index.get(sha256(data))
    flip_byte(pack_path(store, pack_id), loc.offset + loc.clen // 2)
    for read in (lambda: read_chunk(store, sha256(data), loc), lambda: read_chunks(store, [(sha256(data), loc)])):
        with pytest.raises(IntegrityError) as info:
            read()
        assert sha256(data).hex() in str(info.value) and keys.pack(pack_id) in str(info.value)


def test_a_damaged_frame_header_is_a_corrupt_error_naming_the_chunk(store):
    data = b"compressible " * 500
    _, index, (pack_id,) = upload(store, [data])
    loc = index.get(sha256(data))
    flip_byte(pack_path(store, pack_id), loc.offset)  # zstd magic
    with pytest.raises(CorruptError) as info:
        read_chunk(store, sha256(data), loc)
    assert sha256(data).hex() in str(info.value)


def test_a_truncated_pack_is_a_corrupt_error_naming_the_chunk(store):
    data = chunk(3)
    _, index, (pack_id,) = upload(store, [data])
    loc = index.get(sha256(data))
    os.truncate(pack_path(store, pack_id), loc.offset + loc.clen - 1)
    with pytest.raises(CorruptError) as info:
        read_chunk(store, sha256(data), loc)
    assert sha256(data).hex() in str(info.value)


def test_a_corrupt_index_object_is_a_format_error_naming_its_key(store):
    _, _, (pack_id,) = upload(store, [chunk(1)])
    key = keys.index(pack_id)
    flip_byte(os.path.join(store.root, *key.split("/")), 20)
    with pytest.raises(FormatError) as info:
        ChunkIndex().load(store)
    assert key in str(info.value)


def test_plan_runs_cuts_a_run_at_max_bytes_and_read_run_reads_each(store):
    chunks = [chunk(n) for n in range(6)]  # neighbours: one run without a limit
    _, index, _ = upload(store, chunks)
    wanted = [(sha256(c), index.get(sha256(c))) for c in chunks]
    assert len(plan_runs(wanted)) == 1
    frame = max(location.clen for _, location in wanted)
    runs = plan_runs(wanted, max_bytes=2 * frame)
    assert [len(run.chunks) for run in runs] == [2, 2, 2]
    assert all(run.end - run.start <= 2 * frame for run in runs)
    store.gets.clear()
    got = {}
    for run in runs:
        got.update(read_run(store, run))
    assert got == {sha256(c): c for c in chunks}
    assert store.gets["packs"] == 3
    # A frame longer than the limit still makes a run of its own.
    assert [len(run.chunks) for run in plan_runs(wanted, max_bytes=1)] == [1] * 6


def test_a_pack_index_object_grown_to_a_gib_is_refused_without_reading_it(store):
    """Anyone who writes the store can grow an index object (a sparse GiB here): loading a layer's pack
    indexes reads at most MAX_INDEX_BYTES of one and says which key is wrong; before, all of it was read
    into memory and only then found not to be an index."""
    _uploader, _index, pack_ids = upload(store, [chunk(n) for n in range(4)])
    os.truncate(os.path.join(store.root, *keys.index(pack_ids[0]).split("/")), 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as info:
            ChunkIndex().load_packs(store, pack_ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert keys.index(pack_ids[0]) in str(info.value)
    assert peak < 64 << 20, f"{peak} bytes allocated loading an index of 4 entries"
