import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import InputError, UnavailableError
from lazy_fetch.cache import TMP_PREFIX, ChunkCache
from lazy_fetch.lmdb_index import CacheIndex
from tests.other_user import all_paths, readable_by_nobody

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chunk(n: int, size: int = 4096) -> bytes:
    return random.Random(n).randbytes(size)


def chunk_files(directory) -> dict[str, str]:
    """name -> path of every file under the cache's chunks/ directory, temporary ones included."""
    found = {}
    for dirpath, _dirnames, filenames in os.walk(os.path.join(directory, "chunks")):
        for name in filenames:
            found[name] = os.path.join(dirpath, name)
    return found


def assert_consistent(directory, max_bytes):
    """Open the cache and check that index and files agree exactly and every entry reads back valid."""
    with ChunkCache(str(directory), max_bytes) as cache:
        files = chunk_files(directory)
        assert not [name for name in files if name.startswith(TMP_PREFIX)]
        stats = cache.stats()
        assert stats.entries == len(files)
        total = 0
        for name in files:
            assert not cache.lacks(bytes.fromhex(name))  # never claims to lack a chunk it holds
            data = cache.get(bytes.fromhex(name))
            assert data is not None and to_hex(sha256(data)) == name
            total += len(data)
        stats = cache.stats()
        assert stats.rotten == 0
        assert stats.bytes == total <= max_bytes
        return stats


def test_put_get_and_stats(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        data = chunk(1, 5000)
        assert cache.get(sha256(data)) is None
        assert cache.put(sha256(data), data)
        assert cache.get(sha256(data)) == data
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (1, 5000, 1, 1)
        path = chunk_files(tmp_path)[to_hex(sha256(data))]
        assert os.path.basename(os.path.dirname(path)) == to_hex(sha256(data))[:2]


def test_a_put_makes_its_fan_out_directory_when_it_is_gone(tmp_path):
    # the fan-out directory is made when the open finds it missing, not before every write
    cache = ChunkCache(str(tmp_path / "c"), 1 << 20)
    try:
        first = chunk(1)
        second = next(chunk(n) for n in range(2, 100) if to_hex(sha256(chunk(n)))[:2] != to_hex(sha256(first))[:2])
        cache.put(sha256(first), first)
        fan_out = os.path.join(tmp_path, "c", "chunks", to_hex(sha256(second))[:2])
        shutil.rmtree(fan_out, ignore_errors=True)
        assert cache.put(sha256(second), second)
        assert cache.get(sha256(second)) == second and cache.get(sha256(first)) == first
    finally:
        cache.close()


def test_survives_reopen(tmp_path):
    chunks = [chunk(n, 1000 + n) for n in range(20)]
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        for data in chunks:
            cache.put(sha256(data), data)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert all(cache.get(sha256(data)) == data for data in chunks)
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.reconciled) == (20, sum(map(len, chunks)), 0)


def test_one_owner_per_directory(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20):
        with pytest.raises(UnavailableError) as err:
            ChunkCache(str(tmp_path), 1 << 20)
        assert str(tmp_path) in str(err.value)
    ChunkCache(str(tmp_path), 1 << 20).close()


def test_size_must_be_positive(tmp_path):
    with pytest.raises(InputError):
        ChunkCache(str(tmp_path), 0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow", "delete"])
def test_rotten_entry_is_dropped_and_reported_as_miss(tmp_path, damage):
    data, other = chunk(1), chunk(2)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(data), data)
        cache.put(sha256(other), other)
        path = chunk_files(tmp_path)[to_hex(sha256(data))]
        if damage == "delete":
            os.unlink(path)
        else:
            damaged = {"flip": bytes([data[0] ^ 1]) + data[1:], "truncate": data[:-1], "grow": data + b"\0"}[damage]
            with open(path, "wb") as f:
                f.write(damaged)
        assert cache.get(sha256(data)) is None
        stats = cache.stats()
        assert (stats.rotten, stats.entries, stats.bytes) == (1, 1, len(other))
        assert not os.path.exists(path)
        assert cache.get(sha256(other)) == other
        # Fetched again, it is cached again.
        cache.put(sha256(data), data)
        assert cache.get(sha256(data)) == data


def test_lacks_answers_from_memory_and_never_for_a_cached_chunk(tmp_path):
    held = [chunk(n) for n in range(200)]
    others = [chunk(n) for n in range(1000, 1200)]
    with ChunkCache(str(tmp_path), 1 << 30) as cache:
        assert all(cache.lacks(sha256(data)) for data in held + others)
        cache.put_many([(sha256(data), data) for data in held])
        assert not any(cache.lacks(sha256(data)) for data in held)
        assert sum(cache.lacks(sha256(data)) for data in others) >= 190  # slots shared by chance: looked up
        # A rotten chunk, dropped, is lacked again.
        os.unlink(chunk_files(tmp_path)[to_hex(sha256(held[0]))])
        assert cache.get(sha256(held[0])) is None
        assert cache.lacks(sha256(held[0]))
        before = cache.stats().misses
        cache.note_misses(3)  # misses that lacks answered, not looked up, are counted still
        assert cache.stats().misses == before + 3
    with ChunkCache(str(tmp_path), 1 << 30) as cache:  # counted again at open
        assert not any(cache.lacks(sha256(data)) for data in held[1:])
        assert cache.lacks(sha256(held[0]))
        assert cache.evict_to(0) == 199
        assert all(cache.lacks(sha256(data)) for data in held)  # counted down by eviction


def test_put_many_records_a_batch(tmp_path):
    chunks = [chunk(n) for n in range(5)]
    with ChunkCache(str(tmp_path), 8 * 4096) as cache:
        cache.put(sha256(chunks[0]), chunks[0])
        too_big = chunk(99, 9 * 4096)
        batch = [(sha256(data), data) for data in chunks] + [(sha256(too_big), too_big)]
        assert cache.put_many(batch) == 5  # the one larger than the cache is not kept
        assert all(cache.get(sha256(data)) == data for data in chunks)
        assert cache.get(sha256(too_big)) is None
        assert (cache.stats().entries, cache.stats().bytes) == (5, 5 * 4096)
        assert cache.put_many([]) == 0
    assert_consistent(tmp_path, 8 * 4096)


def test_lru_eviction_keeps_under_max_bytes(tmp_path):
    chunks = [chunk(n) for n in range(10)]
    max_bytes = 8 * 4096
    with ChunkCache(str(tmp_path), max_bytes) as cache:
        for data in chunks[:8]:
            cache.put(sha256(data), data)
        assert cache.get(sha256(chunks[0])) == chunks[0]  # now the most recently used
        cache.put(sha256(chunks[8]), chunks[8])
        cache.put(sha256(chunks[9]), chunks[9])
        stats = cache.stats()
        assert stats.bytes <= max_bytes and stats.evictions == 2
        cached = {n for n, data in enumerate(chunks) if cache.get(sha256(data)) is not None}
        assert cached == {0, 3, 4, 5, 6, 7, 8, 9}
        assert len(chunk_files(tmp_path)) == 8
    assert_consistent(tmp_path, max_bytes)


def test_index_walks_least_recent_first(tmp_path):
    index = CacheIndex(str(tmp_path / "index"))
    try:
        for n in range(5):
            index.put(bytes([n]) * 32, 100, 0, atime=1000 + n)
        index.touch({bytes([0]) * 32: 2000, bytes([9]) * 32: 3000})  # an unknown digest is skipped
        assert [digest[0] for digest, _entry in index.least_recent(10)] == [1, 2, 3, 4, 0]
        assert index.evict_to(250) == [bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32]
        assert (len(index), index.total_bytes) == (2, 200)
    finally:
        index.close()


def test_chunk_larger_than_the_cache_is_not_kept(tmp_path):
    with ChunkCache(str(tmp_path), 4096) as cache:
        data = chunk(1, 8192)
        assert not cache.put(sha256(data), data)
        assert cache.get(sha256(data)) is None and cache.stats().entries == 0


def test_reopen_with_smaller_limit_evicts(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        for n in range(10):
            cache.put(sha256(chunk(n)), chunk(n))
    stats = assert_consistent(tmp_path, 4 * 4096)
    assert stats.entries == 4


def test_open_reconciles_files_and_index(tmp_path):
    kept, lost = chunk(1), chunk(2)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(kept), kept)
        cache.put(sha256(lost), lost)
    files = chunk_files(tmp_path)
    os.unlink(files[to_hex(sha256(lost))])  # an entry without a file
    orphan = chunk(3)  # a file without an entry (a put killed before it reached the index)
    orphan_path = os.path.join(tmp_path, "chunks", to_hex(sha256(orphan))[:2], to_hex(sha256(orphan)))
    os.makedirs(os.path.dirname(orphan_path), exist_ok=True)
    with open(orphan_path, "wb") as f:
        f.write(orphan)
    with open(os.path.join(os.path.dirname(files[to_hex(sha256(kept))]), TMP_PREFIX + "leftover"), "wb") as f:
        f.write(b"partial")
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.reconciled) == (1, len(kept), 3)
        assert set(chunk_files(tmp_path)) == {to_hex(sha256(kept))}
        assert cache.get(sha256(orphan)) is None


def test_damaged_index_starts_empty(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(chunk(1)), chunk(1))
    with open(os.path.join(tmp_path, "index", "data.mdb"), "r+b") as f:
        f.write(os.urandom(8192))
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.stats().entries == 0 and chunk_files(tmp_path) == {}
        cache.put(sha256(chunk(1)), chunk(1))
        assert cache.get(sha256(chunk(1))) == chunk(1)


def test_threads_share_one_cache(tmp_path):
    max_bytes = 16 * 4096
    chunks = [chunk(n) for n in range(40)]
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(200):
                data = rng.choice(chunks)
                got = cache.get(sha256(data))
                if got is None:
                    cache.put(sha256(data), data)
                else:
                    assert got == data
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with ChunkCache(str(tmp_path), max_bytes) as cache:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert cache.stats().rotten == 0 and cache.stats().evictions > 0
    assert_consistent(tmp_path, max_bytes)


# -- crashes: a writer process killed with SIGKILL, then the cache reopened

WRITER = r"""
import os, random, signal, sys
from dsec_fs.digest import sha256
from lazy_fetch.cache import ChunkCache

directory, max_bytes, crash, api = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

real_rename, real_unlink = os.rename, os.unlink
renames = 0
def rename(src, dst):
    global renames
    renames += 1
    if crash == "before-rename" and renames == 20:
        die()  # the temporary file is written, the chunk not yet in place
    real_rename(src, dst)
    if crash == "after-rename" and renames == 20:
        die()  # the chunk file is in place, the index does not know it
def unlink(path):
    if crash == "mid-eviction" and "/chunks/" in path and ".tmp-" not in path:
        die()  # the index forgot the evicted chunk, its file is still there
    real_unlink(path)
os.rename, os.unlink = rename, unlink

cache = ChunkCache(directory, max_bytes)
rng = random.Random(7)
for n in range(100000):
    data = random.Random(n % 300).randbytes(rng.randrange(1000, 20000))
    if cache.get(sha256(data)) is None:
        if api == "put":
            cache.put(sha256(data), data)
        else:  # a batch: this chunk and two more, some perhaps cached already
            more = [random.Random(n % 300 + k).randbytes(2000) for k in (1, 2)]
            cache.put_many([(sha256(data), data)] + [(sha256(m), m) for m in more])
    print(n, flush=True)
"""

CRASH_MAX_BYTES = 128 * 1024


def run_writer(directory, crash, kill_after=None, api="put"):
    """Run WRITER (caching with ``api``: put or put_many); with ``kill_after``, SIGKILL it once it has done
    that many operations."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory), str(CRASH_MAX_BYTES), crash, api],
        stdout=subprocess.PIPE, cwd=PROJECT, env={**os.environ, "PYTHONPATH": PROJECT},
    )
    try:
        if kill_after is not None:
            for _ in range(kill_after):
                assert process.stdout.readline(), "the writer ended early"
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL


@pytest.mark.parametrize("api", ["put", "put_many"])
@pytest.mark.parametrize("crash", ["before-rename", "after-rename", "mid-eviction"])
def test_sigkill_at_each_step_leaves_a_consistent_cache(tmp_path, crash, api):
    run_writer(tmp_path, crash, api=api)
    stats = assert_consistent(tmp_path, CRASH_MAX_BYTES)
    assert stats.entries > 0
    if crash != "before-rename":  # the kill left an unindexed chunk file, which the reopen removed
        assert stats.reconciled >= 1


def test_sigkill_at_random_points_leaves_a_consistent_cache(tmp_path):
    for kill_after in (37, 150, 400):
        run_writer(tmp_path, "none", kill_after=kill_after)
        assert_consistent(tmp_path, CRASH_MAX_BYTES)


# -- leftovers and strays: nothing in the directory stops an open, nothing in it is followed


def chunk_path(directory, digest: bytes) -> str:
    return os.path.join(directory, "chunks", to_hex(digest)[:2], to_hex(digest))


def test_open_survives_strays_of_every_kind_and_follows_none(tmp_path):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not the cache's")
    chunks = [chunk(n) for n in range(7)]
    digests = [sha256(data) for data in chunks]
    with ChunkCache(str(directory), 1 << 20) as cache:
        for digest, data in zip(digests, chunks):
            cache.put(digest, data)
    paths = [chunk_path(directory, digest) for digest in digests]
    # Indexed chunks whose files were replaced: by a directory, a symlink to a file of the right bytes
    # outside, an empty file, half of it, a FIFO, a symlink to a FIFO; the last one stays sound.
    os.unlink(paths[0])
    os.makedirs(os.path.join(paths[0], "inside"))
    (outside / "copy").write_bytes(chunks[1])
    os.unlink(paths[1])
    os.symlink(outside / "copy", paths[1])
    open(paths[2], "w").close()
    with open(paths[3], "r+b") as f:
        f.truncate(len(chunks[3]) // 2)
    os.unlink(paths[4])
    os.mkfifo(paths[4])
    os.mkfifo(outside / "fifo")
    os.unlink(paths[5])
    os.symlink(outside / "fifo", paths[5])
    chunks_dir = directory / "chunks"
    os.makedirs(chunks_dir / "ab" / "some-dir" / "deeper")  # the directory of issue 12
    (chunks_dir / "ab" / "some-dir" / "deeper" / "file").write_bytes(b"x")
    os.symlink(outside, chunks_dir / "ab" / "link-to-outside")
    os.symlink(outside, chunks_dir / "cd")  # a fan-out that is a symlink out of the cache
    (chunks_dir / "ef").write_bytes(b"a file where a fan-out directory belongs")
    os.makedirs(chunks_dir / "not-a-fan-out" / "x")
    (chunks_dir / "README").write_bytes(b"a file of a wrong name")
    os.makedirs(chunks_dir / "01", exist_ok=True)
    os.mkfifo(chunks_dir / "01" / "fifo")
    os.makedirs(chunks_dir / "02", exist_ok=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(chunks_dir / "02" / "sock"))
    locked = chunks_dir / "03"
    os.makedirs(locked / "sub", exist_ok=True)
    (locked / "sub" / "f").write_bytes(b"y")
    os.chmod(locked / "sub", 0)
    os.chmod(locked, 0)  # unreadable
    (directory / "index" / "stray").write_bytes(b"z")
    os.makedirs(directory / "index" / "stray-dir")
    (directory / "operator-notes").write_bytes(b"left alone")

    with ChunkCache(str(directory), 1 << 20) as cache:
        assert cache.stats().entries == 1
        assert cache.get(digests[6]) == chunks[6]
        assert [cache.get(digest) for digest in digests[:6]] == [None] * 6
        assert cache.stats().rotten == 0  # all dropped at open, none found on read
        for digest, data in zip(digests, chunks):  # every place can be filled again
            cache.put(digest, data)
        assert [cache.get(digest) for digest in digests] == chunks
    # Nothing outside was touched, nothing stray is left, the operator's file is there.
    assert sorted(os.listdir(outside)) == ["copy", "fifo", "precious"]
    assert (outside / "precious").read_bytes() == b"not the cache's"
    assert sorted(os.listdir(directory / "index")) == ["data.mdb", "lock.mdb"]
    assert (directory / "operator-notes").exists()
    left = {os.path.join(d, n) for d, ds, fs in os.walk(chunks_dir) for n in ds + fs}
    assert {path for path in left if not os.path.isdir(path) or os.listdir(path)} == \
        {os.path.dirname(path) for path in paths} | set(paths)  # and empty fan-out directories
    with ChunkCache(str(directory), 1 << 20) as cache:
        assert (cache.stats().reconciled, cache.stats().entries) == (0, 7)


def test_open_survives_strays_where_the_cache_keeps_its_own(tmp_path):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    directory.mkdir()
    os.symlink(outside, directory / "chunks")  # would send every chunk out of the cache
    os.makedirs(directory / "lock" / "sub")  # a directory where the lock file belongs
    (directory / "index").write_bytes(b"a file where the index directory belongs")
    with ChunkCache(str(directory), 1 << 20) as cache:
        cache.put(sha256(chunk(1)), chunk(1))
        assert cache.get(sha256(chunk(1))) == chunk(1)
    assert os.listdir(outside) == ["precious"]
    assert not os.path.islink(directory / "chunks") and os.path.isfile(directory / "lock")
    # Inside the index: its files replaced by a directory and a symlink.
    os.unlink(directory / "index" / "data.mdb")
    os.makedirs(directory / "index" / "data.mdb")
    os.unlink(directory / "index" / "lock.mdb")
    os.symlink(outside / "precious", directory / "index" / "lock.mdb")
    with ChunkCache(str(directory), 1 << 20) as cache:
        assert cache.stats().entries == 0  # the index started again, the orphaned chunk file went
        cache.put(sha256(chunk(2)), chunk(2))
        assert cache.get(sha256(chunk(2))) == chunk(2)
    assert (outside / "precious").read_bytes() == b"keep"


def test_a_stray_holding_a_mount_is_left_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    directory = tmp_path / "cache"
    with ChunkCache(str(directory), 1 << 20):
        pass
    target = directory / "chunks" / "ab" / "mounted"
    os.makedirs(target)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(target)], check=True)
    try:
        (target / "theirs").write_bytes(b"not the cache's")
        with ChunkCache(str(directory), 1 << 20) as cache:
            cache.put(sha256(chunk(1)), chunk(1))
        assert (target / "theirs").read_bytes() == b"not the cache's"
    finally:
        subprocess.run(["umount", str(target)], check=True)


# -- private: the directory 0700, chunk and index files 0600, narrowed when found wider


def modes_below(directory) -> dict[str, int]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, directory)] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


def test_the_cache_is_private_and_made_so_when_found_wider(tmp_path):
    directory = tmp_path / "cache"
    with ChunkCache(str(directory), 1 << 20) as cache:
        cache.put(sha256(chunk(1)), chunk(1))
    modes = modes_below(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert {name: mode for name, mode in modes.items() if name.startswith("index/") or "/" not in name} == {
        "chunks": 0o700, "index": 0o700, "lock": 0o600, "index/data.mdb": 0o600, "index/lock.mdb": 0o600}
    # An older version left it world-readable: the next open narrows all of it.
    for path in [str(directory), *(os.path.join(directory, name) for name in modes)]:
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    with ChunkCache(str(directory), 1 << 20) as cache:
        cache.put(sha256(chunk(2)), chunk(2))
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert all(mode & 0o077 == 0 for mode in modes_below(directory).values()), modes_below(directory)


def test_another_user_reads_nothing_under_the_cache(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    parent = tempfile.mkdtemp(prefix="dsecfs-cache-")  # not below pytest's 0700 directory
    try:
        os.chmod(parent, 0o755)
        directory = os.path.join(parent, "cache")
        os.makedirs(directory, mode=0o755)  # made wide by someone else: corrected
        with ChunkCache(directory, 1 << 20) as cache:
            for n in range(4):
                cache.put(sha256(chunk(n)), chunk(n))
        paths = all_paths(directory)
        assert len(paths) > 8
        assert readable_by_nobody([parent]) == [parent]  # the probe can read what is readable
        assert readable_by_nobody(paths) == []
        # Nor through the files alone, were the directory opened up by mistake.
        os.chmod(directory, 0o755)
        for sub in ("chunks", "index"):
            os.chmod(os.path.join(directory, sub), 0o755)
        for fan_out in os.listdir(os.path.join(directory, "chunks")):
            os.chmod(os.path.join(directory, "chunks", fan_out), 0o755)
        assert readable_by_nobody(paths) == [p for p in paths if os.path.isdir(p)]
    finally:
        shutil.rmtree(parent)
