"""Seeds for the fuzz tests: valid encodings made by the real writers, built once per session.

``layers``: layers built by build_tree into a real store from in-memory trees holding every inode kind
(chunk sizes 4 KiB and 16 KiB), each with its meta.erofs, blob map, manifest and exported blob file.
``mkfs_images``: images erofs-utils wrote (inline data, its own layouts), when mkfs.erofs is installed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass

import pytest

from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder.blob import FileBlob
from dsec_fs.blobmap import EncodedBlobMap
from erofs_builder.build import build_tree
from erofs_builder.export import export_layer
from erofs_builder.tree import Node, Tree, make_dir

MTIME_NS = 1_700_000_000_123_456_789  # most entries share it, so most inodes are compact


@dataclass(frozen=True)
class Layer:
    digest: str
    meta: bytes
    blobmap: bytes
    manifest: bytes
    blob_path: str  # the exported blob
    store_root: str  # the FilesystemStore holding the layer (and nothing else)

    def blob(self) -> FileBlob:
        return FileBlob(self.blob_path)

    def decoded_blobmap(self) -> EncodedBlobMap:
        return EncodedBlobMap(self.blobmap, source="blobmap")


def _file(data: bytes, **attrs) -> Node:
    def reader(chunk_size: int):
        return (data[i:i + chunk_size] for i in range(0, len(data), chunk_size))

    return Node(mode=stat.S_IFREG | attrs.pop("perm", 0o644), size=len(data), reader=reader if data else None,
                mtime_ns=attrs.pop("mtime_ns", MTIME_NS), **attrs)


def seed_tree(seed: int) -> Tree:
    """Every inode kind and layout our writer makes: compact and extended inodes, inline and block
    symlinks, a directory of several blocks, holes, duplicate chunks, hard links, xattrs of each prefix."""
    rng = random.Random(seed)
    tree = Tree(make_dir(mtime_ns=MTIME_NS))
    multi = rng.randbytes(3 * 4096 + 100)
    shared = _file(b"hard linked\n", xattrs={b"user.comment": b"two names"})
    entries = {
        b"empty": _file(b""),
        b"small": _file(b"hello\n"),
        b"block": _file(rng.randbytes(4096)),
        b"multi": _file(multi, perm=0o4755),
        b"d/dup": _file(multi),
        b"d/e/f/deep": _file(b"deep down", uid=70_000, gid=3_000_000_000),
        b"holes": _file(bytes(2 * 4096) + b"tail" + bytes(20_000) + b"end"),
        b"old": _file(b"before 1970", mtime_ns=-1_000_000_123),
        b"!bang": _file(b"sorts before '.'"),
        b"\xff" * 255: _file(b"longest name"),
        b"hard": shared,
        b"d/hard2": shared,
        b"link": Node(mode=stat.S_IFLNK | 0o777, target=b"small", size=5, mtime_ns=MTIME_NS),
        b"longlink": Node(mode=stat.S_IFLNK | 0o777, target=b"y" * 3000, size=3000, mtime_ns=MTIME_NS),
        b"null": Node(mode=stat.S_IFCHR | 0o666, rdev=os.makedev(1, 3), mtime_ns=MTIME_NS),
        b"d/blk": Node(mode=stat.S_IFBLK | 0o600, rdev=os.makedev(259, 70_000), mtime_ns=MTIME_NS),
        b"fifo": Node(mode=stat.S_IFIFO | 0o644, mtime_ns=MTIME_NS + 1),
        b"sock": Node(mode=stat.S_IFSOCK | 0o755, mtime_ns=MTIME_NS),
        b"acl": _file(b"acl", xattrs={
            b"system.posix_acl_access": struct.pack("<I", 2) + struct.pack("<HHI", 1, 6, 0xFFFFFFFF),
            b"security.capability": struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0),
            b"trusted.x": b"y" * 300,
        }),
    }
    for path, node in entries.items():
        tree.add(path, node)
    opaque = make_dir(mode=0o1777, mtime_ns=MTIME_NS, xattrs={b"trusted.overlay.opaque": b"y"})
    tree.add(b"sticky", opaque)
    for i in range(rng.randint(150, 300)):  # a directory of several blocks
        tree.add(b"many/" + b"x" * 40 + b"%03d" % i, _file(b"%d" % i if i % 3 else b""))
    tree.finish()
    return tree


def _build(tmp, name: str, tree: Tree, chunk_size: int) -> Layer:
    store = FilesystemStore(str(tmp / f"store-{name}"), fsync=False)
    digest = build_tree(tree, store, chunk_size=chunk_size).digest
    files = open_layer(store, digest)
    exported = export_layer(store, digest, tmp / f"export-{name}")
    manifest = dataclasses.replace(files.manifest, created="2024-01-01T00:00:00Z")  # the same every run
    return Layer(digest, files.meta, files.blobmap, manifest.to_json(), exported.blob_path, store.root)


@pytest.fixture(scope="session")
def layers(tmp_path_factory) -> list[Layer]:
    tmp = tmp_path_factory.mktemp("fuzz-layers")
    return [_build(tmp, "4k", seed_tree(1), 4096), _build(tmp, "16k", seed_tree(2), 16384)]


@pytest.fixture(scope="session")
def mkfs_images(tmp_path_factory) -> list[tuple[bytes, str | None]]:
    """(meta, blob path or None) of mkfs.erofs images: plain (FLAT_INLINE data) and chunked on a blob device."""
    if shutil.which("mkfs.erofs") is None:
        return []
    tmp = tmp_path_factory.mktemp("fuzz-mkfs")
    src = tmp / "src"
    (src / "d").mkdir(parents=True)
    rng = random.Random(3)
    for name, data in {"a": rng.randbytes(9000), "b": b"inline tail", "d/c": rng.randbytes(4096),
                       "z": bytes(10000)}.items():
        (src / name).write_bytes(data)
    os.symlink("a", src / "link")
    os.setxattr(src / "b", b"user.k", b"v")
    images = []
    for args, blob in ((["-Enoinline_data"], None), ([], None), (["--chunksize=4096"], "blob")):
        image = tmp / f"img{len(images)}"
        blob_path = str(tmp / f"blob{len(images)}") if blob else None
        extra = [f"--blobdev={blob_path}"] if blob_path else []
        stable = ["-T1600000000", "-U00000000-0000-0000-0000-000000000001", "--all-root"]  # the same every run
        done = subprocess.run(["mkfs.erofs", "--quiet", *stable, *args, *extra, str(image), str(src)],
                              capture_output=True)
        if done.returncode == 0:
            images.append((image.read_bytes(), blob_path))
    return images
