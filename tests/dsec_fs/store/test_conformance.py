"""One behaviour for every backend: the same tests run against a bare path, file://, posix:// and s3://
(moto over HTTP). A backend passes these or it is not a Store."""

from __future__ import annotations

import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsec_fs.errors import CorruptError, InputError, NotFoundError, UnavailableError, UnsupportedError
from dsec_fs.store import FilesystemStore, init_store, open_store
from dsec_fs.store.ref_cache import RefCacheStore
from dsec_fs.store.s3 import S3Store
from dsec_fs.store.wrappers import RetryStore

# The smallest part real S3 (and moto) accepts; the large-object test crosses it twice.
PART_SIZE = 5 * 1024 * 1024


@pytest.fixture(params=["path", "file", "posix", "ref-cached", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path):
    kind = request.param
    if kind == "s3":
        store = S3Store.from_url(request.getfixturevalue("s3_url"), multipart_threshold=PART_SIZE, part_size=PART_SIZE)
    elif kind == "ref-cached":  # the node daemon's wrapper (ref_cache.py) is a Store like any other
        store = RefCacheStore(open_store(str(tmp_path / "store"), create=True), ttl=60)
    else:
        root = tmp_path / "store"
        url = {"path": str(root), "file": f"file://{root}", "posix": f"posix://{root}"}[kind]
        store = open_store(url, create=True)
    with store:
        yield store


def test_open_store_picks_the_backend(tmp_path):
    assert isinstance(open_store(str(tmp_path)), FilesystemStore)
    assert open_store(f"posix://{tmp_path}").url == f"posix://{tmp_path}"
    assert open_store(f"file://{tmp_path}").url == f"file://{tmp_path}"


@pytest.mark.parametrize("scheme", ["file", "posix"])
def test_a_store_directory_is_made_for_its_owner_alone(tmp_path, scheme):
    root = tmp_path / "new" / "store"
    with init_store(f"{scheme}://{root}")[0] as store:  # what `dsecfs store init` and a first build call
        store.put("packs/ab/cd", b"pack bytes")
        store.put("top", b"1")
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in [root, *root.rglob("*")]}
    assert modes == {"new/store": 0o700, "new/store/packs": 0o700, "new/store/packs/ab": 0o700,
                     "new/store/packs/ab/cd": 0o600, "new/store/top": 0o600}


@pytest.mark.s3
def test_open_store_s3_url(s3_url):
    with open_store(s3_url) as store:
        assert isinstance(store, S3Store)
        assert store.url == s3_url
        store.put("x", b"1")
        assert store.get("x") == b"1"


def test_put_get_roundtrip(store):
    store.put("packs/ab/ab01", b"hello world")
    assert store.get("packs/ab/ab01") == b"hello world"
    store.put("packs/ab/ab02", memoryview(b"from a memoryview"))
    assert store.get("packs/ab/ab02") == b"from a memoryview"
    store.put("packs/ab/ab03", bytearray(b"from a bytearray"))
    assert store.get("packs/ab/ab03") == b"from a bytearray"


def test_get_at_most_reads_an_object_up_to_its_limit_and_refuses_a_bigger_one(store):
    store.put("small", b"x" * 100)
    store.put("empty", b"")
    assert store.get_at_most("small", 100) == b"x" * 100
    assert store.get_at_most("small", 1 << 20) == b"x" * 100
    assert store.get_at_most("empty", 10) == b""
    with pytest.raises(UnsupportedError, match="101 bytes, over the limit of 100") as refused:
        store.put("big", b"y" * 101)
        store.get_at_most("big", 100)
    assert "big" in refused.value.where
    with pytest.raises(NotFoundError):
        store.get_at_most("absent", 100)


def test_list_at_most_gives_that_many_of_the_keys(store):
    for n in range(5):
        store.put(f"profiles/x/{n}", b"1")
    store.put("profiles/y", b"1")
    some = store.list_at_most("profiles/x/", 3)
    assert len(some) == 3 and set(some) <= {f"profiles/x/{n}" for n in range(5)}
    assert sorted(store.list_at_most("profiles/x/", 100)) == [f"profiles/x/{n}" for n in range(5)]
    assert store.list_at_most("profiles/z/", 100) == []


@pytest.mark.parametrize("scheme", ["file", "posix"])
def test_get_at_most_refuses_what_a_hostile_writer_leaves_in_a_directory_store_at_once(tmp_path, scheme):
    """A FIFO at the key would block the reader until someone writes to it (a daemon thread stuck, the
    mount that waits for it failing); a symlink would be read through, to /dev/zero or a file outside the
    store, as would a symlink in place of a directory of the key's path. All are refused, at once, as not
    being objects."""
    store = open_store(f"{scheme}://{tmp_path / 'store'}", create=True)
    store.put("profiles/layers/ab/good", b"a profile")
    os.mkfifo(tmp_path / "store" / "profiles" / "layers" / "ab" / "fifo")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the store's")
    os.symlink(outside, tmp_path / "store" / "profiles" / "layers" / "ab" / "link")
    os.symlink("/dev/zero", tmp_path / "store" / "profiles" / "layers" / "ab" / "zero")
    elsewhere = tmp_path / "elsewhere" / "cd"
    elsewhere.mkdir(parents=True)
    (elsewhere / "node").write_bytes(b"outside the store")
    os.symlink(elsewhere, tmp_path / "store" / "profiles" / "layers" / "cd")  # a directory of the path
    with ThreadPoolExecutor(max_workers=1) as pool:
        reading = pool.submit(store.get_at_most, "profiles/layers/ab/fifo", 100)
        try:
            with pytest.raises(CorruptError, match="not a regular file") as refused:
                reading.result(timeout=10)
            assert "profiles/layers/ab/fifo" in refused.value.where
        finally:
            if not reading.done():  # it blocked in open: let it go
                os.close(os.open(tmp_path / "store" / "profiles" / "layers" / "ab" / "fifo", os.O_WRONLY))
    for key in ("profiles/layers/ab/link", "profiles/layers/ab/zero", "profiles/layers/cd/node"):
        with pytest.raises(CorruptError, match="not an object") as refused:
            store.get_at_most(key, 100)
        assert key in refused.value.where
    assert store.get_at_most("profiles/layers/ab/good", 100) == b"a profile"


def test_ranged_get(store):
    data = bytes(range(256)) * 40
    store.put("obj", data)
    assert store.get("obj", 0, 10) == data[:10]
    assert store.get("obj", 1000, 1) == data[1000:1001]
    assert store.get("obj", 4000, 5) == data[4000:4005]
    assert store.get("obj", len(data) - 7, 7) == data[-7:]
    assert store.get("obj", 0, len(data)) == data
    assert store.get("obj", 333) == data[333:]
    assert store.get("obj", len(data)) == b""
    assert store.get("obj", 17, 0) == b""


def test_overlapping_ranges(store):
    data = os.urandom(10_000)
    store.put("obj", data)
    for offset in range(0, 9_000, 700):
        assert store.get("obj", offset, 1_500) == data[offset:offset + 1_500]


@pytest.mark.parametrize(
    "offset, length",
    [(9_995, 10), (9_999, 2), (10_000, 1), (10_500, 3), (10_001, None), (10_001, 0)],
)
def test_range_past_end_is_corrupt(store, offset, length):
    store.put("obj", os.urandom(10_000))
    with pytest.raises(CorruptError):
        store.get("obj", offset, length)


def test_negative_range_is_refused(store):
    store.put("obj", b"abc")
    with pytest.raises(InputError):
        store.get("obj", -1, 2)
    with pytest.raises(InputError):
        store.get("obj", 0, -2)


def test_empty_object(store):
    store.put("empty", b"")
    assert store.exists("empty")
    assert store.size("empty") == 0
    assert store.get("empty") == b""
    assert store.get("empty", 0, 0) == b""
    assert list(store.list("empty")) == ["empty"]
    with pytest.raises(CorruptError):
        store.get("empty", 0, 1)


def test_missing_object(store):
    assert not store.exists("no/such/key")
    for call in (
        lambda: store.get("no/such/key"),
        lambda: store.get("no/such/key", 5, 10),
        lambda: store.get("no/such/key", 0, 0),
        lambda: store.size("no/such/key"),
        lambda: store.mtime("no/such/key"),
    ):
        with pytest.raises(NotFoundError) as info:
            call()
        assert "no/such/key" in str(info.value)


def test_exists_size_and_delete(store):
    store.put("layers/d1/meta.erofs", b"x" * 1234)
    assert store.exists("layers/d1/meta.erofs")
    assert not store.exists("layers/d1")  # a "directory" is not an object
    assert store.size("layers/d1/meta.erofs") == 1234
    store.delete("layers/d1/meta.erofs")
    assert not store.exists("layers/d1/meta.erofs")
    store.delete("layers/d1/meta.erofs")  # deleting twice is fine
    store.delete("never/existed")


def test_list_prefixes(store):
    keys = {
        "packs/ab/ab0001",
        "packs/ab/ab0002",
        "packs/cd/cd0003",
        "index/ab/ab0001",
        "layers/f00d/meta.erofs",
        "layers/f00d/blobmap",
        "layers/f00d/manifest.json",
        "layers/f00e/manifest.json",
        "refs/base/debian:12",
        "top",
    }
    for key in keys:
        store.put(key, key.encode())
    assert set(store.list("")) == keys
    assert set(store.list("packs/")) == {k for k in keys if k.startswith("packs/")}
    assert set(store.list("packs/ab/")) == {"packs/ab/ab0001", "packs/ab/ab0002"}
    assert set(store.list("packs/a")) == {"packs/ab/ab0001", "packs/ab/ab0002"}
    assert set(store.list("packs/ab/ab0001")) == {"packs/ab/ab0001"}
    assert set(store.list("layers/f00d/")) == {f"layers/f00d/{n}" for n in ("meta.erofs", "blobmap", "manifest.json")}
    assert set(store.list("layers/f00")) == {k for k in keys if k.startswith("layers/")}
    assert set(store.list("refs/base/")) == {"refs/base/debian:12"}
    assert list(store.list("nothing/")) == []
    assert list(store.list("pack/")) == []


def test_list_many_keys_under_fan_out(store):
    keys = {f"packs/{i:02x}/{i:02x}{j:060x}" for i in range(0, 256, 17) for j in range(5)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put(k, b"p"), keys))
    assert set(store.list("packs/")) == keys
    assert set(store.list("packs/11/")) == {k for k in keys if k.startswith("packs/11/")}


def test_overwrite_replaces(store):
    store.put("refs/app:latest", b"first version, longer")
    store.put("refs/app:latest", b"second")
    assert store.get("refs/app:latest") == b"second"
    assert store.size("refs/app:latest") == 6


def test_overwrite_is_atomic_for_readers(store):
    # moto answers 500 when requests race on one key (it closes the replaced object's buffer while
    # another request still uses it). A 500 is a transient error, which the contract allows at any time,
    # and dsecfs always uses stores through RetryStore; what must never happen is a torn object.
    store = RetryStore(store, attempts=10, base_delay=0.01, max_delay=0.1)
    size = 256 * 1024
    versions = {b"a" * size, b"b" * (size + 1)}
    store.put("obj", b"a" * size)
    writers_done = threading.Event()
    seen, bad = set(), []

    def write():
        for i in range(6):
            store.put("obj", b"a" * size if i % 2 else b"b" * (size + 1))

    def read():
        while not writers_done.is_set():
            data = store.get("obj")
            (seen.add if data in versions else bad.append)(data[:8] + b"..." + bytes(str(len(data)), "ascii"))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: write(), range(2)))
    finally:
        writers_done.set()
        for t in readers:
            t.join()
    assert bad == []
    assert store.get("obj") in versions


def test_put_all_stores_every_object_then_the_last(store):
    made = []

    def objects():  # made one by one, as a layer's build info is made while the others are written
        for name in ("meta.erofs", "blobmap", "buildinfo"):
            made.append(name)
            yield f"layers/f00d/{name}", name.encode() * 1000
        yield "packs/ab/ab01", memoryview(b"a pack")

    store.put_all(objects(), ("layers/f00d/manifest.json", b"{}"))
    assert made == ["meta.erofs", "blobmap", "buildinfo"]
    assert {key: store.get(key) for key in store.list("")} == {
        **{f"layers/f00d/{name}": name.encode() * 1000 for name in made},
        "packs/ab/ab01": b"a pack", "layers/f00d/manifest.json": b"{}"}
    store.put_all(iter([]), ("top", b"alone"))
    assert store.get("top") == b"alone"


def test_put_all_writes_no_last_when_an_object_or_the_iterator_fails(store, tmp_path):
    def failing():
        yield "layers/f00d/meta.erofs", b"m"
        raise UnavailableError("the build info could not be made", where="layers/f00d/buildinfo")

    with pytest.raises(UnavailableError, match="could not be made"):
        store.put_all(failing(), ("layers/f00d/manifest.json", b"{}"))
    with pytest.raises(InputError):  # an object that cannot be written
        store.put_all(iter([("layers/f00e/meta.erofs", b"m"), ("layers//bad", b"x")]),
                      ("layers/f00e/manifest.json", b"{}"))
    assert not store.exists("layers/f00d/manifest.json") and not store.exists("layers/f00e/manifest.json")
    if isinstance(store, FilesystemStore):  # nor the last one's temporary file
        assert [path for path, _mtime in store.temp_files()] == []


def test_put_many_stores_every_object(store):
    objects = [(f"layers/f00d/{name}", name.encode() * 1000) for name in ("meta.erofs", "blobmap", "buildinfo")]
    store.put_many([*objects, ("packs/ab/ab01", memoryview(b"a pack"))])
    assert {key: store.get(key) for key in store.list("")} == {**dict(objects), "packs/ab/ab01": b"a pack"}
    store.put_many([])
    with pytest.raises(InputError):  # an object that cannot be written: the error is raised
        store.put_many([("layers/f00e/meta.erofs", b"m"), ("layers//bad", b"x")])
    if isinstance(store, FilesystemStore):  # no temporary file left by any of them
        assert [path for path, _mtime in store.temp_files()] == []


def test_put_ephemeral_is_a_put_for_readers(store):
    store.put_ephemeral("leases/abc", b"first")
    store.put_ephemeral("leases/abc", b"second, longer")
    assert store.get("leases/abc") == b"second, longer"
    assert list(store.list("leases/")) == ["leases/abc"]
    store.delete("leases/abc")
    assert not store.exists("leases/abc")


def test_concurrent_puts_from_threads(store):
    payloads = {f"packs/{i % 4:02x}/{i:04x}": os.urandom(1000 + i) for i in range(48)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: store.put(*item), payloads.items()))
    assert set(store.list("packs/")) == set(payloads)
    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(payloads, pool.map(store.get, payloads)))
    assert results == payloads


def test_large_object_crosses_the_multipart_threshold(store):
    data = os.urandom(2 * PART_SIZE + 12_345)
    store.put("packs/99/big", memoryview(data))
    assert store.size("packs/99/big") == len(data)
    assert store.get("packs/99/big") == data
    around_part_boundary = PART_SIZE - 100
    assert store.get("packs/99/big", around_part_boundary, 200) == data[around_part_boundary:around_part_boundary + 200]


def test_keys_with_colons(store):
    store.put("refs/base/debian:12", b"f00d")
    store.put("refs/toolkit/py:3.11-slim", b"beef")
    assert store.get("refs/base/debian:12") == b"f00d"
    assert store.exists("refs/toolkit/py:3.11-slim")
    assert set(store.list("refs/")) == {"refs/base/debian:12", "refs/toolkit/py:3.11-slim"}
    store.delete("refs/base/debian:12")
    assert list(store.list("refs/base/")) == []


@pytest.mark.parametrize("key", ["", "a//b", "../escape", "a/./b", "a/", "/abs"])
def test_invalid_keys_are_refused(store, key):
    with pytest.raises(InputError):
        store.put(key, b"x")


def test_mtime(store):
    before = time.time()
    store.put("obj", b"x")
    after = time.time()
    # S3 keeps whole seconds; the margin covers that, not a slow machine.
    assert before - 1.5 <= store.mtime("obj") <= after + 1.5
