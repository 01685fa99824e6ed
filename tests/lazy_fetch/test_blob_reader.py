import logging
import os
import random

import pytest
import trio

from dsec_fs.chunks import ChunkIndex
from dsec_fs.digest import to_hex
from dsec_fs.errors import InputError
from dsec_fs.pack import MAX_CHUNK_SIZE
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import CountingStore
from erofs_builder.build import build_layer
from erofs_builder.export import export_layer
from lazy_fetch.blob_reader import LayerBlob, open_layer_blob
from lazy_fetch.cache import ChunkCache
from lazy_fetch.fetcher import FILL, PREFETCH, open_fetcher
from tests.dsec_fs.blobmap_support import TupleDecoding
from tests.dsec_fs.forgery import chunks_of_layer, forge
from tests.lazy_fetch.test_fetcher import GatedStore, until
from treecmp import write_files

CHUNK_SIZE = 16384


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    """A real layer: files whose last chunks end mid-block (padding in the blob), a duplicate, an empty file."""
    root = tmp_path_factory.mktemp("layer")
    source = root / "src"
    source.mkdir()
    rng = random.Random(5)
    for name, size in [("big", 3 * CHUNK_SIZE + 1234), ("small", 100), ("odd", 5000), ("empty", 0)]:
        (source / name).write_bytes(rng.randbytes(size))
    (source / "copy").write_bytes((source / "odd").read_bytes())
    store = FilesystemStore(str(root / "store"), fsync=False)
    digest = build_layer(source, store, chunk_size=CHUNK_SIZE).digest
    blob_path = export_layer(store, digest, root / "export").blob_path
    with open(blob_path, "rb") as f:
        materialised = f.read()
    return store, digest, materialised


def run_with_blob(layer, tmp_path, body):
    """Run ``body(blob, counting_store)`` in trio with a LayerBlob over a fresh cache."""
    store, digest, _ = layer
    counting = CountingStore(store)

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 64 << 20) as cache:
            async with open_fetcher(counting, cache) as fetcher:
                blob = await open_layer_blob(open_layer(store, digest), fetcher, label="test")
                counting.reset()
                return await body(blob, counting)

    return trio.run(main)


def test_whole_blob_is_the_materialised_blob_in_one_get(layer, tmp_path):
    materialised = layer[2]

    async def body(blob, counting):
        assert blob.size == len(materialised)
        assert len(blob.blob_map) == 6  # big: 4 chunks, small, odd (its copy is deduplicated)
        assert await blob.read(0, blob.size) == materialised
        assert counting.calls["get"] == 1  # every chunk is in one pack, next to each other
        assert await blob.read(0, blob.size) == materialised  # now from the cache
        assert counting.calls["get"] == 1

    run_with_blob(layer, tmp_path, body)


def test_ranges_match_the_materialised_blob(layer, tmp_path):
    materialised = layer[2]
    rng = random.Random(1)

    async def body(blob, counting):
        block = blob.blob_map.block_size
        ranges = [(rng.randrange(blob.size), rng.randrange(1, 40000)) for _ in range(50)]
        ranges += [(0, 1), (block - 1, 2), (blob.size - 10, 100), (blob.size - 1, 1)]
        for offset, length in ranges:
            assert await blob.read(offset, length) == materialised[offset:offset + length], (offset, length)

    run_with_blob(layer, tmp_path, body)


def test_past_the_end_and_padding(layer, tmp_path):
    async def body(blob, counting):
        assert await blob.read(blob.size, 10) == b""
        assert await blob.read(blob.size + 4096, 10) == b""
        assert await blob.read(5, 0) == b""
        # The last chunk of "big" ends 1234 bytes into a block; the rest of that block is padding.
        blkaddr, _digest, length = next(entry for entry in blob.blob_map.entries if entry[2] == 1234)
        padding_at = blkaddr * blob.blob_map.block_size + length
        assert blob.chunks_for_range(padding_at, 100) == []
        assert await blob.read(padding_at, 100) == bytes(100)
        assert counting.calls.get("get", 0) == 0  # padding needs no chunk
        with pytest.raises(InputError):
            await blob.read(-1, 10)

    run_with_blob(layer, tmp_path, body)


def test_chunks_for_range_names_the_covering_chunks(layer, tmp_path):
    async def body(blob, counting):
        block = blob.blob_map.block_size
        entries = blob.blob_map.entries
        first, second = entries[0], entries[1]
        last_byte_of_first = first[0] * block + first[2] - 1
        across = blob.chunks_for_range(last_byte_of_first, second[0] * block - last_byte_of_first + 1)
        assert [(chunk.entry, chunk.digest) for chunk in across] == [(0, first[1]), (1, second[1])]
        assert [chunk.entry for chunk in blob.chunks_for_range(0, blob.size)] == list(range(len(entries)))
        assert all(chunk.start == blkaddr * block and chunk.length == length
                   for chunk, (blkaddr, _, length) in zip(blob.chunks_for_range(0, blob.size), entries))

    run_with_blob(layer, tmp_path, body)


def test_shared_chunk_index_is_loaded_once(layer, tmp_path):
    store, digest, _ = layer
    counting = CountingStore(store)

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 64 << 20) as cache:
            async with open_fetcher(counting, cache) as fetcher:
                files = open_layer(store, digest)
                first = await open_layer_blob(files, fetcher)
                index_gets = counting.calls["get"]
                assert index_gets == len(files.manifest.packs)
                second = await open_layer_blob(files, fetcher, chunk_index=first.chunk_index, label="again")
                assert counting.calls["get"] == index_gets
                assert (first.label, second.label) == (digest, "again")

    trio.run(main)


def test_a_miss_brings_the_readahead_it_names_in_the_same_get(layer, tmp_path):
    materialised = layer[2]

    async def body(blob, counting):
        stats = blob.fetcher.stats("test")
        ahead = blob.following(0, 2 * CHUNK_SIZE)  # "big" is four chunks: the two after the first fit
        assert await blob.read(0, 10, readahead=ahead) == materialised[:10]
        assert (counting.calls["get"], stats.readahead) == (1, 2)
        block = blob.blob_map.block_size
        (second, _, _), (third, _, _), (fourth, _, _) = blob.blob_map.entries[1:4]
        assert await blob.read(second * block, CHUNK_SIZE, readahead=blob.following(1, 2 * CHUNK_SIZE)) == \
            materialised[second * block:][:CHUNK_SIZE]
        assert counting.calls["get"] == 1  # the readahead answered it; a hit reads nothing ahead
        await blob.read(third * block, 10)
        assert (counting.calls["get"], stats.readahead) == (1, 2)
        await blob.read(fourth * block, 10, priority=PREFETCH, readahead=blob.following(3, 2 * CHUNK_SIZE))
        assert (counting.calls["get"], stats.readahead) == (2, 2)  # prefetch reads bring nothing along
        last = blob.blob_map.entries[-1][0] * block  # "odd": "small" lies between it and "big"
        await blob.read(last, 1)
        assert (counting.calls["get"], stats.readahead) == (3, 2)
        assert await blob.read(0, blob.size) == materialised
        assert (counting.calls["get"], stats.readahead) == (4, 2)

    run_with_blob(layer, tmp_path, body)


def test_a_shared_index_poisoned_by_a_forged_pack_still_reads_the_layer_right(tmp_path):
    """The daemon's ChunkIndex is shared by every layer of a store; a forger's pack, loaded first, claims
    this layer's chunks (tests/dsec_fs/forgery.py). Reads prefer the layer's own packs; chunks the forged
    pack is first for fall back past it, and the index then answers the working location first."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    rng = random.Random(8)
    victim = build_layer(write_files(tmp_path / "victim", {f"f{i}": rng.randbytes(40000) for i in range(6)}),
                         store, chunk_size=CHUNK_SIZE).digest
    forger = build_layer(write_files(tmp_path / "forger", {"x": b"forger"}), store, chunk_size=CHUNK_SIZE).digest
    forged = forge(store, chunks_of_layer(store, victim), forger)
    materialised = open(export_layer(store, victim, tmp_path / "export").blob_path, "rb").read()
    shared = ChunkIndex()
    shared.load_packs(store, [forged])  # the forger's layer was mounted first
    assert all(shared.get(digest).pack_id == forged for digest, _ in chunks_of_layer(store, victim))

    async def read(cache_dir, make_blob):
        with ChunkCache(str(cache_dir), 64 << 20) as cache:  # a cold cache: every chunk from the store
            async with open_fetcher(store, cache) as fetcher:
                blob = await make_blob(fetcher)
                return await blob.read(0, blob.size)

    async def own_packs_first(fetcher):
        return await open_layer_blob(open_layer(store, victim), fetcher, chunk_index=shared)

    async def no_preference(fetcher):  # falls back chunk by chunk
        return LayerBlob((await own_packs_first(fetcher)).blob_map, shared, fetcher)

    assert trio.run(read, tmp_path / "cache1", own_packs_first) == materialised
    assert any(shared.get(digest).pack_id == forged for digest, _ in chunks_of_layer(store, victim))
    assert trio.run(read, tmp_path / "cache2", no_preference) == materialised
    assert all(shared.get(digest).pack_id != forged for digest, _ in chunks_of_layer(store, victim))


def a_victim_and_a_forger(tmp_path):
    """A layer, and a forger's pack (tests/dsec_fs/forgery.py) claiming its chunks, which a shared index
    loaded first: (store, victim, its chunks, the forged pack, the victim's blob, the shared index)."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    rng = random.Random(9)
    victim = build_layer(write_files(tmp_path / "victim", {f"f{i}": rng.randbytes(40000) for i in range(3)}),
                         store, chunk_size=CHUNK_SIZE).digest
    forger = build_layer(write_files(tmp_path / "forger", {"x": b"forger"}), store, chunk_size=CHUNK_SIZE).digest
    chunks = chunks_of_layer(store, victim)
    forged = forge(store, chunks, forger)
    materialised = open(export_layer(store, victim, tmp_path / "export").blob_path, "rb").read()
    shared = ChunkIndex()
    shared.load_packs(store, [forged])
    return store, victim, chunks, forged, materialised, shared


def test_a_fill_that_kept_a_forgers_frames_is_read_right_from_the_layers_own_pack(tmp_path, caplog):
    """A fill reads from the location the shared index answers first, a forged pack's (tests/dsec_fs/
    forgery.py), and keeps its junk frames unchecked: the first read of each finds it is not the chunk,
    drops it, logs the chunk and the pack, and reads the chunk from the layer's own pack."""
    store, victim, chunks, forged, materialised, shared = a_victim_and_a_forger(tmp_path)

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 64 << 20) as cache:
            async with open_fetcher(store, cache) as fetcher:
                blob = await open_layer_blob(open_layer(store, victim), fetcher, chunk_index=shared)
                await fetcher.warm([(digest, shared.get(digest)) for digest, _ in chunks], priority=FILL,
                                   landed=lambda digest, data, error: None)
                await fetcher.written_down_to(0)
                assert cache.stats().frames == len(chunks)
                assert await blob.read(0, blob.size) == materialised
                await fetcher.written_down_to(0)
                stats = cache.stats()
                assert (stats.bad_frames, stats.frames, stats.entries) == (len(chunks), 0, len(chunks))

    with caplog.at_level(logging.WARNING):
        trio.run(main)
    warnings = [r.getMessage() for r in caplog.records if "is not that chunk" in r.getMessage()]
    assert len(warnings) == len(chunks) and all(keys.pack(forged) in warning for warning in warnings)
    assert all(any(to_hex(digest) in warning for warning in warnings) for digest, _ in chunks)


def test_a_read_that_joins_a_fill_of_a_forgers_frames_in_the_air_is_read_right_from_the_layers_own_pack(tmp_path):
    """The same fill, joined by a reader of the layer while its reads are in the store: the frames it
    brings are checked for the reader, are not the chunks, and the reader reads them from the layer's
    own pack; nothing of the forger's is left in the cache."""
    store, victim, chunks, _forged, materialised, shared = a_victim_and_a_forger(tmp_path)
    gated = GatedStore(store)
    gated.gate.set()
    got = []

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 64 << 20) as cache:
            async with open_fetcher(gated, cache) as fetcher:
                blob = await open_layer_blob(open_layer(store, victim), fetcher, chunk_index=shared)
                gated.gate.clear()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: fetcher.warm([(digest, shared.get(digest)) for digest, _ in chunks],
                                                            priority=FILL, landed=lambda digest, data, error: None))
                    await until(lambda: fetcher.store_reads_running >= 1)

                    async def read():
                        got.append(await blob.read(0, blob.size))

                    nursery.start_soon(read)
                    await until(lambda: fetcher.stats(blob.label).coalesced >= 1)  # it joined the fill's reads
                    gated.gate.set()
                assert got == [materialised]
                await fetcher.written_down_to(0)
                assert (cache.stats().frames, cache.stats().entries) == (0, len(chunks))
                assert await blob.read(0, blob.size) == materialised

    trio.run(main)


FORGED_HUGE_CLAIM_READ = r"""
import os, resource, sys
import trio
from dsec_fs import compress
from dsec_fs.chunks import ChunkIndex
from dsec_fs.digest import sha256
from dsec_fs.errors import FormatError
from dsec_fs.layer import open_layer
from dsec_fs.pack import PackWriter
from dsec_fs.store import FilesystemStore, keys
from erofs_builder.build import build_layer
from lazy_fetch.blob_reader import open_layer_blob
from lazy_fetch.cache import ChunkCache
from lazy_fetch.fetcher import open_fetcher
from tests.dsec_fs.forgery import chunks_of_layer, forge_huge_claim

root = sys.argv[1]
store = FilesystemStore(root + "/store", fsync=False)
data = os.urandom(4096)
os.mkdir(root + "/victim")
with open(root + "/victim/f", "wb") as f:
    f.write(data)
victim = build_layer(root + "/victim", store, chunk_size=16384).digest
[(digest, _length)] = chunks_of_layer(store, victim)
forged = forge_huge_claim(store, digest, int(sys.argv[2]))
writer = PackWriter()  # another writer's honest copy of the chunk, in a pack of its own chunks
other = b"another layer's chunk"
writer.add(sha256(other), compress.compress(other), len(other))
writer.add(digest, compress.compress(data), len(data))
copy, pack_bytes, index_bytes = writer.finish()
assert copy not in open_layer(store, victim).manifest.packs
store.put(keys.pack(copy), pack_bytes)
store.put(keys.index(copy), index_bytes)
shared = ChunkIndex()
for pack_id in (forged, copy):  # the node mounted the forger's and the copier's layers first
    try:
        shared.load_packs(store, [pack_id])
    except FormatError as exc:  # the forger's layer does not mount
        print("refused", keys.index(pack_id) in str(exc), digest.hex() in str(exc))

# The node has less memory than the claim: 768 MiB more address space than it uses now.
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (768 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))

async def main():
    with ChunkCache(root + "/cache", 64 << 20, map_size=64 << 20) as cache:
        async with open_fetcher(store, cache) as fetcher:
            blob = await open_layer_blob(open_layer(store, victim), fetcher, chunk_index=shared)
            [own] = open_layer(store, victim).manifest.packs
            os.rename(os.path.join(store.root, keys.pack(own)), root + "/own-pack")  # the layer's own read fails
            got = await blob.read(0, 4096)
            print(got == data, shared.get(digest).pack_id == copy)
            os.rename(root + "/own-pack", os.path.join(store.root, keys.pack(own)))
            print(await blob.read(0, 4096) == data)

trio.run(main)
"""


@pytest.mark.parametrize("claimed", [1 << 30, MAX_CHUNK_SIZE])
def test_a_read_that_falls_back_past_a_location_claiming_more_than_the_node_has_reads_the_next_one(tmp_path, claimed):
    # A layer's own pack fails (gone, here), so its chunk is read from each other location the shared
    # index knows: first a forger's, whose index claims the 4 KiB chunk is a GiB, with a frame of zeros
    # that says so too; zstd asked for the GiB, which the node does not have (MemoryError, rlimit), and
    # that ended the read, the honest copy after it untried. Now no pack index may claim more than any
    # layer's chunk (the forger's is refused as it is loaded, naming the entry), and a location whose size
    # is not the blob map's is refused unread (a CorruptError naming its pack index): the copy is read.
    import subprocess
    import sys

    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", FORGED_HUGE_CLAIM_READ, str(tmp_path), str(claimed)],
                          capture_output=True, text=True, cwd=project, env={**os.environ, "PYTHONPATH": project},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    refused = ["refused", "True", "True"] if claimed > MAX_CHUNK_SIZE else []
    assert done.stdout.split() == [*refused, "True", "True", "True"], done.stdout


@pytest.mark.slow
def test_the_debian_rootfs_blob_names_the_chunks_the_tuple_decoding_names(debian_rootfs, tmp_path):
    """What a read and a miss's readahead ask of the blob map (chunks_for_range, following), on a real
    layer, against the blob map decoded into tuples as before blobmap13."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    files = open_layer(store, build_layer(debian_rootfs, store, chunk_size=CHUNK_SIZE).digest)
    old = TupleDecoding(files.blobmap)
    rng = random.Random(13)
    size = old.blocks * 4096

    async def main():
        with ChunkCache(str(tmp_path / "cache"), 64 << 20) as cache:
            async with open_fetcher(store, cache) as fetcher:
                blob = await open_layer_blob(files, fetcher, label="test")
                for _ in range(3000):
                    offset, length = rng.randrange(size + 8192), rng.choice([1, 4096, CHUNK_SIZE, 128 << 10])
                    assert [(c.entry, c.digest, c.start, c.length) for c in blob.chunks_for_range(offset, length)] == [
                        (i, old.entries[i][1], old.entries[i][0] * 4096, old.entries[i][2])
                        for i in old.entries_in(offset, offset + length)], (offset, length)
                for last in [*rng.sample(range(len(old.entries)), 200), len(old.entries) - 1]:
                    budget, expected = 1 << 20, []
                    for blkaddr, digest, length in old.entries[last + 1:]:
                        budget -= length
                        if budget < 0:
                            break
                        expected.append(digest)
                    assert [digest for digest, _location in blob.following(last, 1 << 20)] == expected

    assert len(old.entries) > 3000
    trio.run(main)
