"""gc on real stores: soft then hard deletes, dry runs, grace, leases, repacking, restoring, and builds
racing gc, with the interleavings chosen by pausing a store call (PausingStore), not by timing.

The helpers (build, run_gc, PausingStore, assert_all_layers_ok, ...) are in gc_support.py, shared with
test_index_mirror.py and test_concurrent_builds.py.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner
from treecmp import write_files

from cli.store_cmds import gc_command, store_group
from dsec_fs.errors import ConflictError, CorruptError, InputError
from dsec_fs.layer import delete_ref, open_layer, publish_layer, set_ref
from dsec_fs.leases import Lease, exclusive_lease, list_leases
from dsec_fs.store import FilesystemStore, keys, open_store
from dsec_fs.store.filesystem import TMP_PREFIX
from dsec_fs.store.wrappers import StoreWrapper
from dsec_fs.store_stats import store_stats
from erofs_builder.build import build_layer
from erofs_builder.fsck import fsck_layer
from tests.dsec_fs.gc_support import (
    CHUNK, PausingStore, assert_all_layers_ok, backdate_layer, build, published_layers, random_bytes, run_gc,
)

def pack_ids(store, prefix: str) -> set[str]:
    return {keys.id_from_key(key) for key in store.list(prefix)}


def snapshot(store) -> dict[str, bytes]:
    return {key: store.get(key) for key in store.list("")}


@pytest.fixture(autouse=True)
def index_dir(tmp_path, monkeypatch):
    """Builds keep their index mirror in the test's directory, not in the user's cache."""
    path = str(tmp_path / "index-mirror")
    monkeypatch.setenv("DSECFS_INDEX_DIR", path)
    return path


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request, tmp_path):
    if request.param == "file":
        store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    else:
        store = open_store(request.getfixturevalue("s3_url"))
    with store:
        yield store


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


SHARED = {f"shared/{i}": random_bytes(i, 3 * CHUNK) for i in range(4)}


def three_layers(store, tmp_path) -> dict[str, str]:
    """a and b share SHARED (b dedups it against a's pack); c has only its own chunks."""
    return {
        "a": build(store, tmp_path / "a", {**SHARED, "a-only": random_bytes(100, 5 * CHUNK)}, "t/a"),
        "b": build(store, tmp_path / "b", {**SHARED, "b-only": random_bytes(101, 5 * CHUNK)}, "t/b"),
        "c": build(store, tmp_path / "c", {"c-only": random_bytes(102, 9 * CHUNK)}, "t/c"),
    }


def test_a_deleted_ref_is_soft_deleted_then_hard_deleted(any_store, tmp_path):
    store = any_store
    layers = three_layers(store, tmp_path)
    c_packs = set(open_layer(store, layers["c"]).manifest.packs)
    all_packs = pack_ids(store, keys.PACKS)
    delete_ref(store, "t/c")

    first = run_gc(store)
    assert first.layers_deleted == [layers["c"]]
    assert first.trashed.packs == len(c_packs) and first.deleted.packs == 0
    assert published_layers(store) == {layers["a"], layers["b"]}
    assert pack_ids(store, keys.PACKS) == all_packs  # soft: the packs are still there
    assert pack_ids(store, keys.INDEX) == all_packs - c_packs  # but no build dedups against them
    assert pack_ids(store, keys.TRASH) == c_packs

    second = run_gc(store)
    assert second.deleted.packs == len(c_packs) and second.deleted.bytes > 0
    assert second.trashed.packs == 0 and second.kept.packs == len(all_packs - c_packs)
    assert pack_ids(store, keys.PACKS) == all_packs - c_packs
    assert not pack_ids(store, keys.TRASH)
    assert not list(store.list(keys.GC_LOCKS)) and not list(store.list(keys.LEASES))
    assert_all_layers_ok(store)

    third = run_gc(store)
    assert (third.trashed.packs, third.deleted.packs, third.layers_deleted) == (0, 0, [])


def test_a_dry_run_changes_nothing_and_predicts_the_real_run(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    run_gc(store)  # c's packs now in the trash, waiting for the hard delete
    delete_ref(store, "t/b")  # b's layer dangling, its own pack unreferenced
    stale = {"started": 1.0, "refreshed": 2.0, "host": "gone", "pid": 1, "purpose": "crashed build"}
    store.put(keys.LEASES + "stale", json.dumps(stale).encode())
    temp = os.path.join(store.root, "packs", TMP_PREFIX + "interrupted")
    with open(temp, "wb") as f:
        f.write(b"half a pack")
    os.utime(temp, (time.time() - 2 * 86400,) * 2)
    before = snapshot(store)

    dry = run_gc(store, dry_run=True)
    assert snapshot(store) == before and os.path.exists(temp)
    assert dry.dry_run and dry.layers_deleted == [layers["b"]]
    assert dry.deleted.packs == 1 and dry.trashed.packs == 1
    assert dry.leases_removed == 1 and dry.temp_files_removed == 1

    real = run_gc(store)
    comparable = ("layers_deleted", "trashed", "deleted", "kept", "restored", "leases_removed", "temp_files_removed")
    assert {k: getattr(real, k) for k in comparable} == {k: getattr(dry, k) for k in comparable}
    assert not os.path.exists(temp) and not list(store.list(keys.LEASES))
    assert_all_layers_ok(store)


def test_the_grace_period_keeps_young_things(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    report = run_gc(store, grace_seconds=3600)
    assert report.layers_deleted == [] and report.trashed.packs == 0
    assert layers["c"] in published_layers(store)
    # Once trashed, a pack also waits out the grace period before the hard delete.
    run_gc(store)
    waiting = run_gc(store, grace_seconds=3600)
    assert waiting.deleted.packs == 0 and waiting.waiting.packs == 1


def test_unreferenced_layers_can_be_kept(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    report = run_gc(store, keep_unreferenced_layers=True)
    assert report.layers_deleted == [] and report.trashed.packs == 0
    assert layers["c"] in published_layers(store)
    assert_all_layers_ok(store)


def test_a_live_lease_blocks_the_hard_delete_a_stale_one_does_not(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    backdate_layer(store, layers["c"])
    with Lease(store, purpose="a build that may have seen c's pack"):
        assert run_gc(store).layers_deleted == [layers["c"]]
        blocked = run_gc(store)
        assert blocked.deleted.packs == 0 and blocked.waiting.packs == 1
    old = time.time() - 3 * 86400
    store.put(keys.LEASES + "crashed", json.dumps({"started": old, "refreshed": old, "host": "h", "pid": 1}).encode())
    report = run_gc(store)
    assert report.deleted.packs == 1 and report.leases_removed == 1
    assert not list(store.list(keys.LEASES))


def test_a_lease_protects_a_layer_no_ref_names_yet(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    with Lease(store, purpose="a build that published c and is about to set its ref"):
        report = run_gc(store)
        assert report.layers_deleted == [] and report.trashed.packs == 0
    assert run_gc(store).layers_deleted == [layers["c"]]


def test_an_unreadable_lease_counts_as_live(store, tmp_path):
    three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    run_gc(store)
    store.put(keys.LEASES + "garbled", b"{not json")
    assert run_gc(store).deleted.packs == 0
    store.delete(keys.LEASES + "garbled")
    assert run_gc(store).deleted.packs == 1


def test_only_one_gc_runs_at_a_time(store, tmp_path):
    three_layers(store, tmp_path)
    holder = exclusive_lease(store, keys.GC_LOCKS, purpose="the other gc")
    try:
        with pytest.raises(ConflictError, match="the other gc"):
            run_gc(store)
        assert [lease.key for lease in list_leases(store, keys.GC_LOCKS)] == [holder.key]
        assert run_gc(store, dry_run=True).dry_run  # a dry run writes nothing, so it needs no lock
    finally:
        holder.release()
    run_gc(store)


def test_a_live_pack_that_lost_its_index_is_restored(store, tmp_path):
    layers = three_layers(store, tmp_path)
    (pack,) = open_layer(store, layers["c"]).manifest.packs
    original = store.get(keys.index(pack))
    store.delete(keys.index(pack))
    assert not fsck_layer(store, layers["c"]).ok
    report = run_gc(store)
    assert report.restored.packs == 1 and report.trashed.packs == 0
    assert store.get(keys.index(pack)) == original
    assert_all_layers_ok(store)


def test_a_live_pack_with_a_corrupt_index_is_reindexed_from_the_pack(store, tmp_path):
    layers = three_layers(store, tmp_path)
    (pack,) = open_layer(store, layers["c"]).manifest.packs
    original = store.get(keys.index(pack))
    store.put(keys.index(pack), original[:-1] + bytes([original[-1] ^ 1]))
    report = run_gc(store)
    assert report.restored.packs == 1 and any(keys.index(pack) in p for p in report.problems)
    assert store.get(keys.index(pack)) == original


def test_a_corrupt_manifest_of_a_live_layer_stops_gc_before_any_delete(store, tmp_path):
    layers = three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    store.put(keys.layer_manifest(layers["a"]), b"{}")
    before = snapshot(store)
    with pytest.raises(CorruptError, match="gc stops"):
        run_gc(store)
    del before[keys.layer_manifest(layers["a"])]
    after = snapshot(store)
    del after[keys.layer_manifest(layers["a"])]
    assert after == before


def test_repacking_a_sparse_pack_shrinks_the_store_and_keeps_layers_whole(any_store, tmp_path):
    store = any_store
    big = {f"big/{i}": random_bytes(200 + i, 4 * CHUNK) for i in range(8)}
    a = build(store, tmp_path / "a", big, "t/a")
    b = build(store, tmp_path / "b", {"big/0": big["big/0"], "own": random_bytes(300, 2 * CHUNK)}, "t/b")
    (a_pack,) = open_layer(store, a).manifest.packs
    assert a_pack in open_layer(store, b).manifest.packs  # b dedups one file against a's pack
    delete_ref(store, "t/a")
    stored_before = store_stats(store)["stored_bytes"]

    dry = run_gc(store, dry_run=True)
    assert dry.repacked.packs == 1 and dry.trashed.packs == 1 and a_pack in pack_ids(store, keys.INDEX)

    report = run_gc(store)
    assert report.repacked.packs == 1 and report.written.packs == 1
    assert report.written.bytes < report.repacked.bytes / 4
    b_packs = open_layer(store, b).manifest.packs
    assert a_pack not in b_packs
    assert a_pack in pack_ids(store, keys.TRASH)
    assert_all_layers_ok(store)

    run_gc(store)
    assert a_pack not in pack_ids(store, keys.PACKS)
    stored_after = store_stats(store)["stored_bytes"]
    assert stored_after < stored_before - 6 * 4 * CHUNK
    assert_all_layers_ok(store)
    assert run_gc(store).repacked.packs == 0


def test_old_temporary_files_of_a_filesystem_store_are_removed(store, tmp_path):
    three_layers(store, tmp_path)
    old = os.path.join(store.root, "index", TMP_PREFIX + "old")
    young = os.path.join(store.root, "index", TMP_PREFIX + "young")
    for path in (old, young):
        with open(path, "wb") as f:
            f.write(b"x")
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    report = run_gc(store)
    assert report.temp_files_removed == 1
    assert not os.path.exists(old) and os.path.exists(young)  # young: maybe a put in progress


class _SwappingStore(FilesystemStore):
    """A store whose index/ another writer swaps for a symlink to outside just after gc's walk met a
    temporary file in it (the rename a hostile writer of a shared mount may time to win that race)."""

    outside = ""

    def temp_files(self):
        for path, mtime in super().temp_files():
            index = os.path.join(self.root, "index")
            if not os.path.islink(index):
                os.rename(index, index + ".moved")
                os.symlink(self.outside, index)
            yield path, mtime


def test_gc_removes_no_temporary_file_outside_the_store_whatever_is_swapped_meanwhile(tmp_path):
    store = _SwappingStore(str(tmp_path / "store"), fsync=False)
    store.put("index/ab", b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    for directory in (outside, tmp_path / "store" / "index"):
        path = directory / (TMP_PREFIX + "old")
        path.write_bytes(b"the operator's")
        os.utime(path, (time.time() - 2 * 3600,) * 2)
    store.outside = str(outside)
    run_gc(store)
    assert (outside / (TMP_PREFIX + "old")).read_bytes() == b"the operator's"


def test_bad_options_are_refused(store):
    with pytest.raises(InputError):
        run_gc(store, grace_seconds=-1)
    with pytest.raises(InputError):
        run_gc(store, repack_threshold=1.5)


# -- builds racing gc, each interleaving chosen by pausing one store call


def _old_layer_and_overlapping_tree(store, tmp_path) -> tuple[str, set[str], str]:
    """An unreferenced old layer, and a source tree that shares most of its chunks."""
    old = build(store, tmp_path / "old", SHARED, "t/old")
    old_packs = set(open_layer(store, old).manifest.packs)
    delete_ref(store, "t/old")
    backdate_layer(store, old)
    src = write_files(tmp_path / "new", {**SHARED, "new-only": random_bytes(400, 3 * CHUNK)})
    return old, old_packs, src


def test_a_build_paused_before_its_manifest_survives_two_gc_runs(store, tmp_path):
    old, old_packs, src = _old_layer_and_overlapping_tree(store, tmp_path)
    # The pool exits last: by then the paused call has been let go, even if an assert failed.
    with ThreadPoolExecutor(1) as pool, \
            PausingStore(store, "put", lambda key: key.endswith("/manifest.json")) as paused:
        building = pool.submit(build_layer, src, paused, name="t/new", chunk_size=CHUNK)
        assert paused.reached.wait(60)
        # The build has listed the indexes and uploaded its own pack; its manifest is not out yet.
        first = run_gc(store)
        assert first.layers_deleted == [old]
        assert old_packs <= pack_ids(store, keys.TRASH)  # trashed: the build's dedup source, too
        second = run_gc(store)
        assert second.deleted.packs == 0  # the build's lease began before the trashing
        paused.proceed.set()
        new = building.result().digest
    new_packs = set(open_layer(store, new).manifest.packs)
    assert old_packs <= new_packs
    assert new_packs <= pack_ids(store, keys.INDEX)  # the build restored what gc had soft-deleted
    assert_all_layers_ok(store)
    for _ in range(2):
        report = run_gc(store)
        assert report.deleted.packs == 0 and report.trashed.packs == 0
    assert new_packs <= pack_ids(store, keys.PACKS) & pack_ids(store, keys.INDEX)
    assert not pack_ids(store, keys.TRASH)
    assert_all_layers_ok(store)


def test_a_build_that_listed_indexes_before_a_soft_delete_restores_them_before_publishing(store, tmp_path):
    old, old_packs, src = _old_layer_and_overlapping_tree(store, tmp_path)
    with ThreadPoolExecutor(1) as pool, \
            PausingStore(store, "put", lambda key: key.startswith(keys.PACKS)) as paused:
        building = pool.submit(build_layer, src, paused, name="t/new", chunk_size=CHUNK)
        assert paused.reached.wait(60)  # chunks deduplicated against old's pack; the new one uploading
        assert run_gc(store).trashed.packs == len(old_packs)
        assert not old_packs & pack_ids(store, keys.INDEX)
        paused.proceed.set()
        new = building.result().digest
    assert old_packs <= set(open_layer(store, new).manifest.packs) <= pack_ids(store, keys.INDEX)
    assert_all_layers_ok(store)
    run_gc(store)
    run_gc(store)
    assert_all_layers_ok(store)


class _UploadBetweenListings(StoreWrapper):
    """Puts ``objects`` (key -> bytes, a pack then its index, as an upload does) into the store right
    before gc lists the indexes: the pack is missing from gc's listing of packs, its index is not. A
    timing a real store cannot make on cue."""

    def __init__(self, inner, objects: dict[str, bytes]):
        super().__init__(inner)
        self.objects = objects

    def _call(self, op, key, fn, sent=0):
        if op == "list" and key == keys.INDEX:
            for name, data in self.objects.items():
                self.inner.put(name, data)
            self.objects = {}
        return fn()


def test_gc_leaves_alone_a_pack_uploaded_between_its_listings(store, tmp_path):
    build(store, tmp_path / "kept", {"a": random_bytes(1, 3 * CHUNK)}, "t/kept")
    elsewhere = FilesystemStore(str(tmp_path / "elsewhere"), fsync=False)
    (pack_id,) = open_layer(elsewhere, build(elsewhere, tmp_path / "new", {"b": random_bytes(2, 3 * CHUNK)})).manifest.packs
    upload = {key: elsewhere.get(key) for key in (keys.pack(pack_id), keys.index(pack_id))}
    report = run_gc(_UploadBetweenListings(store, upload))
    assert not report.problems
    assert store.exists(keys.pack(pack_id)) and store.exists(keys.index(pack_id))  # a build may name it yet
    assert run_gc(store).trashed.packs == 1  # the next run sees it whole: unreferenced, so trashed


def test_gc_restores_a_pack_a_layer_published_during_its_sweep_names(store, tmp_path):
    old, old_packs, _src = _old_layer_and_overlapping_tree(store, tmp_path)
    files = open_layer(store, old)
    # gc pauses after deleting the indexes, before its markers and its second look at the manifests.
    with ThreadPoolExecutor(1) as pool, \
            PausingStore(store, "put", lambda key: key.startswith(keys.TRASH)) as paused:
        collecting = pool.submit(run_gc, paused)
        assert paused.reached.wait(60)
        assert not old_packs & pack_ids(store, keys.INDEX)
        # A rebuild of the same layer publishes (without a build's own post-publish check).
        publish_layer(store, files.meta, files.blobmap, files.manifest)
        set_ref(store, "t/again", old)
        paused.proceed.set()
        report = collecting.result()
    assert report.restored.packs == len(old_packs) and report.trashed.packs == 0
    assert old_packs <= pack_ids(store, keys.INDEX) and not pack_ids(store, keys.TRASH)
    assert_all_layers_ok(store)
    assert run_gc(store).deleted.packs == 0
    assert_all_layers_ok(store)


def test_a_rebuild_after_the_soft_delete_does_not_use_the_trashed_pack(store, tmp_path):
    old, old_packs, src = _old_layer_and_overlapping_tree(store, tmp_path)
    run_gc(store)  # old's pack trashed: its index is gone, the mirror must forget it
    new = build_layer(src, store, name="t/new", chunk_size=CHUNK)
    assert not old_packs & set(new.manifest.packs)
    assert new.stats.new_chunks == new.stats.distinct_chunks  # everything uploaded again
    run_gc(store)
    assert not old_packs & pack_ids(store, keys.PACKS)
    assert_all_layers_ok(store)


# -- statistics and the command line


def test_store_stats_counts_layers_chunks_and_dedup(store, tmp_path):
    empty = store_stats(store)
    assert (empty["layers"], empty["packs"], empty["dedup_ratio"]) == (0, 0, None)
    three_layers(store, tmp_path)
    stats = store_stats(store)
    assert (stats["layers"], stats["refs"], stats["packs"], stats["trashed_packs"]) == (3, 3, 3, 0)
    assert stats["chunks"] == 4 * 3 + 5 + 5 + 9
    assert stats["unique_bytes"] == stats["chunks"] * CHUNK
    assert stats["logical_bytes"] == 2 * (12 + 5) * CHUNK + 9 * CHUNK
    assert stats["dedup_ratio"] == round(stats["logical_bytes"] / stats["unique_bytes"], 3) > 1
    assert stats["stored_bytes"] == sum(store.size(k) for k in store.list(keys.PACKS))
    delete_ref(store, "t/c")
    run_gc(store)
    after = store_stats(store)
    assert (after["layers"], after["refs"], after["packs"], after["trashed_packs"]) == (2, 2, 3, 1)
    assert after["chunks"] == stats["chunks"] - 9


def test_the_gc_and_stats_commands(store, tmp_path):
    three_layers(store, tmp_path)
    delete_ref(store, "t/c")
    runner = CliRunner()
    dry = runner.invoke(gc_command, ["--store", store.root, "--grace", "0s", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["trashed"]["packs"] == 1 and pack_ids(store, keys.TRASH) == set()
    real = runner.invoke(gc_command, ["--store", store.root, "--grace", "0s"])
    assert real.exit_code == 0, real.output
    assert "trashed" in real.output and len(pack_ids(store, keys.TRASH)) == 1
    bad = runner.invoke(gc_command, ["--store", store.root, "--grace", "soon"])
    assert bad.exit_code == 2 and "not a duration" in bad.output
    stats = runner.invoke(store_group, ["stats", "--store", store.root, "--json"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["layers"] == 2
    text = runner.invoke(store_group, ["stats", "--store", store.root])
    assert text.exit_code == 0 and "dedup" in text.output
