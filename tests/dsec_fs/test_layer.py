import io
import json
import os
import resource
import threading
import tracemalloc

import pytest
import zstandard

from dsec_fs.digest import sha256
from dsec_fs.errors import FormatError, InputError, IntegrityError, NotFoundError, UnavailableError, UnsupportedError
from dsec_fs.layer import (
    Manifest,
    delete_ref,
    list_refs,
    open_layer,
    layers_with_prefix,
    parse_ref,
    publish_layer,
    publish_stored,
    resolve,
    set_ref,
    store_metadata,
)
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import StoreWrapper
from tests.dsec_fs.layer_support import publish_pretend_layer, two_layers_sharing_a_prefix

META = b"\xe2\xe1\xf5\xe0 pretend EROFS image" + bytes(4000)
BLOBMAP = b"pretend blob map " * 10
LAYER = sha256(META).hex()


def make_manifest(**changes) -> Manifest:
    fields = dict(
        layer=LAYER,
        blob_id=sha256(BLOBMAP).hex(),
        meta_size=len(META),
        blobmap_size=len(BLOBMAP),
        blobmap_sha256=sha256(BLOBMAP).hex(),
        chunk_size=1 << 20,
        block_size=4096,
        blob_blocks=12,
        packs=sorted(["ab" * 32, "cd" * 32]),
        stats={"files": 3, "bytes": 12345, "chunks": 4, "new_chunks": 2, "seconds": 0.25},
        source="/src/tree",
    )
    fields.update(changes)
    return Manifest(**fields)


class RecordingStore(FilesystemStore):
    """A real directory store that remembers the order in which objects appear (``put_keys``: the renames
    into place, however they were put) and, in ``events``, those renames and its directory fsyncs."""

    def __init__(self, root, *, fsync=False):
        super().__init__(str(root), fsync=fsync)
        self.put_keys: list[str] = []
        self.events: list[tuple[str, str]] = []
        self._events_lock = threading.Lock()

    def _rename(self, dir_fd, tmp, name, key):
        super()._rename(dir_fd, tmp, name, key)
        with self._events_lock:
            self.put_keys.append(key)
            self.events.append(("rename", key))

    def _sync_directory(self, dir_fd, directory):
        super()._sync_directory(dir_fd, directory)
        with self._events_lock:
            self.events.append(("sync", directory))


@pytest.fixture
def store(tmp_path):
    return RecordingStore(tmp_path / "store")


def path_of(store, key) -> str:
    return os.path.join(store.root, *key.split("/"))


def test_manifest_json_round_trip():
    manifest = make_manifest()
    assert Manifest.from_json(manifest.to_json(), source="m") == manifest
    assert manifest.created.endswith("Z")


def test_manifest_ignores_fields_it_does_not_know():
    obj = json.loads(make_manifest().to_json())
    obj["added_later"] = [1, 2]
    assert Manifest.from_json(json.dumps(obj).encode(), source="m") == make_manifest(created=obj["created"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("layer", "XYZ"),
        ("layer", "AB" * 32),
        ("blob_id", 5),
        ("meta_size", -1),
        ("meta_size", "10"),
        ("blob_blocks", True),
        ("chunk_size", 3000),
        ("block_size", 0),
        ("packs", ["cd" * 32, "ab" * 32]),
        ("packs", ["ab" * 32, "ab" * 32]),
        ("packs", "ab" * 32),
        ("stats", {"files": "3"}),
        ("stats", []),
        ("created", "yesterday"),
        ("created", "2024-01-01T00:00:00"),
        ("created", "2024-01-01T00:00:00+02:00"),
        ("source", None),
        ("version", "1"),
    ],
)
def test_manifest_bad_field_is_a_format_error_naming_it(field, value):
    obj = json.loads(make_manifest().to_json())
    obj[field] = value
    with pytest.raises(FormatError) as info:
        Manifest.from_json(json.dumps(obj).encode(), source="layers/x/manifest.json")
    assert repr(field) in str(info.value) and "layers/x/manifest.json" in str(info.value)


def test_manifest_missing_field_is_named():
    obj = json.loads(make_manifest().to_json())
    del obj["chunk_size"]
    with pytest.raises(FormatError, match="'chunk_size'.*missing"):
        Manifest.from_json(json.dumps(obj).encode(), source="m")


@pytest.mark.parametrize("data", [b"", b"{", b"[1, 2]", b"\xff\xfe\x00", b"null"])
def test_manifest_that_is_not_a_json_object_is_a_format_error(data):
    with pytest.raises(FormatError):
        Manifest.from_json(data, source="m")


def test_manifest_from_a_newer_writer_is_unsupported():
    obj = json.loads(make_manifest().to_json())
    obj["version"] = 3
    with pytest.raises(UnsupportedError):
        Manifest.from_json(json.dumps(obj).encode(), source="m")


def test_publish_then_open(store):
    manifest = make_manifest()
    assert publish_layer(store, META, BLOBMAP, manifest) == LAYER
    layer = open_layer(store, LAYER)
    assert (layer.digest, layer.meta, layer.blobmap) == (LAYER, META, BLOBMAP)
    assert layer.manifest == manifest


def test_metadata_stored_first_then_published_is_what_publish_layer_stores(tmp_path):
    """A rebuild stores meta.erofs, the blob map and its build info while its pack is flushed
    (``store_metadata``), then writes the manifest (``publish_stored``): the layer is the same, and
    nothing is published before the manifest."""
    made, given = FilesystemStore(str(tmp_path / "made")), FilesystemStore(str(tmp_path / "given"))
    first, second = make_manifest(), make_manifest()
    extra = keys.layer_buildinfo(LAYER)
    publish_layer(made, META, BLOBMAP, first, also=lambda: (extra, LAYER.encode()))
    metadata = store_metadata(given, META, BLOBMAP, also=lambda digest: (keys.layer_buildinfo(digest), digest.encode()))
    assert metadata.layer == LAYER and given.get(extra) == LAYER.encode()
    assert layers_with_prefix(given) == []
    assert publish_stored(given, second, metadata) == LAYER
    assert first.stored == second.stored
    for key in (keys.layer_meta(LAYER), keys.layer_blobmap(LAYER)):
        assert made.get(key) == given.get(key)
    layer = open_layer(given, LAYER)
    assert (layer.meta, layer.blobmap) == (META, BLOBMAP)


def test_a_manifest_that_does_not_describe_the_stored_metadata_is_not_published(store):
    metadata = store_metadata(store, META, BLOBMAP)
    manifest = make_manifest()
    manifest.meta_size += 1
    with pytest.raises(IntegrityError):
        publish_stored(store, manifest, metadata)
    assert layers_with_prefix(store) == []


class MeetingStore(StoreWrapper):
    """Each get of meta.erofs or the blob map waits for the other to start: open_layer passes only if it
    reads the two side by side (read one after the other, the first get times out)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.barrier = threading.Barrier(2, timeout=5)

    def _call(self, op, key, fn, sent=0):
        if op == "get" and key in (keys.layer_meta(LAYER), keys.layer_blobmap(LAYER)):
            self.barrier.wait()
        return fn()


def test_open_layer_reads_meta_and_blob_map_side_by_side_while_on_manifest_runs(store):
    publish_layer(store, META, BLOBMAP, make_manifest())
    seen = []
    layer = open_layer(MeetingStore(store), LAYER, on_manifest=seen.append)
    assert seen == [layer.manifest] and (layer.meta, layer.blobmap) == (META, BLOBMAP)


def test_an_error_of_on_manifest_is_raised_by_open_layer(store):
    publish_layer(store, META, BLOBMAP, make_manifest())

    def fail(manifest):
        raise NotFoundError("no index", where=f"packs of {manifest.layer}")

    with pytest.raises(NotFoundError, match="no index"):
        open_layer(store, LAYER, on_manifest=fail)


def test_publish_writes_the_manifest_last_once_the_rest_is_durable(tmp_path):
    store = RecordingStore(tmp_path / "store", fsync=True)
    publish_layer(store, META, BLOBMAP, make_manifest(),
                  also=lambda: (keys.layer_buildinfo(LAYER), b"build info"))
    directory = f"layers/{LAYER}"
    objects = {keys.layer_meta(LAYER), keys.layer_blobmap(LAYER), keys.layer_buildinfo(LAYER)}
    # Each object renamed into place, then their directory fsynced (once), then the manifest renamed and
    # its directory fsynced: a crash at any point leaves no manifest whose objects could be lost.
    assert {key for _event, key in store.events[:3]} == objects
    assert store.events[3:] == [("sync", directory), ("rename", keys.layer_manifest(LAYER)), ("sync", directory)]
    assert open_layer(store, LAYER).meta == META
    assert store.get(keys.layer_buildinfo(LAYER)) == b"build info"
    assert not [name for name in os.listdir(path_of(store, directory)) if name.startswith(".tmp-")]


class MeetingWritesStore(RecordingStore):
    """Each write of meta.erofs, the blob map and the build info waits for the other two to start:
    publish_layer passes only if it writes the three side by side."""

    def __init__(self, root):
        super().__init__(root)
        self.barrier = threading.Barrier(3, timeout=5)

    def _write_temp(self, dir_fd, data, key, *, sync):
        if key in (keys.layer_meta(LAYER), keys.layer_blobmap(LAYER), keys.layer_buildinfo(LAYER)):
            self.barrier.wait()
        return super()._write_temp(dir_fd, data, key, sync=sync)


def test_publish_writes_meta_blob_map_and_what_also_makes_side_by_side_before_the_manifest(tmp_path):
    store = MeetingWritesStore(tmp_path / "store")
    publish_layer(store, META, BLOBMAP, make_manifest(), also=lambda: (keys.layer_buildinfo(LAYER), b"build info"))
    assert store.put_keys[-1] == keys.layer_manifest(LAYER)
    assert store.get(keys.layer_buildinfo(LAYER)) == b"build info"
    assert open_layer(store, LAYER).meta == META


def test_a_failure_of_also_publishes_nothing(store):
    def fail():
        raise UnavailableError("injected outage", where=keys.layer_buildinfo(LAYER))

    with pytest.raises(UnavailableError, match="injected outage"):
        publish_layer(store, META, BLOBMAP, make_manifest(), also=fail)
    assert not store.exists(keys.layer_manifest(LAYER))
    with pytest.raises(NotFoundError):
        open_layer(store, LAYER)


class OutageStore(FilesystemStore):
    """Fails the write of the objects whose key ends with ``failing``: an outage (or a crash) there."""

    def __init__(self, root, failing):
        super().__init__(root, fsync=False)
        self.failing = failing

    def _write_temp(self, dir_fd, data, key, *, sync):
        if key.endswith(self.failing):
            raise UnavailableError("injected outage", where=key)
        return super()._write_temp(dir_fd, data, key, sync=sync)


@pytest.mark.parametrize("failing", ["/manifest.json", "/blobmap"])
def test_a_failed_publish_leaves_nothing_a_reader_or_a_ref_can_reach(tmp_path, failing):
    store = OutageStore(str(tmp_path / "store"), failing)
    with pytest.raises(UnavailableError):
        publish_layer(store, META, BLOBMAP, make_manifest())
    assert store.exists(keys.layer_meta(LAYER))  # written before the failure...
    assert not store.exists(keys.layer_manifest(LAYER))  # ...but not published
    assert not [path for path, _mtime in store.temp_files()]  # not even the manifest's temporary file
    with pytest.raises(NotFoundError):
        set_ref(store, "base/debian:12", LAYER)
    with pytest.raises(NotFoundError):
        resolve(store, "base/debian:12")
    with pytest.raises(NotFoundError):
        open_layer(store, LAYER)


def test_publish_refuses_a_manifest_that_does_not_match_the_bytes(store):
    with pytest.raises(IntegrityError):
        publish_layer(store, META + b"x", BLOBMAP, make_manifest())
    with pytest.raises(IntegrityError):
        publish_layer(store, META, BLOBMAP + b"x", make_manifest())
    with pytest.raises(IntegrityError):
        publish_layer(store, META, BLOBMAP, make_manifest(meta_size=len(META) + 1))
    assert store.put_keys == []


def test_publish_refuses_an_invalid_manifest(store):
    with pytest.raises(FormatError, match="'packs'"):
        publish_layer(store, META, BLOBMAP, make_manifest(packs=["cd" * 32, "ab" * 32]))
    assert store.put_keys == []


@pytest.mark.parametrize("key_of", [keys.layer_meta, keys.layer_blobmap])
def test_a_corrupted_layer_file_is_an_integrity_error_naming_its_key(store, key_of):
    publish_layer(store, META, BLOBMAP, make_manifest())
    path = path_of(store, key_of(LAYER))
    with open(path, "r+b") as f:
        f.seek(7)
        f.write(b"!")
    with pytest.raises(IntegrityError) as info:
        open_layer(store, LAYER)
    assert key_of(LAYER) in str(info.value)


def test_meta_and_blob_map_are_stored_compressed_and_the_digest_is_of_the_uncompressed_image(store):
    manifest = make_manifest()
    publish_layer(store, META, BLOBMAP, manifest)
    stored_meta, stored_blobmap = store.get(keys.layer_meta(LAYER)), store.get(keys.layer_blobmap(LAYER))
    assert stored_meta[:4] == b"\x28\xb5\x2f\xfd" and len(stored_meta) < len(META) // 10
    assert zstandard.ZstdDecompressor().decompress(stored_meta) == META
    assert zstandard.ZstdDecompressor().decompress(stored_blobmap) == BLOBMAP
    published = Manifest.from_json(store.get(keys.layer_manifest(LAYER)), source="m")
    assert published.version == 2 and published.layer == sha256(META).hex() and published.meta_size == len(META)
    assert published.stored["meta.erofs"] == {"encoding": "zstd", "size": len(stored_meta),
                                              "sha256": sha256(stored_meta).hex()}
    assert published.stored["blobmap"]["size"] == len(stored_blobmap)
    layer = open_layer(store, LAYER)
    assert (layer.meta, layer.blobmap) == (META, BLOBMAP)


def test_a_layer_of_an_older_writer_stored_uncompressed_is_still_read(store):
    """A version 1 manifest (no ``stored`` field): meta.erofs and the blob map are the objects as they are."""
    obj = json.loads(make_manifest().to_json())
    obj["version"] = 1
    del obj["stored"]
    store.put(keys.layer_meta(LAYER), META)
    store.put(keys.layer_blobmap(LAYER), BLOBMAP)
    store.put(keys.layer_manifest(LAYER), json.dumps(obj).encode())
    layer = open_layer(store, LAYER)
    assert (layer.meta, layer.blobmap, layer.manifest.version) == (META, BLOBMAP, 1)


def _lie_about(store, key, frame):
    """A store writer that lies consistently: replaces ``key``'s object with ``frame`` and gives the
    manifest that frame's stored size and sha256, so only decompression and the digest can catch it."""
    name = key.rsplit("/", 1)[-1]
    obj = json.loads(store.get(keys.layer_manifest(LAYER)))
    obj["stored"][name] = {"encoding": "zstd", "size": len(frame), "sha256": sha256(frame).hex()}
    store.put(key, frame)
    store.put(keys.layer_manifest(LAYER), json.dumps(obj).encode())


def _zeros_frame(size: int, *, declared: bool) -> bytes:
    """A zstd frame of ``size`` zero bytes (a bomb: about 1/10,000 of that), made without holding them."""
    out = io.BytesIO()
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    with compressor.stream_writer(out, size=size if declared else -1, closefd=False) as writer:
        for _ in range(size >> 20):
            writer.write(bytes(1 << 20))
    return out.getvalue()


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("key_of", [keys.layer_meta, keys.layer_blobmap])
def test_a_compressed_object_that_expands_past_the_manifests_size_is_a_format_error_naming_its_key(
        store, key_of, declared):
    """A 1 GiB bomb in 100 KB, its frame declaring its size or not, is refused without expanding it."""
    publish_layer(store, META, BLOBMAP, make_manifest())
    frame = _zeros_frame(1 << 30, declared=declared)
    assert len(frame) < 1 << 20
    _lie_about(store, key_of(LAYER), frame)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(FormatError) as info:
        open_layer(store, LAYER)
    assert key_of(LAYER) in str(info.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 << 10  # KiB: far below 1 GiB


@pytest.mark.parametrize("key_of", [keys.layer_meta, keys.layer_blobmap])
def test_a_compressed_object_that_is_not_zstd_or_decompresses_to_other_bytes_is_corrupt(store, key_of):
    publish_layer(store, META, BLOBMAP, make_manifest())
    _lie_about(store, key_of(LAYER), b"not a zstd frame at all")
    with pytest.raises(FormatError) as info:
        open_layer(store, LAYER)
    assert key_of(LAYER) in str(info.value) and "zstd" in str(info.value)
    original = META if key_of is keys.layer_meta else BLOBMAP
    _lie_about(store, key_of(LAYER), zstandard.ZstdCompressor().compress(original[:-1] + b"?"))
    with pytest.raises(IntegrityError, match="sha256 mismatch") as info:
        open_layer(store, LAYER)
    assert key_of(LAYER) in str(info.value)


def test_a_manifest_naming_more_metadata_than_a_reader_takes_is_refused_before_decompressing(store, monkeypatch):
    publish_layer(store, META, BLOBMAP, make_manifest())
    monkeypatch.setattr("dsec_fs.layer.MAX_METADATA_SIZE", len(META) - 1)
    with pytest.raises(UnsupportedError) as info:
        open_layer(store, LAYER)
    assert keys.layer_meta(LAYER) in str(info.value)


@pytest.mark.parametrize("key_of", [keys.layer_meta, keys.layer_blobmap, keys.layer_manifest])
def test_a_layer_object_grown_past_its_size_is_refused_without_reading_it(store, key_of):
    """A store writer appends a GiB to meta.erofs, the blob map or the manifest (a sparse file here):
    the reader asks for no more than the manifest (or a manifest's bound) allows, and says which key is
    wrong; before, it read the whole object into memory and only then compared sizes."""
    publish_layer(store, META, BLOBMAP, make_manifest())
    os.truncate(path_of(store, key_of(LAYER)), 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises((IntegrityError, FormatError)) as info:
            open_layer(store, LAYER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert key_of(LAYER) in str(info.value)
    assert peak < 64 << 20, f"{peak} bytes allocated reading a layer of a few KB"


@pytest.mark.parametrize("name", ["meta.erofs", "blobmap"])
def test_a_manifest_giving_a_huge_stored_size_for_a_small_object_allocates_nothing_for_it(store, name):
    """The bounded read takes the manifest's stored size as its limit: a lying manifest must not make the
    reader allocate that much for an object of a few KB."""
    publish_layer(store, META, BLOBMAP, make_manifest())
    obj = json.loads(store.get(keys.layer_manifest(LAYER)))
    obj["stored"][name]["size"] = 3 << 30
    store.put(keys.layer_manifest(LAYER), json.dumps(obj).encode())
    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError) as info:
            open_layer(store, LAYER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert name in str(info.value)
    assert peak < 64 << 20, f"{peak} bytes allocated reading a layer of a few KB"


def test_an_oversized_ref_is_refused_without_reading_it(store):
    publish_layer(store, META, BLOBMAP, make_manifest())
    set_ref(store, "base:1", LAYER)
    os.truncate(path_of(store, keys.ref("base", "1")), 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as info:
            resolve(store, "base:1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert keys.ref("base", "1") in str(info.value)
    assert peak < 64 << 20, f"{peak} bytes allocated reading a ref"


def test_a_corrupted_manifest_is_a_format_error_naming_its_key(store):
    publish_layer(store, META, BLOBMAP, make_manifest())
    with open(path_of(store, keys.layer_manifest(LAYER)), "r+b") as f:
        f.write(b"[")
    with pytest.raises(FormatError) as info:
        open_layer(store, LAYER)
    assert keys.layer_manifest(LAYER) in str(info.value)


def test_a_manifest_stored_under_another_layer_is_an_integrity_error(store):
    publish_layer(store, META, BLOBMAP, make_manifest())
    other = "0" * 64
    store.put(keys.layer_manifest(other), store.get(keys.layer_manifest(LAYER)))
    with pytest.raises(IntegrityError):
        open_layer(store, other)


def test_refs(store):
    publish_layer(store, META, BLOBMAP, make_manifest())
    set_ref(store, "base/debian:12", LAYER)
    set_ref(store, "toolkit", LAYER)
    assert resolve(store, "base/debian:12") == LAYER
    assert resolve(store, "toolkit:latest") == LAYER
    assert resolve(store, LAYER) == LAYER
    assert resolve(store, LAYER.upper()) == LAYER
    assert list_refs(store) == {"base/debian:12": LAYER, "toolkit:latest": LAYER}
    assert open_layer(store, "base/debian:12").meta == META

    delete_ref(store, "toolkit")
    assert list_refs(store) == {"base/debian:12": LAYER}
    with pytest.raises(NotFoundError, match="toolkit:latest"):
        resolve(store, "toolkit")
    with pytest.raises(NotFoundError):
        delete_ref(store, "toolkit")


def test_resolve_of_an_unknown_ref_names_it(store):
    with pytest.raises(NotFoundError, match="workspace/task-17:v2"):
        resolve(store, "workspace/task-17:v2")


def test_a_layer_is_named_by_a_short_digest_prefix_or_with_sha256(store):
    digest = publish_pretend_layer(store, META)
    other = publish_pretend_layer(store, META + b"other")
    for name in (digest[:12], digest[:4], digest[:12].upper(), f"sha256:{digest}", f"sha256:{digest[:12]}",
                 f"SHA256:{digest[:7]}"):
        assert resolve(store, name) == digest, name
    assert resolve(store, other[:12]) == other
    assert open_layer(store, digest[:12]).meta == META


def test_an_ambiguous_prefix_is_an_error_listing_the_candidates(store):
    a, b = two_layers_sharing_a_prefix(store)
    with pytest.raises(InputError, match="ambiguous") as error:
        resolve(store, a[:4])
    assert a in str(error.value) and b in str(error.value)
    assert resolve(store, a[:12]) == a and resolve(store, b[:12]) == b


def test_a_prefix_no_layer_has_is_not_found_naming_the_store(store):
    digest = publish_pretend_layer(store, META)
    absent = next(p for p in ("0000", "ffff", "abcd") if not digest.startswith(p))
    with pytest.raises(NotFoundError, match=f"starts with {absent}") as error:
        resolve(store, f"sha256:{absent}")
    assert store.url in str(error.value)
    with pytest.raises(InputError):
        resolve(store, "sha256:12")  # too short to be a prefix
    with pytest.raises(InputError):
        resolve(store, "sha256:base")


def test_a_hex_word_is_a_ref_name_too_and_both_meanings_must_agree(store):
    digest = publish_pretend_layer(store, META)
    other = publish_pretend_layer(store, META + b"other")
    set_ref(store, "cafe", other)
    assert resolve(store, "cafe") == other  # no layer digest starts with cafe (or it would be ambiguous)
    set_ref(store, digest[:6], digest)  # the ref and the prefix name the same layer
    assert resolve(store, digest[:6]) == digest
    set_ref(store, digest[:8], other)
    with pytest.raises(InputError, match="ambiguous"):
        resolve(store, digest[:8])
    assert resolve(store, f"sha256:{digest[:8]}") == digest  # sha256: never means a ref


def test_set_ref_refuses_a_bad_digest(store):
    with pytest.raises(InputError):
        set_ref(store, "base:1", "not-a-digest")


def test_a_corrupt_ref_is_a_format_error_naming_it(store):
    store.put(keys.ref("base", "1"), b"garbage\n")
    with pytest.raises(FormatError, match="refs/base:1"):
        resolve(store, "base:1")
    with pytest.raises(FormatError, match="refs/base:1"):
        list_refs(store)


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("base/debian:12", ("base/debian", "12")),
        ("base/debian", ("base/debian", "latest")),
        ("ws/org/repo-1.2_x:sha-abc.1", ("ws/org/repo-1.2_x", "sha-abc.1")),
        ("base:_x", ("base", "_x")),
    ],
)
def test_parse_ref(ref, expected):
    assert parse_ref(ref) == expected


@pytest.mark.parametrize(
    "ref",
    [
        "",
        ":12",
        "base:",
        "base//debian:1",
        "/base:1",
        "base/:1",
        "../etc:1",
        "base/..:1",
        "a..b:1",
        "base:1..2",
        "base:a:b",
        "base:a/b",
        "base\n:1",
        "base:1\x00",
        "ba\x7fse",
        ".hidden:1",
        "_name:1",
        ".tmp-x:1",
        "base/.:1",
        "with space:1",
        "base:" + "t" * 129,
        "n" * 300,
        "ab" * 32,
        "AB" * 32 + ":1",
    ],
)
def test_bad_refs_are_input_errors(ref):
    with pytest.raises(InputError):
        parse_ref(ref)
