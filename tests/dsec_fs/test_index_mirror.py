"""The local LMDB mirror of a store's pack indexes: incremental syncs, dropping what gc soft-deleted,
rebuilding a damaged mirror, the freshness rule against slow syncs, and the build's check that a lying
mirror cannot make a layer name a chunk its packs do not hold."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from treecmp import write_files

from dsec_fs import compress
from dsec_fs.chunks import ChunkUploader, read_chunk
from dsec_fs.digest import sha256
from dsec_fs.errors import CorruptError
from dsec_fs.dedup_index import OwnPacks, add_to_mirror, load_chunk_index
from dsec_fs.index_mirror import TRUSTED, IndexMirror, mirror_path
from dsec_fs.layer import delete_ref, open_layer
from dsec_fs.pack import PackEntry, decode_index, index_from_pack
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import CountingStore
from erofs_builder.build import build_layer
from tests.dsec_fs.gc_support import CHUNK, PausingStore, assert_all_layers_ok, build, random_bytes, run_gc


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


@pytest.fixture(autouse=True)
def index_root(tmp_path, monkeypatch):
    path = str(tmp_path / "index-mirror")
    monkeypatch.setenv("DSECFS_INDEX_DIR", path)
    return path


def layer_with(store, tmp_path, name: str, seed: int, chunks: int = 4) -> tuple[str, str]:
    """A layer of ``chunks`` random chunks, and the one pack that holds them."""
    digest = build(store, tmp_path / name, {name: random_bytes(seed, chunks * CHUNK)}, f"t/{name}")
    (pack,) = open_layer(store, digest).manifest.packs
    return digest, pack


def chunks_of(store, pack: str) -> list[bytes]:
    return [e.digest for e in decode_index(store.get(keys.index(pack)), source=pack)]


def chunks_of_pack(store, pack: str) -> list[bytes]:
    """From the pack itself, for when its index object is gone."""
    return [e.digest for e in index_from_pack(store.get(keys.pack(pack)), source=pack)]


def test_a_sync_reads_only_the_index_objects_it_has_not_mirrored(store, tmp_path, index_root, monkeypatch):
    _, first = layer_with(store, tmp_path, "one", 1)
    counting = CountingStore(store)
    with IndexMirror.for_store(store, index_root) as mirror:
        assert mirror.pack_ids() == {first}  # the build added its pack already
        stats = mirror.sync(counting)
        assert (stats.listed, stats.fetched, stats.dropped) == (1, 0, 0)
        assert counting.calls.get("get", 0) == 0
        # A pack another host (with its own mirror) uploaded: only its index is read.
        monkeypatch.setenv("DSECFS_INDEX_DIR", str(tmp_path / "elsewhere"))
        _, second = layer_with(store, tmp_path, "two", 2)
        counting.reset()
        stats = mirror.sync(counting)
        assert (stats.listed, stats.fetched) == (2, 1)
        assert counting.calls["get"] == 1 and counting.calls["list"] == 1
        assert mirror.pack_ids() == {first, second}
        for digest in chunks_of(store, second):
            assert [location.pack_id for location in mirror.locations(digest)] == [second]


def test_a_pack_whose_index_disappeared_is_dropped(store, tmp_path, index_root):
    _, gone = layer_with(store, tmp_path, "gone", 1)
    _, kept = layer_with(store, tmp_path, "kept", 2)
    gone_chunks = chunks_of(store, gone)
    store.delete(keys.index(gone))  # what gc's soft delete does
    with IndexMirror.for_store(store, index_root) as mirror:
        assert mirror.locations(gone_chunks[0]) != []  # stale until synced
        stats = mirror.sync(store)
        assert stats.dropped == 1 and mirror.pack_ids() == {kept}
        assert all(mirror.locations(d) == [] for d in gone_chunks)


def test_a_damaged_mirror_is_rebuilt_from_the_store(store, tmp_path, index_root):
    _, pack = layer_with(store, tmp_path, "one", 1)
    path = mirror_path(store.url, index_root)  # a filesystem store's identity is its URL
    data_file = os.path.join(path, "data.mdb")
    with open(data_file, "r+b") as f:
        f.write(os.urandom(8192))
    with load_chunk_index(store) as index:
        assert index.mirror.rebuilt
        assert index.mirror.pack_ids() == {pack}
        assert all(d in index for d in chunks_of(store, pack))


def test_a_mirror_of_another_store_or_version_is_rebuilt(store, tmp_path, index_root):
    _, pack = layer_with(store, tmp_path, "one", 1)
    path = mirror_path(store.url, index_root)
    with IndexMirror("file:///some/other/store", path=path) as foreign:
        assert foreign.rebuilt and foreign.pack_ids() == set()
    with IndexMirror(store.url, path=path) as mirror:
        assert mirror.rebuilt
        mirror.sync(store)
        assert mirror.pack_ids() == {pack}


def test_a_sync_that_began_before_a_newer_one_commits_nothing(store, tmp_path, index_root):
    _, dropped = layer_with(store, tmp_path, "dropped", 1)
    _, other = layer_with(store, tmp_path, "other", 2)
    path = str(tmp_path / "fresh-mirror")
    # The slow sync has listed both indexes and is fetching them when the pause hits.
    slow_store = PausingStore(store, "get", lambda key: key.startswith(keys.INDEX))
    with ThreadPoolExecutor(1) as pool, slow_store, IndexMirror(store.url, path=path) as slow:
        syncing = pool.submit(slow.sync, slow_store)
        assert slow_store.reached.wait(60)
        store.delete(keys.index(dropped))  # gc soft-deletes one of them
        with IndexMirror(store.url, path=path) as fast:
            assert fast.sync(store).fetched == 1
        slow_store.proceed.set()
        stats = syncing.result()
        assert stats.superseded
        assert slow.pack_ids() == {other}  # the slow listing did not bring the dropped pack back
        assert all(slow.locations(d) == [] for d in chunks_of_pack(store, dropped))


def test_an_answer_once_given_stays_for_the_build(store, tmp_path, index_root):
    _, pack = layer_with(store, tmp_path, "one", 1)
    chunk = chunks_of(store, pack)[0]
    with load_chunk_index(store) as index:
        assert index.get(chunk).pack_id == pack
        store.delete(keys.index(pack))
        with IndexMirror.for_store(store, index_root) as other:
            other.sync(store)
            assert other.locations(chunk) == []
        assert chunk in index and index.get(chunk).pack_id == pack


def test_a_second_build_of_the_same_tree_uploads_nothing(store, tmp_path):
    src = write_files(tmp_path / "src", {"a": random_bytes(1, 6 * CHUNK), "b": random_bytes(2, 3 * CHUNK)})
    first = build_layer(src, store, chunk_size=CHUNK)
    packs = set(store.list(keys.PACKS))
    second = build_layer(src, store, chunk_size=CHUNK)
    assert second.digest == first.digest and second.stats.new_chunks == 0
    assert set(store.list(keys.PACKS)) == packs


def test_a_lying_mirror_publishes_nothing_and_is_reset(store, tmp_path, index_root):
    _, pack = layer_with(store, tmp_path, "one", 1)
    secret = random_bytes(99, CHUNK)
    # The mirror claims a chunk the store has never seen is in a pack that really exists.
    with IndexMirror.for_store(store, index_root) as mirror:
        mirror.reset()
        mirror.add_pack(pack, [PackEntry(sha256(secret), 0, 10, CHUNK)])
    src = write_files(tmp_path / "src", {"secret": secret})
    with pytest.raises(CorruptError, match="index mirror"):
        build_layer(src, store, name="t/secret", chunk_size=CHUNK)
    assert not any(key.endswith("manifest.json") and "secret" in key for key in store.list(keys.LAYERS))
    assert "t/secret" not in {key[len(keys.REFS):].split(":")[0] for key in store.list(keys.REFS)}
    result = build_layer(src, store, name="t/secret", chunk_size=CHUNK)
    assert result.stats.new_chunks == 1
    assert_all_layers_ok(store)


def test_a_stale_mirror_entry_for_a_pack_gc_deleted_is_never_used(store, tmp_path):
    old = build(store, tmp_path / "old", {"f": random_bytes(5, 4 * CHUNK)}, "t/old")
    (old_pack,) = open_layer(store, old).manifest.packs
    delete_ref(store, "t/old")
    run_gc(store)
    run_gc(store)  # hard-deleted now, while the mirror still lists it
    assert not store.exists(keys.pack(old_pack))
    new = build(store, tmp_path / "new", {"f": random_bytes(5, 4 * CHUNK), "g": b"more"}, "t/new")
    assert old_pack not in open_layer(store, new).manifest.packs
    assert_all_layers_ok(store)


@pytest.mark.parametrize("spilled", [False, True], ids=["list", "OwnPacks"])
def test_own_packs_are_answered_from_memory_and_mirrored_when_the_caller_says(store, index_root, spilled):
    """A build's own uploads: answered (location and pack) while the index is open, not written to the
    mirror until ``add_to_mirror`` (the build calls it once its tree is freed), then trusted there; the
    build's OwnPacks keeps them in a temporary file meanwhile."""
    pieces = [random_bytes(seed, 3000 + seed) for seed in range(40)]
    deferred = OwnPacks() if spilled else []
    with load_chunk_index(store, own_packs=deferred) as index:
        with ChunkUploader(store, index, pack_target=20_000) as uploader:
            for piece in pieces:
                assert uploader.add(sha256(piece), len(piece), compress.compress(piece))
            packs = uploader.flush()
        assert len(packs) > 1
        for piece in pieces:
            location = index.get(sha256(piece))
            assert read_chunk(store, sha256(piece), location) == piece
            assert index.pack_of(sha256(piece)) == location.pack_id
        assert not uploader.add(sha256(pieces[0]), len(pieces[0]), compress.compress(pieces[0]))
        with IndexMirror.for_store(store, index_root) as mirror:
            assert mirror.pack_ids() == set()
    assert sorted(pack_id for pack_id, _records in deferred) == sorted(packs)
    with IndexMirror.for_store(store, index_root) as mirror:
        assert mirror.pack_ids() == set()
    add_to_mirror(store, deferred)
    with IndexMirror.for_store(store, index_root) as mirror:
        assert mirror.pack_ids() == set(packs)
        assert all(mirror.trust(pack_id) == TRUSTED for pack_id in packs)
    with load_chunk_index(store) as index:  # the next build deduplicates against them without reading them
        assert all(sha256(piece) in index for piece in pieces)
