"""The node's copies of layer metadata (lazy_fetch/meta_cache.py): a layer opened again reads nothing from
the store; a copy that rotted, was cut short, or was replaced by a symlink or a FIFO is dropped (never
followed, never waited on) and read from the store again; a manifest is read again once its copy is
older than MANIFEST_FRESH_SECONDS; the copies stay within their bound. Real layers in a real directory
store, counted by CountingStore."""

from __future__ import annotations

import os
import stat

import pytest
from treecmp import write_files

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.chunks import ChunkIndex, read_chunk
from dsec_fs.errors import CorruptError
from dsec_fs.layer import open_layer
from dsec_fs.pack import decode_index, encode_index
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import CountingStore
from erofs_builder import build_layer
from lazy_fetch import meta_cache
from lazy_fetch.meta_cache import HEADER, MetaCache
from tests.dsec_fs.gc_support import CHUNK, build, random_bytes
from tests.dsec_fs.oversized import overgrow_blob_map

FILES = {f"pkg/mod{i}.py": f"print({i})\n".encode() * (i + 1) for i in range(40)}


@pytest.fixture
def built(tmp_path):
    backend = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digest = build_layer(write_files(tmp_path / "src", FILES), backend, name="tk/py:1", chunk_size=4096).digest
    return backend, digest


def open_counted(backend, copies: MetaCache, ref: str = "tk/py:1"):
    """(LayerFiles, ChunkIndex, the store calls the open made) of an open as the daemon makes it."""
    counting = CountingStore(backend)
    files = open_layer(counting, ref, reads=copies)
    index = ChunkIndex()
    index.load_packs(copies.pack_indexes(counting), files.manifest.packs)
    return files, index, dict(counting.calls)


def located(index: ChunkIndex, files) -> dict:
    """Where the index places each chunk of the layer."""
    return {digest: index.get(digest) for _blkaddr, digest, _length in
            EncodedBlobMap(files.blobmap, source="blobmap").entries}


def copy_path(copies: MetaCache, kind: str) -> str:
    (name,) = os.listdir(os.path.join(copies.directory, kind))
    return os.path.join(copies.directory, kind, name)


def test_a_layer_opened_again_reads_only_its_ref(built, tmp_path):
    backend, digest = built
    copies = MetaCache(str(tmp_path / "cache" / "meta"), 64 << 20)
    first, first_index, calls = open_counted(backend, copies)
    packs = len(first.manifest.packs)
    assert calls == {"get": 1 + 3 + packs}  # ref, manifest, meta.erofs, blob map, pack indexes

    again, again_index, calls = open_counted(backend, copies)
    assert calls == {"get": 1}  # the ref: it may move (RefCacheStore caches it for a TTL)
    assert again == first and again.digest == digest
    assert located(again_index, again) == located(first_index, first)
    _, _, calls = open_counted(backend, copies, digest)
    assert calls == {}
    # And so for a daemon that starts again on the same cache directory.
    _, _, calls = open_counted(backend, MetaCache(copies.directory, 64 << 20), digest)
    assert calls == {}
    assert stat.S_IMODE(os.stat(copies.directory).st_mode) == 0o700


@pytest.mark.parametrize("kind", ["manifest", "meta", "blobmap", "index"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_copy_is_dropped_and_read_again(built, tmp_path, kind, damage):
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    first, first_index, _ = open_counted(backend, copies, digest)
    path = copy_path(copies, kind) if kind != "index" else sorted(
        os.path.join(copies.directory, "index", n) for n in os.listdir(os.path.join(copies.directory, "index")))[0]
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if damage == "flip":
            data[-1] ^= 1
        elif damage == "truncate":
            data = data[:len(data) // 2]
        else:
            data[0] ^= 1
        f.seek(0)
        f.truncate()
        f.write(data)
    again, again_index, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 1}  # that object alone, from the store
    assert again == first and located(again_index, again) == located(first_index, first)
    assert copies.dropped == 1
    _, _, calls = open_counted(backend, copies, digest)  # and it is kept again, whole
    assert calls == {}


def test_a_copy_that_is_the_wrong_object_is_not_served(built, tmp_path):
    """A blob map's copy holding another (well-formed) copy's bytes, header and all: its name is its
    content address, so it fails even though its own checksum holds."""
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    first, _, _ = open_counted(backend, copies, digest)
    with open(copy_path(copies, "manifest"), "rb") as f:
        other = f.read()
    with open(copy_path(copies, "blobmap"), "wb") as f:
        f.write(other)
    again, _, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 1} and again.blobmap == first.blobmap


@pytest.mark.parametrize("replacement", ["symlink", "fifo", "directory"])
def test_a_copy_replaced_by_a_symlink_fifo_or_directory_is_not_followed(built, tmp_path, replacement):
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    first, _, _ = open_counted(backend, copies, digest)
    path = copy_path(copies, "meta")
    decoy = tmp_path / "decoy"
    with open(path, "rb") as f:
        decoy.write_bytes(f.read())  # a perfect copy elsewhere: following the link would "work"
    os.unlink(path)
    if replacement == "symlink":
        os.symlink(decoy, path)
    elif replacement == "fifo":
        os.mkfifo(path)  # opened O_NONBLOCK: no reader blocks on it
    else:
        os.mkdir(path)
        (tmp_path / "meta" / "meta" / os.path.basename(path) / "x").write_bytes(b"x")
    again, _, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 1} and again.meta == first.meta
    assert stat.S_ISREG(os.lstat(path).st_mode)  # replaced by a real copy
    assert decoy.read_bytes()[HEADER.size:] == first.meta  # the decoy was left alone


def test_strays_are_removed_when_the_cache_opens(built, tmp_path):
    backend, digest = built
    directory = str(tmp_path / "meta")
    copies = MetaCache(directory, 64 << 20)
    open_counted(backend, copies, digest)
    meta_dir = os.path.join(directory, "meta")
    os.symlink("/etc/passwd", os.path.join(meta_dir, "b" * 64))
    os.mkfifo(os.path.join(meta_dir, "c" * 64))
    with open(os.path.join(meta_dir, ".x.tmp-123456"), "wb") as f:
        f.write(b"a write a crash cut short")
    MetaCache(directory, 64 << 20)
    assert os.listdir(meta_dir) == [digest]


def test_a_manifest_copy_is_read_again_once_it_is_old(built, tmp_path, monkeypatch):
    """gc's repack rewrites a layer's manifest (its pack list): a manifest copy is used for a while only."""
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    open_counted(backend, copies, digest)
    monkeypatch.setattr(meta_cache, "MANIFEST_FRESH_SECONDS", 0.0)
    _, _, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 1}  # the manifest alone: meta.erofs, the blob map and the indexes are for good


def test_a_manifest_whose_pack_index_copies_went_is_read_again(built, tmp_path):
    """An evicted pack index could be one a repack has removed from the store: the manifest, whose pack
    list may have changed meanwhile, is read again with it."""
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    first, first_index, _ = open_counted(backend, copies, digest)
    os.unlink(sorted(os.path.join(copies.directory, "index", n)
                     for n in os.listdir(os.path.join(copies.directory, "index")))[0])
    again, again_index, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 2}  # the manifest and that index
    assert again == first and located(again_index, again) == located(first_index, first)


def test_two_stores_do_not_share_a_manifest_copy(built, tmp_path):
    """The same layer in another store may sit in other packs: its manifest there is read there."""
    backend, digest = built
    other = FilesystemStore(str(tmp_path / "other"), fsync=False)
    assert build_layer(str(tmp_path / "src"), other, chunk_size=4096).digest == digest
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    open_counted(backend, copies, digest)
    _, _, calls = open_counted(other, copies, digest)
    # its manifest and its pack's index (an index copy is one store's: see the test below); meta.erofs and
    # the blob map, content-addressed, are served by the copies to both
    assert calls == {"get": 2}


def test_the_copies_stay_within_their_bound(tmp_path):
    backend = FilesystemStore(str(tmp_path / "store"), fsync=False)
    digests = [build_layer(write_files(tmp_path / f"src{i}", {f"f{i}": bytes([i]) * 100}), backend).digest
               for i in range(6)]
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    open_counted(backend, copies, digests[0])
    one_layer = sum(os.path.getsize(os.path.join(root, name))
                    for root, _dirs, names in os.walk(copies.directory) for name in names)
    bound = 3 * one_layer
    copies = MetaCache(str(tmp_path / "meta2"), bound)
    for digest in digests:
        open_counted(backend, copies, digest)
    held = sum(os.path.getsize(os.path.join(root, name))
               for root, _dirs, names in os.walk(copies.directory) for name in names)
    assert 0 < held <= bound
    _, _, calls = open_counted(backend, copies, digests[-1])  # the most recent stay
    assert calls == {}


def test_a_copy_bigger_than_the_bound_is_dropped_unread(built, tmp_path):
    backend, digest = built
    copies = MetaCache(str(tmp_path / "meta"), 1 << 20)
    first, _, _ = open_counted(backend, copies, digest)
    os.truncate(copy_path(copies, "meta"), 1 << 40)  # a sparse terabyte in its place: never read into memory
    again, _, calls = open_counted(backend, copies, digest)
    assert calls == {"get": 1} and again.meta == first.meta
    assert os.path.getsize(copy_path(copies, "meta")) < 1 << 20


def test_a_pack_index_copy_is_the_stores_it_was_read_from(tmp_path):
    """A pack index object is not named by its content: a writer of another store may publish a
    different one under a pack id of this store's. Its copy must not serve this store's layers."""
    a = FilesystemStore(str(tmp_path / "a"), fsync=False)
    b = FilesystemStore(str(tmp_path / "b"), fsync=False)
    digest = build(a, tmp_path / "src", {f"f{i}": random_bytes(i, 2 * CHUNK) for i in range(4)}, "t/x")
    (pack,) = open_layer(a, digest).manifest.packs
    entries = decode_index(a.get(keys.index(pack)), source="a")
    rotated = [e._replace(digest=entries[(i + 1) % len(entries)].digest) for i, e in enumerate(entries)]
    b.put(keys.index(pack), encode_index(rotated))  # store B's writer cannot write store A
    copies = MetaCache(str(tmp_path / "meta"), 64 << 20)
    ChunkIndex().load_packs(copies.pack_indexes(b), [pack])  # this node read B's index once
    files = open_layer(a, digest, reads=copies)
    index = ChunkIndex()
    index.load_packs(copies.pack_indexes(a), files.manifest.packs)
    for _blkaddr, chunk_digest, _length in EncodedBlobMap(files.blobmap, source="blobmap").entries:
        read_chunk(a, chunk_digest, index.get(chunk_digest))  # IntegrityError with B's copy


def test_a_blob_map_of_more_entries_than_meta_erofs_can_name_is_refused_before_it_is_copied(built, tmp_path):
    """The daemon's open (through its copies) refuses it as corrupt, naming the map's key, and keeps no
    copy of it: a layer cannot make the node hold or decode a map bigger than the layer can need."""
    backend, digest = built
    overgrow_blob_map(backend, digest)
    copies = MetaCache(str(tmp_path / "cache" / "meta"), 64 << 20)
    with pytest.raises(CorruptError, match="more than the") as info:
        open_layer(backend, digest, reads=copies)
    assert info.value.where == keys.layer_blobmap(digest)
    assert not os.listdir(os.path.join(copies.directory, "blobmap"))
