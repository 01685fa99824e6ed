"""Store objects a lying writer grew to 2 GiB (sparse) are refused by every reader of the store, each
after reading at most its bound (store.base.get_small and the limits next to each object's format), with
an error or a problem naming the key; before, gc, ``store stats``, the index mirror's sync and a build's
check of its packs read each whole into memory. What the layer's own builds depend on is untouched:
gc stops before any delete, or restores the index from its pack; a build restores the index it checks.
"""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from cli.main import main
from dsec_fs.errors import CorruptError, FormatError
from dsec_fs.index_mirror import IndexMirror
from dsec_fs.layer import open_layer, read_blobmap, read_manifest
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import StoreWrapper
from dsec_fs.store_stats import store_stats
from tests.dsec_fs.gc_support import CHUNK, build, random_bytes, run_gc
from tests.dsec_fs.oversized import BOUNDED, grow, lie_about_meta_size, overgrow_blob_map, peak_allocated

FILES = {"a": random_bytes(1, 5 * CHUNK), "b": random_bytes(2, 3 * CHUNK)}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local store, and an index mirror of this test's own for the builds into it."""
    monkeypatch.setenv("DSECFS_INDEX_DIR", str(tmp_path / "index-mirror"))
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def layer_and_pack(store, tmp_path) -> tuple[str, str]:
    digest = build(store, tmp_path / "tree", FILES, "t/a")
    (pack,) = open_layer(store, digest).manifest.packs
    return digest, pack


class KeysSeen(StoreWrapper):
    """The keys of every call made through it."""

    def __init__(self, inner):
        super().__init__(inner)
        self.keys: set[str] = set()

    def _call(self, op, key, fn, sent=0):
        self.keys.add(key)
        return fn()


def objects(store) -> dict[str, int]:
    return {key: store.size(key) for key in store.list("")}


def test_gc_stops_on_a_grown_manifest_of_a_live_layer_and_the_cli_fails(store, tmp_path):
    digest, _pack = layer_and_pack(store, tmp_path)
    key = keys.layer_manifest(digest)
    grow(store, key)
    before = objects(store)
    with peak_allocated() as peak, pytest.raises(CorruptError, match="gc stops") as stopped:
        run_gc(store)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a manifest"
    assert key in str(stopped.value)
    result = CliRunner().invoke(main, ["gc", "--store", store.root, "--grace", "0s"])
    assert result.exit_code == CorruptError.exit_code and key in result.output
    assert objects(store) == before


def test_gc_restores_a_grown_index_from_its_pack(store, tmp_path):
    _digest, pack = layer_and_pack(store, tmp_path)
    original = store.get(keys.index(pack))
    grow(store, keys.index(pack))
    with peak_allocated() as peak:
        report = run_gc(store)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a pack index"
    assert report.restored.packs == 1 and any(keys.index(pack) in p for p in report.problems)
    assert store.get(keys.index(pack)) == original


def test_gc_does_not_read_a_grown_pack_to_restore_its_index(store, tmp_path):
    _digest, pack = layer_and_pack(store, tmp_path)
    store.delete(keys.index(pack))
    grow(store, keys.pack(pack))
    with peak_allocated() as peak:
        report = run_gc(store)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a pack"
    assert any(keys.pack(pack) in p and "over the limit" in p for p in report.problems), report.problems
    assert not store.exists(keys.index(pack))  # nothing indexed from a pack that is not what its id says


def test_gc_dates_a_grown_trash_marker_by_its_store_time(store, tmp_path):
    digest, pack = layer_and_pack(store, tmp_path)
    store.delete(keys.ref("t/a", "latest"))
    run_gc(store)  # the layer unreferenced: its pack trashed
    assert store.exists(keys.trash(pack))
    grow(store, keys.trash(pack))
    with peak_allocated() as peak:
        report = run_gc(store, grace_seconds=3600)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a trash marker"
    assert any(keys.trash(pack) in p and "unreadable trash marker" in p for p in report.problems)
    assert store.exists(keys.pack(pack))  # dated now by its store time: within the grace period, kept


def test_store_stats_counts_grown_objects_as_unreadable(store, tmp_path):
    digest, pack = layer_and_pack(store, tmp_path)
    grow(store, keys.layer_manifest(digest))
    grow(store, keys.index(pack))
    with peak_allocated() as peak:
        stats = store_stats(store)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a manifest and an index"
    assert stats["unreadable_manifests"] == 1 and stats["unreadable_indexes"] == 1
    result = CliRunner().invoke(main, ["store", "stats", "--store", store.root, "--json"])
    assert result.exit_code == 0, result.output


def test_an_index_mirror_sync_skips_a_grown_index(store, tmp_path, caplog):
    _digest, pack = layer_and_pack(store, tmp_path)
    grow(store, keys.index(pack))
    with IndexMirror.for_store(store, str(tmp_path / "another-mirror")) as mirror, peak_allocated() as peak:
        stats = mirror.sync(store)
        assert pack not in mirror.pack_ids()
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a pack index"
    assert stats.unreadable == 1 and keys.index(pack) in caplog.text


def test_a_build_that_dedups_against_a_grown_index_restores_it_from_the_pack(store, tmp_path):
    _digest, pack = layer_and_pack(store, tmp_path)
    original = store.get(keys.index(pack))
    grow(store, keys.index(pack))
    with peak_allocated() as peak:
        again = build(store, tmp_path / "again", {**FILES, "c": random_bytes(3, CHUNK)}, "t/again")
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated for a pack index"
    assert pack in open_layer(store, again).manifest.packs  # it did dedup against it
    assert store.get(keys.index(pack)) == original


def test_a_blob_map_of_more_entries_than_meta_erofs_can_name_is_refused_unread(store, tmp_path):
    """The map reads as sound and the manifest vouches for it (size, sha256, blob blocks): only its size
    against the layer's meta.erofs shows it is more than the layer can need. Refused as corrupt, naming
    the map's key, before the map is read (the store is not asked for it) and by gc's reads too."""
    digest, _pack = layer_and_pack(store, tmp_path)
    meta_size = read_manifest(store, digest).meta_size
    size = overgrow_blob_map(store, digest)
    assert size > 24 + 40 * (meta_size // 8)  # more than one entry per chunk index meta.erofs can hold
    seen = KeysSeen(store)
    with pytest.raises(CorruptError, match="more than the") as info:
        open_layer(seen, digest)
    assert info.value.where == keys.layer_blobmap(digest)
    assert keys.layer_blobmap(digest) not in seen.keys
    with pytest.raises(CorruptError) as info:
        read_blobmap(store, read_manifest(store, digest))
    assert info.value.where == keys.layer_blobmap(digest)


def test_a_manifest_lying_about_meta_size_cannot_have_a_large_blob_map_read(store, tmp_path):
    """The bound on the blob map's size rests on the manifest's meta_size, which only meta.erofs's read
    verifies. A manifest that gives a 4 KiB meta.erofs 4 GiB, and its map 256 MiB (zeros: a 32 KiB zstd
    frame), had the map decompressed side by side with meta.erofs, which then failed: 256 MiB allocated for
    a layer whose meta.erofs can name a few entries (up to 4 GiB so). A map that large is read only once
    meta.erofs is verified: the meta.erofs error, and the map never asked for."""
    digest, _pack = layer_and_pack(store, tmp_path)
    lie_about_meta_size(store, digest)
    seen = KeysSeen(store)
    with peak_allocated() as peak, pytest.raises(FormatError) as info:
        open_layer(seen, digest)
    assert info.value.where.startswith(keys.layer_meta(digest))
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated"
    assert keys.layer_blobmap(digest) not in seen.keys


def test_gc_reads_no_large_blob_map_a_manifest_lying_about_meta_size_vouches_for(store, tmp_path):
    """gc reads a layer's blob map without its meta.erofs. Before: the map's size bound rested on the
    manifest's meta_size unverified, so a manifest giving a 4 KiB meta.erofs 4 GiB had gc decompress the
    256 MiB map it vouched for. Now a map over 8 MiB is read only once meta.erofs is verified: gc reports
    the meta.erofs error, never asks for the map, keeps the layer's packs, and deletes nothing."""
    digest, pack = layer_and_pack(store, tmp_path)
    lie_about_meta_size(store, digest)
    seen = KeysSeen(store)
    before = objects(store)
    with peak_allocated() as peak:
        report = run_gc(seen)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated"
    assert keys.layer_blobmap(digest) not in seen.keys
    assert any(problem.startswith(keys.layer_blobmap(digest)) and keys.layer_meta(digest) in problem
               for problem in report.problems), report.problems
    assert objects(store) == before and store.exists(keys.pack(pack))
