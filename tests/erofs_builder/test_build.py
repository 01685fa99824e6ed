"""build_layer / build_tree end to end on a real directory store: what gets published, dedup across
builds, and that a failed build publishes nothing."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest
from treecmp import assert_same_tree, snapshot, write_files

from dsec_fs.chunks import ChunkIndex, read_chunk
from dsec_fs.errors import InputError, UnavailableError
from dsec_fs.layer import Manifest, open_layer, read_blobmap, read_meta, resolve
from dsec_fs import mounts
from dsec_fs.mounts import mounted_erofs
from dsec_fs.spill import SpillFile
from dsec_fs.store import FilesystemStore
from dsec_fs.store import keys as store_keys
from erofs_builder import build_layer, build_tree, walk_directory
from erofs_builder.export import export_layer
from erofs_builder.fsck import fsck_layer
from dsec_fs.blobmap import BLOCK_SIZE, EncodedBlobMap

CHUNK = 4096


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def materialize_blob(store, blob_map: EncodedBlobMap, path) -> None:
    """Write the virtual blob as a plain file, the way the node daemon serves it."""
    index = ChunkIndex()
    index.load(store)
    with open(path, "wb") as f:
        f.truncate(blob_map.blocks * BLOCK_SIZE)
        for blkaddr, digest, _length in blob_map.entries:
            f.seek(blkaddr * BLOCK_SIZE)
            f.write(read_chunk(store, digest, index.get(digest)))


def keys(store, prefix: str) -> set[str]:
    return set(store.list(prefix))


SHARED = os.urandom(3 * CHUNK)


def test_build_publishes_a_layer_and_its_ref(tmp_path, store):
    src = write_files(tmp_path / "src", {"a": SHARED, "d/b": b"small", "zero": bytes(2 * CHUNK)})
    progress = []
    result = build_layer(src, store, name="test/layer:1", chunk_size=CHUNK,
                         progress=lambda done, total: progress.append((done, total)))

    assert resolve(store, "test/layer:1") == result.digest
    layer = open_layer(store, result.digest)
    assert layer.manifest == result.manifest
    blob_map = EncodedBlobMap(layer.blobmap, source="blobmap")
    assert blob_map.blob_id == result.manifest.blob_id
    assert result.manifest.blob_blocks == blob_map.blocks == 4
    assert result.manifest.chunk_size == CHUNK and result.manifest.source == src
    assert result.manifest.packs == sorted(k.rsplit("/", 1)[1] for k in keys(store, "packs/"))
    assert result.manifest.stats["new_chunks"] == result.stats.new_chunks == 4
    assert result.stats.hole_chunks == 2
    assert progress[-1] == (5 * CHUNK + 5, 5 * CHUNK + 5)


def test_the_same_tree_twice_adds_nothing(tmp_path, store):
    src = write_files(tmp_path / "src", {"a": SHARED, "b": os.urandom(5000)})
    first = build_layer(src, store, chunk_size=CHUNK)
    before = keys(store, "packs/") | keys(store, "index/")
    second = build_layer(src, store, chunk_size=CHUNK)
    assert second.digest == first.digest
    assert second.stats.new_chunks == 0 and second.stats.stored_bytes == 0
    assert keys(store, "packs/") | keys(store, "index/") == before
    assert second.manifest.packs == first.manifest.packs


def test_two_trees_sharing_a_file_share_its_chunks(tmp_path, store):
    first = build_layer(write_files(tmp_path / "one", {"shared": SHARED, "x": b"only in one"}), store, chunk_size=CHUNK)
    second = build_layer(write_files(tmp_path / "two", {"lib/shared": SHARED, "y": b"only in two"}), store,
                         chunk_size=CHUNK)
    assert first.stats.new_chunks == 4 and second.stats.new_chunks == 1
    assert second.stats.dedup_bytes == len(SHARED)
    assert set(first.manifest.packs) <= set(second.manifest.packs)
    assert second.digest != first.digest


def test_a_file_changed_mid_build_publishes_nothing(tmp_path, store):
    src = write_files(tmp_path / "src", {"a-first": os.urandom(20 * CHUNK), "z-later": b"before"})
    tree = walk_directory(src)
    with open(os.path.join(src, "z-later"), "ab") as f:
        f.write(b" and after")
    with pytest.raises(InputError, match="changed") as info:
        build_tree(tree, store, name="test/changed", chunk_size=CHUNK)
    assert info.value.where.endswith("z-later")
    assert not keys(store, "layers/") and not keys(store, "refs/")


class FailingStore(FilesystemStore):
    """The store becomes unavailable for keys containing ``fail_on``: a fault a real store cannot make on cue."""

    fail_on = "manifest.json"

    def _write_temp(self, dir_fd, data, key, *, sync):  # every write of an object, however it was put
        if self.fail_on in key:
            raise UnavailableError("injected outage", where=key)
        return super()._write_temp(dir_fd, data, key, sync=sync)


def files_open_under(directory) -> list[str]:
    """What this process's fds name under ``directory`` (an unnamed temporary file: "DIR/#123 (deleted)")."""
    named = (os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if fd.isdigit()
             and os.path.exists(f"/proc/self/fd/{fd}"))
    return [name for name in named if name.startswith(str(directory) + "/")]


@pytest.mark.parametrize("fail_on", ["packs/", "index/", "meta.erofs", "buildinfo", "manifest.json", None])
def test_a_store_failure_publishes_nothing(tmp_path, monkeypatch, fail_on):
    """... and leaves no temporary file (meta.erofs is written into one, dsec_fs.spill), nor does a build
    that succeeds."""
    store = FailingStore(str(tmp_path / "store"), fsync=False)
    store.fail_on = fail_on or "nothing fails"
    spill_dir = tmp_path / "tmp"
    spill_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_dir))
    spilled = []
    real_spill = SpillFile.__init__

    def spill(self, *args, **kwargs):
        before = len(files_open_under(spill_dir))
        real_spill(self, *args, **kwargs)
        spilled.append(len(files_open_under(spill_dir)) - before)

    monkeypatch.setattr(SpillFile, "__init__", spill)
    src = write_files(tmp_path / "src", {"a": os.urandom(10 * CHUNK), "d/b": b"small"})
    if fail_on is None:
        build_layer(src, store, name="test/works", chunk_size=CHUNK)
        assert resolve(store, "test/works")
    else:
        with pytest.raises(UnavailableError):
            build_layer(src, store, name="test/fails", chunk_size=CHUNK)
        assert not keys(store, "refs/")
        assert not any(key.endswith("manifest.json") for key in keys(store, "layers/"))
    if fail_on not in ("packs/", "index/"):  # those fail before meta.erofs is written
        assert spilled == [1]  # the image was in a file there
    assert files_open_under(spill_dir) == [] and os.listdir(spill_dir) == []


def test_a_bad_name_fails_before_any_work(tmp_path, store):
    src = write_files(tmp_path / "src", {"a": b"data"})
    with pytest.raises(InputError):
        build_layer(src, store, name="../escape")
    assert not keys(store, "")


@pytest.mark.skipif(shutil.which("fsck.erofs") is None, reason="needs erofs-utils")
def test_meta_and_materialized_blob_pass_fsck(tmp_path, store):
    files = {"a": SHARED + b"tail", "d/b": b"small", "dup": SHARED}
    src = write_files(tmp_path / "src", {**files, "holes": bytes(2 * CHUNK) + b"data"})
    os.symlink("a", os.path.join(src, "link"))
    result = build_layer(src, store, chunk_size=CHUNK)
    layer = open_layer(store, result.digest)
    (tmp_path / "meta.erofs").write_bytes(layer.meta)
    materialize_blob(store, EncodedBlobMap(layer.blobmap, source="blobmap"), tmp_path / "blob")
    out = tmp_path / "out"
    subprocess.run(["fsck.erofs", f"--device={tmp_path / 'blob'}", f"--extract={out}", str(tmp_path / "meta.erofs")],
                   check=True, capture_output=True)
    # fsck.erofs 1.5 extracts holes as nothing at all (no seek), so only files without holes are compared;
    # the kernel-mount test below compares everything.
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name
    assert os.readlink(out / "link") == "a"


def make_rich_tree(root) -> str:
    """Every inode kind and the metadata a layer keeps, with holes, repeats and hard links in the data."""
    src = write_files(root, {
        "dup1": SHARED, "dir/dup2": SHARED + SHARED[:100], "zero": bytes(3 * CHUNK),
        "holes": bytes(2 * CHUNK) + b"data" + bytes(CHUNK), "empty": b"", "n" * 255: b"long name",
    })
    with open(os.path.join(os.fsencode(src), b"caf\xe9-latin-1"), "wb") as f:
        f.write(b"a name that is not UTF-8")
    with open(os.path.join(src, "sparse"), "wb") as f:
        f.truncate(64 << 20)
        f.seek(40 << 20)
        f.write(b"in the middle")
    j = lambda *parts: os.path.join(src, *parts)  # noqa: E731
    os.link(j("dup1"), j("dir", "hardlink"))
    os.symlink("../dup1", j("dir", "symlink"))
    os.mknod(j("null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(j("whiteout"), stat.S_IFCHR, os.makedev(0, 0))
    os.mknod(j("blk"), stat.S_IFBLK | 0o600, os.makedev(259, 70000))
    os.mkfifo(j("fifo"))
    os.mknod(j("socket"), stat.S_IFSOCK | 0o755)
    os.chown(j("dup1"), 3_000_000_000, 70000)
    os.chmod(j("dup1"), 0o4755)
    os.chmod(j("dir"), 0o3775)
    os.setxattr(j("dup1"), "user.comment", b"hello")
    os.setxattr(j("dir"), "trusted.overlay.opaque", b"y")
    os.setxattr(j("dir", "symlink"), "security.label", b"\x00\xff", follow_symlinks=False)
    os.utime(j("dir"), ns=(0, 1_600_000_000_123_456_789))
    os.utime(src, ns=(0, 1_500_000_000_000_000_001))
    return src


@pytest.mark.root
def test_kernel_mount_of_the_layer_is_the_source(tmp_path, store):
    src = make_rich_tree(tmp_path / "src")
    result = build_layer(src, store, chunk_size=CHUNK)
    layer = open_layer(store, result.digest)
    (tmp_path / "meta.erofs").write_bytes(layer.meta)
    materialize_blob(store, EncodedBlobMap(layer.blobmap, source="blobmap"), tmp_path / "blob")
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(tmp_path / "meta.erofs", tmp_path / "mnt", [tmp_path / "blob"]) as mnt:
        assert_same_tree(snapshot(src), snapshot(mnt))


@pytest.mark.root
@pytest.mark.slow
def test_debian_rootfs_round_trips_and_rebuilds_for_free(tmp_path, store, debian_rootfs):
    result = build_layer(debian_rootfs, store, name="base/debian:12")
    layer = open_layer(store, "base/debian:12")
    (tmp_path / "meta.erofs").write_bytes(layer.meta)
    materialize_blob(store, EncodedBlobMap(layer.blobmap, source="blobmap"), tmp_path / "blob")
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(tmp_path / "meta.erofs", tmp_path / "mnt", [tmp_path / "blob"]) as mnt:
        assert_same_tree(snapshot(debian_rootfs), snapshot(mnt))
    again = build_layer(debian_rootfs, store)
    assert again.digest == result.digest and again.stats.new_chunks == 0


def test_a_layer_stored_by_an_older_writer_still_checks_exports_and_serves_as_a_parent(tmp_path, store):
    """Layers published before metadata compression (manifest version 1: meta.erofs and the blob map
    stored as they are) stay readable: fsck, export and a rebuild on them as the parent work."""
    src = write_files(tmp_path / "src", {"a": SHARED, "d/b": b"small", "c": os.urandom(CHUNK + 7)})
    digest = build_layer(src, store, chunk_size=CHUNK).digest
    manifest_key = store_keys.layer_manifest(digest)
    manifest = Manifest.from_json(store.get(manifest_key), source=manifest_key)
    meta, blobmap = read_meta(store, manifest), read_blobmap(store, manifest)
    assert store.get(store_keys.layer_meta(digest)) != meta  # stored compressed
    old = json.loads(manifest.to_json())
    old["version"] = 1
    del old["stored"]
    store.put(store_keys.layer_meta(digest), bytes(meta))
    store.put(store_keys.layer_blobmap(digest), blobmap)
    store.put(manifest_key, json.dumps(old).encode())

    report = fsck_layer(store, digest)
    assert report.ok, report.problems
    export_layer(store, digest, tmp_path / "out")
    assert (tmp_path / "out" / "meta.erofs").read_bytes() == meta
    assert build_layer(src, store, chunk_size=CHUNK, parent=digest).digest == digest
    republished = Manifest.from_json(store.get(manifest_key), source=manifest_key)
    assert republished.version == 2 and open_layer(store, digest).meta == meta


@pytest.mark.root
def test_a_build_whose_temporary_directory_is_full_fails_with_an_error_naming_it(tmp_path):
    """meta.erofs is written through a mapping of a temporary file (dsec_fs.spill): with $TMPDIR on a
    file system with no room for it, ``dsecfs build`` exits with an error naming the directory and
    publishes nothing; before, the first store into a page the file system had no room for was a SIGBUS
    that killed the build."""
    full = tempfile.mkdtemp(prefix="dsecfs-fulltmp-", dir="/tmp")  # a mount: not under tmp_path
    mounts.mount("tmpfs", full, "tmpfs", 0, "size=64k,mode=0700")
    try:
        src = write_files(tmp_path / "src", {f"d{n // 100}/f{n}": b"x" for n in range(3000)})
        store = tmp_path / "store"
        dsecfs = os.path.join(os.path.dirname(sys.executable), "dsecfs")
        result = subprocess.run([dsecfs, "build", str(src), "--store", str(store), "--name", "t/full"],
                                env={**os.environ, "TMPDIR": full}, capture_output=True, text=True, timeout=120)
        assert result.returncode > 0, (result.returncode, result.stderr)
        assert full in result.stderr and "Traceback" not in result.stderr
        assert not keys(FilesystemStore(str(store)), "refs/")
    finally:
        mounts.umount(full, lazy=True)
        os.rmdir(full)
