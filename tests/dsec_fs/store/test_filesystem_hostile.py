"""A directory store on a mount other writers share: what a hostile writer leaves at a key, or in place of
a directory of a key's path, never makes the store read, write, list or unlink outside its root, nor
block a reader. (get_at_most's own cases are in test_conformance.py.)"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsec_fs.errors import CorruptError
from dsec_fs.store import open_store


@pytest.fixture(params=["file", "posix"])
def hostile(request, tmp_path):
    """(store, its root, a directory outside it holding one file) with layers/ab a symlink to outside."""
    root = tmp_path / "store"
    store = open_store(f"{request.param}://{root}", create=True)
    store.put("layers/cd/manifest.json", b"{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_bytes(b"the operator's file")
    os.symlink(outside, root / "layers" / "ab")
    with store:
        yield store, root, outside


def test_a_fifo_at_a_key_is_refused_at_once_not_waited_on(hostile):
    store, root, _outside = hostile
    fifo = root / "layers" / "cd" / "pack"
    os.mkfifo(fifo)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reading = pool.submit(store.get, "layers/cd/pack", 0, 16)
        try:
            with pytest.raises(CorruptError, match="not a regular file") as refused:
                reading.result(timeout=10)
            assert "layers/cd/pack" in refused.value.where
        finally:
            if not reading.done():  # blocked in open: let it go
                os.close(os.open(fifo, os.O_WRONLY))


def test_a_symlink_at_a_key_is_not_read_through(hostile):
    """To /dev/zero a whole-object get would never end; to a file outside it would read that file."""
    store, root, outside = hostile
    os.symlink("/dev/zero", root / "layers" / "cd" / "zero")
    os.symlink(outside / "manifest.json", root / "layers" / "cd" / "out")
    for key in ("layers/cd/zero", "layers/cd/out", "layers/ab/manifest.json"):
        with pytest.raises(CorruptError, match="not an object") as refused:
            store.get(key)
        assert key in refused.value.where
        with pytest.raises(CorruptError, match="not an object"):
            store.size(key)
        assert not store.exists(key)
    assert store.get("layers/cd/manifest.json") == b"{}"


def test_list_does_not_walk_a_symlinked_directory(hostile):
    store, _root, _outside = hostile
    assert list(store.list("layers/ab/")) == []
    assert sorted(store.list("layers/")) == ["layers/cd/manifest.json"]


def test_delete_does_not_unlink_through_a_symlinked_directory(hostile):
    """gc deletes the keys of layers nobody refers to: a symlink at layers/ab must not make it unlink the
    operator's files."""
    store, _root, outside = hostile
    with pytest.raises(CorruptError, match="not an object") as refused:
        store.delete("layers/ab/manifest.json")
    assert "layers/ab/manifest.json" in refused.value.where
    assert (outside / "manifest.json").read_bytes() == b"the operator's file"


def test_put_does_not_write_through_a_symlinked_directory(hostile):
    store, _root, outside = hostile
    for key in ("layers/ab/manifest.json", "layers/ab/new/manifest.json"):
        with pytest.raises(CorruptError, match="not an object") as refused:
            store.put(key, b"from the build")
        assert key in refused.value.where
    assert (outside / "manifest.json").read_bytes() == b"the operator's file"
    assert sorted(os.listdir(outside)) == ["manifest.json"]


def test_put_replaces_a_symlink_at_the_key_inside_the_store(hostile):
    store, root, outside = hostile
    os.symlink(outside / "manifest.json", root / "layers" / "cd" / "blobmap")
    store.put("layers/cd/blobmap", b"the layer's blob map")
    assert store.get("layers/cd/blobmap") == b"the layer's blob map"
    assert not os.path.islink(root / "layers" / "cd" / "blobmap")
    assert (outside / "manifest.json").read_bytes() == b"the operator's file"
