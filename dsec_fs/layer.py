"""Layers on a store: the manifest, publishing a layer, refs (name:tag -> layer digest), opening a layer.

A layer is named by the sha256 of its EROFS metadata image (meta.erofs). Publishing writes, in order:
meta.erofs, the blob map, then manifest.json; the manifest's presence is what publishes the layer, and a
ref may only be set to a published layer. The chunks (packs and their indexes) are uploaded before any of
this by chunks.ChunkUploader. A crash at any point therefore leaves no manifest or ref pointing at missing
data. A reader goes the other way: ref, manifest, then meta.erofs and the blob map, each checked against
the manifest before use.

meta.erofs and the blob map are stored as one zstd frame each (manifest version 2, ``Manifest.stored``),
since every node that mounts a layer reads both whole: the stored object's size and sha256 are checked
against the manifest, then it is decompressed to exactly the size the manifest gives (no more than
MAX_METADATA_SIZE, and never past what a zstd frame of its size can hold: dsec_fs.compress), then the
result is checked against the layer digest or the blob map's sha256 as before. A version 1 manifest
(an older writer) has no ``stored``: its objects are stored as they are, and read so.

Opening a layer is on the path of every mount, and each store request is a round trip (tens of ms on
a remote store), so ``open_layer`` makes only the round trips that depend on each other one after
another: the ref, then the manifest, then meta.erofs and the blob map side by side (two threads), while
the caller's ``on_manifest`` does work that needs only the manifest (the daemon loads the layer's pack
indexes there), so that work's round trips overlap too.

Functions here are plain blocking calls on a Store and may be called from any thread; ``open_layer``
reads meta.erofs and the blob map in two threads of its own, ``publish_layer`` (and ``store_metadata``,
the first of its two steps for a caller that writes the manifest later with ``publish_stored``) writes
them through ``Store.put_all`` (threads of the store's), and both wait for them before returning.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from . import compress
from .blobmap import encoded_size, max_entries
from .digest import is_hex_digest, sha256, to_hex
from .errors import CorruptError, FormatError, InputError, IntegrityError, NotFoundError, UnsupportedError
from .spill import SpillFile
from .store import keys
from .store.base import Store, get_small

MANIFEST_VERSION = 2  # 2: meta.erofs and the blob map are stored zstd-compressed (``Manifest.stored``)
READABLE_VERSIONS = (1, 2)
# The most metadata this reader decompresses for one object: a layer of ~10 million inodes. A manifest
# may name any size; this keeps a lying one from making a reader allocate without limit.
MAX_METADATA_SIZE = 4 << 30
# The most a manifest or a ref may hold (ours are under 2 KB and 65 bytes): anyone who can write the store
# can grow one, and a reader must not read a huge object into memory to find it is not a manifest.
MAX_MANIFEST_BYTES = 1 << 20
MAX_REF_BYTES = 4096
STORED_ENCODING = "zstd"
# zstd level of meta.erofs and the blob map: on the Debian rootfs level 1 gives a smaller meta.erofs than
# level 3 (153,005 against 157,716 bytes) and a blob map 1% larger (240,425 against 238,041: digests do not
# compress), in 1.3 instead of 3 ms, which every build and rebuild pays (docs/benchmarks.md, issue 17).
METADATA_LEVEL = 1
# The largest blob map read side by side with meta.erofs (~200,000 entries; the Debian rootfs's is 250 KB).
# A larger one is read once meta.erofs is verified: until then its size bound (``check_blobmap_size``)
# rests on the manifest's meta_size, which a lying manifest may set to 4 GiB.
PARALLEL_BLOBMAP_BYTES = 8 << 20
META, BLOBMAP = "meta.erofs", "blobmap"  # the names of the two objects in ``Manifest.stored``
DEFAULT_TAG = "latest"
MAX_REF_LENGTH = 255
DIGEST_PREFIX = "sha256:"  # a layer may be named sha256:<digest or prefix>, as OCI spells digests
MIN_DIGEST_PREFIX = 4  # shortest digest prefix accepted; dsecfs prints 12 characters

# A name is slash-separated components; each starts with a letter or digit, so none is "." or a hidden
# temporary name, and none can be empty. A tag follows the OCI rule.
_NAME_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HEX_WORD = re.compile(f"[0-9A-Fa-f]{{{MIN_DIGEST_PREFIX},64}}")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(kw_only=True)
class Manifest:
    """What a reader needs to know about a layer before fetching anything else of it.

    Fields a newer writer adds are ignored by this reader; an incompatible change bumps ``version``.
    """

    version: int = MANIFEST_VERSION
    layer: str  # sha256 hex of meta.erofs: the layer's digest
    blob_id: str  # the virtual blob's id: sha256 hex of the blob map (the tag in meta.erofs's device table)
    meta_size: int  # bytes of meta.erofs
    blobmap_size: int  # bytes of the blob map
    blobmap_sha256: str  # checked when the blob map is read
    chunk_size: int  # bytes per chunk (power of two)
    block_size: int  # EROFS block size (power of two)
    blob_blocks: int  # length of the virtual blob in blocks
    packs: list[str]  # sorted ids of the packs that hold this layer's chunks
    stats: dict[str, int | float] = field(default_factory=dict)  # files, bytes, chunks, new_chunks, ...
    created: str = field(default_factory=utc_now)  # ISO-8601 UTC
    source: str = ""  # what the layer was built from (a path, a tar, an OCI reference)
    # Version 2: how meta.erofs and the blob map are stored, by object name (META, BLOBMAP): {"encoding":
    # "zstd", "size": bytes stored, "sha256": hex of the bytes stored}. Filled in by publish_layer.
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> "Manifest":
        """Parse and validate a manifest; ``source`` (the object key) is named in every error."""
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise FormatError("manifest", None, f"not JSON: {exc}", source=source) from None
        if not isinstance(obj, dict):
            raise FormatError("manifest", None, f"expected a JSON object, got {type(obj).__name__}", source=source)
        version = obj.get("version")
        if type(version) is int and version not in READABLE_VERSIONS:
            raise UnsupportedError(f"manifest version {version}, this reader knows only {READABLE_VERSIONS}",
                                   where=source)
        names = [f.name for f in fields(cls) if f.name != "stored" or version != 1]
        for name in names:
            if name not in obj:
                raise FormatError(f"manifest field {name!r}", None, "missing", source=source)
        manifest = cls(**{name: obj[name] for name in names})
        manifest.validate(source=source)
        return manifest

    def validate(self, *, source: str) -> None:
        """Raise FormatError naming the first field whose type or value is wrong."""
        for name, check in _FIELD_CHECKS.items():
            problem = check(getattr(self, name))
            if problem:
                raise FormatError(f"manifest field {name!r}", None, problem, source=source)


def _check_version(value: Any) -> str | None:
    return None if type(value) is int and value in READABLE_VERSIONS else f"expected 1 or 2, got {value!r}"


def _check_digest(value: Any) -> str | None:
    return None if isinstance(value, str) and is_hex_digest(value) else f"expected 64 lowercase hex, got {value!r}"


def _check_size(value: Any) -> str | None:
    return None if type(value) is int and value >= 0 else f"expected a non-negative integer, got {value!r}"


def _check_power_of_two(value: Any) -> str | None:
    if type(value) is int and value > 0 and value & (value - 1) == 0:
        return None
    return f"expected a power of two, got {value!r}"


def _check_packs(value: Any) -> str | None:
    if not isinstance(value, list) or not all(isinstance(p, str) and is_hex_digest(p) for p in value):
        return "expected a list of pack ids (64 lowercase hex)"
    if any(a >= b for a, b in zip(value, value[1:])):
        return "pack ids are not sorted and unique"
    return None


def _check_stats(value: Any) -> str | None:
    if isinstance(value, dict) and all(
        isinstance(k, str) and type(v) in (int, float) for k, v in value.items()
    ):
        return None
    return "expected an object of numbers"


def _check_created(value: Any) -> str | None:
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        when = None
    if when is None or when.utcoffset() != timedelta(0):
        return f"expected an ISO-8601 UTC time, got {value!r}"
    return None


def _check_text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"expected a string, got {value!r}"


def _check_stored(value: Any) -> str | None:
    if not isinstance(value, dict) or not set(value) <= {META, BLOBMAP}:
        return f"expected an object with keys among {META!r}, {BLOBMAP!r}"
    for name, how in value.items():
        if not isinstance(how, dict) or set(how) != {"encoding", "size", "sha256"}:
            return f"{name}: expected an object of encoding, size, sha256"
        if how["encoding"] != STORED_ENCODING:
            return f"{name}: unknown encoding {how['encoding']!r}"
        problem = _check_size(how["size"]) or _check_digest(how["sha256"])
        if problem:
            return f"{name}: {problem}"
    return None


_FIELD_CHECKS = {
    "version": _check_version,
    "layer": _check_digest,
    "blob_id": _check_digest,
    "meta_size": _check_size,
    "blobmap_size": _check_size,
    "blobmap_sha256": _check_digest,
    "chunk_size": _check_power_of_two,
    "block_size": _check_power_of_two,
    "blob_blocks": _check_size,
    "packs": _check_packs,
    "stats": _check_stats,
    "created": _check_created,
    "source": _check_text,
    "stored": _check_stored,
}


@dataclass(frozen=True)
class LayerFiles:
    digest: str
    manifest: Manifest
    meta: bytes
    blobmap: bytes


def compress_metadata(meta: bytes | SpillFile, blobmap: bytes) -> tuple[bytes, bytes]:
    """The zstd frames of meta.erofs and the blob map as ``publish_layer`` and ``store_metadata`` store
    them (any thread)."""
    return tuple(data.compress(METADATA_LEVEL) if isinstance(data, SpillFile)
                 else compress.compress(data, level=METADATA_LEVEL) for data in (meta, blobmap))


def publish_layer(store: Store, meta: bytes | SpillFile, blobmap: bytes, manifest: Manifest, *,
                  also: Callable[[], tuple[str, bytes]] | None = None) -> str:
    """Write meta.erofs and the blob map, each zstd-compressed, then manifest.json; returns the layer digest.
    ``meta`` may be a SpillFile (dsec_fs.spill: a fresh build's image, never whole in memory): it is
    hashed and compressed a piece at a time.

    The manifest must describe these bytes exactly (IntegrityError otherwise, before anything is written);
    its ``stored`` is filled in here, with what is written. The packs holding the layer's chunks must
    already be in the store; that is the caller's job (the ChunkUploader's flush) and is not re-checked
    here. ``also()`` makes (key, data) of another object of the layer that must be in place before the
    manifest (a directory build's build info): it runs in the calling thread while meta.erofs and the
    blob map are written (``Store.put_all``, which writes the manifest once the three are stored, and
    nothing if anything fails). Both are compressed in the calling thread, which keeps its zstd context:
    a new thread's first compression pays for a new context's memory.
    """
    digest = manifest.layer
    manifest_key = keys.layer_manifest(digest)
    manifest.validate(source=manifest_key)
    _check_bytes(meta, digest, manifest.meta_size, what=keys.layer_meta(digest))
    _check_bytes(blobmap, manifest.blobmap_sha256, manifest.blobmap_size, what=keys.layer_blobmap(digest))
    manifest.version = MANIFEST_VERSION
    written, manifest.stored = _stored(digest, compress_metadata(meta, blobmap))

    def objects() -> Iterator[tuple[str, bytes]]:
        yield from written
        if also is not None:
            yield also()

    store.put_all(objects(), (manifest_key, manifest.to_json()))
    return digest


class StoredMetadata:
    """What ``store_metadata`` stored of a layer: its digest, the sizes of meta.erofs and the blob map,
    the blob map's sha256 (the blob id) and, for the manifest, how both are stored."""

    __slots__ = ("layer", "meta_size", "blob_id", "blobmap_size", "stored")

    def __init__(self, layer: str, meta_size: int, blob_id: str, blobmap_size: int, stored: dict[str, dict[str, Any]]):
        self.layer, self.meta_size, self.blob_id, self.blobmap_size, self.stored = (
            layer, meta_size, blob_id, blobmap_size, stored)


def store_metadata(store: Store, meta: bytes, blobmap: bytes, *,
                   also: Callable[[str], tuple[str, bytes]] | None = None) -> StoredMetadata:
    """``publish_layer`` in two steps, for a caller with work left before it can write the manifest (a
    rebuild flushes its new pack meanwhile, so that the two writes' flushes overlap): this one stores
    meta.erofs and the blob map, compressed, and the object ``also(layer digest)`` makes (the build
    info), each durable (``Store.put_all``); ``publish_stored`` then writes the manifest. Until it does
    nothing names these objects: if it never comes they are garbage for gc, as after a crash in
    ``publish_layer``. Any thread (a rebuild calls it in a worker)."""
    digest = to_hex(sha256(meta))
    written, stored = _stored(digest, compress_metadata(meta, blobmap))
    if also is not None:
        written.append(also(digest))
    store.put_many(written)  # nothing names them yet: no order among them (the manifest comes later)
    return StoredMetadata(digest, len(meta), to_hex(sha256(blobmap)), len(blobmap), stored)


def publish_stored(store: Store, manifest: Manifest, metadata: StoredMetadata) -> str:
    """Write the manifest of the layer whose objects ``store_metadata`` stored (``metadata``); returns the
    layer digest. The manifest must describe them (IntegrityError otherwise, nothing written); its
    ``stored`` is filled in here. As for ``publish_layer``, the layer's packs must be in the store."""
    digest = metadata.layer
    manifest_key = keys.layer_manifest(digest)
    if (manifest.layer, manifest.meta_size, manifest.blobmap_sha256, manifest.blobmap_size) != (
            digest, metadata.meta_size, metadata.blob_id, metadata.blobmap_size):
        raise IntegrityError("the manifest does not describe the objects stored", where=manifest_key)
    manifest.validate(source=manifest_key)
    manifest.version = MANIFEST_VERSION
    manifest.stored = metadata.stored
    store.put(manifest_key, manifest.to_json())
    return digest


def _stored(digest: str, frames: tuple[bytes, bytes]) -> tuple[list[tuple[str, bytes]], dict[str, dict[str, Any]]]:
    """(key, frame) of meta.erofs and the blob map of layer ``digest``, and the manifest's ``stored`` of them."""
    written, stored = [], {}
    for (name, key), frame in zip(((META, keys.layer_meta(digest)), (BLOBMAP, keys.layer_blobmap(digest))), frames):
        stored[name] = {"encoding": STORED_ENCODING, "size": len(frame), "sha256": to_hex(sha256(frame))}
        written.append((key, frame))
    return written, stored


class LayerReads(Protocol):
    """Where open_layer reads a layer's parts: this module's read_manifest, read_meta and read_blobmap, or
    something with their signatures and guarantees (verified results) in front of them, such as the
    node daemon's copies (lazy_fetch/meta_cache.py)."""

    def manifest(self, store: Store, digest: str) -> Manifest: ...

    def meta(self, store: Store, manifest: Manifest) -> bytes: ...

    def blobmap(self, store: Store, manifest: Manifest) -> bytes: ...


def open_layer(store: Store, ref_or_digest: str, *, on_manifest: Callable[[Manifest], object] | None = None,
               reads: LayerReads | None = None) -> LayerFiles:
    """Read a published layer: manifest first, then meta.erofs and the blob map side by side, each verified
    (through ``reads`` when given); a map over PARALLEL_BLOBMAP_BYTES only once meta.erofs is, which
    verifies the meta_size its size bound rests on. ``on_manifest(manifest)`` runs in the calling thread
    once the manifest is verified, while the two are read; what it raises is raised here (after both
    reads have ended)."""
    digest = resolve(store, ref_or_digest)
    manifest = reads.manifest(store, digest) if reads else read_manifest(store, digest)
    check_blobmap_size(manifest)
    read_map = functools.partial(reads.blobmap if reads else read_blobmap, store, manifest)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="open-layer") as pool:
        meta_read = pool.submit(reads.meta if reads else read_meta, store, manifest)
        blobmap_read = pool.submit(read_map) if manifest.blobmap_size <= PARALLEL_BLOBMAP_BYTES else None
        if on_manifest is not None:
            on_manifest(manifest)
        meta = meta_read.result()
        blobmap = read_map() if blobmap_read is None else blobmap_read.result()
    return LayerFiles(digest=digest, manifest=manifest, meta=meta, blobmap=blobmap)


def read_manifest(store: Store, digest: str) -> Manifest:
    """The verified manifest of published layer ``digest`` (NotFoundError if it is not published)."""
    manifest_key = keys.layer_manifest(digest)
    try:
        manifest = manifest_at(store, manifest_key)
    except NotFoundError:
        raise NotFoundError("layer is not published (no manifest)", where=f"layer {digest}") from None
    if manifest.layer != digest:
        raise IntegrityError(f"manifest describes layer {manifest.layer}", where=manifest_key)
    return manifest


def manifest_at(store: Store, key: str) -> Manifest:
    """The manifest object ``key``, read only if it holds at most MAX_MANIFEST_BYTES (FormatError naming
    the key otherwise), not checked against its key (``read_manifest`` is)."""
    return Manifest.from_json(get_small(store, key, MAX_MANIFEST_BYTES, "manifest"), source=key)


def read_meta(store: Store, manifest: Manifest) -> bytes:
    """The layer's meta.erofs, decompressed and checked against the layer digest (any thread)."""
    return _read_object(store, manifest, META, keys.layer_meta(manifest.layer), manifest.layer, manifest.meta_size)


def read_blobmap(store: Store, manifest: Manifest) -> bytes:
    """The layer's blob map, as encoded, decompressed and checked against the manifest (any thread)."""
    check_blobmap_size(manifest)
    return _read_object(store, manifest, BLOBMAP, keys.layer_blobmap(manifest.layer), manifest.blobmap_sha256,
                        manifest.blobmap_size)


def read_blobmap_alone(store: Store, manifest: Manifest) -> bytes:
    """read_blobmap for a reader that has no use for meta.erofs (gc, layer figures): a map over
    PARALLEL_BLOBMAP_BYTES is read only once meta.erofs has been read and checked against the layer
    digest (then dropped), as open_layer reads it, so that the meta_size its size bound rests on is
    meta.erofs's own and not only the manifest's word."""
    if manifest.blobmap_size > PARALLEL_BLOBMAP_BYTES:
        read_meta(store, manifest)
    return read_blobmap(store, manifest)


def check_blobmap_size(manifest: Manifest) -> None:
    """CorruptError naming the blob map's key if the manifest gives the map more bytes than the layer can
    need: an entry per chunk of the blob, at most one per block of it and one per chunk index of meta.erofs
    (``dsec_fs.blobmap.max_entries``). Checked before the map is read: a layer cannot make a node hold a map many
    times its own metadata. ``meta_size`` is meta.erofs's own (its read checks it against the layer
    digest), so a manifest that lies about it fails that read instead: open_layer reads a map over
    PARALLEL_BLOBMAP_BYTES only after it, and so does a reader of the map alone (read_blobmap_alone)."""
    most = max_entries(manifest.meta_size, manifest.blob_blocks)
    if manifest.blobmap_size > encoded_size(most):
        raise CorruptError(f"the manifest gives the blob map {manifest.blobmap_size} bytes, more than the "
                           f"{encoded_size(most)} of the {most} entries a layer of {manifest.blob_blocks} "
                           f"blob blocks and a {manifest.meta_size}-byte meta.erofs can need",
                           where=keys.layer_blobmap(manifest.layer))


def _read_object(store: Store, manifest: Manifest, name: str, key: str, expected_hex: str, expected_size: int) -> bytes:
    how = manifest.stored.get(name)
    stored_size = expected_size if how is None else how["size"]
    if max(expected_size, stored_size) > MAX_METADATA_SIZE:
        raise UnsupportedError(f"the manifest gives {max(expected_size, stored_size)} bytes, more than this "
                               f"reader takes ({MAX_METADATA_SIZE})", where=key)
    # At most the size the manifest gives is read: a store writer may have grown the object to any size,
    # and reading all of it before comparing sizes could take all of the reader's memory.
    try:
        data = store.get_at_most(key, stored_size)
    except UnsupportedError:
        raise IntegrityError(f"larger than the {stored_size} bytes the manifest says",
                             where=key if how is None else f"{key} (as stored)") from None
    if how is not None:
        _check_bytes(data, how["sha256"], how["size"], what=f"{key} (as stored)")
        try:
            data = compress.decompress(data, expected_size, what=key)
        except CorruptError as exc:
            raise FormatError("zstd frame", None, exc.message, source=key) from None
    _check_bytes(data, expected_hex, expected_size, what=key)
    return data


def _check_bytes(data: bytes | SpillFile, expected_hex: str, expected_size: int, *, what: str) -> None:
    if len(data) != expected_size:
        raise IntegrityError(f"{len(data)} bytes, the manifest says {expected_size}", where=what)
    actual = to_hex(data.sha256() if isinstance(data, SpillFile) else sha256(data))
    if actual != expected_hex:
        raise IntegrityError(f"sha256 mismatch: expected {expected_hex}, got {actual}", where=what)


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name[:tag]`` (e.g. ``base/debian:12``) into (name, tag); the tag defaults to ``latest``."""
    where = f"ref {ref!r}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in ref):
        raise InputError("contains a control character", where=where)
    if len(ref) > MAX_REF_LENGTH:
        raise InputError(f"longer than {MAX_REF_LENGTH} characters", where=where)
    if ".." in ref:
        raise InputError("contains '..'", where=where)
    name, colon, tag = ref.partition(":")
    if not colon:
        tag = DEFAULT_TAG
    if not name:
        raise InputError("empty name", where=where)
    for component in name.split("/"):
        if not _NAME_COMPONENT.fullmatch(component):
            raise InputError(
                f"bad name component {component!r}: use letters, digits, '.', '_', '-', starting with a letter "
                "or digit", where=where,
            )
    if not tag:
        raise InputError("empty tag", where=where)
    if not _TAG.fullmatch(tag):
        raise InputError(f"bad tag {tag!r}: use letters, digits, '.', '_', '-' (at most 128)", where=where)
    if is_hex_digest(name.lower()):
        raise InputError("a ref name must not look like a layer digest", where=where)
    return name, tag


def set_ref(store: Store, ref: str, digest: str) -> None:
    """Point ``ref`` at a published layer (NotFoundError if ``digest`` has no manifest)."""
    name, tag = parse_ref(ref)
    if not is_hex_digest(digest):
        raise InputError("not a layer digest (64 lowercase hex)", where=f"digest {digest!r}")
    if not store.exists(keys.layer_manifest(digest)):
        raise NotFoundError("layer is not published (no manifest); refusing to point a ref at it",
                            where=f"layer {digest}")
    store.put(keys.ref(name, tag), keys.ref_body(digest))


def resolve(store: Store, ref_or_digest: str) -> str:
    """The digest of the layer ``ref_or_digest`` names: a digest (64 hex characters), a unique prefix of
    one (at least MIN_DIGEST_PREFIX characters, such as the 12 dsecfs prints), either with ``sha256:``
    before it, or a ``name[:tag]`` ref. A bare hex word could be a ref name too: both are looked up, and
    if they name different layers that is an error, as is a prefix of more than one layer's digest."""
    text = ref_or_digest.strip()
    hex_part = text[len(DIGEST_PREFIX):] if text.lower().startswith(DIGEST_PREFIX) else None
    if hex_part is not None or _HEX_WORD.fullmatch(text):
        word = (text if hex_part is None else hex_part).lower()
        if is_hex_digest(word):
            return word
        if hex_part is not None and not _HEX_WORD.fullmatch(word):
            raise InputError(f"expected {MIN_DIGEST_PREFIX} to 64 hex characters after {DIGEST_PREFIX!r}",
                             where=f"layer {text!r}")
        candidates = {digest: f"layer {digest}" for digest in layers_with_prefix(store, word)}
        if hex_part is None:  # also a ref name
            try:
                digest = read_ref(store, text)
                candidates.setdefault(digest, f"ref {text}:{DEFAULT_TAG} -> layer {digest}")
            except NotFoundError:
                pass
        if len(candidates) == 1:
            return next(iter(candidates))
        if not candidates:
            also = "" if hex_part is not None else f" and there is no ref {text}:{DEFAULT_TAG}"
            raise NotFoundError(f"no published layer's digest starts with {word}{also}",
                                where=f"store {store.url}")
        listed = sorted(candidates.values())
        more = f" and {len(listed) - 10} more" if len(listed) > 10 else ""
        raise InputError(f"ambiguous: {text!r} could be any of: {'; '.join(listed[:10])}{more} "
                         "(give more characters of the digest)", where=f"store {store.url}")
    return read_ref(store, text)


def read_ref(store: Store, ref: str) -> str:
    """The layer digest ``ref`` (``name[:tag]``) points at (NotFoundError naming the ref and the store)."""
    name, tag = parse_ref(ref)
    key = keys.ref(name, tag)
    try:
        data = get_small(store, key, MAX_REF_BYTES, "ref")
    except NotFoundError:
        raise NotFoundError(f"no such ref in store {store.url}", where=f"ref {name}:{tag}") from None
    return _decode_ref(data, source=key)


def layers_with_prefix(store: Store, prefix: str = "") -> list[str]:
    """The digests of the published layers (those with a manifest) that start with ``prefix``, sorted."""
    found = set()
    for key in store.list(keys.LAYERS + prefix):
        digest = key[len(keys.LAYERS):].split("/", 1)[0]
        if is_hex_digest(digest) and key == keys.layer_manifest(digest):
            found.add(digest)
    return sorted(found)


def list_refs(store: Store) -> dict[str, str]:
    """Every ref in the store, as ``name:tag`` -> layer digest."""
    refs = {}
    for key in store.list(keys.REFS):
        ref = key[len(keys.REFS):]
        try:
            parse_ref(ref)
        except InputError as exc:
            raise FormatError("ref key", None, exc.message, source=key) from None
        try:
            refs[ref] = _decode_ref(get_small(store, key, MAX_REF_BYTES, "ref"), source=key)
        except NotFoundError:
            continue  # deleted since it was listed
    return refs


def delete_ref(store: Store, ref: str) -> None:
    """Remove a ref (NotFoundError if it does not exist). The layer it pointed at stays until gc."""
    name, tag = parse_ref(ref)
    key = keys.ref(name, tag)
    if not store.exists(key):
        raise NotFoundError(f"no such ref in store {store.url}", where=f"ref {name}:{tag}")
    store.delete(key)


def _decode_ref(data: bytes, *, source: str) -> str:
    digest = keys.ref_target(data)
    if digest is None:
        text = data.decode("ascii", errors="replace").strip()
        raise FormatError("ref", None, f"expected a layer digest, got {text[:80]!r}", source=source)
    return digest
