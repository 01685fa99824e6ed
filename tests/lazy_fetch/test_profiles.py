"""Access profiles (lazy_fetch/profile.py, profile_keeper.py): learned by one daemon from its traces,
shared through the store, used by another daemon with its own state and cache; hostile objects ignored."""

from __future__ import annotations

import os
import random
import threading

import pytest

from dsec_fs.client import Node
from dsec_fs.errors import FormatError, IntegrityError
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import RetryStore, StoreWrapper
from erofs_builder import build_layer
from lazy_fetch import profile
from lazy_fetch.trace import FLAG_MISS, FLAG_PREFETCH, read_trace
from tests.lazy_fetch.daemon_support import Daemons, layer_store, mount_dirs, wait_for

CHUNK = 64 * 1024
rng = random.Random(13)
FILES = {f"pkg/mod{i}.py": rng.randbytes(3 * CHUNK + i) for i in range(8)}
FILES["big/data.bin"] = rng.randbytes(40 * CHUNK)
READ = ("pkg/mod1.py", "pkg/mod4.py", "pkg/mod6.py")  # what "the workload" reads
READ_CHUNKS = sum(-(-len(FILES[name]) // CHUNK) for name in READ)


def _entry(i: int, traces: int = 1, first: int = 0) -> profile.ProfileEntry:
    return profile.ProfileEntry(bytes([i]) * 32, 100, first, traces, f"/f{i}", 0)


def test_a_profile_round_trips_and_refuses_every_damage():
    p = profile.Profile(layer="ab" * 32, traces=2, entries=[_entry(1, 2, 5), _entry(2, 1, 9)])
    data = p.encode()
    again = profile.Profile.decode(data, source="k")
    assert (again.layer, again.traces, again.entries) == (p.layer, p.traces, p.entries)
    flipped = data.replace(b"/f1", b"/f7")
    with pytest.raises(IntegrityError, match="sha256"):
        profile.Profile.decode(flipped, source="profiles/layers/x/n")
    for bad in (data[: len(data) // 2], b"\x00" * 10, b'{"format": "other"}', b"[]",
                b" " * (profile.MAX_PROFILE_BYTES + 1)):
        with pytest.raises(FormatError):
            profile.Profile.decode(bad, source="profiles/layers/x/n")


def test_merging_adds_traces_and_weights_first_read_times():
    a = profile.Profile(layer="ab" * 32, traces=1, entries=[_entry(1, 1, 100), _entry(2, 1, 50)])
    b = profile.Profile(layer="cd" * 32, traces=3, entries=[_entry(1, 3, 300)])
    merged = profile.merge([a, b])
    assert merged.traces == 4
    by_digest = {e.digest: e for e in merged.entries}
    assert by_digest[bytes([1]) * 32].traces == 4 and by_digest[bytes([1]) * 32].first_read_us == 250
    assert [e.digest for e in merged.entries] == [bytes([2]) * 32, bytes([1]) * 32]  # first-read order


def test_a_lookup_decodes_a_bounded_number_of_entries_from_all_node_objects(tmp_path, caplog):
    """Anyone who can write the store can fill every node object of a key to MAX_ENTRIES (32 of them,
    3.2 million entries: a minute of decoding and merging, 1.8 GB, for a mount that waits on it). One
    lookup decodes at most 200,000 of all of them; the objects past that are skipped, named in the log.
    Before, all four objects of 60,000 entries here were decoded and merged."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    prefix = keys.layer_profiles("ab" * 32)
    for node in range(4):
        entries = [profile.ProfileEntry(node.to_bytes(2, "big") + i.to_bytes(30, "big"), 1 << 20, i, 1)
                   for i in range(60_000)]
        store.put(f"{prefix}{node:016x}", profile.Profile(layer="ab" * 32, traces=1, entries=entries).encode())
    found = profile.fetch(store, prefix)
    assert found is not None and found.traces == 3  # 180,000 entries decoded; the fourth object skipped
    assert any("entries, over what is left" in record.getMessage() and prefix in record.getMessage()
               for record in caplog.records)


def test_a_run_that_publishes_again_replaces_what_it_published_before(tmp_path):
    """A long run publishes while it goes on: each later publish of it holds all of the earlier one, and
    the node's object must count the run once, with everything it read, beside what other runs put in."""
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    key = "profiles/layers/x/n"
    other_run = profile.Profile(layer="ab" * 32, traces=1, entries=[_entry(1, 1, 400)])
    profile.publish(store, key, other_run)
    early = profile.Profile(layer="ab" * 32, traces=1, entries=[_entry(1, 1, 100)])
    profile.publish(store, key, early)
    later = profile.Profile(layer="ab" * 32, traces=1, entries=[_entry(1, 1, 100), _entry(2, 1, 900)])
    published = profile.publish(store, key, later, replacing=early)
    again = profile.Profile.decode(store.get(key), source=key)
    assert again.traces == published.traces == 2  # the other run and this one, once
    by_digest = {e.digest: e for e in again.entries}
    assert by_digest[bytes([1]) * 32].traces == 2 and by_digest[bytes([1]) * 32].first_read_us == 250
    assert by_digest[bytes([2]) * 32].traces == 1 and by_digest[bytes([2]) * 32].first_read_us == 900
    assert profile.without(early, early) is None


# ---- with real daemons ---------------------------------------------------------------------------------

@pytest.fixture
def store_dir(tmp_path) -> str:
    return layer_store(tmp_path, FILES, "t/app:1", CHUNK)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _learn(daemons: Daemons, store: str, tmp_path, names=READ, ref="t/app:1", mode="fuse") -> None:
    """One daemon mounts ``ref``, reads ``names``, unmounts: its profile lands in the store."""
    daemons.start(store, profiles=True)
    node = Node(daemons.socket)
    mnt, = mount_dirs(tmp_path, f"learn-{os.path.basename(daemons.state_dir)}")
    info = node.mount(ref, mnt, mode=mode)
    for name in names:
        assert _read(os.path.join(mnt, name)) == FILES[name]
    node.umount(mnt)
    digest = info.layer
    wait_for(lambda: list(FilesystemStore(store).list(keys.layer_profiles(digest))), "the profile object")
    daemons.stop_all()


def _two_daemons(tmp_path):
    return Daemons(tmp_path / "a"), Daemons(tmp_path / "b")


def _reads_that_waited(trace_path: str) -> list:
    return [r for r in read_trace(trace_path).records if r.flags & FLAG_MISS and not r.flags & FLAG_PREFETCH]


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("mode", ["fuse", "kernel"])
def test_a_profile_learned_on_one_node_prefetches_for_another(store_dir, tmp_path, mode, mounts_below):
    a, b = _two_daemons(tmp_path)
    try:
        _learn(a, store_dir, tmp_path, mode=mode)
        assert a.state_dir != b.state_dir and a.cache_dir != b.cache_dir
        b.start(store_dir, profiles=True)
        node = Node(b.socket)
        mnt, = mount_dirs(tmp_path, "mnt-b")
        info = node.mount("t/app:1", mnt, mode=mode)
        assert info.prefetch == "profile:layer" and info.prefetch_chunks == READ_CHUNKS
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the prefetch")
        for name in READ:
            assert _read(os.path.join(mnt, name)) == FILES[name]
        (layer,) = node.status().layers
        assert layer.prefetched_read_bytes == layer.prefetched_bytes > 0 and layer.read_not_prefetched_bytes == 0
        trace = node.mounts()[0].trace
        node.umount(mnt)
        assert _reads_that_waited(trace) == []  # every first read hit the cache
    finally:
        a.stop_all()
        b.stop_all()
    assert mounts_below(tmp_path) == []


@pytest.mark.fuse
@pytest.mark.root
def test_without_a_profile_or_with_no_profile_nothing_is_prefetched(store_dir, tmp_path):
    a, b = _two_daemons(tmp_path)
    try:
        a.start(store_dir, profiles=True)
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        assert node.mount("t/app:1", mnt, mode="fuse").prefetch == ""  # nothing learned yet
        node.umount(mnt)
        a.stop_all()
        _learn(b, store_dir, tmp_path)
        a.start(store_dir, profiles=True)
        info = node.mount("t/app:1", mnt, mode="fuse", profile=False)
        assert info.prefetch == "" and node.prefetches() == []
        node.umount(mnt)
    finally:
        a.stop_all()
        b.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_two_nodes_publishing_at_once_lose_neither(store_dir, tmp_path):
    a, b = _two_daemons(tmp_path)
    try:
        a.start(store_dir, profiles=True)
        b.start(store_dir, profiles=True)
        mounts = {}
        for daemons, name in ((a, "pkg/mod2.py"), (b, "pkg/mod5.py")):
            mnt, = mount_dirs(tmp_path, os.path.basename(str(daemons.tmp_path)) + "-m")
            Node(daemons.socket).mount("t/app:1", mnt, mode="fuse")
            assert _read(os.path.join(mnt, name)) == FILES[name]
            mounts[daemons] = mnt
        threads = [threading.Thread(target=Node(d.socket).umount, args=(m,)) for d, m in mounts.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        store = FilesystemStore(store_dir)
        digest = Node(a.socket).status().layers[0].layer
        wait_for(lambda: len(list(store.list(keys.layer_profiles(digest)))) == 2, "both nodes' objects")
        merged = profile.fetch(store, keys.layer_profiles(digest))
        assert merged.traces == 2 and {e.path for e in merged.entries} == {"/pkg/mod2.py", "/pkg/mod5.py"}
    finally:
        a.stop_all()
        b.stop_all()


@pytest.mark.fuse
@pytest.mark.root
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "oversized", "not-json"])
def test_a_hostile_profile_object_is_ignored_and_the_mount_works(store_dir, tmp_path, damage):
    a, b = _two_daemons(tmp_path)
    try:
        _learn(a, store_dir, tmp_path)
        store = FilesystemStore(store_dir)
        damaged = list(store.list(keys.PROFILES))  # the layer's and its name's
        assert len(damaged) == 2
        for key in damaged:
            data = store.get(key)
            store.put(key, {"corrupt": data.replace(b"mod1", b"mod2"), "truncated": data[:-40],
                            "oversized": data + b" " * profile.MAX_PROFILE_BYTES, "not-json": b"\xff" * 100}[damage])
        b.start(store_dir, profiles=True)
        node = Node(b.socket)
        mnt, = mount_dirs(tmp_path, "mnt-b")
        info = node.mount("t/app:1", mnt, mode="fuse")
        assert info.prefetch == ""
        for name in READ:
            assert _read(os.path.join(mnt, name)) == FILES[name]
        node.umount(mnt)
        assert "ignoring the profile" in b.log()
    finally:
        a.stop_all()
        b.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_a_new_tag_of_a_ref_starts_from_its_predecessors_profile(store_dir, tmp_path):
    a, b = _two_daemons(tmp_path)
    try:
        _learn(a, store_dir, tmp_path)
        src = tmp_path / "src"
        changed = rng.randbytes(len(FILES["pkg/mod4.py"]))
        (src / "pkg/mod4.py").write_bytes(changed)
        v2 = build_layer(str(src), FilesystemStore(store_dir, fsync=False), name="t/app:2", chunk_size=CHUNK)
        b.start(store_dir, profiles=True)
        node = Node(b.socket)
        mnt, = mount_dirs(tmp_path, "mnt-b")
        info = node.mount("t/app:2", mnt, mode="fuse")
        assert info.layer == v2.digest and info.prefetch == "profile:name"
        # the unchanged files found by digest, the changed one by its path: all of READ
        assert info.prefetch_chunks == READ_CHUNKS
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the prefetch")
        assert _read(os.path.join(mnt, "pkg/mod4.py")) == changed
        trace = node.mounts()[0].trace
        node.umount(mnt)
        assert _reads_that_waited(trace) == []
    finally:
        a.stop_all()
        b.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_fill_streams_the_rest_of_the_layer_until_the_cache_bound_and_never_evicts(store_dir, tmp_path):
    a = Daemons(tmp_path / "a")
    cache_bytes = 3 << 20  # the layer holds about 4 MiB of chunks
    try:
        a.start(store_dir, profiles=True, cache_size=str(cache_bytes))
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        info = node.mount("t/app:1", mnt, mode="fuse", fill="layer")
        assert info.prefetch == "fill"
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the fill")
        cache = node.cache_stats()
        assert 0.5 * cache_bytes < cache.bytes <= 0.9 * cache_bytes and cache.evictions == 0
        for name, data in FILES.items():
            assert _read(os.path.join(mnt, name)) == data
        node.umount(mnt)
    finally:
        a.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_auto_fill_streams_a_layer_that_has_no_profile_from_a_slow_store_and_only_the_profile_of_one_that_has(
        store_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("DSECFS_DAEMON_FILL")  # the daemon's own default
    a, b = _two_daemons(tmp_path)
    try:
        a.start(store_dir, profiles=True, latency_ms=20)  # a round trip worth saving
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        info = node.mount("t/app:1", mnt, mode="fuse")  # first ever: no profile anywhere
        assert info.prefetch == "fill"
        for name in READ:
            assert _read(os.path.join(mnt, name)) == FILES[name]
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the fill")
        (job,) = node.prefetches()
        assert not job.fill_skipped and job.fill_chunks == job.chunks == job.done_chunks == node.cache_stats().entries
        (layer,) = node.status().layers
        assert layer.prefetched_bytes == 0  # a fill predicts nothing: it is not counted as prefetched
        node.umount(mnt)
        wait_for(lambda: list(FilesystemStore(store_dir).list(keys.layer_profiles(info.layer))), "the profile")
        a.stop_all()

        b.start(store_dir, profiles=True)
        node = Node(b.socket)
        mnt, = mount_dirs(tmp_path, "mnt-b")
        info = node.mount("t/app:1", mnt, mode="fuse")
        assert info.prefetch == "profile:layer"
        assert info.prefetch_chunks == READ_CHUNKS
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the prefetch")
        assert node.prefetches()[0].fill_chunks == 0
        node.umount(mnt)
    finally:
        a.stop_all()
        b.stop_all()


def test_a_layer_open_samples_the_stores_round_trip_once_per_small_layer_object(store_dir):
    # Fill auto waits for four samples: a sandbox up of two layers gave two when only manifests were
    # timed, and the fill waited for the command's first misses. Refs give none (the ref cache may answer).
    from dsec_fs.layer import open_layer
    from lazy_fetch.daemon_stores import _LayerObjectTimer

    samples = []
    files = open_layer(_LayerObjectTimer(FilesystemStore(store_dir), samples.append), "t/app:1")
    assert files.digest and len(samples) >= 2  # the manifest and the blob map at least
    assert all(seconds >= 0 for seconds in samples)


@pytest.mark.fuse
@pytest.mark.root
def test_auto_fill_skips_the_fill_when_the_store_answers_fast(store_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("DSECFS_DAEMON_FILL")
    a = Daemons(tmp_path / "a")
    try:
        # A local directory: a miss costs less than streaming the whole layer would. (No miss readahead, so
        # that what is cached is what was read.)
        a.start(store_dir, extra_args=["--miss-readahead", "0"])
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        assert node.mount("t/app:1", mnt, mode="fuse").prefetch == "fill"
        for name in READ:
            assert _read(os.path.join(mnt, name)) == FILES[name]
        wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the fill's decision")
        (job,) = node.prefetches()
        assert job.fill_skipped and job.done_chunks == job.chunks == 0
        wait_for(lambda: node.cache_stats().entries == READ_CHUNKS, "what was read, and only that, cached")
        node.umount(mnt)
        assert "fill of layer" in a.log() and "skipped: its store answers in" in a.log()
    finally:
        a.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_a_daemon_that_stops_publishes_the_profiles_of_its_last_mounts(store_dir, tmp_path):
    a = Daemons(tmp_path / "a")
    try:
        a.start(store_dir, profiles=True)
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        digest = node.mount("t/app:1", mnt, mode="fuse").layer
        assert _read(os.path.join(mnt, READ[0])) == FILES[READ[0]]
        a.stop_all()  # SIGTERM with the layer still mounted: unmounted, then its profile published
        merged = profile.fetch(FilesystemStore(store_dir), keys.layer_profiles(digest))
        assert merged is not None and {e.path for e in merged.entries} == {"/" + READ[0]}
    finally:
        a.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_a_layer_detached_lazily_has_its_profile_published_when_the_daemon_stops(store_dir, tmp_path):
    """A lazily detached mount keeps its blob served (and its trace open) until the daemon stops, as the
    containerd snapshotter's removes do: that trace's profile must not be lost."""
    a = Daemons(tmp_path / "a")
    try:
        a.start(store_dir, profiles=True)
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        digest = node.mount("t/app:1", mnt, mode="kernel").layer
        assert _read(os.path.join(mnt, READ[1])) == FILES[READ[1]]
        with open(os.path.join(mnt, READ[0]), "rb") as busy:
            node.umount(mnt, lazy=True)
            assert busy.read() == FILES[READ[0]]
        a.stop_all()
        merged = profile.fetch(FilesystemStore(store_dir), keys.layer_profiles(digest))
        assert merged is not None and {e.path for e in merged.entries} == {"/" + READ[0], "/" + READ[1]}
    finally:
        a.stop_all()


@pytest.mark.fuse
@pytest.mark.root
def test_a_long_run_publishes_its_profile_while_it_goes_on_and_counts_once(store_dir, tmp_path):
    """Profiles are published at unmount and also every --profile-every while a mount lives: a sandbox
    that runs for days is learned from before it ends. Its publishes replace each other: one run, one
    trace, everything it read."""
    a = Daemons(tmp_path / "a")
    try:
        a.start(store_dir, profiles=True, extra_args=["--profile-every", "1s"])
        node = Node(a.socket)
        mnt, = mount_dirs(tmp_path, "mnt-a")
        digest = node.mount("t/app:1", mnt, mode="fuse").layer
        backend = FilesystemStore(store_dir)

        def published_paths() -> set[str]:
            found = profile.fetch(backend, keys.layer_profiles(digest))
            return set() if found is None else {e.path for e in found.entries}

        assert _read(os.path.join(mnt, READ[0])) == FILES[READ[0]]
        wait_for(lambda: published_paths() == {"/" + READ[0]}, "the first read's profile, the mount still up")
        assert _read(os.path.join(mnt, READ[1])) == FILES[READ[1]]
        wait_for(lambda: published_paths() == {"/" + READ[0], "/" + READ[1]}, "the second read's too")
        node.umount(mnt)
        a.stop_all()
        merged = profile.fetch(backend, keys.layer_profiles(digest))
        assert merged.traces == 1 and {e.path for e in merged.entries} == {"/" + READ[0], "/" + READ[1]}
    finally:
        a.stop_all()


def test_a_node_publishes_within_the_size_bound_however_long_its_paths(tmp_path):
    long_path = "/" + "p" * 4000
    learned = profile.Profile(layer="ab" * 32, traces=1, entries=[
        profile.ProfileEntry(i.to_bytes(32, "big"), 100, i, 1, long_path, 0) for i in range(10000)])
    assert len(learned.encode()) > 4 * profile.MAX_PROFILE_BYTES  # halving once would not do
    store = FilesystemStore(str(tmp_path / "store"))
    profile.publish(store, "profiles/layers/x/n", learned)
    data = store.get("profiles/layers/x/n")
    assert len(data) <= profile.MAX_PROFILE_BYTES
    assert profile.Profile.decode(data, source="k").entries


def test_a_node_publishing_over_a_huge_object_at_its_key_reads_no_more_than_a_profile(tmp_path):
    """Anyone may write a node's profile key: what the node merges its news into is read within the bound."""

    class LargestRead(StoreWrapper):
        largest = 0

        def _call(self, op, key, fn, sent=0):
            result = fn()
            if op == "get":
                self.largest = max(self.largest, len(result))
            return result

    store = LargestRead(FilesystemStore(str(tmp_path / "store")))
    store.put("profiles/layers/x/n", b" " * (4 * profile.MAX_PROFILE_BYTES))
    learned = profile.Profile(layer="ab" * 32, traces=1, entries=[_entry(1)])
    profile.publish(store, "profiles/layers/x/n", learned)
    assert store.largest <= profile.MAX_PROFILE_BYTES
    again = profile.Profile.decode(store.get("profiles/layers/x/n"), source="k")
    assert again.entries == learned.entries


def test_listing_a_profile_key_stops_after_max_listed_objects_however_many_are_there(tmp_path):
    """Anyone may write under a profile key: a writer may put millions of objects under it, and a lookup
    must not list them all. (A symlink to a huge tree in place of its directory is not walked at all:
    tests/dsec_fs/store/test_filesystem_hostile.py.)"""

    class ListCounted(FilesystemStore):
        listed = 0

        def list(self, prefix):
            for key in super().list(prefix):
                self.listed += 1
                yield key

    backend = ListCounted(str(tmp_path / "store"))
    prefix = keys.layer_profiles("ab" * 32)
    tree = os.path.join(backend.root, prefix)
    for d in range(3):
        os.makedirs(os.path.join(tree, f"d{d}"))
        for n in range(profile.MAX_LISTED):
            with open(os.path.join(tree, f"d{d}", f"{n:05}"), "wb") as f:
                f.write(b"x")
    store = RetryStore(backend)  # through a wrapper, as the daemon's store is
    names = profile.listed(store, prefix)
    assert len(names) == profile.MAX_PUBLISHERS and all(name.startswith(prefix) for name in names)
    assert backend.listed <= profile.MAX_LISTED
    assert profile.load(store, names) is None  # none is a profile

@pytest.mark.fuse
@pytest.mark.root
def test_auto_fill_does_not_take_the_nodes_own_metadata_copies_for_the_stores_round_trip(store_dir, tmp_path,
                                                                                      monkeypatch):
    """A layer opened again comes from the node's copies (its ref from the ref cache): no store call, so
    no sample of the store's round trip. A sample of the local disk once made a 20 ms store look fast."""
    monkeypatch.delenv("DSECFS_DAEMON_FILL")
    other = {name: random.Random(5).randbytes(len(data)) for name, data in FILES.items()}
    src = tmp_path / "other-src"
    for name, data in other.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    build_layer(str(src), FilesystemStore(store_dir, fsync=False), name="t/other:1", chunk_size=CHUNK)
    a = Daemons(tmp_path / "a")
    try:
        a.start(store_dir, latency_ms=20)
        node = Node(a.socket)
        first, again, new = mount_dirs(tmp_path, "first", "again", "new")
        for ref, mnt in (("t/app:1", first), ("t/app:1", again), ("t/other:1", new)):
            node.mount(ref, mnt, mode="fuse")
            wait_for(lambda: all(p.state == "done" for p in node.prefetches()), f"the fill of {ref}")
            job = node.prefetches()[-1]
            node.umount(mnt)
            assert not job.fill_skipped, f"{ref} on a 20 ms store was not filled"
    finally:
        a.stop_all()
