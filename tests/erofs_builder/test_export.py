"""export_layer (meta.erofs + materialised blob, checked by fsck.erofs and the kernel) and extract_layer
(the tree recreated on disk, compared with the source by tests/treecmp.py), including its refusal to
write through symlinks or into a non-empty directory."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from dsec_fs.errors import ConflictError
from dsec_fs.layer import open_layer
from dsec_fs.mounts import mounted_erofs
from dsec_fs.store import FilesystemStore
from dsec_fs.pack import MAX_CHUNK_SIZE
from erofs_builder import build_layer
from erofs_builder.blob import FileBlob
from dsec_fs.blobmap import EncodedBlobMap
from erofs_builder.export import export_layer, extract_image, extract_layer
from erofs_builder.reader import ErofsImage
from tests.erofs_builder.reader_support import CHUNK, build, make_source, mkfs, needs_mkfs, write
from treecmp import assert_same_tree, snapshot


def test_export_writes_the_image_and_a_block_aligned_blob(rich, tmp_path):
    result = export_layer(rich.store, rich.digest, tmp_path / "out")
    layer = open_layer(rich.store, rich.digest)
    blobmap = EncodedBlobMap(layer.blobmap, source="blobmap")
    assert open(result.meta_path, "rb").read() == layer.meta
    assert os.path.getsize(result.blob_path) == result.blob_size == blobmap.blocks * 4096
    assert sorted(os.listdir(tmp_path / "out")) == ["blob", "meta.erofs"]  # no temporary files left
    with open(result.blob_path, "rb") as f:
        for blkaddr, _digest, length in blobmap.entries:
            f.seek(blkaddr * 4096)
            padded = f.read(-(-length // 4096) * 4096)
            assert padded[length:] == bytes(len(padded) - length)
    # Exporting again replaces both files with the same bytes.
    again = export_layer(rich.store, rich.digest, tmp_path / "out")
    assert open(again.blob_path, "rb").read() == open(rich.blob_path, "rb").read()


@pytest.mark.root
def test_another_user_reads_nothing_of_an_export(tmp_path):
    """The exported blob holds every byte of the layer, a 0600 root file's too, and meta.erofs every name:
    both are 0600, as the node's blob files are 0400 (before: 0644, so uid 65534 read the secret's bytes
    from the blob of an export into a directory others may enter, as ExportedLayers' cache is)."""
    secret = b"ROOT-ONLY-" + os.urandom(16).hex().encode()
    src = tmp_path / "src"
    (src / "private").mkdir(parents=True, mode=0o700)
    write(src / "private" / "key", secret)
    os.chmod(src / "private" / "key", 0o600)
    store = FilesystemStore(str(tmp_path / "store"))
    digest = build_layer(str(src), store).digest
    public = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(public, 0o755)
        result = export_layer(store, digest, os.path.join(public, "out"))
        assert {stat.S_IMODE(os.stat(path).st_mode) for path in (result.meta_path, result.blob_path)} == {0o600}
        assert secret in open(result.blob_path, "rb").read()  # what there is to keep from others
        pid = os.fork()
        if pid == 0:  # the other user
            code = 0
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                for path in (result.meta_path, result.blob_path):
                    try:
                        with open(path, "rb") as f:
                            code |= 1 if secret in f.read() else 2
                    except PermissionError:
                        pass
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0, "uid 65534 read the export"
    finally:
        shutil.rmtree(public)


@pytest.mark.skipif(shutil.which("fsck.erofs") is None, reason="needs erofs-utils")
def test_fsck_erofs_accepts_the_export(rich, tmp_path):
    out = tmp_path / "extracted"
    proc = subprocess.run(["fsck.erofs", f"--device={rich.blob_path}", f"--extract={out}", rich.meta_path],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "multi").read_bytes() == open(os.path.join(rich.src, "multi"), "rb").read()


@pytest.mark.root
def test_extract_as_root_leaves_out_what_gives_privileges_on_the_host(rich, tmp_path):
    """Setuid/setgid bits, device nodes and file capabilities of a layer are not recreated by default;
    whiteouts, setgid directories and everything else are."""
    out = tmp_path / "out"
    stats = extract_layer(rich.store, rich.digest, out)
    assert stats.dropped.to_dict() == {"setuid": 1, "setgid": 0, "devices": 2, "capabilities": 1}
    assert not os.path.lexists(out / "null") and not os.path.lexists(out / "d" / "blk")
    st = os.lstat(out / "whiteout")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert stat.S_IMODE(os.stat(out / "multi").st_mode) == 0o755 and os.path.samefile(out / "multi", out / "d" / "hard2")
    assert stat.S_IMODE(os.stat(out / "d" / "e").st_mode) == 0o2750  # a setgid directory is no privilege
    assert "security.capability" not in os.listxattr(out / "one_chunk")
    # What is left is the source without those parts.
    expected, ours = snapshot(rich.src), snapshot(out)
    assert set(expected[0]) - set(ours[0]) == {b"null", b"d/blk"}


@pytest.mark.root
def test_the_kernel_mounts_the_export_as_the_source(rich, tmp_path):
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(rich.meta_path, tmp_path / "mnt", [rich.blob_path]) as mnt:
        assert_same_tree(snapshot(rich.src), snapshot(mnt))


@pytest.mark.root
def test_extract_recreates_the_source(rich, tmp_path):
    out = tmp_path / "out"
    stats = extract_layer(rich.store, rich.digest, out, keep_privileged=True)
    assert_same_tree(snapshot(rich.src), snapshot(out))
    assert stats.dropped.total() == 0
    assert stats.hard_links == 3 and stats.entries == len(snapshot(rich.src)[0])
    # Holes stay holes: the sparse file has one 4 KiB block of data in 24 KiB.
    st = os.stat(out / "sparse")
    assert st.st_size == 6 * CHUNK and st.st_blocks * 512 <= 2 * CHUNK
    assert os.lseek(os.open(out / "sparse", os.O_RDONLY), 0, os.SEEK_DATA) == 2 * CHUNK
    assert os.stat(out / "zeros").st_blocks == 0


def test_extract_as_an_unprivileged_tree(tmp_path):
    layer = build(tmp_path, make_source(tmp_path / "src", special=False))
    with FileBlob(layer.blob_path) as blob:
        extract_image(ErofsImage(layer.meta, blob=blob), tmp_path / "out", same_owner=False, keep_privileged=True)
    assert_same_tree(snapshot(layer.src), snapshot(tmp_path / "out"))


@needs_mkfs
def test_extract_an_mkfs_image_with_inline_data(tmp_path):
    src = make_source(tmp_path / "src", special=os.geteuid() == 0)
    _path, data = mkfs(tmp_path, src)  # xattrs kept, FLAT_INLINE tails, no chunks
    extract_image(ErofsImage(data), tmp_path / "out", keep_privileged=True)
    assert_same_tree(snapshot(src), snapshot(tmp_path / "out"))


def test_extract_refuses_a_non_empty_directory(rich, tmp_path):
    out = tmp_path / "out"
    write(os.path.join(out, "unrelated"), b"mine")
    with pytest.raises(ConflictError, match="not empty"):
        extract_layer(rich.store, rich.digest, out)
    assert os.listdir(out) == ["unrelated"]
    extract_layer(rich.store, rich.digest, out, exist_ok=True)
    assert (out / "unrelated").read_bytes() == b"mine" and (out / "small").read_bytes() == b"hello\n"


def test_extract_never_writes_through_a_symlink(tmp_path):
    """A symlink already in out_dir where the layer has a directory or a file: nothing lands outside."""
    src = tmp_path / "src"
    write(os.path.join(src, "d", "payload"), b"payload")
    write(os.path.join(src, "f"), b"file")
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digest = build_layer(str(src), store, chunk_size=CHUNK).digest
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"precious")
    for name in ["d", "f"]:
        out = tmp_path / f"out-{name}"
        out.mkdir()
        os.symlink(outside if name == "d" else outside / "f", out / name)
        with pytest.raises(ConflictError):
            extract_layer(store, digest, out, exist_ok=True)
    assert sorted(os.listdir(outside)) == ["f"] and (outside / "f").read_bytes() == b"precious"


def test_a_layer_symlink_is_stored_not_followed(tmp_path):
    """The layer's own symlinks point outside; hard links to them link the symlink, never the target."""
    src = tmp_path / "src"
    src.mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"do not touch")
    os.symlink(target, src / "escape")
    os.link(src / "escape", src / "escape2", follow_symlinks=False)
    os.symlink("../../..", src / "up")
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digest = build_layer(str(src), store, chunk_size=CHUNK).digest
    extract_layer(store, digest, tmp_path / "out", same_owner=False)
    out = tmp_path / "out"
    assert os.readlink(out / "escape") == str(target) and os.readlink(out / "up") == "../../.."
    assert os.lstat(out / "escape").st_ino == os.lstat(out / "escape2").st_ino
    assert os.path.islink(out / "escape2")
    assert target.read_bytes() == b"do not touch" and os.lstat(target).st_nlink == 1


@pytest.mark.root
@pytest.mark.slow
def test_debian_rootfs_extracts_and_exports_identically(tmp_path, debian_rootfs):
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digest = build_layer(debian_rootfs, store).digest
    extract_layer(store, digest, tmp_path / "out", keep_privileged=True)
    expected = snapshot(debian_rootfs)
    assert_same_tree(expected, snapshot(tmp_path / "out"))
    exported = export_layer(store, digest, tmp_path / "exported")
    (tmp_path / "mnt").mkdir()
    with mounted_erofs(exported.meta_path, tmp_path / "mnt", [exported.blob_path]) as mnt:
        assert_same_tree(expected, snapshot(mnt))


FORGED_HUGE_CLAIM_EXPORT = r"""
import os, resource, sys
from dsec_fs.errors import CorruptError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore, keys
from erofs_builder import build_layer
from erofs_builder.export import export_layer, extract_layer
from erofs_builder.fsck import fsck_layer
from tests.dsec_fs.forgery import chunks_of_layer, forge_huge_claim

root = sys.argv[1]
store = FilesystemStore(root + "/store", fsync=False)
os.mkdir(root + "/src")
with open(root + "/src/f", "wb") as f:
    f.write(os.urandom(4096))
layer = build_layer(root + "/src", store, chunk_size=16384).digest
[(digest, _length)] = chunks_of_layer(store, layer)
[own] = open_layer(store, layer).manifest.packs
forge_huge_claim(store, digest, int(sys.argv[2]), own)  # a store writer rewrote the layer's pack and its index

# The node has less memory than the claim: 768 MiB more address space than it uses now.
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (768 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))

for run in (lambda: export_layer(store, layer, root + "/export"), lambda: extract_layer(store, layer, root + "/tree")):
    try:
        run()
        print("read")
    except CorruptError as exc:
        print(type(exc).__name__, keys.index(own) in str(exc), digest.hex() in str(exc))
print(not fsck_layer(store, layer).ok)
"""


@pytest.mark.parametrize("claimed", [1 << 30, MAX_CHUNK_SIZE])
def test_export_and_extract_refuse_a_chunk_whose_pack_index_claims_more_than_the_node_has(tmp_path, claimed):
    # A store writer rewrote a layer's pack index to claim its 4 KiB chunk is a GiB, and its pack to hold a
    # frame of zeros that says so too: export and extract read it, and zstd asked for the GiB, which the
    # node does not have (MemoryError, rlimit). Now no pack index may claim more than any layer's chunk (a
    # FormatError as it is loaded), and the blob map's size bounds every location before it is read (a
    # CorruptError): both name the pack index and the chunk. fsck already reported it unread.
    import sys

    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", FORGED_HUGE_CLAIM_EXPORT, str(tmp_path), str(claimed)],
                          capture_output=True, text=True, cwd=project, env={**os.environ, "PYTHONPATH": project},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    error = "FormatError" if claimed > MAX_CHUNK_SIZE else "CorruptError"
    assert done.stdout.split() == [error, "True", "True"] * 2 + ["True"], done.stdout
