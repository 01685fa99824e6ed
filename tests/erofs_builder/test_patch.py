"""The patch path of incremental rebuilds (erofs_builder/patch.py): which changes patch the parent's
meta.erofs and blob map, which take the full path, and that either way the rebuilt layer is the one a full
build of the tree gives, byte for byte (the same digest, so the same meta.erofs and blob map), that
`dsecfs fsck`, fsck.erofs and the kernel accept it and that it holds the source tree.

Which path a rebuild took is read from the builder's INFO log. The source trees come from
test_incremental.make_source and are left to age past RACY_NS once per module, like there.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import types

import pytest
from treecmp import assert_same_tree, snapshot, write_files

from dsec_fs.errors import FormatError, NotFoundError, UnavailableError
from dsec_fs import compress
from dsec_fs.blobmap import ENTRY, HEADER, EncodedBlobMap
from dsec_fs.digest import sha256, to_hex
from dsec_fs.layer import open_layer, publish_layer, read_manifest
from dsec_fs.mounts import mounted_erofs
from dsec_fs.store import FilesystemStore, keys
from erofs_builder import build_layer
from erofs_builder.export import export_layer
from erofs_builder.fsck import fsck_layer
from erofs_builder.incremental import _HEADER as BUILDINFO_HEADER
from erofs_builder.incremental import RACY_NS, decode_buildinfo, encode_buildinfo, name_layer
from erofs_builder.ondisk.device_slot import SLOT_SIZE, DeviceSlot
from erofs_builder.patch import _count_inodes
from erofs_builder.reader import ErofsImage
from erofs_builder.writer import seal_image
from tests.erofs_builder.test_incremental import (
    CHUNK, assert_layer_is, counting_opens, distinct_mtimes, edit, files_read, make_source,
)

# change -> what the log gives as the reason
# change -> the reasons the log may give for the full path. A symlink made again under its name is another
# inode, unless the filesystem gave it the number the old one freed: then its directory's change says it.
# A rename or removal moves the directory's mtime too: the scan meets whichever comes first in listing order.
STRUCTURAL = {"chmod": ("another mode",), "xattr": ("xattrs",), "rename": ("cannot stat", "not a regular file"),
              "add": ("not a regular file",), "remove": ("cannot stat", "not a regular file"),
              "symlink": ("another inode", "not a regular file"), "mkdir": ("not a regular file",),
              "touch-dir": ("not a regular file",), "add-put-back": ("other names",),
              "mkdir-put-back": ("other names",)}
TREES = ("content", "other-map", "grow", "boundary", "blocks", "racy", "hole", "shared", "same-chunk", "compact",
         "tie", "hardlink", "chain", "kernel", "forged", "outage", "leases", "twice", "hidden-shared", *STRUCTURAL)
ENTRIES = 14  # names make_source makes, the root included


@pytest.fixture(scope="module")
def aged(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("patch-sources")
    roots = {name: str(base / name) for name in TREES}
    for root in roots.values():
        make_source(root)
    for name in ("shared", "hidden-shared"):
        with open(f"{roots[name]}/lib/twin", "wb") as f:  # the same chunks as lib/file0
            f.write(open(f"{roots[name]}/lib/file0", "rb").read())
    os.symlink("lib", f"{roots['forged']}/lnk")
    for name, root in roots.items():
        distinct_mtimes(root)
        if name in ("compact", "tie", "kernel"):  # three files share the build time: compact inodes
            for file in ("file1", "file2", "file3"):
                os.utime(f"{root}/lib/{file}", ns=(0, 1_500_000_000_000_000_000))
    time.sleep(RACY_NS / 1e9 + 0.2)
    for root in roots.values():
        os.chmod(root, 0o755)  # something newer than every file: see test_incremental
    return roots


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def rebuild(root: str, store, parent, caplog, chunk_size: int = CHUNK):
    """Rebuild ``root`` on ``parent``; check it gives the layer a full build gives. Returns the result and
    whether the parent was patched."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="erofs_builder"):
        child = build_layer(root, store, chunk_size=chunk_size, parent=parent.digest)
    patched = "patched parent layer" in caplog.text
    assert patched != ("rebuilding in full" in caplog.text), caplog.text
    assert child.digest == build_layer(root, store, chunk_size=chunk_size).digest
    return child, patched


def check_layer(store, digest: str, root: str, tmp_path) -> None:
    """fsck (every chunk fetched and hashed), fsck.erofs on the export, and the tree extracted is the source."""
    report = fsck_layer(store, digest)
    assert report.ok, report.problems
    assert_layer_is(store, digest, root, tmp_path)
    if shutil.which("fsck.erofs"):
        exported = export_layer(store, digest, tmp_path / f"export-{digest[:8]}")
        proc = subprocess.run(["fsck.erofs", f"--device={exported.blob_path}", exported.meta_path],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_content_change_is_patched(aged, store, tmp_path, caplog):
    root = aged["content"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/lib/file1", 3 * CHUNK + 7, b"patched in place")
    with counting_opens() as opened:
        child, patched = rebuild(root, store, parent, caplog)
    assert patched
    assert files_read(opened, root) >= {"lib/file1"}  # the full build after it reads everything
    assert child.stats.new_chunks == 1 and child.stats.reused_files == child.stats.files - 1 == 8
    check_layer(store, child.digest, root, tmp_path)
    info = decode_buildinfo(store.get(keys.layer_buildinfo(child.digest)), layer=child.digest, source="x")
    assert len(info.paths) == ENTRIES and info.identities[info.paths.index(b"lib/file1")][4] == os.stat(
        f"{root}/lib/file1").st_ctime_ns


def test_a_parent_whose_manifest_names_another_blob_map_is_not_patched(aged, store, tmp_path, caplog):
    """The patch path reads the parent's blob map in place, not decoded and checked whole, so it checks
    first that the parent's meta.erofs names that map: a manifest rewritten to name another layer's map
    (its digest and size, so open_layer accepts it) sends the rebuild down the full path."""
    root = aged["other-map"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    other = build_layer(write_files(tmp_path / "other", {"f": os.urandom(3 * CHUNK)}), store, chunk_size=CHUNK)
    manifest, theirs = read_manifest(store, parent.digest), read_manifest(store, other.digest)
    store.put(keys.layer_blobmap(parent.digest), store.get(keys.layer_blobmap(other.digest)))
    manifest.blob_id, manifest.blobmap_sha256, manifest.blobmap_size = (
        theirs.blob_id, theirs.blobmap_sha256, theirs.blobmap_size)
    manifest.stored["blobmap"] = theirs.stored["blobmap"]
    store.put(keys.layer_manifest(parent.digest), manifest.to_json())
    edit(f"{root}/lib/file1", 2 * CHUNK + 3, b"edited")
    child, patched = rebuild(root, store, parent, caplog)
    assert not patched and "names another blob map" in caplog.text, caplog.text
    check_layer(store, child.digest, root, tmp_path)


class OutageStore(FilesystemStore):
    """Fails the writes of objects whose key holds ``failing``, once it is set."""

    failing: str | None = None

    def _write_temp(self, dir_fd, data, key, *, sync):
        if self.failing is not None and self.failing in key:
            raise UnavailableError("injected outage", where=key)
        return super()._write_temp(dir_fd, data, key, sync=sync)


@pytest.mark.parametrize("failing", ["/meta.erofs", "/blobmap", "/buildinfo", "/manifest.json", "leases/"])
def test_a_store_failure_on_the_patch_path_publishes_nothing(aged, tmp_path, caplog, failing):
    root = aged["outage"]
    store = OutageStore(str(tmp_path / "store"), fsync=False)
    parent = build_layer(root, store, chunk_size=CHUNK)
    published = set(store.list("layers/"))
    edit(f"{root}/lib/file2", CHUNK + 5, os.urandom(64))
    store.failing = failing
    with pytest.raises(UnavailableError, match="injected outage"):
        build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    new = set(store.list("layers/")) - published
    assert not [key for key in new if key.endswith("/manifest.json")], new
    assert [path for path, _mtime in store.temp_files()] == []
    assert list(store.list("leases/")) == []
    store.failing = None
    child, patched = rebuild(root, store, parent, caplog)
    assert patched
    assert fsck_layer(store, child.digest).ok


def test_a_patched_rebuild_reads_only_the_changed_file(aged, store, caplog):
    root = aged["chain"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    for round_ in range(2):  # a patched layer is a parent like any other
        edit(f"{root}/lib/sub/big", round_ * CHUNK, b"round %d" % round_)
        with counting_opens() as opened, caplog.at_level(logging.INFO, logger="erofs_builder"):
            caplog.clear()
            child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
        assert "patched parent layer" in caplog.text
        assert files_read(opened, root) == {"lib/sub/big"}
        assert child.digest == build_layer(root, store, chunk_size=CHUNK).digest
        parent = child


@pytest.mark.parametrize("new_size", [8 * CHUNK + 250, 8 * CHUNK + 1])
def test_a_file_that_keeps_its_chunk_count_is_patched(aged, store, tmp_path, caplog, new_size):
    root = aged["grow"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    os.truncate(f"{root}/lib/file2", new_size)  # 8 chunks + 200 bytes: grows, or shrinks into chunk 8
    child, patched = rebuild(root, store, parent, caplog)
    assert patched
    check_layer(store, child.digest, root, tmp_path)


def append(path: str, size: int) -> None:
    with open(path, "ab") as f:
        f.write(os.urandom(size))


def copy_a_chunk(root: str) -> None:
    with open(f"{root}/lib/file0", "rb") as f:
        edit(f"{root}/lib/file5", 0, f.read(CHUNK))


def give_three_files_one_mtime(root: str) -> None:
    for file in ("file0", "file4", "file5"):  # three inodes: as many as have the build time (fixture)
        edit(f"{root}/lib/{file}", 1, b"tie")
        os.utime(f"{root}/lib/{file}", ns=(0, 1_600_000_000_000_000_000))


# tree -> (chunk size, the change, what the log gives as the reason). Each keeps every name as it was.
FULL_PATH = {
    "boundary": (CHUNK, lambda root: append(f"{root}/lib/file4", CHUNK), "chunk count"),
    # 8 chunks of 16 KiB + 100 bytes: the last chunk grows to 2 blocks, which would move later chunks
    "blocks": (4 * CHUNK, lambda root: append(f"{root}/lib/file1", CHUNK), "number of blocks"),
    "hole": (CHUNK, lambda root: edit(f"{root}/sparse", 3 * CHUNK, b"data in the first hole"), "hole"),
    # lib/twin's old chunk is lib/file0's too
    "shared": (CHUNK, lambda root: edit(f"{root}/lib/twin", CHUNK, b"one of two copies"), "elsewhere too"),
    "same-chunk": (CHUNK, copy_a_chunk, "holds elsewhere"),
    "tie": (CHUNK, give_three_files_one_mtime, "build time"),
}


@pytest.mark.parametrize("tree", FULL_PATH)
def test_a_change_the_patch_cannot_express_takes_the_full_path(aged, store, tmp_path, caplog, tree):
    root = aged[tree]
    chunk_size, change, reason = FULL_PATH[tree]
    parent = build_layer(root, store, chunk_size=chunk_size)
    change(root)
    child, patched = rebuild(root, store, parent, caplog, chunk_size=chunk_size)
    assert not patched and reason in caplog.text
    check_layer(store, child.digest, root, tmp_path)


@pytest.mark.parametrize("change", STRUCTURAL)
def test_a_structural_change_takes_the_full_path(aged, store, tmp_path, caplog, change):
    root = aged[change]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/lib/file3", 0, b"and a content change")
    if change == "chmod":
        os.chmod(f"{root}/lib/file5", 0o600)
    elif change == "xattr":
        os.setxattr(f"{root}/lib/file5", "user.note", b"new")
    elif change == "rename":
        os.rename(f"{root}/lib/file5", f"{root}/lib/file6")
    elif change == "add":
        with open(f"{root}/lib/sub/new", "wb") as f:
            f.write(b"new file")
    elif change == "remove":
        os.unlink(f"{root}/lib/file5")
    elif change == "symlink":
        os.unlink(f"{root}/symlink")
        os.symlink("lib/file2", f"{root}/symlink")
    elif change == "mkdir":
        os.mkdir(f"{root}/lib/sub/dir")
    elif change == "touch-dir":
        os.utime(f"{root}/lib", ns=(0, 10**18))
    elif change.endswith("-put-back"):  # the directory's mtime is as before, only its ctime shows the change
        mtime_ns = os.stat(f"{root}/lib/sub").st_mtime_ns
        if change == "add-put-back":
            with open(f"{root}/lib/sub/new", "wb") as f:
                f.write(b"new file")
        else:
            os.mkdir(f"{root}/lib/sub/dir")
        os.utime(f"{root}/lib/sub", ns=(0, mtime_ns))
    child, patched = rebuild(root, store, parent, caplog)
    assert not patched and any(reason in caplog.text for reason in STRUCTURAL[change]), caplog.text
    check_layer(store, child.digest, root, tmp_path)


def test_a_same_size_change_in_the_racy_window_is_read(aged, store, tmp_path, caplog):
    """lib/file3 changes just before the parent is built, then again with its size and mtime kept: its
    identity may well look unchanged, but the parent did not trust it, so the rebuild reads it."""
    root = aged["racy"]
    edit(f"{root}/lib/file3", 0, b"first")
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/lib/file3", 0, b"again", keep_mtime=True)
    with counting_opens() as opened, caplog.at_level(logging.INFO, logger="erofs_builder"):
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert "patched parent layer" in caplog.text
    assert files_read(opened, root) == {"lib/file3"}
    assert child.digest == build_layer(root, store, chunk_size=CHUNK).digest
    check_layer(store, child.digest, root, tmp_path)


def test_a_compact_inode_is_patched_only_while_its_mtime_stays(aged, store, tmp_path, caplog):
    """lib/file1-3 share the most common mtime, so their inodes are compact (no mtime of their own)."""
    root = aged["compact"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/lib/file1", 5, b"same size, same mtime", keep_mtime=True)
    child, patched = rebuild(root, store, parent, caplog)
    assert patched
    check_layer(store, child.digest, root, tmp_path)
    edit(f"{root}/lib/file2", 5, b"a new mtime")  # compact -> extended: the layout changes
    child, patched = rebuild(root, store, child, caplog)
    assert not patched and "inode form" in caplog.text
    check_layer(store, child.digest, root, tmp_path)


def test_a_hard_linked_file_is_patched_once(aged, store, tmp_path, caplog):
    root = aged["hardlink"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    edit(f"{root}/hardlink", 2 * CHUNK, b"through the other name")
    with counting_opens() as opened, caplog.at_level(logging.INFO, logger="erofs_builder"):
        child = build_layer(root, store, chunk_size=CHUNK, parent=parent.digest)
    assert "patched parent layer" in caplog.text
    assert len(files_read(opened, root)) == 1 and child.stats.new_chunks == 1
    assert child.digest == build_layer(root, store, chunk_size=CHUNK).digest
    check_layer(store, child.digest, root, tmp_path)


@pytest.mark.root
def test_the_kernel_mounts_a_patched_layer_as_the_source(aged, store, tmp_path, caplog):
    root = aged["kernel"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    # Two files, which may get one new mtime: fewer inodes than the build time has (three).
    edit(f"{root}/lib/file4", 4 * CHUNK - 3, b"across a chunk edge")
    os.truncate(f"{root}/lib/sub/big", 15 * CHUNK + 9)
    child, patched = rebuild(root, store, parent, caplog)
    assert patched
    exported = export_layer(store, child.digest, tmp_path / "export")
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(exported.meta_path, tmp_path / "mnt", [exported.blob_path]) as mnt:
        assert_same_tree(snapshot(root), snapshot(mnt))


@pytest.mark.parametrize("forged", [b"lib/sub/../file1", b"lnk/file1"])
def test_a_forged_build_info_cannot_lead_the_patch_path_outside_the_source(aged, store, tmp_path, caplog, forged):
    """The build info is not covered by the manifest. A path in it that reaches lib/file1 through ".." or
    a symlink (lnk -> lib), recorded with another ctime so that the rebuild must look at it, is not read
    there: the rebuild takes the full path."""
    root = aged["forged"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    key = keys.layer_buildinfo(parent.digest)
    info = decode_buildinfo(store.get(key), layer=parent.digest, source=key)
    entries = list(zip(info.paths, info.identities))
    number = info.paths.index(b"lib/file1")
    dev, ino, size, mtime_ns, ctime_ns, mode = entries[number][1]
    entries[number] = (forged, (dev, ino, size, mtime_ns, ctime_ns - 1, mode))  # the same inode, a suspect
    store.put(key, encode_buildinfo(entries, info.shared, parent.digest, time.time_ns()))
    child, patched = rebuild(root, store, parent, caplog)
    assert not patched and "no name of the source's own" in caplog.text, caplog.text
    check_layer(store, child.digest, root, tmp_path)


@pytest.mark.parametrize("path, message", [
    (b"", "an empty path after the root"), (b"/b", "a path starting with '/'"), (b"b/", "a path ending with '/'"),
    (b"a//b", "an empty path component"), (b"a", "a path appears twice"),
])
def test_build_info_refuses_a_path_no_tree_has(path, message):
    """The parent's paths are what the patch path stats, relative to the source: only paths a scan gives
    are accepted (decode_buildinfo checks the whole path list at once)."""
    layer = "ab" * 32
    identity = (1, 2, 3, 4, 5, 0o100644)
    entries = [(b"", identity), (b"a", identity), (b"a/c", identity), (path, identity), (b"z", identity)]
    with pytest.raises(FormatError, match=message):
        decode_buildinfo(encode_buildinfo(entries, [], layer, 10**19), layer=layer, source="buildinfo")
    entries[3] = (b"a/d", identity)
    assert decode_buildinfo(encode_buildinfo(entries, [], layer, 10**19), layer=layer, source="x").paths[3] == b"a/d"


def test_a_rebuild_leaves_no_lease_whichever_way_it_ends(aged, store, caplog):
    """The patch path's lease and chunk index are taken beside loading the parent and the scan
    (patched_build._lease_and_index): a rebuild that takes the full path, and one whose parent is not published,
    leave no lease behind."""
    root = aged["leases"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    with open(f"{root}/lib/sub/added", "wb") as f:  # a name the parent lacks: the full path
        f.write(b"added")
    child, patched = rebuild(root, store, parent, caplog)
    assert not patched and list(store.list("leases/")) == []
    with pytest.raises(NotFoundError):
        build_layer(root, store, chunk_size=CHUNK, parent="0" * 64)
    assert list(store.list("leases/")) == []
    edit(f"{root}/lib/file2", 1, b"content")
    child, patched = rebuild(root, store, child, caplog)
    assert patched and list(store.list("leases/")) == []


def test_inodes_are_counted_as_the_layout_counts_them():
    """patch._count_inodes: a directory per name, another inode once however many names it has; with
    stop_at, counting stops once an mtime has that many."""
    directory, regular = 0o040755, 0o100644
    identities = [(1, 10, 0, 5, 0, directory), (1, 11, 0, 5, 0, directory),  # two directories
                  (1, 20, 3, 5, 0, regular), (1, 20, 3, 5, 0, regular),  # one file, two names
                  (1, 21, 3, 7, 0, regular), (2, 20, 3, 5, 0, regular)]  # another device: another inode
    assert _count_inodes(identities) == {5: 4, 7: 1}
    assert _count_inodes(identities, stop_at=2)[5] == 2


def forge_parent_naming_a_chunk_twice(store, parent: str, early_file: bytes, late_file: bytes) -> str:
    """Republish layer ``parent`` as a layer whose blob map names the first chunk of ``early_file`` twice:
    at its own entry and at the entry of ``late_file``'s first chunk (one block each, the later entry),
    with meta.erofs's device tag, manifest and build info to match: a layer every reader accepts (a mount
    reads entries by number, every chunk by its digest), whose ``late_file`` reads ``early_file``'s first
    block. Returns its digest."""
    files = open_layer(store, parent)
    blob_map = EncodedBlobMap(files.blobmap, source="test")
    early, late = (blob_map.index_of(sha256(data[:CHUNK])) for data in (early_file, late_file))
    assert early < late
    forged_map = bytearray(files.blobmap)
    at = HEADER.size + late * ENTRY.size + ENTRY.size - len(sha256(b""))
    forged_map[at:at + 32] = blob_map.digest(early)
    meta = bytearray(files.meta)
    image = ErofsImage(files.meta, source="test")
    slot_at = image.superblock.devt_slotoff * SLOT_SIZE
    slot = DeviceSlot.unpack(meta, slot_at)
    slot.tag = to_hex(sha256(forged_map)).encode("ascii")
    meta[slot_at:slot_at + SLOT_SIZE] = slot.pack()
    seal_image(meta)
    digest = to_hex(sha256(meta))
    manifest = read_manifest(store, parent)
    manifest.layer, manifest.stored = digest, {}
    manifest.blob_id = manifest.blobmap_sha256 = to_hex(sha256(forged_map))
    info = name_layer(bytearray(store.get(keys.layer_buildinfo(parent))), digest)
    publish_layer(store, bytes(meta), bytes(forged_map), manifest,
                  also=lambda: (keys.layer_buildinfo(digest), bytes(info)))
    return digest


def test_a_parent_whose_blob_map_names_a_chunk_twice_is_not_patched(aged, store, tmp_path, caplog):
    """A blob map that names a chunk at two entries is accepted by every reader now (blobmap13: each entry
    is read by number), so it can be a rebuild's parent. The patch finds a changed file's old chunk by
    its digest: at the first entry that names it, which may be another file's. Patching that entry gave
    the other file the new bytes and left the changed file as it was, in a layer that fsck passes. Such
    a parent takes the full path."""
    root = aged["twice"]
    early, late = (open(f"{root}/lib/{name}", "rb").read() for name in ("file1", "file2"))
    parent = build_layer(root, store, chunk_size=CHUNK)
    forged = forge_parent_naming_a_chunk_twice(store, parent.digest, early, late)
    assert fsck_layer(store, forged).problems  # fsck reports the chunk named twice
    edit(f"{root}/lib/file2", 0, b"changed where the forged map names file1's chunk")
    child, patched = rebuild(root, store, types.SimpleNamespace(digest=forged), caplog)
    assert not patched and "names chunk" in caplog.text, caplog.text
    check_layer(store, child.digest, root, tmp_path)


def test_a_build_info_that_hides_a_shared_chunk_does_not_get_it_patched(aged, store, tmp_path, caplog):
    """The build info's list of blob-map entries that several chunk indexes name is not covered by the
    manifest: anyone who can write the store can empty it. lib/twin holds lib/file0's chunks (one entry
    each, named by both files); with the list emptied, an edit of lib/twin patched the shared entry and
    the published layer gave lib/file0 (and its hard link) lib/twin's new bytes, and fsck passed it. The
    image is asked how many chunk indexes name a replaced chunk: the full path."""
    root = aged["hidden-shared"]
    parent = build_layer(root, store, chunk_size=CHUNK)
    key = keys.layer_buildinfo(parent.digest)
    data = store.get(key)
    info = decode_buildinfo(data, layer=parent.digest, source=key)
    assert info.shared
    body = bytes(info.records) + bytes(info.racy) + bytes(info.paths_blob)  # no shared entries
    frame = compress.compress(body)
    header = list(BUILDINFO_HEADER.unpack_from(data, 0))
    header[3], header[5], header[6] = 0, len(body), sha256(frame)  # shared count, body size, frame sha256
    store.put(key, BUILDINFO_HEADER.pack(*header) + frame)
    assert decode_buildinfo(store.get(key), layer=parent.digest, source=key).shared == []
    edit(f"{root}/lib/twin", 0, b"changed in lib/twin only")
    child, patched = rebuild(root, store, parent, caplog)
    assert not patched and "another chunk index of the image names too" in caplog.text, caplog.text
    check_layer(store, child.digest, root, tmp_path)


def test_a_change_to_the_blobs_first_chunk_is_patched(store, tmp_path, caplog):
    """The first chunk of the blob is block 0: an inode's link count of 1 followed by zeros spells its
    chunk index's device and blkaddr in every image, where no chunk index stands. Counting every match
    (review13's check) sent such a rebuild, and Debian's of libc (bench_rebuild.py), down the full path;
    only this builder's chunk index at a chunk index's place counts."""
    root = str(tmp_path / "src")
    write_files(root, {"lib/first": os.urandom(CHUNK + 100), "lib/second": os.urandom(3 * CHUNK),
                       "lib/empty": b""})
    distinct_mtimes(root)
    time.sleep(RACY_NS / 1e9 + 0.2)
    os.chmod(root, 0o755)  # newer than every file: see test_incremental
    parent = build_layer(root, store, chunk_size=CHUNK)
    first_chunk = EncodedBlobMap(open_layer(store, parent.digest).blobmap, source="blob map").entry(0)[1]
    assert first_chunk == sha256(open(f"{root}/lib/first", "rb").read(CHUNK))  # lib/first is at block 0
    edit(f"{root}/lib/first", 10, b"changed")
    child, patched = rebuild(root, store, parent, caplog)
    assert patched, caplog.text
    check_layer(store, child.digest, root, tmp_path)
