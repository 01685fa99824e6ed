"""A directory of 100,000 entries, mounted in fuse mode by a real ``dsecfs daemon`` with each FUSE binding and
listed with getdents64 (d_ino and d_type as the kernel hands them over, which os.scandir hides): every name
once, each with its type and the inode number stat shows, then the daemon still serving the right bytes,
in reads of every size up to requests of max_pages (1 MiB; 4 MiB O_DIRECT reads come as several).

Why: a reply frames every entry the kernel asked room for, and a listing of a big directory asks for a
lot: with 32 KiB getdents buffers (glibc's) about 1,000 short names per READDIR, and recent kernels size
a READDIR by the caller's buffer, up to the session's max_pages (1 MiB). The raw binding wrote one iovec per entry and
died of EINVAL past IOV_MAX (1,024); fusepy gave every name d_ino 0xffffffff and DT_UNKNOWN.

The layer is built once per module (about 15 s: 100,000 empty files, a few of each other kind).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import stat
import struct

import pytest

from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from tests.lazy_fetch.daemon_support import mount_dirs

pytestmark = [pytest.mark.fuse, pytest.mark.root, pytest.mark.slow]

ENTRIES = 100_000  # in big/, "." and ".." not counted
SYS_GETDENTS64 = 217  # x86_64
DIRENT64 = struct.Struct("<QqHB")  # linux_dirent64: d_ino, d_off, d_reclen, d_type; the name follows
LARGE = random.Random(12).randbytes((5 << 20) + 123)  # large.bin, beside big/
CONTENT = {f"c{i:06d}".encode(): os.urandom(i % 9000 + 1) for i in range(0, ENTRIES, 4999)}
_libc = ctypes.CDLL(None, use_errno=True)


def _special(i: int) -> bytes | None:
    """The name of entry ``i`` of big/ when it is not an empty regular file, else None."""
    if i % 1000 == 1:
        return f"d{i:06d}".encode()  # a directory
    if i % 1000 == 2:
        return f"l{i:06d}".encode()  # a symlink
    if i % 1000 == 3:
        return f"p{i:06d}".encode()  # a FIFO
    if i % 1000 == 4:
        return f"h{i:06d}".encode()  # a hard link of c000000
    if i % 997 == 5:
        return f"long{i:06d}".encode() + b"x" * (180 + i % 60)  # long names: padding of every length
    if i == 6:
        return b"caf\xe9-not-utf8"
    return None


def _make_source(root: str) -> None:
    big = os.path.join(root, "big")
    os.makedirs(big)
    with open(os.path.join(root, "large.bin"), "wb") as f:
        f.write(LARGE)
    for name, data in CONTENT.items():
        with open(os.path.join(os.fsencode(big), name), "wb") as f:
            f.write(data)
    made = len(CONTENT)
    for i in range(ENTRIES):
        if made == ENTRIES:
            break
        name = _special(i)
        path = os.path.join(os.fsencode(big), name or f"f{i:06d}".encode())
        if name is None or name.startswith((b"long", b"caf")):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        elif name.startswith(b"d"):
            os.mkdir(path)
        elif name.startswith(b"l"):
            os.symlink(b"c000000", path)
        elif name.startswith(b"p"):
            os.mkfifo(path)
        else:
            os.link(os.path.join(os.fsencode(big), b"c000000"), path)
        made += 1


@pytest.fixture(scope="module")
def big_layer(tmp_path_factory):
    base = tmp_path_factory.mktemp("large-dir")
    source = str(base / "src")
    _make_source(source)
    store_dir = str(base / "store")
    result = build_layer(source, FilesystemStore(store_dir, fsync=False))
    return store_dir, source, result.digest


def getdents(path: str, buffer_size: int) -> list[tuple[bytes, int, int]]:
    """(name, d_ino, d_type) of every entry of directory ``path``, read with getdents64 into a buffer of
    ``buffer_size`` bytes (so the kernel asks the filesystem for about that much at a time)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    buffer = ctypes.create_string_buffer(buffer_size)
    entries = []
    try:
        while True:
            got = _libc.syscall(SYS_GETDENTS64, fd, buffer, buffer_size)
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"getdents64: {os.strerror(err)}", path)
            if got == 0:
                return entries
            data, offset = buffer.raw[:got], 0
            while offset < got:
                ino, _off, reclen, dtype = DIRENT64.unpack_from(data, offset)
                name = data[offset + DIRENT64.size:offset + reclen].split(b"\0", 1)[0]
                entries.append((name, ino, dtype))
                offset += reclen
    finally:
        os.close(fd)


def _check_listing(listing: list[tuple[bytes, int, int]], source_dir: str, mounted_dir: str, *, stat_every: int):
    """``listing`` holds each entry of ``source_dir`` once, "." and "..", the source's types, one inode
    number per source inode (a hard link shares its file's), and, for every ``stat_every``-th entry and
    all that are not empty files, the inode number lstat shows through the mount."""
    names = [name for name, _ino, _type in listing]
    assert len(names) == len(set(names)), "a name was listed twice"
    by_name = {name: (ino, dtype) for name, ino, dtype in listing}
    assert by_name.pop(b".")[1] == by_name.pop(b"..")[1] == stat.S_IFDIR >> 12
    source_names = os.listdir(os.fsencode(source_dir))
    assert len(source_names) == ENTRIES
    assert sorted(by_name) == sorted(source_names)
    source_inos, mount_inos = {}, {}
    for k, name in enumerate(sorted(source_names)):
        st = os.lstat(os.path.join(os.fsencode(source_dir), name))
        ino, dtype = by_name[name]
        assert dtype == stat.S_IFMT(st.st_mode) >> 12, f"d_type {dtype} of {name!r}, source mode {st.st_mode:o}"
        assert ino != 0 and mount_inos.setdefault(ino, st.st_ino) == st.st_ino, f"d_ino {ino} of {name!r} is shared"
        assert source_inos.setdefault(st.st_ino, ino) == ino, f"hard link {name!r} has d_ino {ino}"
        if k % stat_every == 0 or not name.startswith(b"f"):
            assert os.lstat(os.path.join(os.fsencode(mounted_dir), name)).st_ino == ino, name


def _check_large_reads(path: str) -> None:
    """large.bin whole through the page cache, then with O_DIRECT reads of 4 MiB (each several requests of
    the most the session takes) from an aligned buffer, the last one short."""
    with open(path, "rb") as f:
        assert f.read() == LARGE
    buffer = mmap.mmap(-1, 4 << 20)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for offset in (0, 4 << 20, 1 << 20):
            got = os.preadv(fd, [buffer], offset)
            assert got == min(4 << 20, len(LARGE) - offset) and buffer[:got] == LARGE[offset:offset + got], offset
    finally:
        os.close(fd)
        buffer.close()


@pytest.mark.parametrize("binding", ["raw", "pyfuse3", "fusepy"])
def test_a_directory_of_100000_entries_lists_whole_in_fuse_mode(big_layer, daemons, tmp_path, binding):
    store_dir, source, digest = big_layer
    daemon = daemons.start(store_dir, binding=binding)
    mnt, = mount_dirs(tmp_path, "mnt")
    daemon.node.mount(digest, mnt, mode="fuse")
    big = os.path.join(mnt, "big")

    # 1 MiB buffers first: the kernel asks for up to max_pages (1 MiB) of READDIRPLUS entries at once.
    _check_listing(getdents(big, 1 << 20), os.path.join(source, "big"), big, stat_every=97)
    # glibc's 32 KiB: about a thousand short names per plain READDIR (maybe from the kernel's cache now).
    assert sorted(getdents(big, 32 << 10)) == sorted(getdents(big, 1 << 20))

    assert daemon.alive(), f"the daemon died; its log:\n{daemons.log()[-3000:]}"
    for name, data in CONTENT.items():
        with open(os.path.join(os.fsencode(big), name), "rb") as f:
            assert f.read() == data, name
    with open(os.path.join(big, "l000002"), "rb") as f:
        assert f.read() == CONTENT[b"c000000"]
    _check_large_reads(os.path.join(mnt, "large.bin"))
    assert [m.mountpoint for m in daemon.node.mounts()] == [mnt]
    daemon.node.umount(mnt)
