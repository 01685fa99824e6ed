"""Make and compare directory trees the way a layer must preserve them.

``write_files(root, {"a/b": data})`` writes regular files (parents made as needed) and returns root.

``snapshot(root)`` records, for every path below ``root``: file type, mode (with setuid/setgid/sticky),
uid, gid, mtime to the nanosecond, size, sha256 of the content, symlink target, rdev, xattrs, and which
paths are hard links of one another. ``assert_same_tree`` diffs two snapshots and reports every path that
differs, so a failing test says what was lost.

Directory mtimes are compared too: a builder that touched a directory would be wrong.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    kind: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    content: str | None
    target: bytes | None
    rdev: tuple[int, int] | None
    xattrs: tuple[tuple[bytes, bytes], ...]


_KINDS = {
    stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "sock",
}


def _xattrs(path: bytes) -> tuple[tuple[bytes, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return ()
    out = []
    for name in names:
        value = os.getxattr(path, name, follow_symlinks=False)
        out.append((os.fsencode(name), value))
    return tuple(sorted(out))


def _hash(path: bytes) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def snapshot(root: str | bytes, *, content: bool = True) -> tuple[dict[bytes, Entry], list[frozenset[bytes]]]:
    """(entries by relative path, hard-link groups) for the tree at ``root`` (the root itself is b"")."""
    root_b = os.fsencode(root)
    entries: dict[bytes, Entry] = {}
    by_inode: dict[tuple[int, int], list[bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        path = os.path.join(root_b, rel) if rel else root_b
        st = os.lstat(path)
        kind = _KINDS[stat.S_IFMT(st.st_mode)]
        entries[rel] = Entry(
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
            size=st.st_size if kind in ("file", "symlink") else 0,
            content=_hash(path) if content and kind == "file" else None,
            target=os.readlink(path) if kind == "symlink" else None,
            rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)) if kind in ("chr", "blk") else None,
            xattrs=_xattrs(path),
        )
        if kind != "dir" and st.st_nlink > 1:
            by_inode.setdefault((st.st_dev, st.st_ino), []).append(rel)
        if kind == "dir":
            for name in os.listdir(path):
                stack.append(os.path.join(rel, name) if rel else name)
    groups = [frozenset(paths) for paths in by_inode.values() if len(paths) > 1]
    return entries, sorted(groups, key=sorted)


def diff(a, b, *, limit: int = 20) -> list[str]:
    """Human-readable differences between two snapshots (at most ``limit`` lines)."""
    entries_a, links_a = a
    entries_b, links_b = b
    problems = []
    for path in sorted(set(entries_a) | set(entries_b)):
        ea, eb = entries_a.get(path), entries_b.get(path)
        if ea is None or eb is None:
            problems.append(f"{path!r}: only in {'second' if ea is None else 'first'}")
        elif ea != eb:
            fields = [f for f in Entry.__dataclass_fields__ if getattr(ea, f) != getattr(eb, f)]
            problems.append(f"{path!r}: " + ", ".join(f"{f} {getattr(ea, f)!r} != {getattr(eb, f)!r}" for f in fields))
        if len(problems) >= limit:
            break
    if set(links_a) != set(links_b):
        problems.append(f"hard-link groups differ: {sorted(map(sorted, set(links_a) ^ set(links_b)))[:5]}")
    return problems


def assert_same_tree(a, b) -> None:
    problems = diff(a, b)
    assert not problems, "trees differ:\n  " + "\n  ".join(problems)


def write_files(root, files: dict[str, bytes]) -> str:
    """Write ``files`` (relative path -> content) below ``root``, making root and parent directories (so
    ``{}`` makes an empty directory); returns root."""
    os.makedirs(root, exist_ok=True)
    for name, data in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)
