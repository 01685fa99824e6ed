"""An honest build in a shared store where one writer lies (issue 14; the forgery is tests/dsec_fs/forgery.py),
on a local store and on S3: it publishes a layer that passes fsck, and deduplicates only against packs
it trusts.
"""

from __future__ import annotations

import os

from dsec_fs.layer import resolve
from dsec_fs.store import open_store
from erofs_builder import build_layer
from erofs_builder.fsck import fsck_layer
from tests.dsec_fs.forgery import CHUNK, chunks_of_files, forge, random_files
from treecmp import write_files


def test_an_honest_build_over_a_forged_index_publishes_a_layer_that_passes_fsck(store_url, tmp_path):
    store = open_store(store_url)
    files = random_files(3)
    forger = build_layer(write_files(tmp_path / "forger", random_files(4, 3)), store, name="forger/app:1",
                         chunk_size=CHUNK).digest
    forged_pack = forge(store, chunks_of_files(files), forger)  # claims the honest build's chunks first

    result = build_layer(write_files(tmp_path / "honest", files), store, name="honest/app:1", chunk_size=CHUNK)
    report = fsck_layer(store, "honest/app:1")
    assert report.ok, report.summary()
    assert report.chunks_verified == report.chunks == len(set(chunks_of_files(files)))
    assert forged_pack not in result.manifest.packs
    assert result.manifest.stats["new_chunks"] == report.chunks  # nothing deduplicated against the forgery

    # A second build of the same files deduplicates against the honest packs, which it trusts without
    # reading them again (this host uploaded them); the forged pack is remembered as such.
    again = build_layer(write_files(tmp_path / "again", files | {"extra": b"x"}), store, chunk_size=CHUNK)
    assert again.manifest.stats["new_chunks"] == 1 and forged_pack not in again.manifest.packs
    assert fsck_layer(store, again.digest).ok
    assert resolve(store, "honest/app:1") == result.digest


def test_a_build_verifies_a_pack_another_host_uploaded_before_deduplicating_against_it(store_url, tmp_path,
                                                                                       monkeypatch):
    """Packs of other hosts are read and hashed once, then trusted: the layer dedups against them."""
    store = open_store(store_url)
    files = random_files(5)
    first = build_layer(write_files(tmp_path / "first", files), store, chunk_size=CHUNK)
    monkeypatch.setenv("DSECFS_INDEX_DIR", str(tmp_path / "other-host-mirror"))  # another host's mirror
    second = build_layer(write_files(tmp_path / "second", files | {"extra": b"y"}), store, chunk_size=CHUNK)
    assert second.manifest.stats["new_chunks"] == 1
    assert set(first.manifest.packs) <= set(second.manifest.packs)
    assert fsck_layer(store, second.digest).ok
    assert os.path.isdir(tmp_path / "other-host-mirror")
