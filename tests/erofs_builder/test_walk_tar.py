"""walk_tar / tar_nodes on archives made in the test: GNU tar of real trees (sparse files included),
tarfile-built archives with every member kind and extension, hand-patched headers for hostile input,
gzip / zstd / multi-frame streams, and the streaming contract of Node.reader."""

from __future__ import annotations

import base64
import bz2
import gzip
import hashlib
import io
import logging
import lzma
import os
import random
import stat
import subprocess
import tarfile
import zlib

import pytest
import zstandard

from dsec_fs.errors import InputError, UnsupportedError
from erofs_builder.limits import TarLimits
from erofs_builder.tar_header import header_sum
from erofs_builder.tar_input import _TarStream
from erofs_builder.tar_members import MemberError
from erofs_builder.tree import Tree
from erofs_builder.walk_tar import tar_nodes, walk_tar

CHUNK = 4096
MTIME_NS = 1_700_000_000_123_456_789
BIG_UID = 3_000_000_000  # more than 31 bits: PAX (or GNU base-256) only


# ---------------------------------------------------------------------------------------------------------
# Building archives.


def info(name: str, kind: bytes = tarfile.REGTYPE, *, size: int = 0, mode: int = 0o644, **attrs) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = size
    ti.mode = mode
    ti.mtime = 1_600_000_000
    for key, value in attrs.items():
        setattr(ti, key, value)
    return ti


def make_tar(members, fmt=tarfile.PAX_FORMAT) -> bytes:
    """members: (TarInfo, data or None); a TarInfo's size is set from its data."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as archive:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            archive.addfile(ti, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def file(name: str, data: bytes, **attrs):
    return info(name, size=len(data), **attrs), data


def patched(block: bytes, offset: int, value: bytes) -> bytes:
    """A header block with one field replaced and the checksum recomputed."""
    block = block[:offset] + value + block[offset + len(value) :]
    block = block[:148] + b" " * 8 + block[156:]
    return block[:148] + b"%06o\0 " % sum(block) + block[156:]


def raw_member(ti: tarfile.TarInfo, data: bytes = b"", fmt=tarfile.USTAR_FORMAT) -> bytes:
    return ti.tobuf(fmt, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


END = bytes(1024)


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def read_all(node, chunk: int = CHUNK) -> tuple[bytes, list[int]]:
    """A node's content through its reader, and the indexes of the pieces given as holes (None)."""
    out = bytearray()
    holes = []
    for i, piece in enumerate(node.reader(chunk)):
        length = min(chunk, node.size - i * chunk)
        if piece is None:
            holes.append(i)
            out += bytes(length)
        else:
            assert len(piece) == length
            out += piece
    return bytes(out), holes


class Collect:
    """An on_file that reads every file, as the chunker would, and keeps the content by node."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self.content: dict[int, bytes] = {}
        self.holes: dict[int, list[int]] = {}
        self.calls = 0

    def __call__(self, node) -> None:
        self.calls += 1
        self.content[id(node)], self.holes[id(node)] = read_all(node, self.chunk)
        node.chunks = []  # what the chunker does; here just a marker that the content was consumed

    def of(self, tree: Tree, path: bytes) -> bytes:
        return self.content[id(tree.lookup(path))]


def walk(data: bytes, **kw) -> tuple[Tree, Collect]:
    collect = Collect()
    return walk_tar(io.BytesIO(data), on_file=collect, **kw), collect


def with_link_groups(entries: dict, inode_of: dict) -> dict:
    """Append to each entry the sorted paths that share its inode (hard links)."""
    groups: dict = {}
    for path, inode in inode_of.items():
        groups.setdefault(inode, []).append(path)
    return {path: entry + (sorted(groups[inode_of[path]]),) for path, entry in entries.items()}


def describe(tree: Tree, collect: Collect) -> dict:
    """Everything a layer keeps of each path (content as a hash), and the hard-link group of each path."""
    out = {}
    inode_of = {}
    for path, node in tree.walk():
        content = collect.content.get(id(node))
        out[path] = (
            stat.filemode(node.mode), node.uid, node.gid, node.mtime_ns, node.size, node.target, node.rdev,
            sorted(node.xattrs.items()), hashlib.sha256(content).hexdigest() if content is not None else None,
        )
        inode_of[path] = id(node) if not node.is_dir else path
    return with_link_groups(out, inode_of)


# ---------------------------------------------------------------------------------------------------------
# Every member kind and field.


def everything() -> list:
    pax_attrs = {
        "mtime": "1700000000.123456789",
        "SCHILY.xattr.user.comment": "h\u00e9llo",
        "SCHILY.xattr.security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00",
        "LIBARCHIVE.xattr.user.with%20space": base64.b64encode(b"\xff\x00bin").decode().rstrip("="),
    }
    data = os.urandom(3 * CHUNK + 5)
    return [
        (info("./", tarfile.DIRTYPE, mode=0o755, mtime=1_500_000_000), None),
        (info("dir", tarfile.DIRTYPE, mode=0o2775, uid=BIG_UID, gid=7), None),
        (info("tmp", tarfile.DIRTYPE, mode=0o1777), None),
        file("dir/data", data, mode=0o4755, uid=1000, gid=BIG_UID, pax_headers=pax_attrs),
        file("empty", b""),
        (info("hardlink", tarfile.LNKTYPE, linkname="dir/data"), None),
        (info("/tmp/hardlink2", tarfile.LNKTYPE, linkname="/dir/data"), None),
        (info("symlink", tarfile.SYMTYPE, linkname="dir/data"), None),
        (info("abs", tarfile.SYMTYPE, linkname="/nowhere/" + "x" * 300), None),
        (info("null", tarfile.CHRTYPE, mode=0o666, devmajor=1, devminor=3), None),
        (info("loop", tarfile.BLKTYPE, mode=0o660, devmajor=7, devminor=300), None),
        (info("fifo", tarfile.FIFOTYPE, mode=0o600), None),
        file("./dir/./y", b"y"),
    ]


def test_every_member_kind_becomes_the_expected_node():
    tree, collect = walk(make_tar(everything()))
    get = tree.lookup

    assert tree.root.mode == stat.S_IFDIR | 0o755 and tree.root.mtime_ns == 1_500_000_000 * 10**9
    assert (get(b"dir").mode, get(b"dir").uid, get(b"dir").gid) == (stat.S_IFDIR | 0o2775, BIG_UID, 7)
    assert get(b"tmp").mode == stat.S_IFDIR | 0o1777

    data = get(b"dir/data")
    assert data.mode == stat.S_IFREG | 0o4755 and (data.uid, data.gid) == (1000, BIG_UID)
    assert data.mtime_ns == MTIME_NS and data.size == 3 * CHUNK + 5
    assert data.xattrs == {
        b"user.comment": "h\u00e9llo".encode(),
        b"security.capability": b"\x01\x00\x00\x02\x00\x20\x00\x00",
        b"user.with space": b"\xff\x00bin",
    }
    assert len(collect.of(tree, b"dir/data")) == data.size
    assert data.source == "dir/data"

    # Hard links are the same Node, whatever the slashes; content read once.
    assert get(b"hardlink") is data and get(b"tmp/hardlink2") is data
    assert collect.calls == 3  # dir/data, empty, dir/y
    tree.finish()
    assert data.nlink == 3

    assert get(b"symlink").mode == stat.S_IFLNK | 0o777 and get(b"symlink").target == b"dir/data"
    assert get(b"symlink").size == len(b"dir/data")
    assert get(b"abs").target == b"/nowhere/" + b"x" * 300
    assert (get(b"null").mode, get(b"null").rdev) == (stat.S_IFCHR | 0o666, os.makedev(1, 3))
    assert (get(b"loop").mode, get(b"loop").rdev) == (stat.S_IFBLK | 0o660, os.makedev(7, 300))
    assert get(b"fifo").mode == stat.S_IFIFO | 0o600
    assert get(b"empty").size == 0 and collect.of(tree, b"empty") == b""
    assert collect.of(tree, b"dir/y") == b"y"
    assert sorted(tree.root.children) == sorted(
        [b"dir", b"tmp", b"empty", b"hardlink", b"symlink", b"abs", b"null", b"loop", b"fifo"]
    )


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_in_every_format(fmt):
    long_dir = "/".join(["d" * 60] * 2)  # 121 bytes: ustar needs prefix, GNU an 'L' header
    long_name = long_dir + "/" + "f" * 30
    long_target = "t" * 99 if fmt == tarfile.USTAR_FORMAT else "t" * 200
    members = [file(long_name, b"content"), (info("link", tarfile.SYMTYPE, linkname=long_target), None)]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(file("n" * 255, b"longest name"))
        members.append((info("hard", tarfile.LNKTYPE, linkname=long_name), None))
    tree, collect = walk(make_tar(members, fmt))
    node = tree.lookup(long_name.encode())
    assert collect.content[id(node)] == b"content"
    assert tree.lookup(b"link").target == long_target.encode()
    if fmt != tarfile.USTAR_FORMAT:
        assert collect.of(tree, b"n" * 255) == b"longest name"
        assert tree.lookup(b"hard") is node


def test_gnu_base256_ids_and_negative_mtime():
    ti, data = file("f", b"x", uid=1 << 31, gid=BIG_UID, mtime=-86400)
    tree, _ = walk(make_tar([(ti, data)], tarfile.GNU_FORMAT))
    node = tree.lookup(b"f")
    assert (node.uid, node.gid, node.mtime_ns) == (1 << 31, BIG_UID, -86400 * 10**9)


def test_pax_negative_fractional_mtime():
    tree, _ = walk(make_tar([file("f", b"", pax_headers={"mtime": "-1.5"})]))
    assert tree.lookup(b"f").mtime_ns == -1_500_000_000


def test_path_rules_of_gnu_tar():
    tree, collect = walk(make_tar([
        file("/abs/file", b"1"),
        file("./a/./b", b"first"),
        file("a/b", b"second"),  # duplicate: the last wins
        (info("a", tarfile.DIRTYPE, mode=0o700), None),  # a directory after its entries keeps them
        file("implied/deep/f", b"3"),
    ]))
    assert collect.of(tree, b"abs/file") == b"1"
    assert collect.of(tree, b"a/b") == b"second"
    assert tree.lookup(b"a").mode == stat.S_IFDIR | 0o700 and set(tree.lookup(b"a").children) == {b"b"}
    assert tree.lookup(b"implied/deep").mode == stat.S_IFDIR | 0o755
    assert collect.calls == 4


def test_v7_directory_with_trailing_slash():
    block = raw_member(info("olddir/", tarfile.AREGTYPE, mode=0o751))
    block = patched(block[:512], 257, bytes(8)) + block[512:]  # no ustar magic
    tree, _ = walk(block + END)
    assert tree.lookup(b"olddir").mode == stat.S_IFDIR | 0o751


# ---------------------------------------------------------------------------------------------------------
# Real trees through GNU tar.


def make_real_tree(root: str) -> None:
    j = lambda *p: os.path.join(root, *p)  # noqa: E731
    os.makedirs(j("dir", "sub"))
    os.chmod(j("dir"), 0o2775)
    os.mkdir(j("tmp"))
    os.chmod(j("tmp"), 0o1777)
    with open(j("dir", "data"), "wb") as f:
        f.write(os.urandom(5 * CHUNK + 17))
    with open(j("setuid"), "wb") as f:
        f.write(b"#!/bin/sh\n")
    os.chmod(j("setuid"), 0o4755)
    open(j("empty"), "wb").close()
    os.link(j("dir", "data"), j("hardlink1"))
    os.link(j("dir", "data"), j("tmp", "hardlink2"))
    os.symlink("dir/data", j("symlink"))
    os.symlink("/nowhere/" + "x" * 150, j("dangling"))
    os.mkfifo(j("fifo"), 0o600)
    with open(os.path.join(os.fsencode(root), b"caf\xe9-" + b"n" * 200), "wb") as f:
        f.write(b"non-utf8, long")
    os.setxattr(j("dir", "data"), "user.comment", b"\x00binary\xff")
    for k, path in enumerate(sorted(os.listdir(root))):
        os.utime(os.path.join(root, path), ns=(MTIME_NS, MTIME_NS + 1000 * k), follow_symlinks=False)


def expected_from_disk(root: str) -> dict:
    """describe()-like entries computed from lstat, for comparison with the tar's nodes."""
    root_b = os.fsencode(root)
    out = {}
    inode_of = {}
    for dirpath, dirnames, filenames in os.walk(root_b):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root_b)
            st = os.lstat(path)
            inode_of[rel] = st.st_ino if not stat.S_ISDIR(st.st_mode) else rel
            content = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
            xattrs = sorted((os.fsencode(n), os.getxattr(path, n, follow_symlinks=False))
                            for n in os.listxattr(path, follow_symlinks=False))  # fmt: skip
            size = st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else 0
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else b""
            rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else 0
            out[rel] = (stat.filemode(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, size, target, rdev,
                        xattrs, content)  # fmt: skip
    return with_link_groups(out, inode_of)


def gnu_tar(root: str, out: str, *args: str) -> None:
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", *args, "-C", root, "-cf", out, "."], check=True)


def test_gnu_tar_of_a_real_tree_gives_the_same_nodes(tmp_path):
    root = str(tmp_path / "root")
    os.mkdir(root)
    make_real_tree(root)
    archive = str(tmp_path / "t.tar")
    gnu_tar(root, archive, "--format=posix")
    collect = Collect()
    tree = walk_tar(archive, on_file=collect)
    got = describe(tree, collect)
    got.pop(b"")
    assert got == expected_from_disk(root)
    assert tree.lookup(b"hardlink1") is tree.lookup(b"dir/data") is tree.lookup(b"tmp/hardlink2")
    assert tree.lookup(b"hardlink1").nlink == 3  # walk_tar finished the tree


@pytest.mark.root  # mknod and chown
def test_gnu_tar_of_a_real_tree_with_devices_and_owners(tmp_path):
    root = str(tmp_path / "root")
    os.mkdir(root)
    make_real_tree(root)
    os.mknod(os.path.join(root, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(os.path.join(root, "loop"), stat.S_IFBLK | 0o660, os.makedev(7, 300))
    os.chown(os.path.join(root, "setuid"), BIG_UID, 12345)
    os.chmod(os.path.join(root, "setuid"), 0o4755)
    os.setxattr(os.path.join(root, "dir"), "trusted.note", b"t")
    for path in ("null", "loop", "setuid"):
        os.utime(os.path.join(root, path), ns=(MTIME_NS, MTIME_NS), follow_symlinks=False)
    archive = str(tmp_path / "t.tar")
    gnu_tar(root, archive, "--format=posix", "--numeric-owner")
    collect = Collect()
    got = describe(walk_tar(archive, on_file=collect), collect)
    got.pop(b"")
    assert got == expected_from_disk(root)


def sparse_file(path: str) -> bytes:
    """A 1 MiB + 100 file with data at 3 places, one across a chunk boundary; returns its content."""
    size = (1 << 20) + 100
    content = bytearray(size)
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in ((5 * CHUNK + 10, b"abc"), (100 * CHUNK - 2, b"across"), (size - 50, b"end")):
            f.seek(offset)
            f.write(data)
            content[offset : offset + len(data)] = data
    return bytes(content)


@pytest.mark.parametrize("options", [
    ["--format=gnu"], ["--format=posix", "--sparse-version=0.0"], ["--format=posix", "--sparse-version=0.1"],
    ["--format=posix", "--sparse-version=1.0"],
])  # fmt: skip
def test_gnu_sparse_files(tmp_path, options):
    root = tmp_path / "root"
    root.mkdir()
    content = sparse_file(str(root / "sparse"))
    (root / "after").write_bytes(b"framing is intact")
    archive = str(tmp_path / "s.tar")
    subprocess.run(["tar", "--sparse", *options, "-C", str(root), "-cf", archive, "sparse", "after"], check=True)
    assert os.path.getsize(archive) < 64 * 1024  # really stored sparse
    collect = Collect()
    tree = walk_tar(archive, on_file=collect)
    node = tree.lookup(b"sparse")
    assert node.size == len(content) and collect.of(tree, b"sparse") == content
    data_pieces = {5, 99, 100, len(content) // CHUNK}
    assert set(range(-(-len(content) // CHUNK))) - set(collect.holes[id(node)]) <= data_pieces
    assert 0 in collect.holes[id(node)]
    assert collect.of(tree, b"after") == b"framing is intact"


# ---------------------------------------------------------------------------------------------------------
# Compression.


def test_gzip_zstd_multiframe_and_pipes_give_the_same_tree(tmp_path):
    plain = make_tar(everything())
    expected = describe(*walk(plain))
    (tmp_path / "t.tar").write_bytes(plain)
    subprocess.run(["gzip", "-k", str(tmp_path / "t.tar")], check=True)
    subprocess.run(["zstd", "-q", "-k", str(tmp_path / "t.tar")], check=True)
    half = len(plain) // 2
    cctx = zstandard.ZstdCompressor()
    inputs = {
        "gzip cli": (tmp_path / "t.tar.gz").read_bytes(),
        "zstd cli": (tmp_path / "t.tar.zst").read_bytes(),
        "gzip members": gzip.compress(plain[:half]) + gzip.compress(plain[half:]),
        "zstd frames": cctx.compress(plain[:half]) + cctx.compress(plain[half:]),
    }
    for name, data in inputs.items():
        assert describe(*walk(data)) == expected, name
    # A pipe: no seek, short reads.
    with subprocess.Popen(["zstd", "-dc", str(tmp_path / "t.tar.zst")], stdout=subprocess.PIPE) as proc:
        collect = Collect()
        assert describe(walk_tar(proc.stdout, on_file=collect), collect) == expected
    assert describe(*walk(plain)) == expected
    collect = Collect()
    assert describe(walk_tar(str(tmp_path / "t.tar.gz"), on_file=collect), collect) == expected


@pytest.mark.parametrize("compress", [lzma.compress, bz2.compress], ids=["xz", "bzip2"])
def test_other_compressions_are_unsupported(compress):
    with pytest.raises(UnsupportedError):
        walk(compress(make_tar([file("f", b"x")])))


# ---------------------------------------------------------------------------------------------------------
# The streaming contract.


def test_reader_is_valid_only_until_the_iterator_moves_on():
    nodes = tar_nodes(io.BytesIO(make_tar([file("a", b"A" * 10000), file("b", b"B" * 10)])), source="t")
    path, a = next(nodes)
    reader = a.reader
    pieces = reader(CHUNK)
    assert next(pieces) == b"A" * CHUNK  # partly read
    with pytest.raises(RuntimeError, match="once"):
        reader(CHUNK)
    path, b = next(nodes)  # skips the rest of a
    assert a.reader is None
    with pytest.raises(RuntimeError, match="moved past"):
        next(pieces)
    with pytest.raises(RuntimeError, match="moved past"):
        reader(CHUNK)
    assert (path, b"".join(b.reader(CHUNK))) == (b"b", b"B" * 10)


def test_unread_content_is_skipped_and_metadata_only_trees():
    link = info("l", tarfile.LNKTYPE, linkname="a")
    data = make_tar([file("a", os.urandom(100_000)), file("b", b"bee"), (link, None)])
    tree = walk_tar(io.BytesIO(data), on_file=None)
    a = tree.lookup(b"a")
    assert a.size == 100_000 and a.reader is None and a.chunks is None
    assert tree.lookup(b"l") is a and tree.lookup(b"b").size == 3


def test_on_file_is_called_once_per_file_while_readable():
    seen = []

    def on_file(node):
        seen.append((node.source, b"".join(node.reader(7))))

    members = [file("x", b"0123456789"), (info("y", tarfile.LNKTYPE, linkname="x"), None), file("z", b"zz")]
    walk_tar(io.BytesIO(make_tar(members)), on_file=on_file)
    assert seen == [("x", b"0123456789"), ("z", b"zz")]


def test_tar_into_an_existing_tree():
    tree = Tree()
    walk_tar(io.BytesIO(make_tar([file("one", b"1")])), on_file=None, tree=tree)
    walk_tar(io.BytesIO(make_tar([file("two", b"2")])), on_file=None, tree=tree)
    assert set(tree.root.children) == {b"one", b"two"}


# ---------------------------------------------------------------------------------------------------------
# Hostile input: one test per kind. Member-level problems can be skipped with lenient=True.


def assert_skipped_leniently(data: bytes, caplog, survivor: bytes = b"ok") -> Tree:
    with caplog.at_level(logging.WARNING):
        tree, collect = walk(data, lenient=True)
    assert "skipped" in caplog.text
    assert collect.of(tree, survivor) == b"survivor"
    return tree


OK = file("ok", b"survivor")


@pytest.mark.parametrize("name", ["../etc/passwd", "a/../../b", "/..", "x/.."])
def test_dotdot_names_are_refused(name, caplog):
    data = make_tar([file(name, b"evil"), OK])
    with pytest.raises(MemberError, match=r"'\.\.'") as exc:
        walk(data)
    assert name in str(exc.value) and "at offset 0" in str(exc.value)
    tree = assert_skipped_leniently(data, caplog)
    assert set(tree.root.children) == {b"ok"}


def test_nul_in_a_pax_name_is_refused(caplog):
    data = make_tar([file("a", b"x", pax_headers={"path": "a\0b"}), OK])
    with pytest.raises(MemberError, match="NUL"):
        walk(data)
    assert_skipped_leniently(data, caplog)


@pytest.mark.parametrize("target, message", [
    ("missing", "no earlier member"), ("../outside", r"'\.\.'"), ("dir", "directory"), ("later", "no earlier member"),
])  # fmt: skip
def test_bad_hard_links_are_refused(target, message, caplog):
    data = make_tar([
        (info("dir", tarfile.DIRTYPE), None),
        (info("link", tarfile.LNKTYPE, linkname=target), None),
        file("later", b"too late"),
        OK,
    ])
    with pytest.raises(MemberError, match=message) as exc:
        walk(data)
    assert "member link at offset 512" in str(exc.value)
    tree = assert_skipped_leniently(data, caplog)
    assert tree.lookup(b"link") is None


def test_negative_size_is_fatal():
    block = raw_member(info("f"), fmt=tarfile.GNU_FORMAT)
    data = patched(block, 124, b"\xff" * 12) + END
    for lenient in (False, True):
        with pytest.raises(InputError, match="negative size"):
            walk(data, lenient=lenient)


@pytest.mark.parametrize("cut", [100, 512, 3512, 8600, 8714], ids=[
    "inside the first header", "before any data", "inside data", "inside padding", "inside the second header",
])  # fmt: skip
def test_truncated_archives_are_fatal_even_when_lenient(cut):
    data = make_tar([file("a", os.urandom(8000)), file("b", b"b")])
    for lenient in (False, True):
        with pytest.raises(InputError, match="truncated"):
            walk(data[:cut], lenient=lenient)


def test_size_beyond_the_data_present_is_truncation():
    block = raw_member(info("f", size=1 << 30))[:512]
    with pytest.raises(InputError, match="truncated") as exc:
        walk(block + b"x" * 5000)
    assert "member f at offset 0" in str(exc.value)


def test_missing_end_marker_and_empty_input_are_truncation():
    data = make_tar([file("f", b"data")])
    with pytest.raises(InputError, match="truncated"):
        walk(data.rstrip(b"\0").ljust(1024, b"\0"))  # header + padded data, no zero blocks
    with pytest.raises(InputError, match="truncated"):
        walk(b"")


def test_truncated_compressed_streams(tmp_path):
    plain = make_tar([file("f", os.urandom(50_000))])
    for data in (gzip.compress(plain), zstandard.ZstdCompressor().compress(plain)):
        with pytest.raises(InputError, match="truncated"):
            walk(data[: len(data) // 2])


def test_corrupt_gzip_is_an_input_error():
    data = bytearray(gzip.compress(make_tar([file("f", os.urandom(5000))])))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(InputError):
        walk(bytes(data))


def test_a_lone_zero_block_at_the_end_is_accepted_but_data_after_one_is_not():
    data = make_tar([file("f", b"x")])
    body = data[:1024]
    tree, _ = walk(body + bytes(512))
    assert tree.lookup(b"f") is not None
    hidden = raw_member(*file("hidden", b"h"))
    with pytest.raises(InputError, match="after a zero block"):
        walk(body + bytes(512) + hidden + END)


def test_file_over_the_size_limit(caplog):
    data = make_tar([file("big", bytes(100_000)), OK])
    with pytest.raises(MemberError, match="max_file_size"):
        walk(data, limits=TarLimits(max_file_size=65536))
    with caplog.at_level(logging.WARNING):
        tree, collect = walk(data, lenient=True, limits=TarLimits(max_file_size=65536))
    assert tree.lookup(b"big") is None and collect.of(tree, b"ok") == b"survivor"


def test_bad_header_checksum_is_fatal():
    data = bytearray(make_tar([file("a", b"x" * 600), file("b", b"y")]))
    data[1536 + 10] ^= 0x20  # in the name of b's header, which starts at 512 + 1024
    for lenient in (False, True):
        with pytest.raises(InputError, match="checksum") as exc:
            walk(bytes(data), lenient=lenient)
        assert "offset 1536" in str(exc.value)


def test_header_sum_is_the_byte_sum_with_the_checksum_field_as_spaces():
    blocks = [bytes(512), b"\xff" * 512, *(random.Random(seed).randbytes(512) for seed in range(200)),
              raw_member(info("a", size=3), b"abc")[:512]]
    for block in blocks:
        assert header_sum(block) == sum(block[:148]) + 8 * 32 + sum(block[156:])


@pytest.mark.parametrize("field, mode", [
    (b"0000644\0", 0o644), (b"644\0\0\0\0\0", 0o644), (b"644     ", 0o644), (b" 644   \0", 0o644),
    (b"\0" * 8, 0), (b" " * 8, 0), (b"644\0junk", 0o644), (b"000755 \0", 0o755),
])  # fmt: skip
def test_octal_fields_padded_every_way(field, mode):
    """The header's numbers as any writer pads them: what the fast path and the general rules both read."""
    block = patched(raw_member(info("f", size=1), b"x")[:512], 100, field)
    tree, _ = walk(block + b"x" + bytes(511) + END)
    assert stat.S_IMODE(tree.lookup(b"f").mode) == mode


@pytest.mark.parametrize("field", [b"64 4\0\0\0\0", b"0000648\0", b"+644\0\0\0\0", b"6_44\0\0\0\0", b"-644\0\0\0\0"])
def test_octal_fields_that_are_not_octal(field):
    block = patched(raw_member(info("f", size=1), b"x")[:512], 100, field)
    with pytest.raises(InputError, match="not an octal number"):
        walk(block + b"x" + bytes(511) + END)


def test_only_file_pieces_of_zeros_are_exempt_from_the_expansion_limit():
    """Zero padding, zero header blocks and other reads count towards the expansion limit; only whole file
    pieces of zeros (what the build stores as holes) do not."""
    stream = _TarStream(io.BytesIO(bytes(4096)), None, "t", TarLimits())
    stream.read(512, "a header", "t")
    stream.skip(1024, "padding", "t")
    assert stream.zero_bytes == 0
    stream.read(2048, "a piece", "t", piece=True)
    assert stream.zero_bytes == 2048 and stream.offset == 3584


@pytest.mark.parametrize("seed", range(20))
def test_not_a_tar_at_all(seed):
    with pytest.raises(InputError, match="checksum"):
        walk(b"\0" + random.Random(seed).randbytes(4095))  # (a leading NUL: no compression magic)


def test_header_only_member_claiming_data_is_fatal():
    block = raw_member(info("link", tarfile.SYMTYPE, linkname="x"))
    data = patched(block, 124, b"%011o\0" % 512) + bytes(512) + END
    with pytest.raises(InputError, match="claims 512 bytes"):
        walk(data, lenient=True)


def test_oversized_and_malformed_pax_headers_are_fatal():
    big = make_tar([file("f", b"", pax_headers={"comment": "c" * 5000})])
    with pytest.raises(InputError, match="max_header_size"):
        walk(big, limits=TarLimits(max_header_size=4096))
    pax = b"30 path=short\n"  # the length says 30, the record has 14 bytes
    xheader = raw_member(info("././@PaxHeader", tarfile.XHDTYPE, size=len(pax)), pax)
    with pytest.raises(InputError, match="malformed PAX record"):
        walk(xheader + raw_member(*file("f", b"")) + END, lenient=True)


def test_unknown_member_type(caplog):
    odd = info("odd", b"Z")
    data = raw_member(odd, b"z" * 700)
    data = patched(data[:512], 124, b"%011o\0" % 700) + data[512:]
    data += raw_member(*OK) + END
    with pytest.raises(MemberError, match="unsupported member type"):
        walk(data)
    assert_skipped_leniently(data, caplog)  # its data was skipped correctly


def test_overlay_xattrs_are_refused(caplog):
    data = make_tar([file("f", b"", pax_headers={"SCHILY.xattr.trusted.overlay.opaque": "y"}), OK])
    with pytest.raises(MemberError, match="reserved for OverlayFS"):
        walk(data)
    assert_skipped_leniently(data, caplog)


@pytest.mark.parametrize("attrs, message", [
    ({"uid": 1 << 33}, "uid"),
    ({"pax_headers": {"gid": "12x"}}, "gid"),
    ({"pax_headers": {"mtime": "soon"}}, "mtime"),
    ({"pax_headers": {"mtime": "9" * 30}}, "out of range"),
    ({"pax_headers": {"SCHILY.xattr.": "v"}}, "xattr name"),
    ({"pax_headers": {"LIBARCHIVE.xattr.user.x": "***"}}, "base64"),
])  # fmt: skip
def test_bad_member_fields(attrs, message, caplog):
    data = make_tar([file("f", b"", **attrs), OK])
    with pytest.raises(MemberError, match=message):
        walk(data)
    assert_skipped_leniently(data, caplog)


def test_device_numbers_beyond_linux_dev_t(caplog):
    data = make_tar([(info("dev", tarfile.CHRTYPE, devmajor=5000, devminor=1), None), OK])
    with pytest.raises(MemberError, match="device major 5000"):
        walk(data)
    assert_skipped_leniently(data, caplog)


def test_invalid_symlink_targets(caplog):
    data = make_tar([(info("s", tarfile.SYMTYPE, linkname="a", pax_headers={"linkpath": "a\0b"}), None), OK])
    with pytest.raises(MemberError, match="symlink target"):
        walk(data)
    assert_skipped_leniently(data, caplog)


def test_entries_below_a_file_or_a_symlink(caplog):
    for first in (file("etc", b"a file"), (info("etc", tarfile.SYMTYPE, linkname="/etc"), None)):
        link = info("shadow", tarfile.LNKTYPE, linkname="etc/passwd")
        data = make_tar([first, file("etc/passwd", b"root::0:0"), (link, None), OK])
        with pytest.raises(InputError, match="not a directory"):
            walk(data)
        tree = assert_skipped_leniently(data, caplog)
        assert tree.lookup(b"etc/passwd") is None and tree.lookup(b"shadow") is None


def test_decompression_bomb_and_total_limits():
    letters = make_tar([file("letters", b"A" * (32 << 20))])
    bomb = zstandard.ZstdCompressor().compress(letters)
    limits = TarLimits(max_expansion=100, expansion_allowance=1 << 20)
    with pytest.raises(InputError, match="decompression bomb"):
        walk_tar(io.BytesIO(bomb), on_file=Collect(), limits=limits)
    with pytest.raises(InputError, match="decompression bomb"):
        walk_tar(io.BytesIO(gzip.compress(letters, 1)), on_file=Collect(), limits=limits)
    with pytest.raises(InputError, match="max_tar_bytes"):
        walk_tar(io.BytesIO(letters), on_file=None, limits=TarLimits(max_tar_bytes=1 << 20))
    assert walk_tar(io.BytesIO(bomb), on_file=None).lookup(b"letters").size == 32 << 20  # default limits


def test_zeros_the_build_stores_as_holes_do_not_count_as_expansion():
    """A file of zeros compresses beyond any ratio but costs the layer nothing: the same limits pass it,
    read piece by piece as the chunker reads it, and still catch a bomb of anything else around it."""
    limits = TarLimits(max_expansion=100, expansion_allowance=1 << 20)
    zeros = zstandard.ZstdCompressor().compress(make_tar([file("zeros", bytes(32 << 20))]))
    collect = Collect(chunk=1 << 20)
    tree = walk_tar(io.BytesIO(zeros), on_file=collect, limits=limits)
    assert tree.lookup(b"zeros").size == 32 << 20 and collect.content[id(tree.lookup(b"zeros"))] == bytes(32 << 20)
    mixed = zstandard.ZstdCompressor().compress(make_tar([file("zeros", bytes(32 << 20)),
                                                           file("letters", b"A" * (32 << 20))]))
    with pytest.raises(InputError, match="decompression bomb"):
        walk_tar(io.BytesIO(mixed), on_file=Collect(chunk=1 << 20), limits=limits)


# Sparse maps: hand-made PAX 0.1 / 0.0 / 1.0 members, valid and hostile.


def sparse_01(segments: list[tuple[int, int]], realsize: int, stored: int | None = None, **extra) -> list:
    total = sum(length for _, length in segments) if stored is None else stored
    pax = {"GNU.sparse.map": ",".join(f"{o},{n}" for o, n in segments), "GNU.sparse.size": str(realsize),
           "GNU.sparse.numblocks": str(len(segments)), **extra}  # fmt: skip
    return [file("sp", bytes(range(256)) * (total // 256) + bytes(total % 256), pax_headers=pax), OK]


def test_valid_hand_made_sparse_maps():
    data = make_tar(sparse_01([(0, 256), (3 * CHUNK, 512), (10 * CHUNK, 0)], 10 * CHUNK))
    tree, collect = walk(data)
    content = collect.of(tree, b"sp")
    assert len(content) == 10 * CHUNK and content[:256] == bytes(range(256))
    assert content[3 * CHUNK : 3 * CHUNK + 512] == bytes(range(256)) * 2
    assert content.count(0) == len(content) - 768 + 3  # holes, and the zero byte of each range(256)
    assert collect.holes[id(tree.lookup(b"sp"))] == [1, 2, 4, 5, 6, 7, 8, 9]
    # Format 0.0: repeated offset / numbytes records.
    pax = b"".join(pax_record(b"GNU.sparse." + key, value) for key, value in [
        (b"size", b"9000"), (b"numblocks", b"2"),
        (b"offset", b"100"), (b"numbytes", b"2"), (b"offset", b"5000"), (b"numbytes", b"3"),
    ])  # fmt: skip
    xheader = raw_member(info("./PaxHeaders/sp", tarfile.XHDTYPE, size=len(pax)), pax)
    tree, collect = walk(xheader + raw_member(*file("sp", b"abcde")) + END)
    content = collect.of(tree, b"sp")
    assert len(content) == 9000 and content[100:102] == b"ab" and content[5000:5003] == b"cde"


@pytest.mark.parametrize("segments, realsize, stored, message", [
    ([(512, 100), (0, 100)], 4096, None, "unsorted"),
    ([(0, 200), (100, 100)], 4096, None, "overlaps"),
    ([(0, 100), (4000, 200)], 4096, None, "past the file's size"),
    ([(0, 100)], 4096, 200, "covers 100 bytes but the member stores 200"),
    ([(0, 10)], 4096, None, None),  # valid: the control case
])  # fmt: skip
def test_absurd_sparse_maps(segments, realsize, stored, message, caplog):
    data = make_tar(sparse_01(segments, realsize, stored))
    if message is None:
        walk(data)
        return
    with pytest.raises(MemberError, match=message):
        walk(data)
    tree = assert_skipped_leniently(data, caplog)
    assert tree.lookup(b"sp") is None


def test_sparse_map_numblocks_mismatch_and_segment_limit(caplog):
    data = make_tar(sparse_01([(0, 10), (100, 10)], 4096, **{"GNU.sparse.numblocks": "3"}))
    with pytest.raises(MemberError, match="numblocks"):
        walk(data)
    data = make_tar(sparse_01([(i * 10, 1) for i in range(50)], 4096))
    with pytest.raises(MemberError, match="max_sparse_segments"):
        walk(data, limits=TarLimits(max_sparse_segments=20))
    with caplog.at_level(logging.WARNING):
        tree, collect = walk(data, lenient=True, limits=TarLimits(max_sparse_segments=20))
    assert collect.of(tree, b"ok") == b"survivor"


@pytest.mark.parametrize("options", [["--format=gnu"], ["--format=posix", "--sparse-version=1.0"]])
def test_segment_limit_in_gnu_tar_sparse_formats(tmp_path, options, caplog):
    root = tmp_path / "root"
    root.mkdir()
    sparse_file(str(root / "sparse"))
    (root / "ok").write_bytes(b"survivor")
    archive = tmp_path / "s.tar"
    subprocess.run(["tar", "--sparse", *options, "-C", str(root), "-cf", str(archive), "sparse", "ok"], check=True)
    limits = TarLimits(max_sparse_segments=2)
    with pytest.raises(MemberError, match="segments"):
        walk(archive.read_bytes(), limits=limits)
    with caplog.at_level(logging.WARNING):
        tree, collect = walk(archive.read_bytes(), lenient=True, limits=limits)
    assert tree.lookup(b"sparse") is None and collect.of(tree, b"ok") == b"survivor"


def test_malformed_sparse_map_1_0(caplog):
    pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "4096", "GNU.sparse.name": "sp"}
    for map_text in (b"1\n0\nabc\n", b"99999999\n", b"2\n0\n10\n"):  # bad number, too many, runs past the data
        body = map_text.ljust(512, b"\0") + b"x" * 10
        data = make_tar([file("GNUSparseFile.0/sp", body, pax_headers=pax), OK])
        with pytest.raises(MemberError, match="sparse map"):
            walk(data)
        tree = assert_skipped_leniently(data, caplog)
        assert tree.lookup(b"sp") is None


# ---------------------------------------------------------------------------------------------------------
# Plain members (walk_tar._plain_entry) against the general rules, and the stream's read-ahead.


def general_rules_only(monkeypatch) -> None:
    """Every member read by the general rules (_TarReader.member, _node_for), as before the plain path."""
    import erofs_builder.walk_tar as walk_tar_module

    monkeypatch.setattr(walk_tar_module, "_plain_entry", lambda *args: None)


def described_with_sources(data: bytes, **kw) -> dict:
    tree, collect = walk(data, **kw)
    sources = {path: node.source for path, node in tree.walk() if path}
    return {"nodes": describe(tree, collect), "sources": sources}


def plain_and_unusual_members() -> list:
    """Plain members of every kind, and members next to them that the plain path must leave alone."""
    return [
        (info("./", tarfile.DIRTYPE, mode=0o755, mtime=1_500_000_000), None),
        (info("./d", tarfile.DIRTYPE, mode=0o2775, uid=1000, gid=1000), None),
        file("./d/f", b"plain", uid=1000, gid=1000, mode=0o4755),
        file("./d/.hidden", b"dotfile"),
        file("d//double", b"an empty component"),
        file("./d/./dot", b"a '.' component"),
        file("/abs/olute", b"a leading slash"),
        file("a..b", b"two dots in a name"),
        file("l" * 60 + "/" + "n" * 80, b"a long name"),  # ustar: prefix; GNU: 'L'; PAX: path
        (info("link", tarfile.LNKTYPE, linkname="./d/f"), None),
        (info("link-to-long", tarfile.LNKTYPE, linkname="l" * 60 + "/" + "n" * 80), None),
        (info("sym", tarfile.SYMTYPE, linkname="d/f"), None),
        (info("longsym", tarfile.SYMTYPE, linkname="t" * 150), None),  # GNU: 'K'; PAX: linkpath
        file("empty", b""),
        file("big", os.urandom(3 * CHUNK + 7)),
        (info("fifo", tarfile.FIFOTYPE), None),
        file("after", b"framing intact"),
    ]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_plain_members_give_what_the_general_rules_give(fmt, monkeypatch):
    members = plain_and_unusual_members()
    if fmt == tarfile.USTAR_FORMAT:  # no long link names in ustar
        members = [m for m in members if m[0].name not in ("longsym", "link-to-long")]
    data = make_tar(members, fmt)
    import erofs_builder.walk_tar as walk_tar_module

    plain = []
    real = walk_tar_module._plain_entry
    monkeypatch.setattr(walk_tar_module, "_plain_entry", lambda *a: plain.append(real(*a)) or plain[-1])
    fast = described_with_sources(data)
    assert sum(entry is not None for entry in plain) >= 8  # the plain path took the plain members
    general_rules_only(monkeypatch)
    assert described_with_sources(data) == fast
    assert fast["nodes"][b"d/.hidden"][0] == "-rw-r--r--" and b"d/double" in fast["nodes"]


@pytest.mark.parametrize("options", [["--sparse"], ["--sparse", "--format=posix"], ["--sparse", "--format=oldgnu"]])
def test_gnu_tar_archives_plain_and_general_give_the_same_tree(tmp_path, options, monkeypatch):
    root = str(tmp_path / "root")
    os.mkdir(root)
    make_real_tree(root)
    sparse_file(os.path.join(root, "sparse"))
    archive = str(tmp_path / "t.tar")
    subprocess.run(["tar", *options, "-C", root, "-cf", archive, "."], check=True)
    with open(archive, "rb") as f:
        data = f.read()
    fast = described_with_sources(data)
    general_rules_only(monkeypatch)
    assert described_with_sources(data) == fast


@pytest.mark.parametrize("block_read", [512, 700, 1537, 4096])
def test_members_across_read_ahead_boundaries(block_read, monkeypatch):
    """Headers, padding and data cut by the read-ahead at any offset read as with one large buffer; so do
    truncations, which still name what they cut."""
    data = make_tar(plain_and_unusual_members(), tarfile.GNU_FORMAT)
    whole = described_with_sources(data)
    import erofs_builder.tar_input as tar_input_module

    monkeypatch.setattr(tar_input_module, "_BLOCK_READ", block_read)
    assert described_with_sources(data) == whole
    assert described_with_sources(gzip.compress(data)) == whole
    for cut in range(100, len(data) - 1024, 1111):
        with pytest.raises(InputError, match="truncated"):
            walk(data[:cut])


def test_truncated_plain_member_names_the_member_and_its_offset():
    data = make_tar([file("a", b"x" * 600), file("b", b"y" * 300)], tarfile.GNU_FORMAT)
    with pytest.raises(InputError, match="truncated") as exc:
        walk(data[:1536 + 512 + 100])  # inside b's data; b's header is at 512 + 1024
    assert exc.value.where.endswith("member b at offset 1536")
    with pytest.raises(InputError, match="truncated") as exc:
        walk(data[:512 + 300])  # inside a's data
    assert exc.value.where.endswith("member a at offset 0")


def test_a_plain_member_over_the_limits_meets_the_general_rules(caplog):
    """What the plain path does not take (a file over max_file_size, a header-only member with data, a
    hard link to a missing member, a signed checksum) is refused or read as the general rules say."""
    limits = TarLimits(max_file_size=4)
    with pytest.raises(MemberError, match="max_file_size"):
        walk(make_tar([file("big", b"12345")], tarfile.GNU_FORMAT), limits=limits)
    with pytest.raises(MemberError, match="which no earlier member is"):
        walk(make_tar([(info("l", tarfile.LNKTYPE, linkname="gone"), None)], tarfile.GNU_FORMAT))
    block = bytearray(raw_member(info("s", tarfile.SYMTYPE, linkname="t"))[:512])
    block[124:136] = b"00000000001\0"  # a symlink claiming a byte of data
    block[148:156] = b"%06o\0 " % header_sum(bytes(block))
    with pytest.raises(InputError, match="claims 1 bytes"):
        walk(bytes(block) + bytes(512) + END)


def test_truncated_gzip_names_the_member_cut_and_where_the_input_ends():
    """A gzip stream cut short: the error names the member whose data is cut and the uncompressed offset
    where the input ends, not a read-ahead begun at an earlier header (gzip's read drops what it had
    decompressed when it meets the early end)."""
    rng = random.Random(17)
    sizes = [50_000] * 30 + [900_000] + [50_000] * 9
    members = [file(f"f{i:02d}", rng.randbytes(size)) for i, size in enumerate(sizes)]
    plain = make_tar(members, tarfile.GNU_FORMAT)
    headers, offset = {}, 0
    for ti, data in members:
        headers[ti.name] = offset
        offset += 512 + -(-len(data) // 512) * 512
    compressed = gzip.compress(plain)
    for fraction in (0.3, 0.8):
        cut = compressed[: int(len(compressed) * fraction)]
        ends_at = len(zlib.decompressobj(31).decompress(cut))  # the uncompressed bytes the cut input holds
        name = max((n for n, at in headers.items() if at + 512 <= ends_at), key=headers.get)
        message = f"truncated: the compressed input ends at uncompressed offset {ends_at}$"
        with pytest.raises(InputError, match=message) as exc:
            walk(cut)
        assert exc.value.where.endswith(f"member {name} at offset {headers[name]}")
