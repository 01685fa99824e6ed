"""Hypothesis strategies for directory trees, and ``materialise`` to create one on disk.

A spec is plain data (``Dir`` at the root, other entry classes below), so hypothesis can shrink it and a
failing example prints readably. ``tree_specs(chunk_size)`` draws trees meant to break an EROFS writer:
every inode kind, hard links, names from 1 to 255 bytes (non-UTF-8, and names starting with '!' or '-'
that sort before "."), file sizes around block and chunk boundaries, holes and written zeros, xattrs,
setuid/setgid/sticky bits, uid/gid above 65535, nanosecond mtimes, and big directories.

``materialise(spec, root)`` needs root (mknod, chown, trusted.* xattrs) and a filesystem with sparse
files and xattrs. It creates everything, then the hard links, then sets directory metadata deepest first,
so every mtime ends up exactly as the spec says.

Limits the kernel imposes on real files: a symlink target is at most 4095 bytes (PATH_MAX with its NUL);
user.* xattrs only go on regular files and directories; a socket path must fit sun_path (108 bytes),
so sockets are bound under a short /proc/self/fd path and renamed into place.
"""

from __future__ import annotations

import os
import random
import socket
import stat
from dataclasses import dataclass

from hypothesis import strategies as st

BLOCK = 4096
COMMON_MTIME_NS = 1_700_000_000_123_456_789  # most entries share it, so most inodes can be compact
SYMLINK_MAX = 4095


@dataclass(frozen=True)
class Meta:
    mode: int = 0o644  # permission bits, with setuid/setgid/sticky
    uid: int = 0
    gid: int = 0
    mtime_ns: int = COMMON_MTIME_NS
    xattrs: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True)
class File:
    meta: Meta = Meta()
    size: int = 0
    seed: int = 0  # the content of data blocks
    # One letter per 4 KiB block (the last may be partial): "d" data, "z" written zeros, "h" a hole.
    blocks: str = ""


@dataclass(frozen=True)
class Symlink:
    target: bytes
    meta: Meta = Meta(mode=0o777)


@dataclass(frozen=True)
class Device:
    kind: str  # "chr" or "blk"
    major: int
    minor: int
    meta: Meta = Meta(mode=0o600)


@dataclass(frozen=True)
class Fifo:
    meta: Meta = Meta()


@dataclass(frozen=True)
class Socket:
    meta: Meta = Meta(mode=0o755)


@dataclass(frozen=True)
class HardLink:
    """Another name for an existing non-directory: the ``index``-th (modulo) one created."""

    index: int


@dataclass(frozen=True)
class Dir:
    meta: Meta = Meta(mode=0o755)
    children: tuple[tuple[bytes, object], ...] = ()
    filler: int = 0  # extra empty files named 0000..., to make directories span several blocks
    filler_name_length: int = 8


Entry = File | Symlink | Device | Fifo | Socket | HardLink | Dir


def file_bytes(spec: File) -> bytes:
    """The content ``materialise`` writes for ``spec`` (holes read as zeros)."""
    out = bytearray(spec.size)
    for i, kind in enumerate(spec.blocks):
        if kind == "d":
            start, end = i * BLOCK, min((i + 1) * BLOCK, spec.size)
            out[start:end] = random.Random(spec.seed * 100_003 + i).randbytes(end - start)
    return bytes(out)


def exact_block_names() -> list[bytes]:
    """Names whose directory is exactly one full block: 13 + 14 (".", "..") + 289 * 14 + 23 = 4096."""
    two_letters = [bytes([a, b]) for a in range(97, 123) for b in range(97, 123)]
    return two_letters[:289] + [b"eleven-byte"]


# ---- materialise --------------------------------------------------------------------------------


def materialise(spec: Dir, root: str | bytes) -> None:
    """Create the tree ``spec`` at ``root`` (created if missing; it takes the root Dir's metadata)."""
    root = os.fsencode(root)
    os.makedirs(root, exist_ok=True)
    created: list[bytes] = []  # non-directories, in creation order, for hard links
    links: list[tuple[bytes, HardLink]] = []
    dirs: list[tuple[bytes, Dir]] = []
    _create_dir_contents(spec, root, created, links, dirs)
    for path, link in links:
        if created:
            os.link(created[link.index % len(created)], path, follow_symlinks=False)
    for path, dir_spec in reversed(dirs):  # children before parents: creating entries touches mtime
        _set_meta(path, dir_spec.meta, user_xattrs=True)
    _set_meta(root, spec.meta, user_xattrs=True)


def _create_dir_contents(spec: Dir, path: bytes, created: list, links: list, dirs: list) -> None:
    taken = {name for name, _child in spec.children}
    for i in range(spec.filler):
        filler_name = str(i).zfill(spec.filler_name_length).encode()
        if filler_name in taken:
            continue
        filler = os.path.join(path, filler_name)
        with open(filler, "wb"):
            pass
        _set_meta(filler, Meta(), user_xattrs=True)
    for name, child in sorted(spec.children, key=lambda item: item[0]):
        child_path = os.path.join(path, name)
        if isinstance(child, HardLink):
            links.append((child_path, child))
        elif isinstance(child, Dir):
            os.mkdir(child_path)
            dirs.append((child_path, child))
            _create_dir_contents(child, child_path, created, links, dirs)
        else:
            _create_leaf(child, child_path)
            created.append(child_path)


def _create_leaf(spec: Entry, path: bytes) -> None:
    if isinstance(spec, File):
        _write_file(spec, path)
    elif isinstance(spec, Symlink):
        os.symlink(spec.target, path)
    elif isinstance(spec, Device):
        kind = stat.S_IFCHR if spec.kind == "chr" else stat.S_IFBLK
        os.mknod(path, kind | 0o600, os.makedev(spec.major, spec.minor))
    elif isinstance(spec, Fifo):
        os.mkfifo(path)
    elif isinstance(spec, Socket):
        _make_socket(path)
    else:
        raise TypeError(f"not a leaf spec: {spec!r}")
    _set_meta(path, spec.meta, user_xattrs=isinstance(spec, File))


def _write_file(spec: File, path: bytes) -> None:
    content = file_bytes(spec)
    with open(path, "wb") as f:
        for i, kind in enumerate(spec.blocks):
            if kind != "h":
                f.seek(i * BLOCK)
                f.write(content[i * BLOCK:(i + 1) * BLOCK])
        f.truncate(spec.size)


def _make_socket(path: bytes) -> None:
    parent, name = os.path.split(path)
    fd = os.open(parent, os.O_PATH | os.O_DIRECTORY)
    try:
        short = b".sock-%d" % os.getpid()
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(b"/proc/self/fd/%d/%s" % (fd, short))
        os.rename(short, name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def _set_meta(path: bytes, meta: Meta, *, user_xattrs: bool) -> None:
    """xattrs, owner, mode (after chown, which clears setuid/setgid), then mtime, which nothing touches after."""
    for name, value in meta.xattrs:
        if user_xattrs or not name.startswith(b"user."):
            os.setxattr(path, name, value, follow_symlinks=False)
    os.chown(path, meta.uid, meta.gid, follow_symlinks=False)
    if not os.path.islink(path):
        os.chmod(path, meta.mode)
    os.utime(path, ns=(meta.mtime_ns, meta.mtime_ns), follow_symlinks=False)


# ---- strategies ---------------------------------------------------------------------------------

_NAME_BYTES = st.sampled_from(b"!-._~aAzZ09 \x01\x7f\x80\xc3\xff")
_FIXED_NAMES = [b"!", b"-", b"-.", b"!.", b".a", b"..a", b"...", b"a" * 255, b"\xff" * 255, b"\xc3\x28",
                b"-" * 254 + b"!"]


def names() -> st.SearchStrategy[bytes]:
    """File names: 1..255 bytes, no '/' or NUL, never "." or ".."."""
    return st.one_of(
        st.sampled_from(_FIXED_NAMES),
        st.lists(_NAME_BYTES, min_size=1, max_size=12).map(bytes),
        st.binary(min_size=1, max_size=255).map(lambda b: b.replace(b"/", b"_").replace(b"\0", b"_")),
        st.integers(1, 255).map(lambda n: bytes([0x61 + n % 26]) * n),
    ).filter(lambda name: name not in (b".", b".."))


def mtimes() -> st.SearchStrategy[int]:
    return st.one_of(
        st.just(COMMON_MTIME_NS),
        st.just(COMMON_MTIME_NS),
        st.integers(0, 2**33 * 10**9),  # to year 2242: a 64-bit seconds field
        st.sampled_from([0, 1, 999_999_999, COMMON_MTIME_NS + 1, COMMON_MTIME_NS // 10**9 * 10**9]),
    )


_IDS = st.sampled_from([0, 0, 0, 1, 1000, 65534, 65535, 65536, 100_000, 2**31, 2**32 - 2])


def xattr_sets(*, user: bool) -> st.SearchStrategy[tuple[tuple[bytes, bytes], ...]]:
    """Up to three xattrs; values up to ~1.5 KiB so inodes straddle blocks and tails need padding."""
    prefixes = [b"trusted.", b"security."] + ([b"user."] if user else [])
    name = st.tuples(st.sampled_from(prefixes), st.text("abcxyz._-", min_size=1, max_size=20)).map(
        lambda t: t[0] + b"t" + t[1].encode())
    value = st.one_of(st.binary(max_size=40), st.integers(0, 1500).map(lambda n: bytes([n % 251]) * n))
    return st.dictionaries(name, value, max_size=3).map(lambda d: tuple(sorted(d.items())))


def metas(*, modes: st.SearchStrategy[int], user_xattrs: bool) -> st.SearchStrategy[Meta]:
    return st.builds(Meta, mode=modes, uid=_IDS, gid=_IDS, mtime_ns=mtimes(), xattrs=xattr_sets(user=user_xattrs))


def files(chunk_size: int) -> st.SearchStrategy[File]:
    boundaries = [0, 1, 4095, 4096, 4097, chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size + 1]

    @st.composite
    def draw(draw_) -> File:
        size = draw_(st.one_of(st.sampled_from(boundaries), st.integers(0, 3 * chunk_size)))
        pattern = draw_(st.sampled_from(["d", "z", "h", "mixed"]))
        count = -(-size // BLOCK)
        if pattern == "mixed":
            blocks = "".join(draw_(st.lists(st.sampled_from("ddzh"), min_size=count, max_size=count)))
        else:
            blocks = pattern * count
        meta = draw_(metas(modes=st.integers(0, 0o7777), user_xattrs=True))
        return File(meta=meta, size=size, seed=draw_(st.integers(0, 3)), blocks=blocks)

    return draw()


def symlinks() -> st.SearchStrategy[Symlink]:
    lengths = st.one_of(st.integers(1, 64), st.integers(3900, SYMLINK_MAX), st.sampled_from([4000 - 64, 2048]))
    targets = st.one_of(
        st.binary(min_size=1, max_size=64).map(lambda b: b.replace(b"\0", b"x")),
        st.tuples(lengths, st.integers(0, 255)).map(lambda t: bytes((t[1] + i) % 255 + 1 for i in range(t[0]))),
    )
    return st.builds(Symlink, target=targets, meta=metas(modes=st.just(0o777), user_xattrs=False))


def devices() -> st.SearchStrategy[Device]:
    return st.builds(
        Device, kind=st.sampled_from(["chr", "blk"]), major=st.sampled_from([0, 1, 8, 255, 256, 4095]),
        minor=st.sampled_from([0, 1, 255, 256, 65535, 2**20 - 1]),
        meta=metas(modes=st.integers(0, 0o7777), user_xattrs=False))


def tree_specs(chunk_size: int = 8192, *, max_leaves: int = 24) -> st.SearchStrategy[Dir]:
    """Whole trees: a root Dir, at most a few levels deep."""
    leaves = st.one_of(
        files(chunk_size), files(chunk_size), symlinks(), devices(),
        st.builds(Fifo, meta=metas(modes=st.integers(0, 0o7777), user_xattrs=False)),
        st.builds(Socket, meta=metas(modes=st.integers(0, 0o7777), user_xattrs=False)),
        st.builds(HardLink, index=st.integers(0, 1000)),
    )
    dir_metas = metas(modes=st.integers(0, 0o7777), user_xattrs=True)

    def directories(children: st.SearchStrategy) -> st.SearchStrategy[Dir]:
        return st.builds(
            Dir, meta=dir_metas,
            children=st.dictionaries(names(), children, max_size=6).map(lambda d: tuple(sorted(d.items()))),
            # 0, or enough 12 + 8 .. 12 + 40 byte entries to fill one or two blocks and end anywhere
            filler=st.one_of(st.just(0), st.just(0), st.integers(100, 400)),
            filler_name_length=st.integers(8, 40),
        )

    return directories(st.recursive(leaves, directories, max_leaves=max_leaves))

