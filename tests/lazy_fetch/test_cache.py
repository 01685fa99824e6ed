import errno
import logging
import os
import random
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace

import lmdb
import pytest

from dsec_fs import compress
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import InputError, UnavailableError
from lazy_fetch import cache_segments
from lazy_fetch.cache import ChunkCache, Frame, read_index
from lazy_fetch.cache_segments import TMP_PREFIX, segment_name
from lazy_fetch.lmdb_index import CacheIndex, IndexEntry
from tests.other_user import all_paths, readable_by_nobody

PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chunk(n: int, size: int = 4096) -> bytes:
    return random.Random(n).randbytes(size)


def segment_files(directory) -> dict[str, str]:
    """name -> path of every file under the cache's segments/ directory, temporary ones included."""
    found = {}
    for dirpath, _dirnames, filenames in os.walk(os.path.join(directory, "segments")):
        for name in filenames:
            found[name] = os.path.join(dirpath, name)
    return found


def located(cache: ChunkCache, digest: bytes) -> tuple[str, int, int]:
    where = cache.locate(digest)
    assert where is not None
    return where


def overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def assert_consistent(directory, max_bytes):
    """Open the cache and check that index and segments agree exactly and every entry reads back valid;
    returns the stats of that open (with what it reconciled)."""
    with ChunkCache(str(directory), max_bytes) as cache:
        reconciled = cache.stats().reconciled
    entries = read_index(str(directory))
    files = segment_files(directory)
    assert not [name for name in files if name.startswith(TMP_PREFIX)]
    assert set(files) == {segment_name(entry.segment) for entry in entries.values()}  # none unindexed
    for entry in entries.values():
        assert entry.offset + entry.size <= os.path.getsize(files[segment_name(entry.segment)])
    with ChunkCache(str(directory), max_bytes) as cache:
        total = 0
        for digest, entry in entries.items():
            assert not cache.lacks(digest)  # never claims to lack a chunk it holds
            data = cache.get(digest)
            assert data is not None and sha256(data) == digest and len(data) == entry.size
            total += len(data)
        stats = cache.stats()
        assert (stats.rotten, stats.reconciled, stats.entries) == (0, 0, len(entries))
        assert stats.bytes == total <= max_bytes
        return replace(stats, reconciled=reconciled)


def test_put_get_and_stats(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        data = chunk(1, 5000)
        assert cache.get(sha256(data)) is None
        assert cache.put(sha256(data), data)
        assert cache.get(sha256(data)) == data
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (1, 5000, 1, 1)
        path, offset, size = located(cache, sha256(data))
        assert (os.path.dirname(path), offset, size) == (os.path.join(tmp_path, "segments"), 0, 5000)
        with open(path, "rb") as f:
            assert f.read() == data


def test_a_put_makes_the_segments_directory_when_it_is_gone(tmp_path):
    # made at open, and again by a put that finds it gone (not checked before every write)
    cache = ChunkCache(str(tmp_path / "c"), 1 << 20)
    try:
        first, second = chunk(1), chunk(2)
        cache.put(sha256(first), first)
        shutil.rmtree(tmp_path / "c" / "segments")
        assert cache.put(sha256(second), second)
        assert cache.get(sha256(second)) == second
        assert cache.get(sha256(first)) is None and cache.stats().rotten == 1  # its segment went with it
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


@pytest.mark.parametrize("damage", ["flip", "truncate", "zeroed", "delete"])
def test_rotten_entry_is_dropped_and_reported_as_miss(tmp_path, damage):
    data, other = chunk(1), chunk(2)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(data), data)
        cache.put(sha256(other), other)
        path, offset, size = located(cache, sha256(data))
        assert located(cache, sha256(other))[0] != path  # two puts, two segments
        if damage == "delete":
            os.unlink(path)
        elif damage == "truncate":
            os.truncate(path, offset + size - 1)
        else:
            overwrite(path, offset, bytes([data[0] ^ 1]) if damage == "flip" else bytes(size))
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
        path, offset, _size = located(cache, sha256(held[0]))
        overwrite(path, offset, bytes([held[0][0] ^ 1]))
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
        assert len(segment_files(tmp_path)) == 8  # one put, one segment; the evicted ones' are gone
    assert_consistent(tmp_path, max_bytes)


def test_index_walks_least_recent_first(tmp_path):
    index = CacheIndex(str(tmp_path / "index"))
    try:
        for n in range(5):
            index.put_many([(bytes([n]) * 32, IndexEntry(segment=n, offset=0, size=100, atime=1000 + n, checksum=0))])
        index.touch({bytes([0]) * 32: 2000, bytes([9]) * 32: 3000})  # an unknown digest is skipped
        assert [digest[0] for digest, _entry in index.least_recent(10)] == [1, 2, 3, 4, 0]
        assert [digest for digest, _entry in index.evict_to(250)] == [bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32]
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


def test_open_reconciles_segments_and_index(tmp_path):
    kept, lost = chunk(1), chunk(2)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(kept), kept)
        cache.put(sha256(lost), lost)
        kept_path, lost_path = located(cache, sha256(kept))[0], located(cache, sha256(lost))[0]
    os.unlink(lost_path)  # an entry without a segment
    orphan = chunk(3)  # a segment without an entry (a put killed before it reached the index)
    with open(os.path.join(tmp_path, "segments", segment_name(99)), "wb") as f:
        f.write(orphan)
    with open(os.path.join(tmp_path, "segments", TMP_PREFIX + "leftover"), "wb") as f:
        f.write(b"partial")
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.reconciled) == (1, len(kept), 3)
        assert set(segment_files(tmp_path).values()) == {kept_path}
        assert cache.get(sha256(orphan)) is None
        cache.put(sha256(orphan), orphan)
        assert located(cache, sha256(orphan))[0] != kept_path and cache.get(sha256(kept)) == kept


def test_damaged_index_starts_empty(tmp_path):
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put(sha256(chunk(1)), chunk(1))
    with open(os.path.join(tmp_path, "index", "data.mdb"), "r+b") as f:
        f.write(os.urandom(8192))
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.stats().entries == 0 and segment_files(tmp_path) == {}
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
from lazy_fetch import cache_segments
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
        die()  # the temporary segment is written, not yet in place
    real_rename(src, dst)
    if crash == "after-rename" and renames == 20:
        die()  # the segment is in place, the index does not know its chunks
def unlink(path):
    if crash == "mid-eviction" and "/segments/" in path and ".tmp-" not in path:
        die()  # the index forgot every chunk of the segment, the segment is still there
    real_unlink(path)
def punch_hole(fd, offset, length):
    if crash == "mid-punch":
        die()  # the index forgot an evicted chunk, its bytes are still in a segment in use
    real_punch_hole(fd, offset, length)
os.rename, os.unlink = rename, unlink
real_punch_hole, cache_segments.punch_hole = cache_segments.punch_hole, punch_hole

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


@pytest.mark.parametrize(("crash", "api"), [
    (crash, api) for crash in ("before-rename", "after-rename", "mid-eviction") for api in ("put", "put_many")
] + [("mid-punch", "put_many")])  # a put's segment holds one chunk: it goes whole, no hole is punched
def test_sigkill_at_each_step_leaves_a_consistent_cache(tmp_path, crash, api):
    run_writer(tmp_path, crash, api=api)
    stats = assert_consistent(tmp_path, CRASH_MAX_BYTES)
    assert stats.entries > 0
    if crash in ("before-rename", "after-rename", "mid-eviction"):  # an unindexed segment (or a
        assert stats.reconciled >= 1  # temporary one) was left, which the reopen removed


def test_sigkill_at_random_points_leaves_a_consistent_cache(tmp_path):
    for kill_after in (37, 150, 400):
        run_writer(tmp_path, "none", kill_after=kill_after)
        assert_consistent(tmp_path, CRASH_MAX_BYTES)


# -- leftovers and strays: nothing in the directory stops an open, nothing in it is followed


def test_open_survives_strays_of_every_kind_and_follows_none(tmp_path):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not the cache's")
    chunks = [chunk(n) for n in range(7)]
    digests = [sha256(data) for data in chunks]
    with ChunkCache(str(directory), 1 << 20) as cache:
        for digest, data in zip(digests, chunks):
            cache.put(digest, data)
        paths = [located(cache, digest)[0] for digest in digests]  # a segment each
    # Indexed segments replaced: by a directory, a symlink to a file of the right bytes outside, an
    # empty file, half of it, a FIFO, a symlink to a FIFO; the last one stays sound.
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
    segments_dir = directory / "segments"
    os.makedirs(segments_dir / "some-dir" / "deeper")  # the directory of issue 12
    (segments_dir / "some-dir" / "deeper" / "file").write_bytes(b"x")
    os.symlink(outside, segments_dir / "link-to-outside")
    os.symlink(outside, segments_dir / segment_name(1000))  # a segment's name, a symlink out of the cache
    (segments_dir / ("f" * 16)).write_bytes(b"the last segment number")  # no new number past it
    os.makedirs(segments_dir / "not-a-segment" / "x")
    (segments_dir / "README").write_bytes(b"a file of a wrong name")
    (segments_dir / segment_name(1001).upper()).write_bytes(b"a segment's name, almost")
    os.mkfifo(segments_dir / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(segments_dir / segment_name(1002)))
    locked = segments_dir / "03"
    os.makedirs(locked / "sub", exist_ok=True)
    (locked / "sub" / "f").write_bytes(b"y")
    os.chmod(locked / "sub", 0)
    os.chmod(locked, 0)  # unreadable
    old_chunks = directory / "chunks"  # an older layout's chunk files, one a symlink out of the cache
    os.makedirs(old_chunks / "ab")
    (old_chunks / "ab" / ("ab" + "0" * 62)).write_bytes(b"an old chunk file")
    os.symlink(outside, old_chunks / "cd")
    (directory / "index" / "stray").write_bytes(b"z")
    os.makedirs(directory / "index" / "stray-dir")
    (directory / "operator-notes").write_bytes(b"left alone")

    with ChunkCache(str(directory), 1 << 20) as cache:
        assert cache.stats().entries == 1
        assert cache.get(digests[6]) == chunks[6]
        assert [cache.get(digest) for digest in digests[:6]] == [None] * 6
        assert cache.stats().rotten == 0  # all dropped at open, none found on read
        for digest, data in zip(digests, chunks):  # every chunk can be cached again
            cache.put(digest, data)
        assert [cache.get(digest) for digest in digests] == chunks
        held = {located(cache, digest)[0] for digest in digests}
    # Nothing outside was touched, nothing stray is left, the operator's file is there.
    assert sorted(os.listdir(outside)) == ["copy", "fifo", "precious"]
    assert (outside / "precious").read_bytes() == b"not the cache's"
    assert sorted(os.listdir(directory / "index")) == ["data.mdb", "lock.mdb"]
    assert (directory / "operator-notes").exists() and not os.path.lexists(old_chunks)
    assert sorted(os.listdir(segments_dir)) == sorted(os.path.basename(path) for path in held)
    assert paths[6] in held and len(held) == 7
    with ChunkCache(str(directory), 1 << 20) as cache:
        assert (cache.stats().reconciled, cache.stats().entries) == (0, 7)


def test_open_survives_strays_where_the_cache_keeps_its_own(tmp_path):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    directory.mkdir()
    os.symlink(outside, directory / "segments")  # would send every chunk out of the cache
    os.makedirs(directory / "lock" / "sub")  # a directory where the lock file belongs
    (directory / "index").write_bytes(b"a file where the index directory belongs")
    with ChunkCache(str(directory), 1 << 20) as cache:
        cache.put(sha256(chunk(1)), chunk(1))
        assert cache.get(sha256(chunk(1))) == chunk(1)
    assert os.listdir(outside) == ["precious"]
    assert not os.path.islink(directory / "segments") and os.path.isfile(directory / "lock")
    # Inside the index: its files replaced by a directory and a symlink.
    os.unlink(directory / "index" / "data.mdb")
    os.makedirs(directory / "index" / "data.mdb")
    os.unlink(directory / "index" / "lock.mdb")
    os.symlink(outside / "precious", directory / "index" / "lock.mdb")
    with ChunkCache(str(directory), 1 << 20) as cache:
        assert cache.stats().entries == 0  # the index started again, the orphaned segment went
        cache.put(sha256(chunk(2)), chunk(2))
        assert cache.get(sha256(chunk(2))) == chunk(2)
    assert (outside / "precious").read_bytes() == b"keep"


def test_a_stray_holding_a_mount_is_left_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    directory = tmp_path / "cache"
    with ChunkCache(str(directory), 1 << 20):
        pass
    target = directory / "segments" / "mounted"
    os.makedirs(target)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(target)], check=True)
    try:
        (target / "theirs").write_bytes(b"not the cache's")
        with ChunkCache(str(directory), 1 << 20) as cache:
            cache.put(sha256(chunk(1)), chunk(1))
        assert (target / "theirs").read_bytes() == b"not the cache's"
    finally:
        subprocess.run(["umount", str(target)], check=True)


# -- private: the directory 0700, segment and index files 0600, narrowed when found wider


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
        "segments": 0o700, "index": 0o700, "lock": 0o600, "index/data.mdb": 0o600, "index/lock.mdb": 0o600}
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
        for sub in ("segments", "index"):
            os.chmod(os.path.join(directory, sub), 0o755)
        assert readable_by_nobody(paths) == [p for p in paths if os.path.isdir(p)]
    finally:
        shutil.rmtree(parent)


# -- segments: a batch in one file, holes on eviction, damage under the cache, the older layout


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_batch_lands_in_one_segment(tmp_path):
    chunks = [chunk(n, 4096 + 100 * n) for n in range(50)]
    with ChunkCache(str(tmp_path), 1 << 24) as cache:
        assert cache.put_many([(sha256(data), data) for data in chunks + chunks[:3]]) == 53  # repeats kept once
        (name, path), = segment_files(tmp_path).items()
        offset = 0
        for data in chunks:  # end to end, in the batch's order
            assert located(cache, sha256(data)) == (path, offset, len(data))
            offset += len(data)
        assert os.path.getsize(path) == offset == cache.stats().bytes
        assert cache.put_many([(sha256(data), data) for data in chunks[:10]]) == 10  # all cached: no segment
        assert list(segment_files(tmp_path)) == [name]
        assert all(cache.get(sha256(data)) == data for data in chunks)


def test_eviction_punches_holes_and_unlinks_an_emptied_segment(tmp_path):
    older = [chunk(n, 64 * 1024) for n in range(16)]
    newer = [chunk(n, 64 * 1024) for n in range(100, 116)]
    with ChunkCache(str(tmp_path), 1 << 24) as cache:
        cache.put_many([(sha256(data), data) for data in older])
        cache.put_many([(sha256(data), data) for data in newer])
        older_path, newer_path = located(cache, sha256(older[0]))[0], located(cache, sha256(newer[0]))[0]
        full = allocated(older_path)
        assert full >= 16 * 64 * 1024
        assert cache.evict_to(24 * 64 * 1024) == 8  # the least recent: half of the older batch (one atime)
        assert allocated(older_path) <= full - 8 * 64 * 1024  # their blocks are free
        assert os.path.getsize(older_path) == 16 * 64 * 1024  # the others keep their offsets
        kept = [data for data in older if cache.holds([sha256(data)])]  # (holds: no LRU move)
        assert len(kept) == 8
        assert cache.evict_to(16 * 64 * 1024) == 8
        assert not os.path.exists(older_path) and os.path.exists(newer_path)  # none of it left: unlinked
        assert all(cache.get(sha256(data)) == data for data in newer)
        assert not cache.holds(sha256(data) for data in older)
        assert cache.stats().rotten == 0
    assert_consistent(tmp_path, 1 << 24)


def test_without_holes_evicted_bytes_count_against_the_bound_until_their_segment_goes(tmp_path, monkeypatch):
    def refuse(fd, offset, length):  # a filesystem without FALLOC_FL_PUNCH_HOLE (vfat, some FUSE ones)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(cache_segments, "punch_hole", refuse)
    size, max_bytes = 16 * 1024, 32 * 16 * 1024
    with ChunkCache(str(tmp_path), max_bytes) as cache:
        for batch in range(8):  # a batch of 8 chunks a segment; each second chunk used again
            chunks = [chunk(batch * 100 + n, size) for n in range(8)]
            cache.put_many([(sha256(data), data) for data in chunks])
            for data in chunks[::2]:
                assert cache.get(sha256(data)) == data
            on_disk = sum(os.path.getsize(path) for path in segment_files(tmp_path).values())
            assert on_disk <= max_bytes  # the segments, evicted bytes in them included, within the bound
            assert cache.stats().bytes <= max_bytes
        assert cache.stats().evictions > 0 and cache.stats().rotten == 0
    assert_consistent(tmp_path, max_bytes)


def test_a_segment_truncated_or_rotted_under_the_cache_gives_misses_not_wrong_bytes(tmp_path):
    chunks = [chunk(n) for n in range(10)]
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        cache.put_many([(sha256(data), data) for data in chunks])
        path, offset, _size = located(cache, sha256(chunks[7]))
        os.truncate(path, offset + 100)  # chunks 7, 8 and 9 cut off
        overwrite(path, located(cache, sha256(chunks[2]))[1] + 50, b"rot")
        assert [cache.get(sha256(data)) for data in chunks] == chunks[:2] + [None] + chunks[3:7] + [None] * 3
        stats = cache.stats()
        assert (stats.rotten, stats.entries) == (4, 6)
        cache.put_many([(sha256(data), data) for data in chunks[7:9]])  # fetched again, into a new segment
    os.truncate(path, offset - 1)  # now chunk 6 too, the cache closed: found at open
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert (cache.stats().reconciled, cache.stats().entries) == (1, 7)
        assert [cache.get(sha256(data)) for data in chunks] == chunks[:2] + [None] + chunks[3:6] + [None] + \
            chunks[7:9] + [None]
        assert cache.stats().rotten == 0


def test_a_crash_between_a_segment_and_its_index_commit_leaves_nothing_indexed(tmp_path):
    # The writer is killed inside its first put_many, once the segment is renamed into place and before
    # the index records it.
    writer = r"""
import os, random, signal, sys
from dsec_fs.digest import sha256
from lazy_fetch import lmdb_index
from lazy_fetch.cache import ChunkCache

def die(self, entries):
    os.kill(os.getpid(), signal.SIGKILL)
lmdb_index.CacheIndex.put_many = die
cache = ChunkCache(sys.argv[1], 1 << 20)
cache.put_many([(sha256(data), data) for data in (random.Random(n).randbytes(4096) for n in range(20))])
"""
    process = subprocess.run([sys.executable, "-c", writer, str(tmp_path)], cwd=PROJECT, timeout=60,
                             env={**os.environ, "PYTHONPATH": PROJECT})
    assert process.returncode == -signal.SIGKILL
    (name, path), = segment_files(tmp_path).items()
    assert not name.startswith(TMP_PREFIX) and os.path.getsize(path) == 20 * 4096  # written, in place
    assert read_index(str(tmp_path)) == {}
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert (cache.stats().entries, cache.stats().reconciled) == (0, 1)
        assert segment_files(tmp_path) == {}
        assert all(cache.lacks(sha256(chunk(n))) for n in range(20))


@pytest.mark.parametrize("hostile", ["symlink", "fifo", "symlink-to-fifo", "directory"])
def test_a_hostile_entry_in_place_of_a_segment_is_not_followed_and_does_not_block(tmp_path, hostile):
    directory, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    chunks = [chunk(n) for n in range(4)]
    results = []
    with ChunkCache(str(directory), 1 << 20) as cache:
        cache.put_many([(sha256(data), data) for data in chunks])
        path = located(cache, sha256(chunks[0]))[0]
        (outside / "copy").write_bytes(open(path, "rb").read())  # the segment's very bytes
        os.unlink(path)
        if hostile == "symlink":
            os.symlink(outside / "copy", path)
        elif hostile == "directory":
            os.makedirs(os.path.join(path, "inside"))
        else:
            os.mkfifo(outside / "fifo")
            os.symlink(outside / "fifo", path) if hostile == "symlink-to-fifo" else os.mkfifo(path)
        reader = threading.Thread(target=lambda: results.extend(cache.get(sha256(data)) for data in chunks[:2]))
        reader.start()
        reader.join(timeout=20)
        assert not reader.is_alive(), "a read blocked on what is in the segment's place"
        assert results == [None, None] and cache.stats().rotten == 2
        cache.evict_to(0)  # no hole is punched through it
        assert (outside / "copy").read_bytes() == b"".join(chunks)
    with ChunkCache(str(directory), 1 << 20) as cache:
        assert cache.stats().entries == 0 and segment_files(directory) == {}
    assert sorted(os.listdir(outside)) == ["copy", "fifo"][:1 + ("fifo" in hostile)]


def test_a_cache_of_the_older_layout_starts_again_empty(tmp_path, caplog):
    # Layout 1, as main wrote it before segments: an index of (size, atime, xxh3) entries and no layout
    # mark, a file per chunk under chunks/<hh>/.
    data = chunk(1)
    digest = sha256(data)
    os.makedirs(tmp_path / "index", mode=0o700)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=3, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(digest, struct.pack("<QQQ", len(data), 1, 2), db=env.open_db(b"entries", txn=txn))
        txn.put(struct.pack(">Q", 1) + digest, b"", db=env.open_db(b"lru", txn=txn))
        txn.put(b"bytes", struct.pack("<Q", len(data)), db=env.open_db(b"totals", txn=txn))
    env.close()
    os.makedirs(tmp_path / "chunks" / to_hex(digest)[:2])
    (tmp_path / "chunks" / to_hex(digest)[:2] / to_hex(digest)).write_bytes(data)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert (cache.stats().entries, cache.stats().bytes) == (0, 0)
        assert cache.get(digest) is None and cache.lacks(digest)
        assert not os.path.exists(tmp_path / "chunks")
        assert cache.put(digest, data) and cache.get(digest) == data
    assert "layout 1" in caplog.text
    assert_consistent(tmp_path, 1 << 20)


def test_a_cache_of_layout_2_is_kept_and_read_as_plain_chunks(tmp_path, caplog):
    # Layout 2, as main wrote it before frames: entries of (segment, offset, size, atime, xxh3), all plain.
    data = chunk(2)
    digest = sha256(data)
    os.makedirs(tmp_path / "index", mode=0o700)
    os.makedirs(tmp_path / "segments", mode=0o700)
    (tmp_path / "segments" / segment_name(7)).write_bytes(data)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"layout", struct.pack("<Q", 2), db=env.open_db(b"meta", txn=txn))
        txn.put(digest, struct.pack("<QQQQQ", 7, 0, len(data), 1, cache_segments.checksum(data)),
                db=env.open_db(b"entries", txn=txn))
        txn.put(struct.pack(">Q", 1) + digest, b"", db=env.open_db(b"lru", txn=txn))
        txn.put(b"bytes", struct.pack("<Q", len(data)), db=env.open_db(b"totals", txn=txn))
    env.close()
    caplog.set_level(logging.INFO, logger="lazy_fetch.cache")
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert (cache.stats().entries, cache.stats().bytes, cache.stats().frames) == (1, len(data), 0)
        assert cache.get(digest) == data
    assert "an index of layout 2" in caplog.text and "kept, and marked layout 3" in caplog.text
    caplog.clear()
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.get(digest) == data
    assert "layout" not in caplog.text
    assert_consistent(tmp_path, 1 << 20)


def test_frames_are_kept_as_given_count_as_stored_and_give_way_to_their_plain_chunk(tmp_path):
    plain = [bytes(2048) + chunk(n) for n in range(4)]
    digests = [sha256(data) for data in plain]
    frames = [Frame(compress.compress(data), len(data), "ab" * 32) for data in plain]
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.put_many(zip(digests, frames)) == 4
        assert cache.get(digests[0]) == frames[0]
        stats = cache.stats()
        assert (stats.frames, stats.bytes) == (4, sum(len(frame.frame) for frame in frames))
        cache.put(digests[0], frames[0]._replace(frame=b"other"))  # a frame does not replace one
        assert cache.get(digests[0]) == frames[0]
        assert cache.put(digests[0], plain[0]) and cache.get(digests[0]) == plain[0]
        cache.put(digests[0], frames[0])  # nor a plain chunk
        assert cache.get(digests[0]) == plain[0]
        cache.put_many([(digests[1], frames[1]), (digests[1], plain[1])])  # a plain chunk after its frame
        assert cache.get(digests[1]) == plain[1]
        assert not cache.drop_frame(digests[1])  # a plain chunk is not dropped as a frame
        assert cache.drop_frame(digests[2]) and cache.get(digests[2]) is None
        stats = cache.stats()
        assert (stats.entries, stats.frames, stats.bad_frames) == (3, 1, 1)
        assert stats.bytes == len(plain[0]) + len(plain[1]) + len(frames[3].frame)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:  # counted again at open
        assert cache.stats().frames == 1 and cache.get(digests[3]) == frames[3]
        cache.evict_to(len(plain[1]) + len(frames[3].frame))  # the least recent, plain[0], goes
        assert cache.get(digests[0]) is None and cache.stats().frames == 1
        cache.evict_to(0)
        assert (cache.stats().frames, cache.stats().bytes) == (0, 0)
    assert_consistent(tmp_path, 1 << 20)


def test_a_frames_record_damaged_to_a_plain_ones_length_is_not_read_as_the_chunk(tmp_path):
    # The two kinds of entry are told apart by their length: a frame's 80-byte record that loses its last
    # 40 bytes at rest reads as a plain chunk's. Its checksum is seeded apart, so the read finds it rotten
    # (and drops it) instead of handing out the compressed frame as the chunk's bytes.
    data = bytes(4096) + chunk(3)
    digest = sha256(data)
    frame = Frame(compress.compress(data), len(data), "ab" * 32)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.put_many([(digest, frame)]) == 1
    env = lmdb.open(str(tmp_path / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        entries = env.open_db(b"entries", txn=txn)
        record = txn.get(digest, db=entries)
        assert len(record) == 80
        txn.put(digest, record[:40], db=entries)
    env.close()
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        assert cache.get(digest) is None
        assert cache.stats().rotten == 1 and cache.stats().entries == 0


def test_a_frame_put_that_races_its_plain_chunk_does_not_replace_it(tmp_path, monkeypatch):
    # A fill's frame and the chunk a reader checked are put by different threads (the cache writer, and
    # a read's own write when the writer is behind): a frame that found no entry when its put began must
    # not replace the plain chunk put while its segment was written (it did: the chunk, verified, went
    # back to unchecked bytes, decompressed and checked again, or read again if the store lied).
    plain = [bytes(2048) + chunk(n) for n in range(4)]
    digests = [sha256(data) for data in plain]
    frames = [Frame(compress.compress(data), len(data), "ab" * 32) for data in plain]
    real_write = cache_segments.write_temporary
    racing: list[list[int]] = []  # the chunks the reader puts while the next frames' segment is written

    def write_while_a_reader_puts(directory, views):
        if racing:  # the frames' put, before it takes the lock: the reader's put goes in first
            cache.put_many([(digests[n], plain[n]) for n in racing.pop()])
        return real_write(directory, views)

    monkeypatch.setattr("lazy_fetch.cache.write_temporary", write_while_a_reader_puts)
    with ChunkCache(str(tmp_path), 1 << 20) as cache:
        racing.append([0, 1])
        assert cache.put_many(zip(digests[:3], frames[:3])) == 3
        assert [cache.get(digest) for digest in digests[:3]] == [plain[0], plain[1], frames[2]]
        stats = cache.stats()
        assert (stats.entries, stats.frames) == (3, 1)
        assert stats.bytes == len(plain[0]) + len(plain[1]) + len(frames[2].frame)
        assert cache.frame_growth == len(plain[2]) - len(frames[2].frame)  # what reading frames[2] adds
        segments = len(os.listdir(tmp_path / "segments"))
        racing.append([3])  # every frame of a put raced: no segment is left for it
        assert cache.put(digests[3], frames[3]) and cache.get(digests[3]) == plain[3]
        assert len(os.listdir(tmp_path / "segments")) == segments + 1  # the reader's
    with ChunkCache(str(tmp_path), 1 << 20) as cache:  # counted again at open
        assert cache.frame_growth == len(plain[2]) - len(frames[2].frame)
        cache.put(digests[2], plain[2])  # (assert_consistent reads plain chunks)
        assert cache.frame_growth == 0
    assert_consistent(tmp_path, 1 << 20)
