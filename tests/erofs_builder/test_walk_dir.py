"""walk_directory on real trees made in tmp_path: every inode kind, metadata, xattrs, links, sparse files,
and the input errors a build must report by path."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from treecmp import Entry, assert_same_tree, snapshot

from dsec_fs.errors import InputError
from erofs_builder.tree import Tree
from erofs_builder.walk_dir import stat_identity, walk_directory

pytestmark = pytest.mark.root  # mknod, chown, trusted.* xattrs

CHUNK = 4096
BIG_UID = 3_000_000_000  # beyond 16 bits and 31 bits
LONG_NAME = b"n" * 255
NON_UTF8 = b"caf\xe9-\xff\xfe"
SPARSE_SIZE = 5 << 30
MTIME_NS = 1_600_000_000_123_456_789


def make_everything(root: bytes) -> None:
    """A directory with every inode kind and the metadata a layer must keep."""
    j = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    os.mkdir(j(b"dir"), 0o2755)
    os.chmod(j(b"dir"), 0o2755)  # setgid survives the umask only through chmod
    os.mkdir(j(b"tmp"))
    os.chmod(j(b"tmp"), 0o1777)
    with open(j(b"dir", b"data"), "wb") as f:
        f.write(os.urandom(2 * CHUNK + 100))
    with open(j(b"empty"), "wb"):
        pass
    with open(j(b"setuid"), "wb") as f:
        f.write(b"#!/bin/sh\n")
    os.chown(j(b"setuid"), BIG_UID, BIG_UID + 1)
    os.chmod(j(b"setuid"), 0o4755)  # after chown, which clears setuid
    with open(j(b"sparse"), "wb") as f:
        f.truncate(SPARSE_SIZE)
        f.seek(3 << 30)
        f.write(b"data in the middle")
    os.link(j(b"dir", b"data"), j(b"hardlink1"))
    os.link(j(b"dir", b"data"), j(b"tmp", b"hardlink2"))
    os.symlink(b"dir/data", j(b"symlink"))
    os.symlink(b"/nowhere/" + b"x" * 3000, j(b"dangling"))
    os.mknod(j(b"null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(j(b"loop"), stat.S_IFBLK | 0o660, os.makedev(7, 300))
    os.mknod(j(b"whiteout"), stat.S_IFCHR, os.makedev(0, 0))
    os.mkfifo(j(b"fifo"), 0o600)
    os.mknod(j(b"socket"), stat.S_IFSOCK | 0o755)
    with open(j(LONG_NAME), "wb") as f:
        f.write(b"long")
    with open(j(NON_UTF8), "wb") as f:
        f.write(b"latin-1")
    os.setxattr(j(b"dir", b"data"), b"user.comment", b"hello")
    os.setxattr(j(b"dir", b"data"), b"trusted.overlay.opaque", b"y")
    os.setxattr(j(b"dir", b"data"), b"security.capability", b"\x01\x00\x00\x02" + bytes(16))
    os.setxattr(j(b"symlink"), b"trusted.link", b"\x00binary\xff", follow_symlinks=False)
    os.setxattr(j(b"dir"), b"user.empty", b"")
    if shutil.which("setfacl"):
        subprocess.run(["setfacl", "-m", "u:1234:r", j(b"setuid")], check=True)
        subprocess.run(["setfacl", "-d", "-m", "g:55:rx", j(b"tmp")], check=True)
    for path in (j(b"dir", b"data"), j(b"symlink"), j(b"fifo"), j(b"dir"), j(b"tmp")):
        os.utime(path, ns=(MTIME_NS, MTIME_NS), follow_symlinks=False)
    os.chmod(root, 0o750)
    os.utime(root, ns=(MTIME_NS, MTIME_NS + 1))


def read_all(node, chunk_size: int) -> bytes:
    out = bytearray()
    for piece in node.reader(chunk_size):
        out += piece if piece is not None else bytes(min(chunk_size, node.size - len(out)))
    return bytes(out)


def tree_snapshot(tree: Tree, *, content: bool = True):
    """The treecmp snapshot of a walked Tree, for comparison with the snapshot of the directory itself."""
    kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFCHR: "chr",
             stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "sock"}
    entries, paths_of = {}, {}
    for path, node in tree.walk():
        kind = kinds[stat.S_IFMT(node.mode)]
        digest = None
        if content and kind == "file":
            h = hashlib.sha256()
            done = 0
            for piece in node.reader(1 << 20):
                piece = piece if piece is not None else bytes(min(1 << 20, node.size - done))
                h.update(piece)
                done += len(piece)
            digest = h.hexdigest()
        entries[path] = Entry(
            kind=kind, mode=stat.S_IMODE(node.mode), uid=node.uid, gid=node.gid, mtime_ns=node.mtime_ns,
            size=node.size if kind in ("file", "symlink") else 0, content=digest,
            target=node.target if kind == "symlink" else None,
            rdev=(os.major(node.rdev), os.minor(node.rdev)) if kind in ("chr", "blk") else None,
            xattrs=tuple(sorted(node.xattrs.items())),
        )
        paths_of.setdefault(id(node), []).append(path)
    links = [frozenset(p) for p in paths_of.values() if len(p) > 1]
    return entries, sorted(links, key=sorted)


@pytest.fixture
def everything(tmp_path) -> bytes:
    root = os.fsencode(tmp_path / "src")
    os.mkdir(root)
    make_everything(root)
    return root


def test_walk_keeps_everything_a_layer_must(everything):
    tree = walk_directory(everything)
    # content=False: the 5 GiB sparse file is read below, through the reader, without hashing zeros
    assert_same_tree(snapshot(everything, content=False), tree_snapshot(tree, content=False))

    data = tree.lookup(b"dir/data")
    assert tree.lookup(b"hardlink1") is data and tree.lookup(b"tmp/hardlink2") is data
    assert data.nlink == 3
    assert read_all(data, CHUNK) == open(os.path.join(everything, b"dir", b"data"), "rb").read()
    assert tree.lookup(b"dir").mode == stat.S_IFDIR | 0o2755
    assert tree.lookup(b"setuid").mode == stat.S_IFREG | 0o4755
    assert tree.lookup(b"setuid").uid == BIG_UID and tree.lookup(b"setuid").gid == BIG_UID + 1
    assert tree.lookup(b"symlink").xattrs == {b"trusted.link": b"\x00binary\xff"}
    assert tree.lookup(b"dir").xattrs == {b"user.empty": b""}
    assert tree.lookup(b"loop").rdev == os.makedev(7, 300)
    assert tree.lookup(LONG_NAME).size == 4 and tree.lookup(NON_UTF8).size == 7
    assert tree.root.mode == stat.S_IFDIR | 0o750 and tree.root.mtime_ns == MTIME_NS + 1
    if shutil.which("setfacl"):
        assert b"system.posix_acl_access" in tree.lookup(b"setuid").xattrs
        assert b"system.posix_acl_default" in tree.lookup(b"tmp").xattrs

    st = os.lstat(os.path.join(everything, b"dir", b"data"))
    assert data.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)
    names = (b"dir/data", b"hardlink1", b"tmp/hardlink2")
    assert data.source in [os.fsdecode(os.path.join(everything, name)) for name in names]


def test_sparse_file_skips_holes_without_reading(everything):
    node = walk_directory(everything).lookup(b"sparse")
    assert node.size == SPARSE_SIZE
    pieces = list(node.reader(1 << 20))
    assert len(pieces) == SPARSE_SIZE >> 20
    data = [(i, p) for i, p in enumerate(pieces) if p is not None]
    assert len(data) == 1 and data[0][0] == (3 << 30) >> 20
    assert data[0][1].startswith(b"data in the middle") and len(data[0][1]) == 1 << 20


def test_the_same_tree_with_content(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    (root / "a").write_bytes(os.urandom(3 * CHUNK + 1))
    (root / "b").mkdir()
    (root / "b" / "c").write_bytes(b"")
    with open(root / "holey", "wb") as f:
        f.seek(5 * CHUNK)
        f.write(b"tail")
    tree = walk_directory(str(root))
    assert_same_tree(snapshot(root), tree_snapshot(tree))
    assert [p is None for p in tree.lookup(b"holey").reader(CHUNK)] == [True] * 5 + [False]


def test_symlinked_source_is_followed_but_nothing_below_it(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "link").symlink_to(tmp_path / "real")
    (tmp_path / "alias").symlink_to("real")
    tree = walk_directory(tmp_path / "alias")
    link = tree.lookup(b"link")
    assert link.is_symlink and link.target == os.fsencode(tmp_path / "real")


@pytest.mark.parametrize("make", ["missing", "file", "symlink-to-file"])
def test_a_source_that_is_not_a_directory(tmp_path, make):
    source = tmp_path / "source"
    if make == "file":
        source.write_bytes(b"x")
    elif make == "symlink-to-file":
        (tmp_path / "target").write_bytes(b"x")
        source.symlink_to("target")
    with pytest.raises(InputError) as info:
        walk_directory(str(source))
    assert info.value.where == str(source)


def test_a_file_that_grows_while_read(tmp_path):
    (tmp_path / "grows").write_bytes(bytes(CHUNK) + b"x" * CHUNK)
    node = walk_directory(tmp_path).lookup(b"grows")
    pieces = node.reader(CHUNK)
    next(pieces)
    with open(tmp_path / "grows", "ab") as f:
        f.write(b"more")
    with pytest.raises(InputError, match="changed while it was read") as info:
        list(pieces)
    assert info.value.where == str(tmp_path / "grows")


def test_a_file_changed_between_walk_and_read(tmp_path):
    (tmp_path / "f").write_bytes(b"before")
    node = walk_directory(tmp_path).lookup(b"f")
    (tmp_path / "f").write_bytes(b"after!")
    with pytest.raises(InputError, match="changed since the directory was scanned"):
        list(node.reader(CHUNK))


def test_a_walked_file_keeps_the_identity_of_its_lstat(tmp_path):
    """A regular file's identity and reader are made on demand (WalkedFile): the identity is the walk's
    lstat even after the build drops mode bits (sandbox commit drops setuid), and the file still reads."""
    (tmp_path / "suid").write_bytes(b"content")
    os.chmod(tmp_path / "suid", 0o4755)
    st = os.lstat(tmp_path / "suid")
    node = walk_directory(tmp_path).lookup(b"suid")
    assert node.identity == stat_identity(st)
    node.mode = stat.S_IFREG | 0o755
    assert node.identity == stat_identity(st)
    assert list(node.reader(CHUNK)) == [b"content"]


def test_a_file_replaced_by_a_symlink_is_not_followed(tmp_path):
    (tmp_path / "f").write_bytes(b"secret")
    node = walk_directory(tmp_path).lookup(b"f")
    (tmp_path / "f").unlink()
    (tmp_path / "f").symlink_to("/etc/hostname")
    with pytest.raises(InputError) as info:
        list(node.reader(CHUNK))
    assert info.value.where == str(tmp_path / "f")


def test_a_directory_replaced_by_a_symlink_to_itself_is_not_followed(tmp_path):
    """The file's inode is the walk's, but reaching it now takes a symlink: the read refuses it (the
    directory is opened beneath the root without following symlinks, then the file by its name)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"content")
    (tmp_path / "g").write_bytes(b"other")
    tree = walk_directory(tmp_path)
    assert list(tree.lookup(b"g").reader(CHUNK)) == [b"other"]
    (tmp_path / "sub").rename(tmp_path / "moved")
    (tmp_path / "sub").symlink_to("moved")
    with pytest.raises(InputError, match="symbolic links") as info:
        list(tree.lookup(b"sub/f").reader(CHUNK))
    assert info.value.where == str(tmp_path / "sub" / "f")


def test_files_of_several_directories_read_in_any_order(tmp_path):
    """Readers keep the fd of the directory last read: going back to an earlier directory reopens it."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(3):
            (tmp_path / name / f"f{i}").write_bytes(f"{name}{i}".encode() * 100)
    tree = walk_directory(tmp_path)
    for path in (b"a/f0", b"b/f0", b"a/f1", b"a/f2", b"b/f2", b"b/f1"):
        assert list(tree.lookup(path).reader(CHUNK)) == [path.replace(b"/f", b"") * 100]


# Root reads everything, so unreadable entries are made real by a child process whose capability bounding
# set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: for it, mode 000 means what it says.
UNPRIVILEGED_WALK = textwrap.dedent("""
    import sys
    from dsec_fs.errors import InputError
    from erofs_builder.walk_dir import stat_identity, walk_directory
    try:
        tree = walk_directory(sys.argv[1])
        for _path, node in tree.walk():
            if node.reader:
                list(node.reader(4096))
    except InputError as exc:
        print(exc.where)
        print(exc.message)
""")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("unreadable", ["file", "directory"])
def test_unreadable_entries_are_input_errors_naming_the_path(tmp_path, unreadable):
    (tmp_path / "src" / "sub").mkdir(parents=True)
    target = tmp_path / "src" / "sub" / ("secret" if unreadable == "file" else "locked")
    if unreadable == "file":
        target.write_bytes(b"secret")
    else:
        target.mkdir()
        (target / "inside").write_bytes(b"x")
    target.chmod(0)
    out = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", UNPRIVILEGED_WALK,
         str(tmp_path / "src")],
        capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    where, message = out.stdout.splitlines()
    assert where == str(target)
    assert "Permission denied" in message
