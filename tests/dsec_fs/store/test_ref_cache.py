"""RefCacheStore: refs read from the store are used for a TTL, then read again; a moved ref is followed,
a ref set through the wrapper is seen at once; nothing else is cached, nor a ref that names no published
layer (a body damaged on the way, by FaultStore rules as DSECFS_FAULTS gives them to the daemon). Over a
real directory store, counted by CountingStore below the wrapper."""

from __future__ import annotations

import time

import pytest

from dsec_fs.errors import CorruptError, NotFoundError
from dsec_fs.layer import read_manifest, read_ref
from dsec_fs.store import FilesystemStore
from dsec_fs.store.ref_cache import RefCacheStore
from dsec_fs.store.wrappers import CountingStore, FaultStore

A, B = "a" * 64, "b" * 64
NUMBERED = "12" * 32  # a digest whose characters stay hex digits when a low bit flips: "1" <-> "0", "2" <-> "3"


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


def test_a_ref_cut_short_on_the_way_is_not_remembered(backend):
    """The first read of the ref comes back cut short (a CorruptError for its reader), the second whole:
    the next read goes to the store, not to what the first read brought for the TTL."""
    counting = CountingStore(backend)
    cached = RefCacheStore(FaultStore(counting, "get:1:truncate"), ttl=60)
    with pytest.raises(CorruptError, match="expected a layer digest"):
        read_ref(cached, "tk/tool:1")
    assert read_ref(cached, "tk/tool:1") == A
    assert read_ref(cached, "tk/tool:1") == A and counting.calls["get"] == 2 and cached.hits == 1


def test_a_ref_damaged_into_another_digest_is_forgotten_when_its_layer_has_no_manifest(backend):
    """A flipped bit can leave a digest that names no published layer: once the reader finds no manifest
    for it, the ref is read again, and names its layer; a ref whose layer's manifest is there stays."""
    backend.put("refs/tk/num:1", f"{NUMBERED}\n".encode())
    backend.put("refs/tk/other:1", f"{B}\n".encode())
    counting = CountingStore(backend)
    cached = RefCacheStore(FaultStore(counting, "get:1:corrupt=20-24"), ttl=60)
    damaged = read_ref(cached, "tk/num:1")
    assert damaged != NUMBERED and damaged[:20] == NUMBERED[:20]
    assert read_ref(cached, "tk/other:1") == B
    with pytest.raises(NotFoundError, match="not published"):
        read_manifest(cached, damaged)
    assert read_ref(cached, "tk/num:1") == NUMBERED
    assert read_ref(cached, "tk/other:1") == B and counting.calls["get"] == 4  # 2 refs, the manifest, the re-read
