"""A directory store on a mount other writers share: what a hostile writer leaves at a key, or in place of
a directory of a key's path, never makes the store read, write, list or unlink outside its root, nor
block a reader. (get_at_most's own cases are in test_conformance.py.)"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsec_fs.errors import CorruptError, NotFoundError, UnavailableError
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


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_list_lists_objects_only(hostile):
    """What ``exists`` says is no object (a symlink, a FIFO at a key) is not listed as one either."""
    store, root, outside = hostile
    os.symlink(outside / "manifest.json", root / "layers" / "cd" / "out")
    os.mkfifo(root / "layers" / "cd" / "fifo")
    assert sorted(store.list("layers/")) == ["layers/cd/manifest.json"]


def test_a_tree_deeper_than_any_key_does_not_break_list(hostile):
    """Directories nested thousands deep (another writer's) cost list neither a stack frame nor an fd per
    level: os.fwalk raised RecursionError from list, and gc's walk of the store failed with it."""
    store, root, _outside = hostile
    fd = os.open(root / "layers", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(2000):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        os.close(fd)
        fds = _open_fds()
        assert sorted(store.list("layers/")) == ["layers/cd/manifest.json"]
        assert [path for path, _mtime in store.temp_files()] == []
        assert _open_fds() == fds
    finally:
        subprocess.run(["rm", "-rf", str(root / "layers" / "d")], check=True)  # shutil.rmtree recurses


def test_a_removed_root_is_a_store_error(hostile):
    """An unmounted or removed shared mount: every call is an UnavailableError naming the key, never a raw
    OSError (put raised FileNotFoundError), and list does not pretend the store is empty."""
    store, root, _outside = hostile
    os.rename(root, root.with_name("moved"))
    calls = {"put": lambda: store.put("layers/cd/x", b"x"), "get": lambda: store.get("layers/cd/manifest.json"),
             "size": lambda: store.size("layers/cd/manifest.json"), "list": lambda: list(store.list("layers/")),
             "delete": lambda: store.delete("layers/cd/manifest.json"),
             "get_at_most": lambda: store.get_at_most("layers/cd/manifest.json", 10)}
    for name, call in calls.items():
        with pytest.raises(UnavailableError, match="root") as refused:
            call()
        assert "layers/" in refused.value.where, name


def test_no_fd_is_left_open_by_what_a_hostile_writer_leaves(hostile):
    store, root, outside = hostile
    os.mkfifo(root / "layers" / "cd" / "fifo")
    os.symlink("/dev/zero", root / "layers" / "cd" / "zero")
    (root / "layers" / "cd" / "dir").mkdir()
    fds = _open_fds()
    for key in ("layers/cd/fifo", "layers/cd/zero", "layers/cd/dir", "layers/ab/manifest.json", "layers/cd/none",
                "layers/cd/manifest.json/below", "layers/ab/x/y"):
        for call in (lambda: store.get(key, 0, 1), lambda: store.get_at_most(key, 10), lambda: store.size(key),
                     lambda: store.exists(key), lambda: store.put(key, b"x"), lambda: list(store.list(key + "/")),
                     lambda: store.delete(key)):
            try:
                call()
            except (CorruptError, NotFoundError, UnavailableError):
                pass
    assert _open_fds() == fds
    assert (outside / "manifest.json").read_bytes() == b"the operator's file"
