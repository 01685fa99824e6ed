"""Incremental builds (build_layer(parent=...)): only changed files are read, the result is the layer a full
build gives, changes that keep size and mtime are still caught, and a parent without usable build info
means reading everything, never a wrong chunk list. Which rebuilds patch the parent (patch.py) and which
take the full path is tested in test_patch.py.

File reads are counted with a Python audit hook on "open" (os.open raises it), so nothing in the build
is replaced. Trees are made once per module and left to age past RACY_NS, because the builder refuses
to trust the identity of a file changed less than RACY_NS before its build (see incremental.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import pytest
from treecmp import assert_same_tree, snapshot

from dsec_fs.errors import FormatError
from dsec_fs.mounts import mounted_erofs
from dsec_fs.store import FilesystemStore, keys
from erofs_builder import build_layer
from erofs_builder.export import export_layer, extract_layer
from erofs_builder.incremental import RACY, RACY_NS, decode_buildinfo
from tests.dsec_fs.oversized import BOUNDED, grow, peak_allocated

CHUNK = 4096
TREES = ("reads-one", "same-size-mtime", "replaced", "corrupt", "missing", "version-1", "chunk-size", "other-store",
         "untouched", "kernel", "grown")

_opened: list[str] | None = None  # paths os.open was called with while counting


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def counting_opens():
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def files_read(opened: list[str], root: str) -> set[str]:
    return {os.path.relpath(path, root) for path in opened if path.startswith(root + os.sep)}


def make_source(root: str) -> None:
    """Files of several chunks, a sparse file, a hard link, a symlink, an empty file."""
    os.makedirs(f"{root}/lib/sub")
    for i in range(6):
        with open(f"{root}/lib/file{i}", "wb") as f:
            f.write(os.urandom(8 * CHUNK + 100 * i))
    with open(f"{root}/lib/sub/big", "wb") as f:
        f.write(os.urandom(16 * CHUNK))
    with open(f"{root}/sparse", "wb") as f:
        f.truncate(32 * CHUNK)
        f.seek(20 * CHUNK)
        f.write(b"data in a hole")
    os.link(f"{root}/lib/file0", f"{root}/hardlink")
    os.symlink("lib/file1", f"{root}/symlink")
    open(f"{root}/empty", "wb").close()


def distinct_mtimes(root: str) -> None:
    """Give every name below ``root`` an mtime of its own. Files made in one clock tick share an mtime,
    which may then be the most common one, the image's build time (layout.py), so that their inodes are
    compact: an edit would then change their form, and a rebuild could not patch its parent (patch.py).
    With distinct mtimes the build time is the root's."""
    names = [os.path.join(top, entry) for top, dirs, files in os.walk(root) for entry in dirs + files]
    for number, path in enumerate(names):
        os.utime(path, ns=(0, 1_400_000_000_000_000_000 + number), follow_symlinks=False)


@pytest.fixture(scope="module")
def aged(tmp_path_factory) -> dict[str, str]:
    """A source tree per test, old enough for its files to be recorded in build info. The roots (but the
    "untouched" one's) are touched last, so the newest ctime each walk sees is recent."""
    base = tmp_path_factory.mktemp("sources")
    roots = {name: str(base / name) for name in TREES}
    for root in roots.values():
        make_source(root)
        distinct_mtimes(root)
    time.sleep(RACY_NS / 1e9 + 0.2)
    for name, root in roots.items():
        if name != "untouched":
            os.chmod(root, 0o755)
    return roots


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def store_bytes(store, prefix: str) -> dict[str, int]:
    return {key: len(store.get(key)) for key in store.list(prefix)}


def edit(path: str, offset: int, data: bytes, *, keep_mtime: bool = False) -> None:
    """Overwrite bytes in place; with ``keep_mtime`` put the old mtime back (as ``touch -d`` would)."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_size == before.st_size
    assert after.st_mtime_ns == before.st_mtime_ns or not keep_mtime


def assert_layer_is(store, digest: str, root: str, tmp_path) -> None:
    out = tmp_path / f"extract-{digest[:8]}"
    extract_layer(store, digest, out)
    assert_same_tree(snapshot(root), snapshot(str(out)))


def test_a_rebuild_reads_only_the_changed_file(aged, store, tmp_path):
    root = aged["reads-one"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    info = decode_buildinfo(store.get(keys.layer_buildinfo(parent.digest)), layer=parent.digest, source="buildinfo")
    assert len(info.paths) == 14  # every name: 3 directories (the root too), 10 regular files, 1 symlink
    assert len(info.trusted_files()) == 9  # every non-empty regular file, once per name
    packs_before = store_bytes(store, "packs/")
    edit(f"{root}/lib/sub/big", 5 * CHUNK + 10, b"changed bytes")

    with counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert files_read(opened, root) == {"lib/sub/big"}
    assert (child.stats.files, child.stats.reused_files) == (9, 8)  # one of 9 inodes read (patch path)
    assert child.stats.new_chunks == 1 and child.stats.new_bytes == CHUNK
    new_packs = {k: v for k, v in store_bytes(store, "packs/").items() if k not in packs_before}
    assert len(new_packs) == 1 and sum(new_packs.values()) < CHUNK + 512  # one random chunk, compressed

    full = build_layer(root, store, chunk_size=CHUNK)
    assert child.digest == full.digest  # the same metadata, blob map and chunks as a full build
    assert_layer_is(store, child.digest, root, tmp_path)


@pytest.mark.root
def test_the_kernel_mounts_a_rebuilt_layer_as_the_source(aged, store, tmp_path):
    root = aged["kernel"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/sparse", 20 * CHUNK, b"DATA IN A HOLE")
    os.truncate(f"{root}/lib/file4", 3 * CHUNK + 1)
    child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert child.stats.reused_files == 6
    exported = export_layer(store, child.digest, tmp_path / "export")
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(exported.meta_path, tmp_path / "mnt", [exported.blob_path]) as mnt:
        assert_same_tree(snapshot(root), snapshot(mnt))


def test_a_change_that_keeps_size_and_mtime_is_read(aged, store, tmp_path):
    root = aged["same-size-mtime"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/lib/file3", 100, b"same size, same mtime", keep_mtime=True)
    with counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert files_read(opened, root) == {"lib/file3"}
    assert child.digest != parent.digest and child.stats.new_chunks == 1
    assert_layer_is(store, child.digest, root, tmp_path)


def test_a_replaced_file_with_the_old_size_and_mtime_is_read(aged, store, tmp_path):
    root = aged["replaced"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    old = os.stat(f"{root}/lib/file2")
    with open(f"{root}/lib/file2.new", "wb") as f:
        f.write(os.urandom(old.st_size))
    os.utime(f"{root}/lib/file2.new", ns=(old.st_atime_ns, old.st_mtime_ns))
    os.rename(f"{root}/lib/file2.new", f"{root}/lib/file2")
    with counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert files_read(opened, root) == {"lib/file2"}
    assert_layer_is(store, child.digest, root, tmp_path)


def test_files_changed_just_before_the_build_are_read_next_time(tmp_path, store):
    root = str(tmp_path / "fresh")
    make_source(root)
    parent = build_layer(root, store, chunk_size=CHUNK)  # every file is younger than RACY_NS: none trusted
    info = decode_buildinfo(store.get(keys.layer_buildinfo(parent.digest)), layer=parent.digest, source="x")
    assert set(info.racy) == {RACY} and not info.trusted_files()
    with counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert len(files_read(opened, root)) == 8 and child.stats.reused_files == 0
    assert child.digest == parent.digest


def test_the_filesystem_clock_decides_too(aged, store):
    """Old files, but nothing in the tree newer than them: the filesystem's clock cannot be shown to have
    moved past them (it may lag ours), so they are not recorded."""
    root = aged["untouched"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    info = decode_buildinfo(store.get(keys.layer_buildinfo(parent.digest)), layer=parent.digest, source="x")
    assert set(info.racy) == {RACY}


@pytest.mark.parametrize("damage", ["corrupt", "missing", "version-1"])
def test_a_parent_without_usable_build_info_means_reading_everything(aged, store, tmp_path, caplog, damage):
    root = aged[damage]
    parent = build_layer(root, store, chunk_size=CHUNK)
    key = keys.layer_buildinfo(parent.digest)
    if damage == "missing":
        store.delete(key)
    else:
        data = bytearray(store.get(key))
        if damage == "corrupt":
            data[-5] ^= 0x40
        else:  # what an older dsecfs wrote: only regular files, without what the patch path needs
            data[8:12] = (1).to_bytes(4, "little")
        store.put(key, bytes(data))
    edit(f"{root}/lib/file1", 0, b"X")
    with caplog.at_level(logging.WARNING, logger="erofs_builder.incremental"), counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert len(files_read(opened, root)) == 8 and child.stats.reused_files == 0
    assert "every file is read" in caplog.text
    assert_layer_is(store, child.digest, root, tmp_path)


def test_a_parent_of_another_chunk_size_lends_nothing(aged, store, caplog):
    root = aged["chunk-size"]
    parent = build_layer(root, store, chunk_size=2 * CHUNK)
    with caplog.at_level(logging.WARNING, logger="erofs_builder.incremental"), counting_opens() as opened:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert len(files_read(opened, root)) == 8 and child.stats.reused_files == 0
    assert "chunk size" in caplog.text
    assert child.digest == build_layer(root, store, chunk_size=CHUNK).digest


def test_chunks_the_store_does_not_hold_are_read_not_borrowed(aged, tmp_path):
    """A parent whose layer objects are in the store but whose chunks are not (copied from elsewhere, or gc'd)."""
    root = aged["other-store"]
    first = FilesystemStore(str(tmp_path / "first"), fsync=False)
    second = FilesystemStore(str(tmp_path / "second"), fsync=False)
    parent = build_layer(root, first, chunk_size=CHUNK)
    for key in first.list(keys.LAYERS):
        second.put(key, first.get(key))
    with counting_opens() as opened:
        child = build_layer(root, second, chunk_size=CHUNK, parent=parent.digest)
    assert len(files_read(opened, root)) == 8 and child.stats.reused_files == 0
    assert child.digest == parent.digest
    assert_layer_is(second, child.digest, root, tmp_path)


def test_build_info_rejects_every_damaged_byte(aged, store):
    parent = build_layer(aged["reads-one"], store, chunk_size=CHUNK)
    data = store.get(keys.layer_buildinfo(parent.digest))
    good = decode_buildinfo(data, layer=parent.digest, source="buildinfo")
    assert good.paths
    for offset in range(len(data)):
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        with pytest.raises(FormatError):
            decode_buildinfo(bytes(damaged), layer=parent.digest, source="buildinfo")
    for cut in (0, 10, 88, len(data) - 1):
        with pytest.raises(FormatError):
            decode_buildinfo(data[:cut], layer=parent.digest, source="buildinfo")
    with pytest.raises(FormatError, match="describes layer"):
        decode_buildinfo(data, layer="0" * 64, source="buildinfo")


def test_a_parent_whose_build_info_a_writer_grew_is_not_read_whole(aged, store, tmp_path, caplog):
    """Build info grown past any a build writes (2 GiB, sparse): the rebuild reads at most its bound
    (incremental.MAX_STORED), warns naming the key and reads every file; before, it read all of it."""
    root = aged["grown"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    key = keys.layer_buildinfo(parent.digest)
    grow(store, key, 2 << 30)
    edit(f"{root}/lib/file1", 0, b"X")
    with caplog.at_level(logging.WARNING, logger="erofs_builder.incremental"), peak_allocated() as peak:
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert peak[0] < BOUNDED, f"{peak[0]} bytes allocated"
    assert child.stats.reused_files == 0 and "every file is read" in caplog.text and key in caplog.text
    assert_layer_is(store, child.digest, root, tmp_path)
