"""Helpers of the reader tests, shared with test_fsck.py and test_export.py; the ``rich`` fixture (make_source's
tree built as a layer, once a module) is in conftest.py.

- ``make_source``: a tree with every inode kind and the metadata a layer keeps (``write`` makes its files).
- ``build``: a tree built into a FilesystemStore and exported (``BuiltLayer``); ``mkfs``: the same tree
  made by erofs-utils' mkfs.erofs (``needs_mkfs`` skips without it).
- ``reader_snapshot``: the reader's view of an image in tests/treecmp.py's format.
- ``read_all``/``assert_reports_format_error``: everything the reader says about an image, and the check
  that a damaged one is read consistently or refused with a FormatError naming structure and offset.

Import it as ``tests.erofs_builder.reader_support`` (not through conftest: pytest loads every directory's
conftest under the one name "conftest").
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass

import pytest
from treecmp import Entry

from dsec_fs.errors import FormatError, UnsupportedError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.export import export_layer
from erofs_builder.reader import ErofsImage

CHUNK = 4096
BLOCK = 4096
KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFCHR: "chr",
         stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "sock"}
needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def make_source(root, *, special: bool = True) -> str:
    """A tree with every inode kind and the metadata a layer keeps. ``special`` adds what needs root:
    device nodes, foreign owners, trusted/security xattrs."""
    rng = random.Random(7)
    src = os.fsencode(root)
    j = lambda *parts: os.path.join(src, *(os.fsencode(p) for p in parts))  # noqa: E731
    multi = rng.randbytes(3 * CHUNK + 100)
    files = {
        "empty": b"", "small": b"hello\n", "one_chunk": rng.randbytes(CHUNK), "multi": multi,
        "d/dup": multi, "zeros": bytes(2 * CHUNK + 5), "d/e/f/deep": b"deep down",
        "!bang": b"sorts before '.'", "-dash": b"so does this", "sp ace": b"space", "n" * 255: b"long name",
    }
    for name, data in files.items():
        write(j(name), data)
    write(j(b"caf\xe9"), b"a name that is not UTF-8")
    for i in range(300):  # a directory of several blocks
        write(j("many", f"{'x' * 40}{i:03}"), str(i).encode())
    with open(j("sparse"), "wb") as f:  # hole, data, hole
        f.truncate(6 * CHUNK)
        f.seek(2 * CHUNK + 10)
        f.write(b"in the middle")
    os.symlink("small", j("link"))
    os.symlink("y" * 3000, j("longlink"))  # does not fit inline next to its inode
    os.symlink("/nonexistent/outside", j("dangling"))
    os.link(j("small"), j("hard"))
    os.link(j("multi"), j("d", "hard2"))
    os.link(j("dangling"), j("d", "hardsym"), follow_symlinks=False)  # a hard link to the symlink itself
    os.mkfifo(j("fifo"))
    os.mknod(j("socket"), stat.S_IFSOCK | 0o755)
    os.setxattr(j("small"), b"user.comment", b"hi there")
    os.setxattr(j("d"), b"user.dir", bytes(range(256)))
    os.chmod(j("multi"), 0o4755)
    os.mkdir(j("sticky"), 0o1777)
    os.chmod(j("sticky"), 0o1777)
    os.chmod(j("d", "e"), 0o2750)
    os.chmod(j("zeros"), 0o000)
    if special:
        os.mknod(j("null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(j("whiteout"), stat.S_IFCHR, os.makedev(0, 0))
        os.mknod(j("d", "blk"), stat.S_IFBLK | 0o600, os.makedev(259, 70000))
        os.chown(j("one_chunk"), 1234, 5678)
        os.chown(j("d", "e", "f"), 70000, 3_000_000_000)
        os.chown(j("link"), 42, 43, follow_symlinks=False)
        os.setxattr(j("d"), b"trusted.overlay.opaque", b"y")
        os.setxattr(j("dangling"), b"trusted.sym", b"on a symlink", follow_symlinks=False)
        os.setxattr(j("one_chunk"), b"security.capability",
                    struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0))  # cap_net_bind_service
        subprocess.run(["setfacl", "-m", "u:1234:r-x", os.fsdecode(j("small"))], check=True)
    # mtimes last, children before parents, to the nanosecond; one before 1970.
    paths = [dirpath for dirpath, _, _ in os.walk(src)]
    for dirpath, dirnames, filenames in os.walk(src):
        paths += [os.path.join(dirpath, n) for n in filenames + dirnames]
    for i, path in enumerate(sorted(set(paths), key=len, reverse=True)):
        os.utime(path, ns=(0, 1_600_000_000_000_000_000 + i * 1_000_003_007), follow_symlinks=False)
    os.utime(j("small"), ns=(0, -1_000_000_123))
    os.utime(j("d"), ns=(0, 1_700_000_000_123_456_789))
    os.utime(src, ns=(0, 1_500_000_000_000_000_001))
    return os.fsdecode(src)


def reader_snapshot(image: ErofsImage, *, piece: int | None = None):
    """The image as the reader shows it, in treecmp's snapshot format. With ``piece``, file data is read
    in pieces of that many bytes (checking that pieces and whole reads agree is the caller's choice)."""
    entries: dict[bytes, Entry] = {}
    by_nid: dict[int, list[bytes]] = {}
    for path, nid in image.walk():
        s = image.stat(nid)
        kind = KINDS[stat.S_IFMT(s.mode)]
        content = None
        if kind == "file":
            h = hashlib.sha256()
            step = piece or max(s.size, 1)
            for offset in range(0, s.size, step):
                h.update(image.read(nid, offset, step))
            content = h.hexdigest()
        entries[path] = Entry(
            kind=kind, mode=stat.S_IMODE(s.mode), uid=s.uid, gid=s.gid, mtime_ns=s.mtime_ns,
            size=s.size if kind in ("file", "symlink") else 0, content=content,
            target=image.readlink(nid) if kind == "symlink" else None,
            rdev=s.rdev if kind in ("chr", "blk") else None,
            xattrs=tuple(sorted(image.xattrs(nid).items())),
        )
        if kind != "dir":
            by_nid.setdefault(nid, []).append(path)
    groups = [frozenset(paths) for paths in by_nid.values() if len(paths) > 1]
    return entries, sorted(groups, key=sorted)


@dataclass
class BuiltLayer:
    store: FilesystemStore
    digest: str
    src: str
    meta: bytes
    meta_path: str
    blob_path: str


def build(tmp_path, src: str, *, chunk_size: int = CHUNK) -> BuiltLayer:
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digest = build_layer(src, store, chunk_size=chunk_size).digest
    exported = export_layer(store, digest, tmp_path / "exported")
    return BuiltLayer(store, digest, src, open_layer(store, digest).meta, exported.meta_path, exported.blob_path)


def mkfs(tmp_path, src: str, *args: str) -> tuple[str, bytes]:
    """mkfs.erofs of ``src``. erofs-utils 1.5 fails on a 255-byte name, so make_source's is removed first."""
    root_mtime = os.lstat(src).st_mtime_ns
    os.unlink(os.path.join(src, "n" * 255))
    os.utime(src, ns=(0, root_mtime))
    image = str(tmp_path / "mkfs.erofs.img")
    subprocess.run(["mkfs.erofs", "--quiet", *args, image, src], check=True, capture_output=True)
    with open(image, "rb") as f:
        return image, f.read()


def read_all(meta: bytes, blob) -> tuple:
    """Everything the reader can say about an image, through every entry point, checked for agreement."""
    image = ErofsImage(meta, blob=blob)
    view = reader_snapshot(image, piece=CHUNK + 1)
    assert reader_snapshot(image) == view  # pieces and whole reads agree
    for path, nid in image.walk():
        assert image.resolve(path) == nid
        if stat.S_ISDIR(image.stat(nid).mode):
            for name, child, _ftype in image.readdir(nid):
                assert image.lookup(nid, name) == child
        elif stat.S_ISREG(image.stat(nid).mode) and image.inode(nid).layout == 4:
            image.chunk_map(nid)
    return view


def assert_reports_format_error(meta: bytes, blob) -> tuple | None:
    """The reader either reads the image consistently or raises a FormatError naming structure and
    offset (or UnsupportedError); nothing else."""
    try:
        return read_all(meta, blob)
    except FormatError as exc:
        assert exc.structure and exc.offset is not None and 0 <= exc.offset, exc
        assert "meta.erofs" in str(exc)
    except UnsupportedError as exc:
        assert exc.where
    return None
