"""Hostile and careless requests to a real node daemon: paths on its own mounts, prefetch lists that are
no files, thousands of idle connections. Each must get a clear answer in bounded time and memory while
the daemon keeps serving the right bytes.

Before request_paths.py, a mount request for a directory inside one of the daemon's own fuse-mode mounts
(or an umount of state_dir/fuse) made its trio thread, which serves FUSE, look the path up on its own
session: the daemon hung in D state for good. A FIFO as a prefetch list hung the request, /dev/zero took
the daemon to the OOM killer, and about 1,000 idle connections made accept() fail with EMFILE, which
ended the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from dsec_fs.client import Node
from dsec_fs.errors import ConflictError, InputError, NotFoundError
from dsec_fs.mounts import mount_table, umount
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from tests.lazy_fetch.daemon_support import DSECFS, Daemons, layer_metric, layer_store, memory_bytes, mount_dirs
from tests.s3server import free_port
from treecmp import write_files

pytestmark = [pytest.mark.fuse, pytest.mark.root]

FILES = {"dir/a.txt": b"alpha\n" * 1000, "dir/sub/b.bin": os.urandom(300_000), "top.txt": b"top\n"}
ANSWER_SECONDS = 2.0  # the bound for a refused request


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> str:
    return layer_store(tmp_path_factory.mktemp("hostile"), FILES, "t/hostile:1", 64 * 1024)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _assert_serving(node: Node, fuse_mnt: str, kernel_mnt: str) -> None:
    assert node.status().pid > 0
    for mnt in (fuse_mnt, kernel_mnt):
        for name, data in FILES.items():
            assert _read(os.path.join(mnt, name)) == data


def _refused_quickly(call, *args, error=InputError, match: str = "own") -> None:
    started = time.monotonic()
    with pytest.raises(error, match=match):
        call(*args)
    assert time.monotonic() - started < ANSWER_SECONDS


@pytest.mark.parametrize("binding", ["raw", "pyfuse3", "fusepy"])
def test_paths_on_the_daemons_own_mounts_are_refused_while_it_keeps_serving(store_dir, daemons, tmp_path, binding):
    daemon = daemons.start(store_dir, binding=binding)
    node = Node(daemons.socket, timeout=10)  # a daemon that hangs on itself would never answer
    fuse_mnt, kernel_mnt, spare = mount_dirs(tmp_path, "fuse", "kernel", "spare")
    node.mount("t/hostile:1", fuse_mnt, mode="fuse")
    node.mount("t/hostile:1", kernel_mnt, mode="kernel")
    session = os.path.join(daemons.state_dir, "fuse")
    link = str(tmp_path / "link-into-layer")
    os.symlink(os.path.join(fuse_mnt, "dir"), link)
    try:
        for target in (os.path.join(fuse_mnt, "dir"), os.path.join(kernel_mnt, "dir"), session,
                       os.path.join(session, "layers"), link, os.path.join(link, "sub")):
            _refused_quickly(node.mount, "t/hostile:1", target)
        for target in (session, os.path.join(session, "layers")):
            _refused_quickly(node.umount, target, match="FUSE session")
        _refused_quickly(node.umount, os.path.join(fuse_mnt, "dir"))
        _refused_quickly(node.umount, link)
        _refused_quickly(node.prefetch, fuse_mnt, os.path.join(fuse_mnt, "top.txt"))
        _refused_quickly(node.umount, spare, error=NotFoundError, match="no layer is mounted")
        _assert_serving(node, fuse_mnt, kernel_mnt)
        # The operator's first guess in /proc/mounts, through the CLI: refused with a non-zero exit.
        started = time.monotonic()
        cli = subprocess.run([DSECFS, "umount", session, "--socket", daemons.socket], capture_output=True,
                             text=True, timeout=30)
        assert cli.returncode != 0 and "FUSE session" in cli.stderr
        assert time.monotonic() - started < 10
        _assert_serving(node, fuse_mnt, kernel_mnt)
        assert daemon.alive()
        to_kernel_mnt = str(tmp_path / "link-to-a-mountpoint")  # names one of ours: unmounted, not refused
        os.symlink(kernel_mnt, to_kernel_mnt)
        node.umount(to_kernel_mnt)
        assert [m.mountpoint for m in node.mounts()] == [fuse_mnt]
    finally:
        for mnt in {m.mountpoint for m in node.mounts()}:
            node.umount(mnt)


def test_prefetch_lists_that_are_no_regular_files_are_refused_at_once(store_dir, daemons, tmp_path):
    daemon = daemons.start(store_dir)
    node = Node(daemons.socket, timeout=10)
    fuse_mnt, kernel_mnt = mount_dirs(tmp_path, "fuse", "kernel")
    node.mount("t/hostile:1", fuse_mnt, mode="fuse")
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    huge = str(tmp_path / "huge.json")
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte of zeros that costs no disk
    rss_before = memory_bytes(daemon.pid)
    try:
        for path, match in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                            (str(tmp_path), "not a regular file"), (huge, "over the limit")):
            _refused_quickly(lambda: node.mount("t/hostile:1", kernel_mnt, prefetch_list=path), match=match)
            _refused_quickly(node.prefetch, fuse_mnt, path, match=match)
        assert node.mounts()[0].mountpoint == fuse_mnt and len(node.mounts()) == 1
        assert memory_bytes(daemon.pid) < rss_before + (64 << 20)
        assert _read(os.path.join(fuse_mnt, "dir/sub/b.bin")) == FILES["dir/sub/b.bin"]
    finally:
        node.umount(fuse_mnt)


def _connect_idle(path: str, count: int) -> list[socket.socket]:
    """``count`` connections that send nothing (non-blocking connects: a full backlog must not stall us)."""
    idle = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        result = sock.connect_ex(path)
        assert result in (0, errno.EAGAIN, errno.EINPROGRESS), os.strerror(result)
        idle.append(sock)
    return idle


@pytest.mark.parametrize("nofile", [1024, 200])
def test_thousands_of_idle_connections_neither_stop_nor_block_the_daemon(store_dir, daemons, tmp_path, nofile):
    """With nofile 1024 the connection cap closes idle connections first; with 200 accept() itself runs out
    of descriptors (EMFILE) and the daemon backs off instead of exiting."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8192), max(hard, 8192)))
    daemon = daemons.start(store_dir, command=["prlimit", f"--nofile={nofile}:{nofile}", DSECFS])
    node = Node(daemons.socket, timeout=20)
    mnt, = mount_dirs(tmp_path, "mnt")
    idle: list[socket.socket] = []
    try:
        idle = _connect_idle(daemons.socket, 2000)
        node.mount("t/hostile:1", mnt, mode="fuse")
        assert _read(os.path.join(mnt, "dir/sub/b.bin")) == FILES["dir/sub/b.bin"]
        assert node.status().connections <= 512
        for sock in idle:
            sock.close()
        idle = []
        time.sleep(0.5)
        assert node.status().pid == daemon.pid and daemon.alive()
        assert _read(os.path.join(mnt, "dir/a.txt")) == FILES["dir/a.txt"]
        node.umount(mnt)
    finally:
        for sock in idle:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_state_dir_on_tmpfs_refuses_kernel_mode_clearly_and_fuse_mode_works(store_dir, tmp_path):
    """/run is tmpfs on a systemd machine, and the kernel refuses a file-backed EROFS image there (ENOTBLK):
    a kernel-mode mount says so and what to do, a fuse-mode one works."""
    from dsec_fs.errors import UnsupportedError
    from dsec_fs.mounts import mount

    memory = tmp_path / "run"
    memory.mkdir()
    mount("tmpfs", str(memory), "tmpfs")
    daemons = Daemons(tmp_path)
    daemons.state_dir = str(memory / "state")
    try:
        node = daemons.start(store_dir).node
        kernel_mnt, fuse_mnt = mount_dirs(tmp_path, "kernel", "fuse")
        with pytest.raises(UnsupportedError, match="disk filesystem") as error:
            node.mount("t/hostile:1", kernel_mnt, mode="kernel")
        assert "--state-dir" in error.value.message and node.mounts() == []
        node.mount("t/hostile:1", fuse_mnt, mode="fuse")
        assert _read(os.path.join(fuse_mnt, "top.txt")) == FILES["top.txt"]
        node.umount(fuse_mnt)
    finally:
        daemons.stop_all()
        umount(str(memory), lazy=True)


_HOLD_CONNECTIONS = r"""
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))
    held.append(sock)
for sock in held:  # each a request begun and never finished
    try:
        sock.send(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
    except OSError:
        pass
print("holding", flush=True)
sys.stdin.read()
"""


def test_another_user_flooding_the_metrics_port_leaves_the_daemon_its_descriptors(store_dir, daemons, tmp_path):
    """uid 65534 opens 600 connections to the TCP metrics page and begins a request on each. The page took
    up to 512 connections, as the API's socket does: with nofile 256 every descriptor went to them, every
    read of a mounted layer failed (EIO) and so did ``status``. It keeps at most METRICS_CONNECTIONS."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8192), max(hard, 8192)))
    port = free_port()
    daemons.start(store_dir, command=["prlimit", "--nofile=256:256", DSECFS],
                  extra_args=["--metrics-address", f"127.0.0.1:{port}"])
    node = Node(daemons.socket, timeout=20)
    mnt, = mount_dirs(tmp_path, "mnt")
    flood = None
    try:
        node.mount("t/hostile:1", mnt, mode="fuse")
        flood = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                  "-I", "-S", "-c", _HOLD_CONNECTIONS, str(port), "600"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flood.stdout.readline() == "holding\n"
        time.sleep(1)  # the daemon accepts what it will meanwhile
        node.cache_evict(0)
        for name, data in FILES.items():
            assert _read(os.path.join(mnt, name)) == data
        assert node.status().pid > 0
        node.umount(mnt)
    finally:
        if flood is not None:
            flood.stdin.close()
            flood.wait(10)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_ASK_WITHOUT_PAUSE = r"""
import hashlib, http.client, json, sys, threading, time
port, connections, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
pages, answers, lock = set(), [0], threading.Lock()
def ask():
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read()
        with lock:
            answers[0] += response.status == 200
            pages.add(hashlib.sha256(body).hexdigest())
threads = [threading.Thread(target=ask) for _ in range(connections)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"answers": answers[0], "pages": len(pages)}), flush=True)
"""


def test_another_user_asking_for_the_metrics_page_without_pause_gets_it_rendered_at_most_once_per_interval(
        store_dir, daemons, tmp_path):
    """uid 65534 asks for the TCP metrics page from METRICS_CONNECTIONS connections without pause. Each
    request rendered the page afresh in the trio thread that serves every mount's FUSE reads (tens of ms a
    render on a busy node: lazy_fetch/metrics.py), so the flood kept that thread busy and slowed every
    sandbox's reads. The page is rendered at most once per SHARED_PAGE_SECONDS now; a page rendered again
    differs (the process's CPU seconds, at least), so the distinct pages the flood gets count the renders.
    A reader of a mounted layer gets its bytes meanwhile."""
    import json

    from lazy_fetch.daemon import METRICS_CONNECTIONS
    from lazy_fetch.metrics import SHARED_PAGE_SECONDS

    flood_seconds = 3.0
    port = free_port()
    node = daemons.start(store_dir, extra_args=["--metrics-address", f"127.0.0.1:{port}"]).node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("t/hostile:1", mnt, mode="fuse")
    flood = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                              "-I", "-S", "-c", _ASK_WITHOUT_PAUSE, str(port), str(METRICS_CONNECTIONS),
                              str(flood_seconds)], stdout=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + flood_seconds
        while time.monotonic() < end:
            node.cache_evict(0)  # each round reads from the store again
            _assert_serving_one(mnt)
        out, _ = flood.communicate(timeout=60)
        got = json.loads(out)
        assert got["answers"] > 10 * METRICS_CONNECTIONS  # the flood was answered, and often
        assert got["pages"] <= flood_seconds / SHARED_PAGE_SECONDS + 2
        assert node.status().pid > 0
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        node.umount(mnt)


def test_mount_requests_naming_ever_new_stores_leave_the_daemon_bounded(store_dir, daemons, tmp_path):
    """A mount request may name any store URL, and the daemon kept a store context (a store client, a chunk
    index, a fetcher) for each one for good: a client naming new URLs grew it without bound. Now at most
    MAX_STORES are held: those no layer uses are let go (their counters stay in the figures), and a new URL
    finding every one in use is refused, clearly, until a layer of one is unmounted."""
    from dsec_fs.errors import UnavailableError
    from lazy_fetch.daemon_stores import MAX_STORES

    node = daemons.start(store_dir).node
    mnt, *mnts = mount_dirs(tmp_path, "own", *(f"m{i}" for i in range(MAX_STORES)))
    node.mount("t/hostile:1", mnt, mode="fuse")  # the daemon's own store: one context, in use
    for i in range(2 * MAX_STORES):  # stores without the ref: each answer says so, none is refused
        empty = tmp_path / f"empty{i}"
        empty.mkdir()
        with pytest.raises(NotFoundError):
            node.mount("t/hostile:1", mnts[0], mode="fuse", store=str(empty))
    stores = {}
    for i in range(MAX_STORES):  # distinct layers, so that each store has a layer of its own mounted
        stores[i] = layer_store(tmp_path / f"s{i}", {"n.txt": f"store {i}\n".encode()}, "t/other:1", 64 * 1024)
    for i in range(MAX_STORES - 1):
        node.mount("t/other:1", mnts[i], mode="fuse", store=stores[i])
    last = mnts[MAX_STORES - 1]
    with pytest.raises(UnavailableError, match="stores already") as refused:
        node.mount("t/other:1", last, mode="fuse", store=stores[MAX_STORES - 1])
    assert refused.value.where == stores[MAX_STORES - 1]
    assert _read(os.path.join(mnts[0], "n.txt")) == b"store 0\n"
    first = next(m.layer for m in node.mounts() if m.mountpoint == mnts[0])
    misses = layer_metric(node, "dsecfs_layer_chunk_misses_total", first)
    assert misses > 0
    node.umount(mnts[0])
    node.mount("t/other:1", last, mode="fuse", store=stores[MAX_STORES - 1])  # lets go of store 0
    assert layer_metric(node, "dsecfs_layer_chunk_misses_total", first) == misses  # what it counted stays
    for i in range(1, MAX_STORES):
        assert _read(os.path.join(mnts[i], "n.txt")) == f"store {i}\n".encode()
    _assert_serving_one(mnt)
    for path in [mnt, *mnts[1:]]:
        node.umount(path)


def _assert_serving_one(mnt: str) -> None:
    for name, data in FILES.items():
        assert _read(os.path.join(mnt, name)) == data


def _fill(directory: str) -> str:
    """Write zeros into a file of ``directory`` until its filesystem has no room left; returns the file."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 20))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return path


@contextlib.contextmanager
def _state_dir_on(tmp_path, directory: str) -> Iterator[Daemons]:
    """Daemons whose state directory is on the filesystem just mounted at ``directory``, which is
    unmounted once they are stopped."""
    daemons = Daemons(tmp_path)
    daemons.state_dir = os.path.join(directory, "state")
    try:
        yield daemons
    finally:
        try:
            daemons.stop_all()
        finally:
            umount(directory, lazy=True)


def test_a_full_state_dir_neither_fails_reads_nor_stops_the_daemon(tmp_path):
    """The sandboxes' upper dirs live in the daemon's state directory (overlay/node_service.py), so a
    sandbox's process that fills its upper dir fills the disk the daemon traces reads on. A trace write
    that failed (ENOSPC) failed the read it was recording (EIO, and every read after it), and the failed
    write of the periodic flush ended the daemon, and a mount or unmount whose mount table could not be
    written answered "internal error" and left the daemon's tables behind. The trace is given up instead
    (logged) and reads go on; a mount is refused, clearly; an unmount is made, its record logged as failed."""
    from dsec_fs.errors import UnavailableError
    from dsec_fs.mounts import mount
    from lazy_fetch.daemon_traces import TRACE_FLUSH_SECONDS
    from lazy_fetch.trace import FLUSH_RECORDS

    files = {f"many/{i:04d}.txt": f"file {i}\n".encode() * 50 for i in range(2 * FLUSH_RECORDS)}
    store_dir = layer_store(tmp_path / "many", files, "t/many:1", 64 * 1024)
    small = tmp_path / "small"
    small.mkdir()
    mount("tmpfs", str(small), "tmpfs", data="size=4m")
    with _state_dir_on(tmp_path, str(small)) as daemons:
        daemon = daemons.start(store_dir, binding="raw")
        mnt, = mount_dirs(tmp_path, "mnt")
        daemon.node.mount("t/many:1", mnt, mode="fuse")
        names = sorted(files)
        assert _read(os.path.join(mnt, names[0])) == files[names[0]]
        filler = _fill(str(small))
        for name in names:  # more reads than a trace buffers: its writes meet the full disk
            assert _read(os.path.join(mnt, name)) == files[name]
        time.sleep(TRACE_FLUSH_SECONDS + 1)  # the periodic flush meets it too
        assert daemon.alive() and daemon.node.status().pid == daemon.pid
        assert "cannot write the trace" in daemons.log()
        # A mount must be listed before it is made (mount_table.py): refused, clearly, while the disk is full.
        other, = mount_dirs(tmp_path, "other")
        with pytest.raises(UnavailableError, match="cannot write the mount table"):
            daemon.node.mount("t/many:1", other, mode="fuse")
        daemon.node.umount(mnt)  # the change stands, its record fails (logged)
        assert daemon.node.mounts() == []
        os.unlink(filler)
        daemon.node.mount("t/many:1", other, mode="fuse")
        assert _read(os.path.join(other, names[-1])) == files[names[-1]]
        daemon.node.umount(other)


def _free_pages(directory: str, pages: int) -> str:
    """Fill ``directory``'s filesystem (tmpfs), then free ``pages`` pages of it; returns the filler."""
    filler = _fill(directory)
    os.truncate(filler, os.path.getsize(filler) - pages * os.sysconf("SC_PAGE_SIZE"))
    return filler


def test_a_state_dir_too_full_for_the_fuse_session_file_refuses_a_mount_clearly_and_leaves_nothing(tmp_path):
    """A nearly full state disk where a new mount's record in the mount table fits but its FUSE session
    file (raw binding: the session's inode numbers, rewritten for each new layer) does not. The mount
    answered 500 "internal error: OSError(28)", and the layer's tree stayed served with no mount counted,
    so every later mount of that layer was refused ("this layer is already served") until a restart. Now
    it is an UnavailableError naming the file, nothing is listed, mounted or left half-written, and the
    layer mounts once there is room. The state directory is a small tmpfs, so fuse mode (kernel mode
    refuses tmpfs); the disk is filled to each of a few points, one of which is the right one."""
    from dsec_fs.errors import UnavailableError
    from dsec_fs.mounts import is_mountpoint, mount
    from erofs_builder import build_layer
    from lazy_fetch.layer_mount import SESSION_FILE
    from lazy_fetch.mount_table import MOUNT_TABLE
    from dsec_fs.store import FilesystemStore
    from treecmp import write_files

    store_dir = str(tmp_path / "store")
    store = FilesystemStore(store_dir, fsync=False)
    page = os.sysconf("SC_PAGE_SIZE")

    def new_layer(i: int) -> str:
        build_layer(write_files(tmp_path / f"src{i}", {"n.txt": f"layer {i}\n".encode()}), store,
                    name=f"t/n{i}:1", chunk_size=64 * 1024)
        return f"t/n{i}:1"

    small = tmp_path / "small"
    small.mkdir()
    mount("tmpfs", str(small), "tmpfs", data="size=4m")
    with _state_dir_on(tmp_path, str(small)) as daemons:
        session_file = os.path.join(daemons.state_dir, SESSION_FILE)
        node = daemons.start(store_dir, binding="raw").node
        mnt, = mount_dirs(tmp_path, "mnt")
        i = 0
        while os.path.getsize(session_file) <= page:  # every layer served once is in it: make it two pages
            node.mount(new_layer(i), mnt, mode="fuse")
            node.umount(mnt)
            i += 1
        ref = new_layer(i)
        refused = {}
        for pages in range(1, 6):
            filler = _free_pages(str(small), pages)
            try:
                node.mount(ref, mnt, mode="fuse")
            except UnavailableError as exc:
                refused[pages] = exc.where
                assert node.mounts() == [] and not is_mountpoint(mnt)
                assert not [name for name in os.listdir(daemons.state_dir) if ".tmp-" in name]
            else:
                assert _read(os.path.join(mnt, "n.txt")) == f"layer {i}\n".encode()
                node.umount(mnt)
            finally:
                os.unlink(filler)
        assert session_file in refused.values(), refused
        assert set(refused.values()) <= {session_file, os.path.join(daemons.state_dir, MOUNT_TABLE)}
        node.mount(ref, mnt, mode="fuse")  # with room again
        assert _read(os.path.join(mnt, "n.txt")) == f"layer {i}\n".encode()
        node.umount(mnt)


def _allocate_all(directory: str) -> str:
    """Allocate a file of ``directory`` until its filesystem has no block left (fallocate: a disk
    filesystem's delayed allocation makes writes fail while blocks are still free); returns the file."""
    path, size, piece = os.path.join(directory, "filler"), 0, 1 << 20
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while piece >= 512:
            try:
                os.posix_fallocate(fd, size, piece)
                size += piece
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                piece //= 2
    finally:
        os.close(fd)
    return path


def test_a_state_dir_too_full_for_a_meta_image_refuses_a_kernel_mount_clearly_and_leaves_nothing(tmp_path):
    """Kernel mode writes the layer's meta.erofs into the state directory: on a disk where the mount
    table's record fits and the image does not, the mount answered 500 "internal error: OSError(28)". Now
    an UnavailableError naming the file, with nothing listed, mounted or left in meta/. Kernel mode refuses
    tmpfs, so the state directory is a small ext4 (a loop device), filled but for a few KiB."""
    from dsec_fs.errors import UnavailableError
    from dsec_fs.mounts import is_mountpoint

    files = {f"dir/{i:04d}-{'n' * 80}.txt": b"x" for i in range(1500)}  # a meta image of some 200 KiB
    store_dir = layer_store(tmp_path / "wide", files, "t/wide:1", 64 * 1024)
    image, disk = str(tmp_path / "disk.img"), tmp_path / "disk"
    disk.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "1024", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, str(disk)], check=True)
    with _state_dir_on(tmp_path, str(disk)) as daemons:
        meta_dir = os.path.join(daemons.state_dir, "meta")
        node = daemons.start(store_dir, binding="raw").node
        mnt, = mount_dirs(tmp_path, "mnt")
        node.mount("t/wide:1", mnt, mode="kernel")  # the image's size, and that kernel mode works here
        meta_size = os.path.getsize(os.path.join(meta_dir, os.listdir(meta_dir)[0]))
        assert meta_size > 64 << 10
        node.umount(mnt)
        filler = _allocate_all(str(disk))
        os.truncate(filler, os.path.getsize(filler) - (16 << 10))  # room for the table and a trace
        try:
            with pytest.raises(UnavailableError, match="cannot write the layer's meta image") as refused:
                node.mount("t/wide:1", mnt, mode="kernel")
            assert refused.value.where.startswith(meta_dir + "/") and refused.value.where.endswith(".erofs")
            assert node.mounts() == [] and not is_mountpoint(mnt) and os.listdir(meta_dir) == []
        finally:
            os.unlink(filler)
        node.mount("t/wide:1", mnt, mode="kernel")
        name = sorted(files)[-1]
        assert _read(os.path.join(mnt, name)) == files[name]
        node.umount(mnt)


# Sends each request of argv[2:] (a Python literal of bytes) on a connection of its own to port argv[1],
# and prints what the daemon answered each (its status line), or how the connection ended.
_ONE_REQUEST_EACH = r"""
import ast, socket, sys
port = int(sys.argv[1])
for request in sys.argv[2:]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(ast.literal_eval(request))
        try:
            answer = conn.recv(4096)
        except OSError as exc:
            answer = repr(exc).encode()
        print(answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed", flush=True)
"""
# Requests h11 takes that the server did not expect: a target urlsplit refuses (ValueError: Invalid
# IPv6 URL), and a HEAD, whose answer h11 refuses to give a body (LocalProtocolError).
_ODD_REQUESTS = [b"GET //[x/metrics HTTP/1.1\r\nhost: x\r\n\r\n", b"GET http://[::1/metrics HTTP/1.1\r\nhost: x\r\n\r\n",
                 b"HEAD /metrics HTTP/1.1\r\nhost: x\r\n\r\n", b"HEAD /v1/nothing HTTP/1.1\r\nhost: x\r\n\r\n"]


def test_another_user_sending_requests_the_server_did_not_expect_gets_an_answer_and_the_daemon_lives(
        store_dir, daemons, tmp_path):
    """uid 65534 sends the TCP metrics page a request whose target urlsplit refuses (``//[x``) and a HEAD.
    Before: the ValueError, and h11's LocalProtocolError at the body of the answer to HEAD, left the
    connection's task, ended the server's nursery and with it the daemon: every mount on the node dead
    (ENOTCONN). Now: 400 for the target, the answer's head without its body for HEAD; the daemon reads on,
    and its API socket answers the same requests alike."""
    port = free_port()
    daemons.start(store_dir, extra_args=["--metrics-address", f"127.0.0.1:{port}"])
    node = Node(daemons.socket, timeout=20)
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount("t/hostile:1", mnt, mode="fuse")
    try:
        sent = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               "-I", "-S", "-c", _ONE_REQUEST_EACH, str(port), *map(repr, _ODD_REQUESTS)],
                              capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.splitlines() == ["HTTP/1.1 400 ", "HTTP/1.1 400 ", "HTTP/1.1 405 ", "HTTP/1.1 404 "]
        node.cache_evict(0)
        for name, data in FILES.items():
            assert _read(os.path.join(mnt, name)) == data
        assert node.status().pid > 0
        with socket.socket(socket.AF_UNIX) as conn:  # the API socket, the same requests
            conn.connect(daemons.socket)
            conn.sendall(b"HEAD /v1/status HTTP/1.1\r\nhost: x\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 405 ")
        assert node.status().pid > 0
        node.umount(mnt)
    finally:
        with contextlib.suppress(Exception):
            umount(mnt)


def test_a_mountpoint_another_user_could_redirect_is_refused(store_dir, daemons, tmp_path):
    """mount(2) looks its target up by name and follows symlinks. Before: a mountpoint in a directory uid
    65534 owns was mounted on, and 65534, swapping it for a symlink to a root directory in a loop
    (RENAME_EXCHANGE), had the layer mounted over that directory in 6 of 40 mounts; a symlink 65534 left
    in /var/tmp (sticky) was followed (os.path.realpath reads it with readlink, which fs.protected_symlinks
    does not guard): the layer went over its target. Now both are refused, naming the directory; a path
    through a symlink root made in /var/tmp still mounts."""
    daemons.start(store_dir)
    node = Node(daemons.socket, timeout=20)
    base = f"/var/tmp/hostile-{os.getpid()}-{time.monotonic_ns()}"
    theirs, victim, squat, ours = (f"{base}-{name}" for name in ("theirs", "victim", "squat", "ours"))
    os.mkdir(victim)
    os.symlink(victim, ours)
    try:
        subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
                        f"mkdir -p {theirs}/mnt && ln -s {victim} {squat}"], check=True)
        _refused_quickly(node.mount, "t/hostile:1", f"{theirs}/mnt", match="another user may change .*: its entry .*-theirs")
        _refused_quickly(node.mount, "t/hostile:1", squat, match="another user may change .*: its entry .*-squat")
        assert not any(entry.mountpoint in (victim, f"{theirs}/mnt") for entry in mount_table())
        node.mount("t/hostile:1", ours, mode="kernel")  # root's own symlink in /var/tmp: followed
        assert _read(os.path.join(victim, "top.txt")) == FILES["top.txt"]
        node.umount(ours)
        assert node.status().pid > 0
    finally:
        for entry in mount_table():
            if entry.mountpoint.startswith(base):
                umount(entry.mountpoint, lazy=True)
        subprocess.run(["rm", "-rf", theirs, victim, squat, ours], check=True)


OTHER_FILES = {"dir/a.txt": b"other\n" * 700, "other.bin": os.urandom(120_000)}  # dir/a.txt says which layer
STORM_THREADS = 6
STORM_CALLS = 40


@pytest.fixture(scope="module")
def two_layers(store_dir, tmp_path_factory) -> str:
    """store_dir, with a second layer t/other:1."""
    build_layer(write_files(tmp_path_factory.mktemp("other") / "src", OTHER_FILES),
                FilesystemStore(store_dir, fsync=False), name="t/other:1", chunk_size=64 * 1024)
    return store_dir


def _post_and_hang_up(path: str, mountpoint: str, layer: str) -> None:
    """A mount request sent whole on a connection closed at once, its answer never read."""
    body = json.dumps({"layer": layer, "mountpoint": mountpoint, "mode": "kernel"}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(b"POST /v1/mounts HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))


def test_a_storm_of_mounts_and_unmounts_of_the_same_mountpoints_and_layers_leaves_every_table_true(
        two_layers, daemons, tmp_path):
    """Mounts of different layers run at once (daemon_mounts.py's turns): many clients at once mounting
    two layers on three directories, each named by its path or by symlinks to it, in both modes,
    unmounting them (lazily too) and hanging up right after a request. Every call ends with its answer
    or a conflict (there already) or not found (nothing there), or (a link to a directory that carries a
    fuse-mode mount, which lies on the daemon's own FUSE session) is refused; after it, each directory carries at most
    one mount of ours (never two stacked), exactly those the daemon lists, each the layer listed; all of
    them unmount, leaving no meta image, blob or layer tree served."""
    daemon = daemons.start(two_layers)
    directories = mount_dirs(tmp_path, "m0", "m1", "m2")
    names: dict[str, list[str]] = {}
    for i, directory in enumerate(directories):
        link, link_to_link = str(tmp_path / f"link{i}"), str(tmp_path / f"link{i}-again")
        os.symlink(directory, link)
        os.symlink(link, link_to_link)
        names[directory] = [directory, link, link_to_link]
    expected_errors = (ConflictError, NotFoundError)
    failures: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        node = Node(daemons.socket, timeout=60)
        for _ in range(STORM_CALLS):
            name = rng.choice(names[rng.choice(directories)])
            layer = rng.choice(("t/hostile:1", "t/other:1"))
            try:
                action = rng.random()
                if action < 0.45:
                    node.mount(layer, name, mode=rng.choice(("kernel", "fuse")))
                elif action < 0.85:
                    node.umount(name, lazy=rng.random() < 0.3)
                else:
                    _post_and_hang_up(daemons.socket, name, layer)
            except expected_errors:
                pass
            except InputError as exc:  # a link's target carrying a fuse-mode mount: the daemon's own session
                if "own FUSE session" not in str(exc):
                    failures.append(exc)
            except BaseException as exc:  # noqa: BLE001 - reported below, with the others
                failures.append(exc)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(STORM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    node = Node(daemons.socket, timeout=30)
    try:
        assert [repr(exc) for exc in failures] == []
        time.sleep(1.0)  # the hung-up requests' mounts end too
        listed = {m.mountpoint: m for m in node.mounts()}
        assert set(listed) <= set(directories)
        below = [e.mountpoint for e in mount_table() if e.mountpoint.startswith(str(tmp_path) + "/")]
        session = os.path.join(daemons.state_dir, "fuse")
        assert sorted(below) == sorted([session, *listed])  # one each (none stacked), and only those listed
        for mountpoint, mount in listed.items():
            data = _read(os.path.join(mountpoint, "dir/a.txt"))
            assert data == (FILES if mount.ref == "t/hostile:1" else OTHER_FILES)["dir/a.txt"], mount
        assert daemon.alive()
    finally:
        for mount in node.mounts():
            node.umount(mount.mountpoint)
    below = [e.mountpoint for e in mount_table() if e.mountpoint.startswith(str(tmp_path) + "/")]
    assert node.mounts() == [] and below == [session]
    daemons.stop_all()
    assert "Traceback" not in daemons.log()
