"""diff_layers: two releases of a real project (idna sdists from PyPI) against an independent comparison of
the two source trees, every kind of change on a synthetic tree, hard links, chunk accounting, layers of
different chunk sizes, and the `dsecfs diff` command."""

from __future__ import annotations

import filecmp
import glob
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tarextract import extract_tar
from treecmp import snapshot

from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.diff import FIELDS, diff_layers

CHUNK = 4096
PYPI_CACHE = os.environ.get("DSECFS_TEST_PYPI", "/var/cache/dsecfs-test/pypi")
# idna 3.4 -> 3.7: most files change, setup.py, MANIFEST.in and a symlink (tools/intranges.py) go away.
RELEASES = ("idna", "3.4", "3.7")


@pytest.fixture
def store(tmp_path):
    return FilesystemStore(str(tmp_path / "store"), fsync=False)


def sdist(package: str, version: str) -> str:
    """The sdist of package==version from the cache, downloaded with pip the first time."""
    found = glob.glob(os.path.join(PYPI_CACHE, f"{package}-{version}.tar.gz"))
    if not found:
        os.makedirs(PYPI_CACHE, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                               ":all:", f"{package}=={version}", "-d", PYPI_CACHE], capture_output=True)
        found = glob.glob(os.path.join(PYPI_CACHE, f"{package}-{version}.tar.gz"))
        if done.returncode or not found:
            pytest.skip(f"cannot download {package}=={version}: {done.stderr.decode()[-300:]}")
    return found[0]


def extract(archive: str, dest) -> str:
    extract_tar(archive, str(dest))
    (top,) = os.listdir(dest)
    return os.path.join(dest, top)


def nlinks(root: str) -> dict[bytes, int]:
    """Link count of every non-directory below ``root``, by relative path."""
    root_b = os.fsencode(root)
    counts = {}
    for dirpath, dirs, files in os.walk(root_b):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            counts[os.path.relpath(path, root_b)] = os.lstat(path).st_nlink
    return counts


def expected_diff(root_a: str, root_b: str) -> tuple[list[bytes], list[bytes], dict[bytes, set[str]]]:
    """(added, removed, changed path -> fields) from the two source trees themselves."""
    (entries_a, _), (entries_b, _) = snapshot(root_a), snapshot(root_b)
    links_a, links_b = nlinks(root_a), nlinks(root_b)
    changed = {}
    for path in entries_a.keys() & entries_b.keys():
        ea, eb = entries_a[path], entries_b[path]
        fields = {name for name, a, b in [("type", ea.kind, eb.kind), ("mode", ea.mode, eb.mode),
                                          ("uid", ea.uid, eb.uid), ("gid", ea.gid, eb.gid),
                                          ("mtime", ea.mtime_ns, eb.mtime_ns), ("xattrs", ea.xattrs, eb.xattrs)]
                  if a != b}
        if ea.kind == eb.kind:
            for name, a, b in [("content", ea.content, eb.content), ("target", ea.target, eb.target),
                               ("rdev", ea.rdev, eb.rdev), ("nlink", links_a.get(path), links_b.get(path))]:
                if a != b:
                    fields.add(name)
        if fields:
            changed[path] = fields
    return sorted(entries_b.keys() - entries_a.keys()), sorted(entries_a.keys() - entries_b.keys()), changed


def assert_diff_matches(result, root_a: str, root_b: str) -> None:
    added, removed, changed = expected_diff(root_a, root_b)
    assert sorted(result.added) == added
    assert sorted(result.removed) == removed
    assert {c.path: set(c.fields) for c in result.changed} == changed
    for change in result.changed:
        assert list(change.fields) == [f for f in FIELDS if f in change.fields]
        assert change.a.keys() == change.b.keys() == set(change.fields)


def normalize(root: str) -> None:
    """Same owner, modes and times everywhere: only names and contents can differ between two trees."""
    for dirpath, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            path = os.path.join(dirpath, name)
            os.lchown(path, 0, 0)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
            os.utime(path, ns=(0, 10**18), follow_symlinks=False)
    os.utime(root, ns=(0, 10**18))


def chunk_digests(root: str) -> dict[bytes, int]:
    """digest -> length of every non-zero CHUNK-sized piece of every regular file below ``root``."""
    found = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                while piece := f.read(CHUNK):
                    if piece.count(0) != len(piece):
                        found[hashlib.sha256(piece).digest()] = len(piece)
    return found


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    package, old, new = RELEASES
    base = tmp_path_factory.mktemp("releases")
    return extract(sdist(package, old), base / "a"), extract(sdist(package, new), base / "b")


def test_diff_of_two_releases_lists_what_changed(releases, store):
    root_a, root_b = releases
    a = build_layer(root_a, store, chunk_size=CHUNK, name="pypi/idna:old").digest
    b = build_layer(root_b, store, chunk_size=CHUNK, name="pypi/idna:new").digest
    result = diff_layers(store, "pypi/idna:old", "pypi/idna:new")
    assert (result.a, result.b, result.content_by) == (a, b, "chunks")
    assert_diff_matches(result, root_a, root_b)

    # Content, checked against filecmp over the common regular files.
    common = [p for p in snapshot(root_a)[0].keys() & snapshot(root_b)[0].keys()
              if os.path.isfile(os.path.join(os.fsencode(root_a), p))
              and not os.path.islink(os.path.join(os.fsencode(root_a), p))]
    differ = {p for p in common if not filecmp.cmp(os.path.join(os.fsencode(root_a), p),
                                                   os.path.join(os.fsencode(root_b), p), shallow=False)}
    assert differ and len(differ) < len(common)
    assert {c.path for c in result.changed if "content" in c.fields} == differ
    assert b"tools/intranges.py" in result.removed and b"setup.py" in result.removed

    # Chunks: what B needs that A does not have, from hashing the two trees directly.
    chunks_a, chunks_b = chunk_digests(root_a), chunk_digests(root_b)
    new = chunks_b.keys() - chunks_a.keys()
    assert result.chunks.new == len(new) and result.chunks.new_bytes == sum(chunks_b[d] for d in new)
    assert result.chunks.shared == len(chunks_a.keys() & chunks_b.keys())
    assert result.chunks.dropped == len(chunks_a.keys() - chunks_b.keys())

    backwards = diff_layers(store, b, a)
    assert (backwards.added, backwards.removed) == (result.removed, result.added)
    assert [c.path for c in backwards.changed] == [c.path for c in result.changed]


def test_with_metadata_equalised_only_the_differing_files_are_listed(releases, store, tmp_path):
    roots = []
    for name, root in zip("ab", releases):
        subprocess.run(["cp", "-a", root, str(tmp_path / name)], check=True)
        normalize(str(tmp_path / name))
        roots.append(str(tmp_path / name))
    digests = [build_layer(root, store, chunk_size=CHUNK).digest for root in roots]
    result = diff_layers(store, *digests)
    _added, removed, changed = expected_diff(*roots)
    assert all(fields == {"content"} for fields in changed.values())
    assert {c.path for c in result.changed} == set(changed)
    assert all(c.fields == ("content",) for c in result.changed)
    assert sorted(result.removed) == removed and not result.added


def same_times(root: str, *, but: str = "") -> None:
    """One mtime for every entry below and at ``root`` (but ``but``), so only what a test changes differs."""
    for dirpath, dirs, files in os.walk(root):
        for path in [dirpath] + [os.path.join(dirpath, name) for name in dirs + files]:
            if path != but:
                os.utime(path, ns=(0, 5), follow_symlinks=False)


def write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_every_kind_of_change_is_named(tmp_path, store):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for root in roots:
        write(f"{root}/same", b"unchanged")
        write(f"{root}/content", os.urandom(3 * CHUNK))
        write(f"{root}/mode", b"m")
        write(f"{root}/xattr", b"x")
        write(f"{root}/mtime", b"t")
        write(f"{root}/becomes-dir", b"a file first")
        write(f"{root}/gone/file", b"removed with its directory")
        os.symlink("target-one", f"{root}/link")
        write(f"{root}/linked", b"one name, then two")
        os.utime(f"{root}/mtime", ns=(0, 1_000_000_000))
    a, b = roots
    write(f"{b}/content", open(f"{a}/content", "rb").read()[:CHUNK] + os.urandom(2 * CHUNK))
    os.chmod(f"{b}/mode", 0o4711)
    os.setxattr(f"{b}/xattr", "user.note", b"\xff\x00")
    os.utime(f"{b}/mtime", ns=(0, 2_000_000_001))
    os.unlink(f"{b}/becomes-dir")
    write(f"{b}/becomes-dir/child", b"inside")
    os.remove(f"{b}/gone/file")
    os.rmdir(f"{b}/gone")
    os.remove(f"{b}/link")
    os.symlink("target-two", f"{b}/link")
    os.link(f"{b}/linked", f"{b}/second-name")
    write(f"{b}/new", b"added")
    for root in roots:
        same_times(root, but=f"{root}/mtime")
    result = diff_layers(store, *(build_layer(root, store, chunk_size=CHUNK).digest for root in roots))
    assert_diff_matches(result, a, b)
    fields = {c.path: c.fields for c in result.changed}
    assert fields == {
        b"content": ("content",), b"mode": ("mode",), b"xattr": ("xattrs",), b"mtime": ("mtime",),
        b"becomes-dir": ("type", "mode"), b"link": ("target",), b"linked": ("nlink",),
    }
    assert result.added == [b"becomes-dir/child", b"new", b"second-name"]
    assert result.removed == [b"gone", b"gone/file"]
    by_path = {c.path: c for c in result.changed}
    assert (by_path[b"mode"].a, by_path[b"mode"].b) == ({"mode": "0644"}, {"mode": "4711"})
    assert (by_path[b"xattr"].a, by_path[b"xattr"].b) == ({"xattrs": []}, {"xattrs": ["user.note"]})
    assert by_path[b"link"].b == {"target": "target-two"}
    assert by_path[b"becomes-dir"].b["type"] == "dir"
    # The first chunk of "content" is shared with A; its other two and the two new small files are new;
    # the old two and the contents of the removed files are only in A.
    assert (result.chunks.new, result.chunks.new_bytes) == (4, 2 * CHUNK + len(b"inside") + len(b"added"))
    assert (result.chunks.dropped, result.chunks.dropped_bytes) == (
        4, 2 * CHUNK + len(b"a file first") + len(b"removed with its directory"))

    text = result.text()
    assert "~ /content  content 12,288 bytes -> 12,288 bytes" in text
    assert "+ /becomes-dir/child" in text and "- /gone/file" in text
    assert "~ /mtime  mtime 1970-01-01T00:00:01.000000000Z -> 1970-01-01T00:00:02.000000001Z" in text
    lines = [line for line in text.splitlines() if line[:2] in ("+ ", "- ", "~ ")]
    assert [line[2:].split("  ")[0] for line in lines] == sorted(
        (line[2:].split("  ")[0] for line in lines), key=lambda p: p.encode().split(b"/"))


@pytest.mark.root
def test_owner_and_device_changes(tmp_path, store):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for root in roots:
        os.makedirs(root)
        write(f"{root}/owned", b"o")
        os.mknod(f"{root}/dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        os.mknod(f"{root}/blk", stat.S_IFBLK | 0o600, os.makedev(8, 1))
    a, b = roots
    os.chown(f"{b}/owned", 1000, 2000)
    os.remove(f"{b}/dev")
    os.mknod(f"{b}/dev", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    os.remove(f"{b}/blk")
    os.mkfifo(f"{b}/blk", 0o600)
    for root in roots:
        same_times(root)
    result = diff_layers(store, *(build_layer(root, store, chunk_size=CHUNK).digest for root in roots))
    assert_diff_matches(result, a, b)
    assert {c.path: (c.fields, c.a, c.b) for c in result.changed} == {
        b"owned": (("uid", "gid"), {"uid": 0, "gid": 0}, {"uid": 1000, "gid": 2000}),
        b"dev": (("rdev",), {"rdev": "1:3"}, {"rdev": "1:5"}),
        b"blk": (("type",), {"type": "blk"}, {"type": "fifo"}),
    }


def test_a_hard_linked_file_is_reported_once_per_name(tmp_path, store):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    for root in roots:
        write(f"{root}/one", b"shared inode")
        os.link(f"{root}/one", f"{root}/two")
        os.link(f"{root}/one", f"{root}/three")
    with open(f"{roots[1]}/one", "r+b") as f:
        f.write(b"SHARED")
    for root in roots:
        same_times(root)
    result = diff_layers(store, *(build_layer(root, store, chunk_size=CHUNK).digest for root in roots))
    assert [(c.path, c.fields) for c in result.changed] == [
        (b"one", ("content",)), (b"three", ("content",)), (b"two", ("content",))]


def test_layers_of_different_chunk_sizes_are_compared_by_data(tmp_path, store):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    data = os.urandom(5 * CHUNK + 10)
    for root in (a, b):
        write(f"{root}/same", data)
        write(f"{root}/edited", data)
    with open(f"{b}/edited", "r+b") as f:
        f.seek(3 * CHUNK)
        f.write(bytes([data[3 * CHUNK] ^ 0xFF]))  # a byte that differs (a fixed one matches 1 time in 256)
    for root in (a, b):
        same_times(root)
    layer_a = build_layer(a, store, chunk_size=CHUNK).digest
    layer_b = build_layer(b, store, chunk_size=2 * CHUNK).digest
    result = diff_layers(store, layer_a, layer_b)
    assert result.content_by == "data"
    assert [(c.path, c.fields) for c in result.changed] == [(b"edited", ("content",))]
    assert result.chunks.shared == 0


def test_the_diff_command(tmp_path, store):
    import cli.diff_cmds  # noqa: F401  (registers `diff` on the group, as cli/main.py does at its bottom)
    from cli.main import main

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write(f"{a}/file", b"one")
    write(f"{b}/file", b"two")
    write(f"{b}/added", b"new")
    layer_a = build_layer(a, store, chunk_size=CHUNK).digest
    layer_b = build_layer(b, store, chunk_size=CHUNK).digest
    runner = CliRunner()
    as_json = runner.invoke(main, ["diff", layer_a, layer_b, "--store", store.root, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == diff_layers(store, layer_a, layer_b).to_dict()
    assert json.loads(as_json.output)["added"] == ["/added"]
    as_text = runner.invoke(main, ["diff", layer_a, layer_b, "--store", store.root])
    assert as_text.exit_code == 0 and "+ /added" in as_text.output and "~ /file  " in as_text.output
    missing = runner.invoke(main, ["diff", layer_a, "no/such:ref", "--store", store.root])
    assert missing.exit_code == 6
