"""RefCacheStore: refs read from the store are used for a TTL, then read again; a moved ref is followed,
a ref set through the wrapper is seen at once; nothing else is cached. Over a real directory store,
counted by CountingStore below the wrapper."""

from __future__ import annotations

import time

import pytest

from dsec_fs.errors import NotFoundError
from dsec_fs.layer import read_ref
from dsec_fs.store import FilesystemStore
from dsec_fs.store.ref_cache import RefCacheStore
from dsec_fs.store.wrappers import CountingStore

A, B = "a" * 64, "b" * 64


@pytest.fixture
def backend(tmp_path):
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    store.put("refs/tk/tool:1", f"{A}\n".encode())
    store.put("obj", b"plain object")
    return store


def test_a_ref_is_read_once_within_its_ttl_and_a_moved_ref_is_followed_after(backend):
    counting = CountingStore(backend)
    cached = RefCacheStore(counting, ttl=0.3)
    assert [read_ref(cached, "tk/tool:1") for _ in range(5)] == [A] * 5
    assert counting.calls["get"] == 1 and cached.hits == 4

    backend.put("refs/tk/tool:1", f"{B}\n".encode())  # another node moves the ref
    assert read_ref(cached, "tk/tool:1") == A  # within the TTL: as it was, a layer that exists for good
    time.sleep(0.35)
    assert read_ref(cached, "tk/tool:1") == B
    assert counting.calls["get"] == 2


def test_a_ref_set_or_deleted_through_the_cache_is_seen_at_once(backend):
    cached = RefCacheStore(backend, ttl=60)
    assert read_ref(cached, "tk/tool:1") == A
    cached.put("refs/tk/tool:1", f"{B}\n".encode())
    assert read_ref(cached, "tk/tool:1") == B
    cached.delete("refs/tk/tool:1")
    with pytest.raises(NotFoundError):
        read_ref(cached, "tk/tool:1")


def test_a_missing_ref_is_not_remembered(backend):
    cached = RefCacheStore(backend, ttl=60)
    with pytest.raises(NotFoundError):
        read_ref(cached, "tk/new:1")
    backend.put("refs/tk/new:1", f"{B}\n".encode())
    assert read_ref(cached, "tk/new:1") == B


def test_other_keys_ranges_and_ttl_zero_go_to_the_store(backend):
    counting = CountingStore(backend)
    cached = RefCacheStore(counting, ttl=60)
    for _ in range(2):
        assert cached.get("obj") == b"plain object"
        assert cached.get("refs/tk/tool:1", 0, 4) == A[:4].encode()
    assert counting.calls["get"] == 4
    off = RefCacheStore(counting, ttl=0)
    for _ in range(2):
        assert read_ref(off, "tk/tool:1") == A
    assert counting.calls["get"] == 6
