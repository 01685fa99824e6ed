"""Fuzzing the binary and JSON parsers: on any input each returns a result that keeps its contract or raises
its own kind of DsecError, within bounded time and memory (fuzzlib.bounded).

Inputs are mostly structure-aware: valid encodings made by the real writers (build_tree's meta.erofs and
blob maps, mkfs.erofs images, PackWriter's packs and indexes, manifests, build info, traces, prefetch
lists), mutated byte-wise (fuzzlib.mutations) and then, where the format has a checksum or a length in a
header, often resealed (the checksum recomputed, the length fixed up) so the mutation reaches the
structures behind it instead of stopping at the checksum. JSON formats are also mutated as documents
(a field removed, or replaced by any JSON value). Arbitrary bytes come too.

"Contract" per parser, beyond not crashing:
- ErofsImage: what parses is self-consistent: the walk ends, every path resolves to its nid, directories
  are strictly sorted with "." and "..", a read returns exactly the bytes the size allows, pieces agree
  with a whole read, holes read as zeros, symlink targets are their size. The on-disk decoders alone
  (superblock, device slot, inode, xattrs, dirent block) raise nothing but their errors.
- fsck_image never raises, and reports what the reader refuses. fsck_layer never raises either, with
  any one object of a published layer damaged in the store; it finds every change to meta.erofs or the
  blob map, and when it passes the layer still reads exactly as before.
- Pack indexes, blob maps, build info: what decodes re-encodes to the very same bytes.
- Chunk reads from a corrupted pack (or through a corrupted, resealed index) return the chunk's true
  bytes or raise CorruptError: never other bytes.
- Manifests, prefetch lists, traces, refs: what is accepted survives a write/read round trip unchanged.

Each input that once broke a parser is kept under corpus/<parser>/ and replayed by test_corpus.
"""

from __future__ import annotations

import os
import random
import stat
import struct
import tempfile

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from dsec_fs import compress
from dsec_fs.chunks import ChunkLocation, read_chunk, read_chunks
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import CorruptError, FormatError, InputError, UnsupportedError
from dsec_fs.layer import Manifest, open_layer, parse_ref
from dsec_fs.pack import PACK_TRAILER, PackWriter, decode_index, encode_index, index_from_pack
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.base import check_key
from erofs_builder.blob import FileBlob, StoreBlob
from dsec_fs.blobmap import BlobMap, EncodedBlobMap
from erofs_builder.fsck import fsck_image, fsck_layer
from erofs_builder.incremental import _HEADER as BUILDINFO_HEADER
from erofs_builder.incremental import _RECORD as BUILDINFO_RECORD
from erofs_builder.incremental import _SHARED as BUILDINFO_SHARED
from erofs_builder.incremental import decode_buildinfo, encode_buildinfo
from erofs_builder.ondisk import chunk_index, dirent, xattr
from erofs_builder.ondisk.device_slot import DeviceSlot
from erofs_builder.ondisk.inode import LAYOUT_CHUNK_BASED, Inode
from erofs_builder.ondisk.superblock import SB_OFFSET, Superblock, seal_block0
from erofs_builder.reader import ErofsImage
from erofs_builder.tree import Node, Tree
from fuzzlib import bounded, corpus_cases, fuzz_settings, inputs, json_mutations, mutations, note
from lazy_fetch import prefetch_list
from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.miss_readahead import FileChunks
from lazy_fetch.prefetch_list import PrefetchEntry, PrefetchList
from lazy_fetch.trace import RECORD, TraceHeader, TraceWriter, read_trace
from tests.lazy_fetch.file_chunks_support import as_values, file_chunks_of_index

BLOCK = 4096
INODES_START = 1280  # after the superblock and our one-slot device table
WHOLE_READ_MAX = 256 << 10  # files up to this size are also read whole and compared with pieces
TRACE_FLAGS = 0x1 | 0x2 | 0x4 | 0x8
# Parsers that read files (traces, prefetch lists) get their input here, one file rewritten per example.
SCRATCH = tempfile.TemporaryDirectory(prefix="dsecfs-fuzz-")


# ---------------------------------------------------------------------------------------------------------
# EROFS images.


def examine_image(meta: bytes, blob) -> int:
    """Everything the reader offers, checked for consistency; returns the number of names walked."""
    image = ErofsImage(meta, blob=blob)
    names = 0
    for path, nid in image.walk():
        names += 1
        assert image.resolve(path) == nid
        st_ = image.stat(nid)
        image.xattrs(nid)
        if stat.S_ISDIR(st_.mode):
            entries = image.readdir(nid)
            listed = [name for name, _nid, _ftype in entries]
            assert listed == sorted(set(listed)), "directory entries are not strictly sorted"
            assert b"." in listed and b".." in listed
        elif stat.S_ISREG(st_.mode):
            _examine_file(image, nid, st_.size)
        elif stat.S_ISLNK(st_.mode):
            target = image.readlink(nid)
            assert len(target) == st_.size and b"\0" not in target
    return names


def _examine_file(image: ErofsImage, nid: int, size: int) -> None:
    chunked = image.inode(nid).layout == LAYOUT_CHUNK_BASED
    if chunked:
        chunk_size = image.chunk_size(nid)
        chunk_map = image.chunk_map(nid)
        assert len(chunk_map) == -(-size // chunk_size)
    # A file's size comes from the image: read bounded windows, never the whole of a huge one.
    for offset, length in ((0, 5000), (size // 2, 9000), (max(size - 7000, 0), 10_000), (size, 1), (size + 9, 3)):
        assert len(image.read(nid, offset, length)) == max(0, min(length, size - offset))
    if size <= WHOLE_READ_MAX:
        whole = image.read(nid, 0, size)
        assert len(whole) == size
        assert b"".join(image.read(nid, offset, 3000) for offset in range(0, size, 3000)) == whole
        if chunked:
            for k, (_device, blkaddr) in enumerate(chunk_map):
                if blkaddr == chunk_index.HOLE:
                    assert not any(whole[k * chunk_size:(k + 1) * chunk_size]), "a hole did not read as zeros"


def check_image(meta: bytes, blob) -> None:
    outcome = bounded(lambda: examine_image(meta, blob), allowed=(FormatError, UnsupportedError),
                      input_size=len(meta))
    note(outcome)
    if isinstance(outcome, FormatError):
        assert outcome.structure and (outcome.offset is None or outcome.offset >= 0), outcome
        assert "meta.erofs" in str(outcome), outcome


def fix_up_image(meta: bytes, block_count: bool) -> bytes:
    """Reseal the superblock checksum (and with ``block_count`` make the size a whole number of blocks
    and the superblock agree), so a mutation gets past the superblock to the structures behind it."""
    image = bytearray(meta)
    if len(image) < SB_OFFSET + 128:
        return meta
    if block_count:
        image += bytes(-len(image) % BLOCK)
        struct.pack_into("<I", image, SB_OFFSET + 0x24, len(image) // BLOCK)
    seal_block0(image, BLOCK)
    return bytes(image)


@st.composite
def images(draw, seeds: list[bytes]) -> bytes:
    """Mostly mutated seeds with the superblock fixed up after the mutation; sometimes anything."""
    # Hypothesis favours the low end of a range: the common choices are the low ones.
    if draw(st.integers(0, 19), label="anything") == 19:
        return draw(inputs(seeds, max_random=3 * BLOCK))
    # Two mutants in three leave the superblock and the device table (bytes 1024..1279) alone.
    start = draw(st.sampled_from([INODES_START, INODES_START, SB_OFFSET]), label="from")
    meta = draw(mutations(seeds, start=start))
    if draw(st.integers(0, 19), label="leave the superblock alone") == 19:
        return meta
    return fix_up_image(meta, block_count=draw(st.integers(0, 9), label="keep the block count") != 9)


@pytest.fixture(scope="module")
def image_seeds(layers, mkfs_images):
    """(metas, blob for each) of our layers and the mkfs.erofs images with a blob or without data on one."""
    seeds = [(layer.meta, layer.blob_path) for layer in layers]
    seeds += [(meta, blob) for meta, blob in mkfs_images]
    return seeds


@fuzz_settings(500)
@given(data=st.data())
def test_erofs_reader_on_mutated_images(image_seeds, data):
    seed, blob_path = data.draw(st.sampled_from(image_seeds), label="seed")
    meta = data.draw(images([seed]), label="image")
    if blob_path is None:
        if not _needs_blob(meta):
            check_image(meta, None)
        return
    with FileBlob(blob_path) as blob:
        check_image(meta, blob)


def _needs_blob(meta: bytes) -> bool:
    """An image with extra devices whose data the check reads needs a blob: without one, reading device 1
    is an UnavailableError (the caller's fault), not a finding."""
    try:
        return bool(ErofsImage(meta).devices)
    except (FormatError, UnsupportedError):
        return False


@fuzz_settings(300)
@given(data=st.data())
def test_the_miss_readaheads_file_map_on_mutated_images(layers, data):
    """FileChunks.of_image (erofs_builder/chunked_files.py underneath) raises only its errors, within
    bounds, and where it and the reader's walk (LayerIndex) both take an image, gives the same map."""
    layer = data.draw(st.sampled_from(layers), label="layer")
    meta = data.draw(images([layer.meta]), label="image")
    blob_map = layer.decoded_blobmap()
    outcome = bounded(lambda: FileChunks.of_image(meta, blob_map, source="layer x meta.erofs"),
                      allowed=(FormatError, UnsupportedError), input_size=len(meta))
    note(outcome)
    if isinstance(outcome, FormatError):
        assert outcome.structure and "layer x meta.erofs" in str(outcome), outcome
    try:
        walked = file_chunks_of_index(LayerIndex("x", ErofsImage(meta), blob_map))
    except (FormatError, UnsupportedError):
        return
    if isinstance(outcome, FileChunks):
        assert as_values(outcome) == as_values(walked)


@fuzz_settings(150)
@given(data=st.data())
def test_fsck_image_never_raises(layers, data):
    layer = data.draw(st.sampled_from(layers), label="layer")
    meta = data.draw(images([layer.meta]), label="image")
    with layer.blob() as blob:
        report = bounded(lambda: fsck_image(meta, blob, blobmap=layer.decoded_blobmap()), allowed=(),
                         input_size=len(meta))
        try:
            examine_image(meta, blob)
        except (FormatError, UnsupportedError):
            assert not report.ok, "fsck passed an image the reader refuses"


def layer_view(store, digest: str) -> list:
    """What a reader of the layer sees: every path with its stat, xattrs, target and content."""
    files = open_layer(store, digest)
    image = ErofsImage(files.meta, blob=StoreBlob.for_layer(store, files))
    view = []
    for path, nid in image.walk():
        st_ = image.stat(nid)
        content = image.read(nid, 0, st_.size) if stat.S_ISREG(st_.mode) else None
        target = image.readlink(nid) if stat.S_ISLNK(st_.mode) else None
        view.append((path, st_, sorted(image.xattrs(nid).items()), target, content))
    return view


@pytest.fixture(scope="module")
def pristine(layers):
    """Each seed layer's store, with the reader's view of the layer before anything was damaged."""
    stores = [FilesystemStore(layer.store_root, fsync=False) for layer in layers]
    return [(layer, store, layer_view(store, layer.digest)) for layer, store in zip(layers, stores)]


@fuzz_settings(150)
@given(data=st.data())
def test_fsck_layer_on_a_damaged_store_object(pristine, data):
    """One object of a published layer damaged in the store (meta.erofs, blob map, manifest, a pack, a
    pack index, resealed or not): fsck_layer never raises, finds every change to the digest-named files,
    and when it passes, the layer still reads exactly as before."""
    layer, store, view = data.draw(st.sampled_from(pristine), label="layer")
    objects = [keys.layer_meta(layer.digest), keys.layer_blobmap(layer.digest), keys.layer_manifest(layer.digest),
               *store.list(keys.PACKS), *store.list(keys.INDEX)]
    key = data.draw(st.sampled_from(objects), label="object")
    original = store.get(key)
    damaged = data.draw(mutations([original]), label="bytes")
    if key.startswith(keys.INDEX) and data.draw(st.booleans(), label="reseal the index"):
        damaged = reseal_index(damaged, fix_count=True)
    store.put(key, damaged)
    try:
        report = bounded(lambda: fsck_layer(store, layer.digest, check_chunks=True), allowed=(),
                         input_size=len(damaged))
        note("accepted" if report.ok else report.problems[0].kind)
        if damaged != original and key in objects[:2]:
            assert not report.ok, f"fsck passed a changed {key}"
        if report.ok:
            assert layer_view(store, layer.digest) == view, "fsck passed a layer that no longer reads the same"
    finally:
        store.put(key, original)


@fuzz_settings(400)
@given(data=st.binary(max_size=600), offset=st.integers(0, 600), count=st.integers(0, 0xFFFF))
def test_ondisk_structures_on_arbitrary_bytes(data, offset, count):
    """Each on-disk decoder alone: its result, or FormatError / UnsupportedError."""
    errors = (FormatError, UnsupportedError)
    image = bytes(SB_OFFSET) + data
    bounded(lambda: Superblock.unpack(image), allowed=errors, input_size=len(image))
    bounded(lambda: DeviceSlot.unpack(data, offset), allowed=errors, input_size=len(data))
    bounded(lambda: Inode.unpack(data, offset >> 5, meta_offset=0, build_time=1, build_time_nsec=0),
            allowed=errors, input_size=len(data))
    bounded(lambda: xattr.decode(data, offset, count, nid=1, source="x"), allowed=errors, input_size=len(data))
    entries = bounded(lambda: list(dirent.unpack_block(data, offset=0, nid=1, source="x")), allowed=errors,
                      input_size=len(data))
    if isinstance(entries, list):
        # A block that reads is its entries' encoding (the reserved byte aside), then nothing or a NUL.
        encoded = bytearray(dirent.pack_block(entries))
        block = bytearray(data[:len(encoded)])
        for i in range(len(entries)):
            block[12 * i + 11] = 0
        assert block == encoded and data[len(encoded):len(encoded) + 1] in (b"", b"\0")


# ---------------------------------------------------------------------------------------------------------
# Packs, pack indexes, chunk reads, zstd frames.


def make_pack(seed: int) -> tuple[str, bytes, bytes, dict[bytes, bytes]]:
    """(pack id, pack, index, digest -> chunk) of a pack of a few chunks: random, repetitive, tiny."""
    rng = random.Random(seed)
    writer = PackWriter()
    chunks = {}
    for data in (rng.randbytes(5000), b"text " * 900, rng.randbytes(1), bytes(100) + b"x", rng.randbytes(4096)):
        digest = sha256(data)
        writer.add(digest, compress.compress(data), len(data))
        chunks[digest] = data
    pack_id, pack, index = writer.finish()
    return pack_id, pack, index, chunks


PACKS = [make_pack(seed) for seed in range(3)]
INDEX_SEEDS = [index for _id, _pack, index, _chunks in PACKS] + [encode_index([])]
PACK_SEEDS = [pack for _id, pack, _index, _chunks in PACKS]


def reseal_index(data: bytes, fix_count: bool) -> bytes:
    """Recompute an index's trailing sha256 (and with ``fix_count`` its entry count from its length)."""
    body = bytearray(data[:-32])
    if len(body) < 16:
        return data
    if fix_count:
        struct.pack_into("<I", body, 12, max(len(body) - 16, 0) // 48)
    return bytes(body) + sha256(body)


def reseal_pack(data: bytes, fix_count: bool) -> bytes:
    """Reseal the index a pack's trailer points at, if it points inside the pack."""
    if len(data) < PACK_TRAILER.size:
        return data
    index_length, _magic = PACK_TRAILER.unpack_from(data, len(data) - PACK_TRAILER.size)
    index_at = len(data) - PACK_TRAILER.size - index_length
    if index_at < 0:
        return data
    return data[:index_at] + reseal_index(data[index_at:-PACK_TRAILER.size], fix_count) + data[-PACK_TRAILER.size:]


@st.composite
def resealed(draw, seeds: list[bytes], reseal) -> bytes:
    """Mostly mutants with their checksum recomputed (and often their count fixed), so entries are reached."""
    data = draw(inputs(seeds, max_random=1024))
    how = draw(st.sampled_from(["reseal and fix count", "reseal", "as is"]), label="fix-up")
    return data if how == "as is" else reseal(data, how == "reseal and fix count")


def check_index(data: bytes) -> None:
    outcome = bounded(lambda: decode_index(data, source="index/x"), allowed=FormatError, input_size=len(data))
    note(outcome)
    if not isinstance(outcome, FormatError):
        assert encode_index(outcome) == data, "an index that decodes must be exactly its entries' encoding"
        _check_entries(outcome, frames_end=None)


def _check_entries(entries, frames_end: int | None) -> None:
    end = 0
    for entry in entries:
        assert entry.clen > 0 and entry.offset >= end
        end = entry.offset + entry.clen
    assert frames_end is None or end <= frames_end
    assert len({entry.digest for entry in entries}) == len(entries)


def check_pack(data: bytes) -> None:
    outcome = bounded(lambda: index_from_pack(data, source="packs/x"), allowed=FormatError, input_size=len(data))
    note(outcome)
    if not isinstance(outcome, FormatError):
        index_length = PACK_TRAILER.unpack_from(data, len(data) - PACK_TRAILER.size)[0]
        index_at = len(data) - PACK_TRAILER.size - index_length
        assert encode_index(outcome) == data[index_at:-PACK_TRAILER.size]
        _check_entries(outcome, frames_end=index_at)


@fuzz_settings(400)
@given(data=resealed(INDEX_SEEDS, reseal_index))
def test_pack_index_decoder(data):
    check_index(data)


@fuzz_settings(400)
@given(data=resealed(PACK_SEEDS, reseal_pack))
def test_index_from_pack(data):
    check_pack(data)


PACK_STORE = FilesystemStore(os.path.join(SCRATCH.name, "packs"), fsync=False)


def check_chunk_reads(pack_id: str, pack: bytes, index: bytes, truth: dict[bytes, bytes]) -> None:
    """``pack`` stored as pack ``pack_id`` and read through ``index``, one chunk at a time and merged: every
    chunk comes back as bytes with its digest (``truth``'s, when it knows the chunk) or raises CorruptError."""
    PACK_STORE.put(keys.pack(pack_id), pack)
    try:
        entries = decode_index(index, source="index")
    except FormatError:
        return
    wanted = [(e.digest, ChunkLocation(pack_id, e.offset, e.clen, e.ulen)) for e in entries]

    def read_all() -> dict[bytes, bytes]:
        found = {}
        for digest, location in wanted:
            try:
                found[digest] = read_chunk(PACK_STORE, digest, location)
            except CorruptError:
                pass
        try:
            together = read_chunks(PACK_STORE, wanted)
        except CorruptError:
            together = {}
        for digest, chunk in together.items():
            assert found.get(digest, chunk) == chunk, "one read and a merged read disagree"
        return {**found, **together}

    for digest, chunk in bounded(read_all, allowed=(), input_size=len(pack) + len(index)).items():
        assert sha256(chunk) == digest
        assert digest not in truth or chunk == truth[digest]


@fuzz_settings(300)
@given(data=st.data())
def test_chunk_reads_never_return_corrupt_bytes(data):
    """A damaged pack, read through its true index or through a damaged (resealed) index object."""
    pack_id, pack, index, chunks = data.draw(st.sampled_from(PACKS), label="pack")
    damaged = data.draw(st.sampled_from(["pack", "index", "both"]), label="damaged")
    if damaged != "index":
        pack = data.draw(mutations([pack]), label="pack bytes")
    if damaged != "pack":
        mutated = reseal_index(data.draw(mutations([index]), label="index bytes"), fix_count=True)
        try:
            decode_index(mutated, source="index")
            index = mutated
        except FormatError:
            pass
    check_chunk_reads(pack_id, pack, index, chunks)


def replay_chunk_read(data: bytes) -> None:
    """A corpus entry: u32 length of the pack, the pack, then the index object to read it through."""
    if len(data) < 4:
        return
    (pack_length,) = struct.unpack_from("<I", data)
    pack = data[4:4 + pack_length]
    check_chunk_reads(to_hex(sha256(pack)), pack, data[4 + pack_length:], {})


FRAMES = [compress.compress(data)
          for data in (b"", b"a", b"abc" * 1000, bytes(1 << 16), random.Random(4).randbytes(3000))]


@fuzz_settings(300)
@given(frame=inputs(FRAMES, max_random=512), size=st.one_of(st.integers(0, 1 << 17), st.just(None)))
def test_decompress(frame, size):
    if size is None:  # the size the frame itself declares, so the decompression proper is reached
        try:
            size = zstandard.get_frame_parameters(frame).content_size
        except zstandard.ZstdError:
            size = 0
        size = size if size <= 0xFFFFFFFF else 0  # callers pass a u32 (pack index) or a bounded body size
    check_decompress(frame, size)


def check_decompress(frame: bytes, size: int) -> None:
    outcome = bounded(lambda: compress.decompress(frame, size, what="chunk"), allowed=CorruptError,
                      input_size=len(frame))
    note(outcome)
    if not isinstance(outcome, CorruptError):
        assert len(outcome) == size


# ---------------------------------------------------------------------------------------------------------
# Blob maps.


def blobmap_seeds(layers) -> list[bytes]:
    small = BlobMap(1 << 24)
    for length in (1, 4096, 4097, 1 << 24):
        small.add(sha256(b"%d" % length), length)
    return [layer.blobmap for layer in layers] + [small.encode(), BlobMap(4096).encode()]


def fix_up_blobmap(data: bytes) -> bytes:
    """Make the header's count and block total agree with the entries, so a mutation reaches them."""
    if len(data) < 24:
        return data
    count = (len(data) - 24) // 40
    body = bytearray(data[:24 + 40 * count])
    blocks = sum(-(-struct.unpack_from("<I", body, 24 + 40 * i + 4)[0] // BLOCK) for i in range(count))
    struct.pack_into("<II", body, 16, count, blocks & 0xFFFFFFFF)
    return bytes(body)


@st.composite
def blobmaps(draw, seeds: list[bytes]) -> bytes:
    data = draw(inputs(seeds, max_random=1024))
    return fix_up_blobmap(data) if draw(st.integers(0, 3), label="leave the header alone") != 3 else data


def check_blobmap(data: bytes) -> None:
    outcome = bounded(lambda: EncodedBlobMap(data, source="blobmap"), allowed=FormatError, input_size=len(data))
    note(outcome)
    if not isinstance(outcome, FormatError):
        assert outcome.encode() == data, "a blob map that decodes must be exactly its entries' encoding"


@fuzz_settings(400)
@given(data=st.data())
def test_blob_map_decoder(layers, data):
    check_blobmap(data.draw(blobmaps(blobmap_seeds(layers))))


# ---------------------------------------------------------------------------------------------------------
# JSON documents: manifests, prefetch lists; and refs.


@st.composite
def json_documents(draw, seeds: list[bytes]) -> bytes:
    """Seeds edited as documents, or their bytes mutated, or arbitrary bytes."""
    if draw(st.booleans(), label="byte-wise"):
        return draw(inputs(seeds, max_random=512))
    return draw(json_mutations(seeds))


def check_manifest(data: bytes) -> None:
    outcome = bounded(lambda: Manifest.from_json(data, source="manifest.json"),
                      allowed=(FormatError, UnsupportedError), input_size=len(data))
    note(outcome)
    if isinstance(outcome, Manifest):
        encoded = outcome.to_json()
        assert Manifest.from_json(encoded, source="again").to_json() == encoded


@fuzz_settings(300)
@given(data=st.data())
def test_manifest_parser(layers, data):
    check_manifest(data.draw(json_documents([layer.manifest for layer in layers])))


def check_ref(text: str) -> None:
    outcome = bounded(lambda: parse_ref(text), allowed=InputError, input_size=len(text))
    if not isinstance(outcome, InputError):
        name, tag = outcome
        check_key(keys.ref(name, tag), "ref")
        assert parse_ref(f"{name}:{tag}") == (name, tag)
        assert all(0x20 <= ord(c) != 0x7F for c in name + tag) and ".." not in name + tag


REF_ALPHABET = st.sampled_from(list("aZ09._-/:") + ["..", "\x00", "\x7f", "é", "\n", "/" * 2])


@fuzz_settings(300)
@given(text=st.one_of(st.text(max_size=300), st.lists(REF_ALPHABET, max_size=80).map("".join)))
def test_parse_ref(text):
    check_ref(text)


def prefetch_seeds() -> list[bytes]:
    entries = [PrefetchEntry(chunk=i, digest=sha256(b"%d" % i), offset=i * BLOCK, length=BLOCK - i,
                             first_read_us=1000 * i, traces=1 + i % 3) for i in range(4)]
    listed = PrefetchList(layer="ab" * 32, chunk_size=1 << 20, traces=3, min_fraction=0.5, entries=entries)
    empty = PrefetchList(layer="cd" * 32, chunk_size=4096, traces=0, min_fraction=1, entries=[])
    return [listed.to_json(), empty.to_json()]


def check_prefetch_list(data: bytes, directory: str) -> None:
    path = os.path.join(directory, "list.json")
    with open(path, "wb") as f:
        f.write(data)
    outcome = bounded(lambda: prefetch_list.load(path), allowed=(FormatError, UnsupportedError),
                      input_size=len(data))
    note(outcome)
    if isinstance(outcome, PrefetchList):
        assert PrefetchList.from_json(outcome.to_json(), source="again") == outcome


@fuzz_settings(250)
@given(data=json_documents(prefetch_seeds()))
def test_prefetch_list_loader(data):
    check_prefetch_list(data, SCRATCH.name)


# ---------------------------------------------------------------------------------------------------------
# Build info.

LAYER = "5e" * 32


def buildinfo_seeds() -> list[bytes]:
    tree = Tree()
    for i, path in enumerate([b"a", b"d/b", b"d/e/" + b"f" * 200, b"\xff\xfe", b"z"]):
        mode = stat.S_IFREG | 0o644
        tree.add(path, Node(mode=mode, size=i + 1, identity=(7, 100 + i, i + 1, 5 * i, 10 * i, mode)))
    entries = [(path, node.identity or (7, 200, 0, 0, 45, node.mode)) for path, node in tree.walk()]
    root = [(b"", (7, 99, 0, 0, 5, stat.S_IFDIR | 0o755))]
    return [encode_buildinfo(entries, [0, 3], LAYER, 10**19), encode_buildinfo(entries, [], LAYER, 40),
            encode_buildinfo(root, [], LAYER, 10**19)]


def wrap_buildinfo(body: bytes, count: int, shared: int, layer: bytes) -> bytes:
    """A build-info object around ``body``, header fields all consistent with it."""
    frame = compress.compress(body)
    return BUILDINFO_HEADER.pack(b"DSECBINF", 2, count, shared, 0, len(body), sha256(frame), layer) + frame


@st.composite
def buildinfos(draw) -> bytes:
    seeds = buildinfo_seeds()
    if draw(st.booleans(), label="mutate the body, rewrap"):
        seed = draw(st.sampled_from(seeds), label="seed")
        count, shared = struct.unpack_from("<II", seed, 12)
        body = compress.decompress(seed[BUILDINFO_HEADER.size:], struct.unpack_from("<Q", seed, 24)[0], what="seed")
        body = draw(mutations([body, body + body])) if body else draw(st.binary(max_size=200))
        count = draw(st.sampled_from([count, count + 1, max(count - 1, 0), 2 * count, 0xFFFFFFFF]), label="count")
        shared = draw(st.sampled_from([shared, shared + 1, max(shared - 1, 0), 0xFFFFFFFF]), label="shared")
        return wrap_buildinfo(body, count, shared, bytes.fromhex(LAYER))
    return draw(inputs(seeds, max_random=512))


def check_buildinfo(data: bytes) -> None:
    layer = data[64:96].hex() if len(data) >= 96 else LAYER
    outcome = bounded(lambda: decode_buildinfo(data, layer=layer, source="buildinfo"), allowed=FormatError,
                      input_size=len(data))
    note(outcome)
    if not isinstance(outcome, FormatError):
        body = b"".join([*(BUILDINFO_RECORD.pack(*identity) for identity in outcome.identities), outcome.racy,
                         *(BUILDINFO_SHARED.pack(index) for index in outcome.shared),
                         *(path + b"\0" for path in outcome.paths)])
        assert body == compress.decompress(data[BUILDINFO_HEADER.size:], len(body), what="buildinfo"), \
            "build info that decodes must be exactly its entries' encoding"


@fuzz_settings(300)
@given(data=buildinfos())
def test_buildinfo_decoder(data):
    check_buildinfo(data)


# ---------------------------------------------------------------------------------------------------------
# Access traces.


def trace_seeds(directory: str) -> list[bytes]:
    seeds = []
    for n, mode in ((0, "kernel"), (5, "fuse")):
        path = os.path.join(directory, f"seed-{n}")
        writer = TraceWriter(path, TraceHeader(layer="ab" * 32, ref="base/x:1", role="base", mode=mode,
                                               chunk_size=4096, started_ns=1))
        for i in range(n):
            writer.record(nid=i, offset=i * 4096, length=4096, chunk=i or 0xFFFFFFFF, latency_us=i * 10,
                          flags=i % 16, time_ns=i * 1000)
        writer.close()
        with open(path, "rb") as f:
            seeds.append(f.read())
    return seeds


TRACE_SEEDS = trace_seeds(SCRATCH.name)


@st.composite
def traces(draw) -> bytes:
    if draw(st.booleans(), label="mutate the header as JSON"):
        seed = draw(st.sampled_from(TRACE_SEEDS), label="seed")
        length = struct.unpack_from("<I", seed, 8)[0]
        header = draw(json_documents([seed[12:12 + length]]))
        return seed[:8] + struct.pack("<I", len(header)) + header + seed[12 + length:]
    return draw(inputs(TRACE_SEEDS, max_random=1024))


def check_trace(data: bytes, directory: str, strict: bool) -> None:
    path = os.path.join(directory, "trace")
    with open(path, "wb") as f:
        f.write(data)
    outcome = bounded(lambda: read_trace(path, strict=strict), allowed=(FormatError, UnsupportedError),
                      input_size=len(data))
    note(outcome)
    if isinstance(outcome, (FormatError, UnsupportedError)):
        return
    header_end = 12 + struct.unpack_from("<I", data, 8)[0]
    records, partial = divmod(len(data) - header_end, RECORD.size)
    assert len(outcome.records) == records and outcome.truncated == bool(partial) and not (strict and partial)
    assert all(not record.flags & ~TRACE_FLAGS for record in outcome.records)
    for name, spec in TraceHeader.__dataclass_fields__.items():
        assert type(getattr(outcome.header, name)) is (int if spec.type in ("int", int) else str), name


@fuzz_settings(300)
@given(data=traces(), strict=st.booleans())
def test_trace_reader(data, strict):
    check_trace(data, SCRATCH.name, strict)


# ---------------------------------------------------------------------------------------------------------
# The corpus: inputs that once broke a parser, replayed with the same checks.

CHECKS = {
    "erofs": lambda data, layers: check_image(data, None) if not _needs_blob(data) else _with_blob(data, layers),
    "pack-index": lambda data, _layers: check_index(data),
    "pack": lambda data, _layers: check_pack(data),
    "chunk-read": lambda data, _layers: replay_chunk_read(data),
    "zstd": lambda data, _layers: check_decompress(data[4:], struct.unpack_from("<I", data)[0]),
    "blobmap": lambda data, _layers: check_blobmap(data),
    "manifest": lambda data, _layers: check_manifest(data),
    "ref": lambda data, _layers: check_ref(data.decode("utf-8", "surrogateescape")),
    "prefetch-list": lambda data, _layers: check_prefetch_list(data, SCRATCH.name),
    "buildinfo": lambda data, _layers: check_buildinfo(data),
    "trace": lambda data, _layers: check_trace(data, SCRATCH.name, strict=False),
}


def _with_blob(meta: bytes, layers) -> None:
    with layers[0].blob() as blob:
        check_image(meta, blob)


@pytest.mark.parametrize("path", [path for parser in CHECKS for path in corpus_cases(parser)],
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_corpus(path, layers):
    CHECKS[path.parent.name](path.read_bytes(), layers)
