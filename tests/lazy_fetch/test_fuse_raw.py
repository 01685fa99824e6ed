"""The raw FUSE adapter without a mount: its message structs against include/uapi/linux/fuse.h, and a
session answering requests written to one end of a socket pair (the other end stands for /dev/fuse) over
a real SessionTree; and the inode numbers a SessionTree carries over to the daemon that takes it over.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

import pytest
import trio

from dsec_fs.mounts import umount
from erofs_builder.reader import ErofsImage
from lazy_fetch import fuse_raw as raw
from lazy_fetch.fs_core import ROOT_INO, SLOT_SHIFT, LayerTree, SessionTree

BLOB = bytes(range(256)) * 64  # 16 KiB
BLOB_ID = "b" * 64


class BytesBlob:
    def __init__(self, data: bytes, delay: float = 0.0):
        self.data, self.size, self.delay = data, len(data), delay

    async def read(self, offset, length):
        await trio.sleep(self.delay)
        return self.data[offset:offset + length]


def test_structs_have_the_kernels_sizes():
    sizes = {raw.IN_HEADER: 40, raw.OUT_HEADER: 16, raw.INIT_OUT: 64, raw.ATTR: 88, raw.ATTR_OUT: 16,
             raw.ENTRY_OUT: 40, raw.GETATTR_IN: 16, raw.OPEN_IN: 8, raw.OPEN_OUT: 16, raw.READ_IN: 40,
             raw.GETXATTR_IN: 8, raw.GETXATTR_OUT: 8, raw.INTERRUPT_IN: 8, raw.KSTATFS: 80, raw.DIRENT: 24}
    assert {s.format: s.size for s in sizes} == {s.format: size for s, size in sizes.items()}
    assert raw.INIT_IN.size == 20  # fuse_init_in is 64 bytes; only its first five words are read


def test_dirents_are_padded_to_eight_bytes():
    record = raw.dirent_bytes(b"abc", 77, 5, stat.S_IFDIR | 0o755)
    assert len(record) == 32 and record.endswith(b"abc" + bytes(5))
    assert raw.DIRENT.unpack_from(record) == (77, 5, 3, stat.S_IFDIR >> 12)
    assert len(raw.dirent_bytes(b"12345678", 1, 1, stat.S_IFREG)) == 32


def test_session_params_round_trip_and_fit_the_biggest_request():
    params = raw.SessionParams(38, raw.WANTED_FLAGS, raw.MAX_WRITE, raw.MAX_PAGES)
    assert raw.SessionParams.from_json(params.to_json()) == params
    assert params.buffer_size >= raw.MAX_PAGES * raw.PAGE and params.buffer_size >= 80 + raw.MAX_WRITE
    with pytest.raises(TypeError):
        raw.SessionParams.from_json(None)  # a daemon died before INIT: nothing to resume


def _request(opcode: int, nodeid: int, body: bytes = b"", unique: int = 9) -> tuple[tuple, bytes]:
    header = raw.IN_HEADER.pack(raw.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 1, 0, 0)
    return raw.IN_HEADER.unpack(header), body


class Harness:
    """A _Session writing its replies into a socket pair; ``ask`` dispatches one request, ``reply`` reads
    one answer (error, payload)."""

    def __init__(self, session_tree: SessionTree, nursery: trio.Nursery, params: raw.SessionParams | None = None):
        self.ours, self.device = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.inits = []
        self.session = raw._Session(session_tree, self.device.fileno(), params, self.inits.append)
        self.nursery = nursery

    def ask(self, opcode: int, nodeid: int, body: bytes = b"", unique: int = 9) -> None:
        self.session.dispatch(*_request(opcode, nodeid, body, unique), self.nursery)

    async def reply(self, unique: int = 9) -> tuple[int, bytes]:
        await trio.lowlevel.wait_readable(self.ours)  # reads answer from tasks of their own
        data = self.ours.recv(1 << 21)
        length, error, got_unique = raw.OUT_HEADER.unpack_from(data)
        assert length == len(data) and got_unique == unique
        return error, data[raw.OUT_HEADER.size:]

    def nothing_pending(self) -> bool:
        self.ours.setblocking(False)
        try:
            self.ours.recv(1)
        except BlockingIOError:
            return True
        finally:
            self.ours.setblocking(True)
        return False


def test_a_session_answers_the_kernels_requests(built_layer):
    tree = SessionTree()
    tree.blobs.add(BLOB_ID, BytesBlob(BLOB))
    tree.add_layer("1" * 64, LayerTree(ErofsImage(built_layer.layer.meta), None))

    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(tree, nursery)
            # INIT: our version, the flags we want of those offered, 1 MiB requests; the parameters are saved.
            h.ask(raw.INIT, 0, raw.INIT_IN.pack(7, 45, 128 << 10, 0xFFFFFFFF, 0) + bytes(44))
            error, body = await h.reply()
            major, minor, readahead, flags, *_rest, max_pages, _align, _flags2 = raw.INIT_OUT.unpack(body)
            assert (error, major, minor, readahead, max_pages) == (0, 7, 38, 128 << 10, 256)
            assert flags & raw.WANTED_FLAGS == raw.WANTED_FLAGS
            assert h.inits == [raw.SessionParams(38, raw.WANTED_FLAGS, raw.MAX_WRITE, 256)]

            # LOOKUP in a synthetic directory: no caching; a missing name in one is an error.
            h.ask(raw.LOOKUP, ROOT_INO, b"blobs\0")
            error, body = await h.reply()
            blobs_ino, _gen, entry_valid, attr_valid, _n1, _n2 = raw.ENTRY_OUT.unpack_from(body)
            assert (error, entry_valid, attr_valid) == (0, 0, 0)
            h.ask(raw.LOOKUP, blobs_ino, BLOB_ID.encode() + b"\0")
            error, body = await h.reply()
            blob_ino, *_ = raw.ENTRY_OUT.unpack_from(body)
            attr = raw.ATTR.unpack_from(body, raw.ENTRY_OUT.size)
            assert error == 0 and attr[0] == blob_ino and attr[1] == len(BLOB) and attr[9] == stat.S_IFREG | 0o400
            h.ask(raw.LOOKUP, blobs_ino, b"nope\0")
            assert (await h.reply())[0] == -errno.ENOENT

            # ... and in a layer directory, immutable: cached, and a missing name is a negative entry.
            layer_root = (2 << SLOT_SHIFT) | ROOT_INO
            h.ask(raw.LOOKUP, layer_root, b"small.txt\0")
            error, body = await h.reply()
            small_ino, _gen, entry_valid, attr_valid, *_ = raw.ENTRY_OUT.unpack_from(body)
            assert (error, entry_valid, attr_valid) == (0, raw.CACHE_SECONDS, raw.CACHE_SECONDS)
            h.ask(raw.LOOKUP, layer_root, b"nope\0")
            error, body = await h.reply()
            assert error == 0 and raw.ENTRY_OUT.unpack_from(body)[:3] == (0, 0, raw.CACHE_SECONDS)

            # GETATTR, OPEN (ENOSYS: the kernel opens files itself), READ (fh 0).
            h.ask(raw.GETATTR, small_ino, raw.GETATTR_IN.pack(0, 0, 0))
            error, body = await h.reply()
            assert error == 0 and raw.ATTR.unpack_from(body, raw.ATTR_OUT.size)[:2] == (small_ino, 6)
            h.ask(raw.OPEN, blob_ino, raw.OPEN_IN.pack(os.O_RDONLY, 0))
            assert (await h.reply())[0] == -errno.ENOSYS
            h.ask(raw.READ, blob_ino, raw.READ_IN.pack(blob_ino, 1000, 3000, 0, 0, 0, 0))
            assert await h.reply() == (0, BLOB[1000:4000])

            # READDIR and READDIRPLUS, within the size asked for.
            h.ask(raw.READDIR, ROOT_INO, raw.READ_IN.pack(ROOT_INO, 0, 4096, 0, 0, 0, 0))
            error, body = await h.reply()
            assert error == 0 and body == (raw.dirent_bytes(b"blobs", blobs_ino, 1, stat.S_IFDIR)
                                           + raw.dirent_bytes(b"layers", 2, 2, stat.S_IFDIR)
                                           + raw.dirent_bytes(b"flush-probe", 3, 3, stat.S_IFREG))
            h.ask(raw.READDIRPLUS, ROOT_INO, raw.READ_IN.pack(ROOT_INO, 0, 200, 0, 0, 0, 0))
            error, body = await h.reply()
            assert error == 0 and len(body) == 128 + 32 and raw.ENTRY_OUT.unpack_from(body)[0] == blobs_ino

            # xattrs: the size, then the value; too small a buffer is ERANGE; none is ENODATA.
            h.ask(raw.GETXATTR, small_ino, raw.GETXATTR_IN.pack(0, 0) + b"user.comment\0")
            assert await h.reply() == (0, raw.GETXATTR_OUT.pack(6, 0))
            h.ask(raw.GETXATTR, small_ino, raw.GETXATTR_IN.pack(6, 0) + b"user.comment\0")
            assert await h.reply() == (0, b"a note")
            h.ask(raw.GETXATTR, small_ino, raw.GETXATTR_IN.pack(3, 0) + b"user.comment\0")
            assert (await h.reply())[0] == -errno.ERANGE
            h.ask(raw.GETXATTR, blob_ino, raw.GETXATTR_IN.pack(0, 0) + b"user.x\0")
            assert (await h.reply())[0] == -errno.ENODATA
            h.ask(raw.LISTXATTR, small_ino, raw.GETXATTR_IN.pack(100, 0))
            assert b"user.comment\0" in (await h.reply())[1]

            # FLUSH is refused once for good; unknown ops are ENOSYS; forgets get no answer.
            h.ask(raw.FLUSH, blob_ino, bytes(24))
            assert (await h.reply())[0] == -errno.ENOSYS
            h.ask(16, blob_ino, bytes(40))  # WRITE
            assert (await h.reply())[0] == -errno.ENOSYS
            h.ask(raw.FORGET, blob_ino, bytes(8))
            h.ask(raw.BATCH_FORGET, 0, bytes(8))
            assert h.nothing_pending()
            h.ask(raw.STATFS, ROOT_INO)
            error, body = await h.reply()
            assert error == 0 and raw.KSTATFS.unpack(body)[5:7] == (raw.BLOCK_SIZE, raw.NAME_MAX)

    trio.run(main)


def test_without_no_open_support_files_are_opened_read_only_with_pages_kept_and_no_flush():
    tree = SessionTree()
    tree.blobs.add(BLOB_ID, BytesBlob(BLOB))
    blob_ino = tree.lookup(tree.lookup(ROOT_INO, b"blobs").ino, BLOB_ID.encode()).ino
    params = raw.SessionParams(38, raw.WANTED_FLAGS & ~raw.FUSE_NO_OPEN_SUPPORT, raw.MAX_WRITE, 256)

    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(tree, nursery, params)
            h.ask(raw.OPEN, blob_ino, raw.OPEN_IN.pack(os.O_WRONLY, 0))
            assert (await h.reply())[0] == -errno.EROFS
            h.ask(raw.OPEN, blob_ino, raw.OPEN_IN.pack(os.O_RDONLY, 0))
            error, body = await h.reply()
            assert (error, *raw.OPEN_OUT.unpack(body)[:2]) == (0, blob_ino, raw.FOPEN_KEEP_CACHE | raw.FOPEN_NOFLUSH)
            h.ask(raw.OPEN, (1 << SLOT_SHIFT) | ROOT_INO, raw.OPEN_IN.pack(os.O_RDONLY, 0))
            assert (await h.reply())[0] == -errno.EINVAL  # a directory

    trio.run(main)


def test_an_interrupted_read_is_still_answered_with_its_bytes():
    """INTERRUPT is ignored (as libfuse does): EINTR would fail page faults and exec with EIO."""
    tree = SessionTree()
    tree.blobs.add(BLOB_ID, BytesBlob(BLOB, delay=0.2))
    blob_ino = tree.lookup(tree.lookup(ROOT_INO, b"blobs").ino, BLOB_ID.encode()).ino

    async def main():
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                h = Harness(tree, nursery)
                h.ask(raw.READ, blob_ino, raw.READ_IN.pack(blob_ino, 0, 10, 0, 0, 0, 0), unique=5)
                await trio.sleep(0.05)  # the read now waits for the (slow) blob
                h.ask(raw.INTERRUPT, 0, raw.INTERRUPT_IN.pack(5), unique=6)
                assert await h.reply(unique=5) == (0, BLOB[:10])
                assert h.nothing_pending()  # INTERRUPT itself gets no answer

    trio.run(main)


def test_a_resumed_session_asks_for_the_lost_requests_first():
    tree = SessionTree()
    ours, device = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    device.setblocking(False)
    params = raw.SessionParams(38, raw.WANTED_FLAGS, raw.MAX_WRITE, raw.MAX_PAGES)

    async def main():
        with trio.fail_after(5):
            await serve_one()

    async def serve_one():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: raw.serve(tree, device.fileno(), params=params,
                                                              task_status=task_status))
            assert ours.recv(64) == raw.OUT_HEADER.pack(16, raw.NOTIFY_RESEND, 0)
            unique = raw.UNIQUE_RESEND | 42  # a resent request: answered under the same unique
            ours.send(b"".join(_request_bytes(raw.GETATTR, ROOT_INO, raw.GETATTR_IN.pack(0, 0, 0), unique)))
            await trio.lowlevel.wait_readable(ours)
            length, error, got = raw.OUT_HEADER.unpack_from(ours.recv(1024))
            assert (error, got, length) == (0, unique, 16 + raw.ATTR_OUT.size + raw.ATTR.size)
            nursery.cancel_scope.cancel()

    trio.run(main)


def _request_bytes(opcode: int, nodeid: int, body: bytes, unique: int) -> list[bytes]:
    return [raw.IN_HEADER.pack(raw.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 1, 0, 0), body]


def test_inode_numbers_carry_over_to_the_next_session_tree(built_layer):
    image = ErofsImage(built_layer.layer.meta)
    first = SessionTree()
    for name in ("a", "b", "c"):
        first.blobs.add(name * 64, BytesBlob(b"x"))
    first.blobs.remove("a" * 64)
    first.add_layer("1" * 64, LayerTree(image, None))
    first.add_layer("2" * 64, LayerTree(image, None))
    numbers = first.numbers()
    assert numbers == {"blobs": {"a" * 64: 2, "b" * 64: 3, "c" * 64: 4}, "layers": {"1" * 64: 2, "2" * 64: 3}}

    second = SessionTree(numbers)  # re-added in another order, the numbers stay
    second.add_layer("2" * 64, LayerTree(image, None))
    second.blobs.add("c" * 64, BytesBlob(b"x"))
    blobs = second.lookup(ROOT_INO, b"blobs").ino
    assert second.lookup(blobs, b"c" * 64).ino == first.lookup(blobs, b"c" * 64).ino
    layers = second.lookup(ROOT_INO, b"layers").ino
    assert second.lookup(layers, b"2" * 64).ino == first.lookup(layers, b"2" * 64).ino
    second.blobs.add("d" * 64, BytesBlob(b"x"))  # a new name never takes a number given before
    second.add_layer("3" * 64, LayerTree(image, None))
    assert second.numbers()["blobs"]["d" * 64] == 5 and second.numbers()["layers"]["3" * 64] == 4


def test_a_readdir_of_thousands_of_entries_is_one_reply_within_the_size_asked_for():
    """One record per name used to be one writev iovec each: past IOV_MAX (1,024) the write failed EINVAL
    and ended the session (test_fuse_large_dir.py lists 100,000 entries through a real mount)."""
    tree = SessionTree()
    names = [f"{i:064x}" for i in range(3000)]
    for name in names:
        tree.blobs.add(name, BytesBlob(b"x"))
    blobs_dir = 1 << SLOT_SHIFT | ROOT_INO
    size = 128 << 10  # 1,489 records of 88 bytes

    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(tree, nursery)
            listed, offset = [], 0
            while True:
                h.ask(raw.READDIR, blobs_dir, raw.READ_IN.pack(0, offset, size, 0, 0, 0, 0))
                error, body = await h.reply()
                assert error == 0 and len(body) <= size
                if not body:
                    break
                position = 0
                while position < len(body):
                    ino, offset, namelen, dtype = raw.DIRENT.unpack_from(body, position)
                    start = position + raw.DIRENT.size
                    listed.append((body[start:start + namelen].decode(), dtype))
                    position = start + namelen + (-(raw.DIRENT.size + namelen) % 8)
            assert listed == [(name, stat.S_IFREG >> 12) for name in names]

    trio.run(main)


class OversizeReads:
    """A SessionTree whose reads of one inode answer more bytes than asked for: a reply the kernel refuses
    (EINVAL), a fault no real part makes on demand."""

    def __init__(self, tree: SessionTree, bad_ino: int):
        self.tree, self.bad_ino = tree, bad_ino

    def __getattr__(self, name):
        return getattr(self.tree, name)

    async def read(self, ino, offset, size):
        data = await self.tree.read(ino, offset, size)
        return data + bytes(4096) if ino == self.bad_ino else data


@pytest.mark.fuse
@pytest.mark.root
def test_a_reply_the_kernel_refuses_fails_that_request_only(tmp_path):
    tree = SessionTree()
    tree.blobs.add("bad", BytesBlob(BLOB))
    tree.blobs.add("good", BytesBlob(BLOB))
    blobs = tree.lookup(ROOT_INO, b"blobs").ino
    fs = OversizeReads(tree, tree.lookup(blobs, b"bad").ino)
    mountpoint = str(tmp_path / "mnt")
    os.mkdir(mountpoint)

    def read(name: str) -> bytes:
        fd = os.open(os.path.join(mountpoint, "blobs", name), os.O_RDONLY | os.O_DIRECT)
        try:
            return os.read(fd, 8192)  # one READ of 8 KiB, answered 12 KiB for "bad"
        finally:
            os.close(fd)

    async def main():
        fd = raw.mount(mountpoint, ["ro", "fsname=test", "default_permissions"])
        mounted = True
        try:
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    await nursery.start(lambda task_status: raw.serve(fs, fd, params=None, task_status=task_status))
                    # Abandoned if serve fails (as it did): closing fd below then aborts the connection,
                    # which ends the read; without that it would wait for its answer forever.
                    with pytest.raises(OSError) as refused:
                        await trio.to_thread.run_sync(read, "bad", abandon_on_cancel=True)
                    assert refused.value.errno == errno.EIO
                    assert await trio.to_thread.run_sync(read, "good", abandon_on_cancel=True) == BLOB[:8192]
                    await trio.to_thread.run_sync(umount, mountpoint)  # the session ends: serve returns
                    mounted = False
        finally:
            os.close(fd)  # the last reference: the connection is aborted, nothing waits on it any more
            if mounted:
                umount(mountpoint, lazy=True)

    trio.run(main)
