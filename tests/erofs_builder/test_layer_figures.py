"""``dsecfs inspect`` reports the layer itself (erofs_builder.layer_figures), not the statistics of the
build that last wrote its manifest: a rebuild that found every chunk stored must not turn it into a
layer of 0 stored bytes."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from treecmp import write_files

from cli.main import main
from dsec_fs.errors import FormatError
from dsec_fs.store import FilesystemStore, keys
from erofs_builder import build_layer
from erofs_builder.layer_figures import layer_figures
from tests.dsec_fs.oversized import BOUNDED, grow, lie_about_meta_size, peak_allocated

CHUNK = 64 * 1024


@pytest.fixture
def trees(tmp_path):
    shared = os.urandom(3 * CHUNK)  # in both trees: three chunks the layers share
    a = write_files(tmp_path / "a", {"shared.bin": shared, "only-a.bin": os.urandom(2 * CHUNK + 100),
                                     "dir/small": b"small file"})
    os.link(os.path.join(a, "dir/small"), os.path.join(a, "dir/small-link"))  # counted once
    b = write_files(tmp_path / "b", {"shared.bin": shared, "only-b.bin": os.urandom(CHUNK)})
    return a, b


def test_inspect_reports_the_layer_and_a_rebuild_does_not_change_it(tmp_path, trees):
    a, b = trees
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    first = build_layer(a, store, name="a:1", chunk_size=CHUNK)
    _files, alone = layer_figures(store, "a:1")
    assert (alone.files, alone.bytes) == (3, 3 * CHUNK + 2 * CHUNK + 100 + len(b"small file"))
    assert (alone.entries, alone.inodes) == (6, 5)  # root, dir, and four names, two of them one file
    assert alone.chunks == first.manifest.stats["distinct_chunks"] == 3 + 3 + 1
    assert alone.stored_bytes == first.manifest.stats["stored_bytes"] > 0  # the first build stored them all
    assert (alone.shared_chunks, alone.own_stored_bytes, alone.other_layers, alone.missing_chunks) == (
        0, alone.stored_bytes, 0, 0)

    again = build_layer(a, store, name="a:1", chunk_size=CHUNK)  # the same layer; its manifest rewritten
    assert again.digest == first.digest and again.manifest.stats["stored_bytes"] == 0
    build_layer(b, store, name="b:1", chunk_size=CHUNK)
    _files, now = layer_figures(store, first.digest[:12])
    assert (now.files, now.bytes, now.chunks, now.stored_bytes) == (alone.files, alone.bytes, alone.chunks,
                                                                     alone.stored_bytes)
    assert now.shared_chunks == 3 and now.other_layers == 1
    assert 0 < now.shared_stored_bytes < now.stored_bytes
    assert now.own_stored_bytes == now.stored_bytes - now.shared_stored_bytes

    shown = CliRunner().invoke(main, ["inspect", "a:1", "--store", store.root, "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert data["figures"] == now.to_dict() and data["build_stats"]["stored_bytes"] == 0
    text = CliRunner().invoke(main, ["inspect", "a:1", "--store", store.root]).stdout
    assert "files       3 (" in text and "shared      3 chunks" in text and "1 other layers" in text


@pytest.mark.parametrize("grown", ["index of its pack", "manifest of another layer"])
def test_inspect_refuses_a_grown_store_object_without_reading_it(tmp_path, trees, grown):
    """A store writer grew an object ``inspect`` reads to 2 GiB (sparse): it reads at most the bound of
    that kind of object, and fails naming the key (before, it read all of it into memory)."""
    a, b = trees
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    layer = build_layer(a, store, name="a:1", chunk_size=CHUNK)
    other = build_layer(b, store, name="b:1", chunk_size=CHUNK)
    key = keys.index(layer.manifest.packs[0]) if grown.startswith("index") else keys.layer_manifest(other.digest)
    grow(store, key)
    with peak_allocated() as peak, pytest.raises(FormatError) as refused:
        layer_figures(store, "a:1")
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated"
    assert key in str(refused.value)
    shown = CliRunner().invoke(main, ["inspect", "a:1", "--store", store.root])
    assert shown.exit_code == FormatError.exit_code and key in shown.output


def test_inspect_reads_no_large_blob_map_another_layers_lying_manifest_vouches_for(tmp_path, trees):
    """``inspect`` reads the other layers' blob maps without their meta.erofs. Before: a manifest giving a
    4 KiB meta.erofs 4 GiB had the 256 MiB map it vouched for decompressed (its size bound rests on
    meta_size). Now a map over 8 MiB is read once meta.erofs is verified: the error names that meta.erofs."""
    a, b = trees
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    build_layer(a, store, name="a:1", chunk_size=CHUNK)
    other = build_layer(b, store, name="b:1", chunk_size=CHUNK)
    lie_about_meta_size(store, other.digest)
    with peak_allocated() as peak, pytest.raises(FormatError) as refused:
        layer_figures(store, "a:1")
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated"
    assert refused.value.where.startswith(keys.layer_meta(other.digest))
