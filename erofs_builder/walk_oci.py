"""OCI images as build input: an OCI image layout (a directory, or a tar of one as `docker save` writes
since Docker 25) or a docker-archive (`docker save` / skopeo docker-archive: manifest.json with Layers).
A registry is a source of the same kind (walk_registry.py: it gives this module's ImageSource).

We pick the image for ``platform`` (and, in a layout holding several, for a ``tag``: the index entry's
org.opencontainers.image.ref.name) from the image index (nested indexes included), check that every blob
we read (nested indexes, manifest, config, layers) has the sha256 and size its descriptor names
(IntegrityError naming the blob), and walk the layers, bottom first, each as a tar stream (walk_tar).

Two results:
- ``flatten=True``: one Tree, the image's root filesystem. OCI whiteouts are applied: ``.wh.NAME`` deletes
  NAME from the layers below, ``.wh..wh..opq`` hides everything the layers below have in its directory.
  A whiteout never hides an entry of its own layer (OCI image spec, layer.md).
- ``flatten=False``: one Tree per layer, bottom first, ready to be stacked by OverlayFS (lowerdir lists the
  top layer first): whiteouts become character devices 0:0 named NAME, opaque directories get the xattr
  trusted.overlay.opaque = "y", and so does a directory the layer deletes below and makes again itself.
  A directory a layer only implies (its entries arrive without it) takes the attributes the layers below
  show for it, since in overlay the upper one's attributes win; both results agree on every attribute.

Streaming: each layer's content is read once, while its tar is walked, so the build's per-file function
(``on_file``, see walk_tar) is called for every regular file of every layer as it streams by; a file that
a later layer deletes has been chunked for nothing, which is the price of reading each blob once. The
digest of a layer is known only at its end: a tampered layer raises IntegrityError after its files went
through ``on_file``, before walk_oci returns, so nothing is published. ``open_oci_image`` gives the image
(its config and layer list) without walking it; ``walk_layers`` walks such a list.

Unsupported (UnsupportedError naming the descriptor): unknown media types of manifests, configs and
layers, foreign / non-distributable layers, digests other than sha256. The archive form of a layout or
docker-archive must be a plain tar (it is read at random offsets; ``tarfile`` indexes it, and every blob
taken from it is verified by digest, so a hostile container tar cannot smuggle content in).

Threads: everything runs in the calling thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from dsec_fs.errors import InputError, IntegrityError, NotFoundError, UnsupportedError

from .tree import Node, Tree, make_dir
from .limits import DEFAULT_LIMITS, LayerBudget, TarLimits
from .walk_tar import OnFile, fill_tree, tar_nodes

log = logging.getLogger(__name__)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = {OCI_INDEX, DOCKER_MANIFEST_LIST}
MANIFEST_TYPES = {OCI_MANIFEST, DOCKER_MANIFEST}
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
CONFIG_TYPES = {OCI_CONFIG, DOCKER_CONFIG}
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
}
FOREIGN_LAYER_TYPES = {
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}
# docker-archive layers have no descriptor; they are uncompressed tars (or compressed ones: we sniff).
DOCKER_ARCHIVE_LAYER = "application/vnd.docker.image.rootfs.diff.tar"

WHITEOUT_PREFIX = b".wh."
OPAQUE_MARKER = b".wh..wh..opq"
OVERLAY_OPAQUE_XATTR = b"trusted.overlay.opaque"
MAX_JSON_SIZE = 4 << 20  # manifests, indexes and configs (registries refuse manifests over 4 MiB)
MAX_INDEX_NESTING = 4
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
# How docker-archives name blobs by digest: "<hex>.tar" / "<hex>.json" (skopeo, docker < 25) or
# "blobs/sha256/<hex>" (docker >= 25). Legacy "<layer id>/layer.tar" is not a digest: see _docker_image.
_NAMED_BY_DIGEST = re.compile(r"(?:blobs/sha256/)?([0-9a-f]{64})(?:\.tar|\.json)?")


@dataclass(frozen=True)
class OciLayer:
    """One layer blob of the chosen image, bottom layer first in the lists this module returns."""

    digest: str  # "sha256:<hex>": the bytes ``open`` gives must hash to this
    media_type: str
    size: int  # bytes of the blob (compressed, if it is)
    # A context manager giving the blob as a stream (VerifiedBlob): leaving the ``with`` normally, or
    # with an InputError, reads the rest of the blob and raises IntegrityError if its size or sha256
    # differs from the descriptor.
    open: Callable[[], VerifiedBlob]


@dataclass(frozen=True)
class OciImage:
    """The image chosen from a source: its config as stored (so that it can be copied byte for byte) and
    its layers, bottom first. A docker-archive's config has no descriptor: its media type is Docker's."""

    where: str
    config_media_type: str
    config_digest: str
    config_data: bytes
    layers: list[OciLayer]


class VerifiedBlob:
    """A blob read as a stream and hashed as it goes; ``verify`` reads what is left and checks it all."""

    def __init__(self, raw: BinaryIO, digest: str, size: int, where: str):
        self._raw = raw
        self._expected_hex = _digest_hex(digest, where)
        self._size = size
        self._hash = hashlib.sha256()
        self._read = 0
        self.where = where
        self.name = where  # walk_tar names a stream by its ``name`` in errors

    def read(self, n: int = -1) -> bytes:
        left = self._size - self._read
        data = self._raw.read(left if n < 0 else min(n, left))
        self._hash.update(data)
        self._read += len(data)
        return data

    def verify(self) -> None:
        while self.read(1 << 20):
            pass
        if self._read != self._size:
            raise IntegrityError(f"blob has {self._read} bytes, its descriptor says {self._size}", where=self.where)
        if self._hash.hexdigest() != self._expected_hex:
            raise IntegrityError(
                f"sha256 is {self._hash.hexdigest()}, the descriptor says {self._expected_hex}", where=self.where
            )

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> VerifiedBlob:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            # A damaged blob is an IntegrityError, whatever a parser made of it: verify on InputError too.
            if exc_type is None or issubclass(exc_type, InputError):
                self.verify()
        finally:
            self.close()


# ---------------------------------------------------------------------------------------------------------
# Where blobs come from: a directory, or a tar of one.


class _Directory:
    def __init__(self, root: str):
        self.root = root

    def size(self, name: str) -> int | None:
        try:
            st = os.stat(os.path.join(self.root, name))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def open(self, name: str) -> BinaryIO:
        return open(os.path.join(self.root, name), "rb", buffering=1 << 20)


class _ArchiveSlice:
    """Bytes [offset, offset + size) of a file, as a stream."""

    def __init__(self, path: str, offset: int, size: int):
        self._file = open(path, "rb", buffering=1 << 20)
        self._file.seek(offset)
        self._left = size

    def read(self, n: int = -1) -> bytes:
        data = self._file.read(self._left if n < 0 else min(n, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()


class _Archive:
    """A plain tar holding a layout or a docker-archive; tarfile indexes its members (headers only)."""

    def __init__(self, path: str):
        self.path = path
        self._members: dict[str, tuple[int, int]] = {}  # name -> (data offset, size)
        try:
            with tarfile.open(path, "r:") as archive:
                previous = -1  # offset of the previous member's header
                for member in archive:
                    # A negative size field sends tarfile back to an earlier header: it would loop forever.
                    if member.size < 0 or member.offset <= previous:
                        raise InputError(f"member {member.name[:64]!r} at offset {member.offset} has a negative size",
                                         where=path)
                    previous = member.offset
                    if member.isreg() and not member.sparse:
                        self._members[_clean_name(member.name)] = (member.offset_data, member.size)
        except (tarfile.TarError, OSError, ValueError, OverflowError) as exc:
            # tarfile seeks past a member's data by its size field: a huge one is a ValueError or
            # OverflowError from the seek, not a TarError.
            raise InputError(f"not a readable (uncompressed) tar archive: {exc}", where=path) from None

    def size(self, name: str) -> int | None:
        member = self._members.get(name)
        return None if member is None else member[1]

    def open(self, name: str) -> BinaryIO:
        offset, size = self._members[name]
        return _ArchiveSlice(self.path, offset, size)


def _clean_name(name: str) -> str:
    return "/".join(part for part in name.split("/") if part not in ("", "."))


class ImageSource(Protocol):
    """Where an image's documents and blobs come from (a layout here, a registry in walk_registry.py).
    ``where`` names the source in errors; every method checks what it returns against the descriptor."""

    where: str

    def read_document(self, descriptor: Descriptor, what: str) -> bytes:
        """An index or manifest named by a descriptor (at most MAX_JSON_SIZE bytes)."""

    def read_blob(self, descriptor: Descriptor, what: str) -> bytes:
        """A config blob (at most MAX_JSON_SIZE bytes)."""

    def open_layer(self, descriptor: Descriptor) -> VerifiedBlob:
        """A layer blob as a stream, verified as it is read (see OciLayer)."""


class _Source:
    """Named files of a layout or docker-archive, each opened as a VerifiedBlob (an ImageSource)."""

    def __init__(self, path: str):
        self.path = path
        self.where = path
        if os.path.isdir(path):
            self._files = _Directory(path)
        elif os.path.isfile(path):
            self._files = _Archive(path)
        else:
            raise InputError("no such directory or file", where=path)

    def size(self, name: str) -> int | None:
        """Bytes of file ``name``; None if there is no such (regular) file."""
        return self._files.size(name)

    def existing_size(self, name: str, where: str) -> int:
        if ".." in name.split("/") or name.startswith("/"):
            raise InputError(f"file name {name!r} leaves the image", where=where)
        if "\0" in name:
            raise InputError(f"file name {name!r} contains NUL", where=where)
        size = self.size(name)
        if size is None:
            raise InputError("missing from the image", where=where)
        return size

    def _open_raw(self, name: str, where: str) -> BinaryIO:
        try:
            return self._files.open(name)
        except OSError as exc:
            raise InputError(f"cannot open: {exc.strerror}", where=where) from None

    def open(self, name: str, digest: str, size: int | None, what: str) -> VerifiedBlob:
        """File ``name`` as a stream that must hash to ``digest`` (and have ``size`` bytes, if given)."""
        where = f"{self.path}: {what} ({name})"
        actual = self.existing_size(name, where)
        if size is not None and actual != size:
            raise IntegrityError(f"blob has {actual} bytes, its descriptor says {size}", where=where)
        return VerifiedBlob(self._open_raw(name, where), digest, actual, where)

    def read_bytes(self, name: str, digest: str | None, what: str) -> bytes:
        """A small file, verified against ``digest`` unless it is one of the layout's unhashed files."""
        where = f"{self.path}: {what} ({name})"
        if self.existing_size(name, where) > MAX_JSON_SIZE:
            raise InputError(f"more than {MAX_JSON_SIZE} bytes of JSON", where=where)
        if digest is None:
            f = self._open_raw(name, where)
            try:
                return f.read()
            finally:
                f.close()
        with self.open(name, digest, None, what) as blob:
            return blob.read()

    def read_json(self, name: str, digest: str | None, what: str):
        return parse_json(self.read_bytes(name, digest, what), f"{self.path}: {what} ({name})")

    def read_document(self, descriptor: Descriptor, what: str) -> bytes:
        return self.read_bytes(descriptor.blob, descriptor.digest, what)

    read_blob = read_document

    def open_layer(self, descriptor: Descriptor) -> VerifiedBlob:
        return self.open(descriptor.blob, descriptor.digest, descriptor.size, f"layer {descriptor.digest}")


def parse_json(data: bytes, where: str):
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"not valid JSON: {exc}", where=where) from None


# ---------------------------------------------------------------------------------------------------------
# JSON documents.


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: tuple[str, str, str | None] | None  # (os, architecture, variant)
    ref_name: str | None = None  # the org.opencontainers.image.ref.name annotation (a layout's tag)

    @property
    def blob(self) -> str:
        return "blobs/sha256/" + self.digest.removeprefix("sha256:")  # the digest was checked

    def describe(self) -> str:
        return f"{self.media_type} {self.digest}"


def _field(obj, key: str, kind: type, where: str, *, optional: bool = False):
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"field {key!r} is missing or not a {kind.__name__}", where=where)
    return value


def parse_descriptor(obj, where: str) -> Descriptor:
    media_type = _field(obj, "mediaType", str, where)
    digest = _field(obj, "digest", str, where)
    size = _field(obj, "size", int, where)
    if size < 0:
        raise InputError(f"negative size in descriptor {digest}", where=where)
    _digest_hex(digest, f"{where}: descriptor {media_type}")
    platform = _field(obj, "platform", dict, where, optional=True)
    if platform is not None:
        variant = _field(platform, "variant", str, where, optional=True)
        platform = (_field(platform, "os", str, where), _field(platform, "architecture", str, where), variant)
    annotations = _field(obj, "annotations", dict, where, optional=True) or {}
    ref_name = annotations.get(REF_NAME_ANNOTATION)
    return Descriptor(media_type, digest, size, platform, ref_name if isinstance(ref_name, str) else None)


def _digest_hex(digest: str, where: str) -> str:
    match = _DIGEST.fullmatch(digest)
    if match:
        return match.group(1)
    if not digest.startswith("sha256:") and re.fullmatch(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+", digest):
        raise UnsupportedError(f"digest {digest!r}: only sha256 is supported", where=where)
    raise InputError(f"malformed digest {digest!r}", where=where)


def parse_platform(platform: str) -> tuple[str, str, str | None]:
    parts = platform.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise InputError(f"platform {platform!r} is not os/architecture[/variant]", where="platform")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def _platform_name(platform: tuple[str, str, str | None]) -> str:
    return "/".join(part for part in platform if part)


def _matches(have: tuple[str, str, str | None], want: tuple[str, str, str | None]) -> bool:
    return have[:2] == want[:2] and (want[2] is None or have[2] == want[2])


# ---------------------------------------------------------------------------------------------------------
# Choosing the image and its layers.


def oci_layer_streams(path: str | os.PathLike, platform: str = "linux/amd64") -> list[OciLayer]:
    """The layers of the image for ``platform`` in the layout or docker-archive at ``path``, bottom first."""
    return open_oci_image(path, platform).layers


def open_oci_image(path: str | os.PathLike, platform: str = "linux/amd64", tag: str | None = None) -> OciImage:
    """The image for ``platform`` (and ``tag``, in a layout) in the layout or docker-archive at ``path``.

    Manifests, indexes and the config are read and verified here; each layer is verified while it is read
    through its ``open()`` (see OciLayer).
    """
    source = _Source(os.fspath(path))
    want = parse_platform(platform)
    if source.size("index.json") is not None:
        return _oci_image(source, want, tag)
    if source.size("manifest.json") is not None:
        if tag is not None:
            raise InputError(f"a docker-archive has no tags to choose {tag!r} from", where=source.path)
        return _docker_image(source, want)
    raise InputError("neither an OCI layout (index.json) nor a docker-archive (manifest.json)", where=source.path)


def _oci_image(source: _Source, want: tuple[str, str, str | None], tag: str | None) -> OciImage:
    layout = source.read_json("oci-layout", None, "oci-layout")
    version = _field(layout, "imageLayoutVersion", str, f"{source.path}: oci-layout")
    if version != "1.0.0":
        raise UnsupportedError(f"image layout version {version!r}", where=f"{source.path}: oci-layout")
    index = source.read_json("index.json", None, "index.json")
    return image_from_index(source, index, "index.json", want, tag)


def image_from_index(source: ImageSource, index, what: str, want: tuple[str, str, str | None],
                     tag: str | None = None) -> OciImage:
    """The image for ``want`` that an index leads to; with ``tag``, among the index's entries of that
    ref name only (a layout's tags)."""
    return image_from_manifest(source, manifest_in_index(source, index, what, want, tag), want)


def manifest_in_index(source: ImageSource, index, what: str, want: tuple[str, str, str | None],
                      tag: str | None = None) -> Descriptor:
    """The descriptor of the image manifest for ``want`` (and ``tag``) that an index leads to."""
    where = f"{source.where}: {what}"
    entries = [parse_descriptor(entry, where) for entry in _field(index, "manifests", list, where)]
    if tag is not None:
        tagged = [d for d in entries if d.ref_name == tag]
        if not tagged:
            tags = sorted({d.ref_name for d in entries if d.ref_name is not None})
            raise NotFoundError(f"no image tagged {tag!r}; the tags are {tags or 'none'}", where=source.where)
        entries = tagged
    return _choose_manifest(source, _candidates(source, entries, where, 0, set()), want)


def image_from_manifest(source: ImageSource, descriptor: Descriptor, want: tuple[str, str, str | None]) -> OciImage:
    """The image an image manifest describes: its config read and checked against ``want``."""
    what = f"manifest {descriptor.digest}"
    where = f"{source.where}: {what}"
    manifest = parse_json(source.read_document(descriptor, what), where)
    if _field(manifest, "schemaVersion", int, where) != 2:
        raise UnsupportedError(f"manifest schemaVersion {manifest['schemaVersion']}", where=where)
    config_descriptor = parse_descriptor(_field(manifest, "config", dict, where), where)
    if config_descriptor.media_type not in CONFIG_TYPES:
        raise UnsupportedError(f"config of media type {config_descriptor.media_type!r}", where=where)
    config_what = f"config {config_descriptor.digest}"
    config_data = source.read_blob(config_descriptor, config_what)
    _check_config_platform(parse_json(config_data, f"{source.where}: {config_what}"), want, where)
    layers = []
    for entry in _field(manifest, "layers", list, where):
        layer = parse_descriptor(entry, where)
        if layer.media_type in FOREIGN_LAYER_TYPES:
            raise UnsupportedError(f"foreign (non-distributable) layer {layer.describe()}", where=where)
        if layer.media_type not in LAYER_TYPES:
            raise UnsupportedError(f"layer of unknown media type: {layer.describe()}", where=where)
        layers.append(OciLayer(layer.digest, layer.media_type, layer.size,
                               functools.partial(source.open_layer, layer)))
    return OciImage(source.where, config_descriptor.media_type, config_descriptor.digest, config_data, layers)


def _candidates(source: ImageSource, entries: list[Descriptor], where: str, depth: int,
                seen: set[str]) -> list[Descriptor]:
    """Every image manifest an index's entries lead to, nested indexes followed (their blobs verified).
    ``seen`` holds the digests of nested indexes already read: each is read once, however often named."""
    found = []
    for descriptor in entries:
        if descriptor.media_type in INDEX_TYPES:
            if descriptor.digest in seen:
                continue
            seen.add(descriptor.digest)
            if depth >= MAX_INDEX_NESTING:
                raise InputError(f"image indexes nested more than {MAX_INDEX_NESTING} deep", where=where)
            child_where = f"{source.where}: index {descriptor.digest}"
            child = parse_json(source.read_document(descriptor, f"index {descriptor.digest}"), child_where)
            children = [parse_descriptor(entry, child_where)
                        for entry in _field(child, "manifests", list, child_where)]
            found += _candidates(source, children, child_where, depth + 1, seen)
        elif descriptor.media_type in MANIFEST_TYPES:
            found.append(descriptor)
        else:
            raise UnsupportedError(f"unknown media type in an image index: {descriptor.describe()}", where=where)
    return found


def _choose_manifest(source: ImageSource, candidates: list[Descriptor], want) -> Descriptor:
    """The one manifest for ``want``: among those labelled with a platform, else among unlabelled ones."""
    labelled = [d for d in candidates if d.platform is not None and _matches(d.platform, want)]
    unlabelled = [d for d in candidates if d.platform is None]
    chosen = {d.digest: d for d in (labelled or unlabelled)}
    if len(chosen) == 1:
        return next(iter(chosen.values()))
    platforms = sorted({_platform_name(d.platform) for d in candidates if d.platform is not None})
    if not chosen:
        raise InputError(
            f"no image for platform {_platform_name(want)}; the image has {platforms or 'none'}", where=source.where
        )
    tags = sorted({d.ref_name for d in chosen.values() if d.ref_name is not None})
    raise InputError(
        f"{len(chosen)} different images for platform {_platform_name(want)} ({sorted(chosen)}); "
        + (f"choose one of the tags {tags} (oci:DIR:TAG)" if tags else "keep one in the layout"),
        where=source.where,
    )


def _check_config_platform(config, want, where: str) -> None:
    if not isinstance(config, dict):
        raise InputError("the image config is not a JSON object", where=where)
    os_name, architecture = config.get("os"), config.get("architecture")
    if isinstance(os_name, str) and isinstance(architecture, str) and (os_name, architecture) != want[:2]:
        raise InputError(f"the image is for {os_name}/{architecture}, not {_platform_name(want)}", where=where)


def _docker_image(source: _Source, want: tuple[str, str, str | None]) -> OciImage:
    where = f"{source.path}: manifest.json"
    images = source.read_json("manifest.json", None, "manifest.json")
    if not isinstance(images, list) or len(images) != 1:
        images = images if isinstance(images, list) else []
        tags = [image.get("RepoTags") for image in images if isinstance(image, dict)]
        raise InputError(f"a docker-archive with exactly one image is needed, not {tags}", where=where)
    image = images[0]
    config_name = _field(image, "Config", str, where)
    named = _NAMED_BY_DIGEST.fullmatch(config_name)
    if named is None:
        raise UnsupportedError(f"config {config_name!r} is not named by its digest: cannot verify it", where=where)
    config_digest = "sha256:" + named.group(1)
    config_data = source.read_bytes(config_name, config_digest, "config")
    config_where = f"{source.path}: config ({config_name})"
    config = parse_json(config_data, config_where)
    _check_config_platform(config, want, where)
    diff_ids = _field(_field(config, "rootfs", dict, config_where), "diff_ids", list, config_where)
    names = _field(image, "Layers", list, where)
    if not all(isinstance(item, str) for item in names + diff_ids):
        raise InputError("Layers and diff_ids must be lists of strings", where=where)
    if len(names) != len(diff_ids):
        raise InputError(f"{len(names)} layers but {len(diff_ids)} diff_ids in the config", where=where)
    foreign = _field(image, "LayerSources", dict, where, optional=True) or {}
    layers = []
    for name, diff_id in zip(names, diff_ids):
        if _field(foreign.get(diff_id), "mediaType", str, where, optional=True) in FOREIGN_LAYER_TYPES:
            raise UnsupportedError(f"foreign layer {diff_id}", where=where)
        # A layer named by digest must hash to it; a legacy "<id>/layer.tar" is the uncompressed layer,
        # so it hashes to its diff_id.
        named = _NAMED_BY_DIGEST.fullmatch(name)
        digest = "sha256:" + named.group(1) if named else diff_id
        size = source.existing_size(name, f"{source.path}: layer {digest} ({name})")
        opener = functools.partial(source.open, name, digest, None, f"layer {digest}")
        layers.append(OciLayer(digest, DOCKER_ARCHIVE_LAYER, size, opener))
    return OciImage(source.path, DOCKER_CONFIG, config_digest, config_data, layers)


# ---------------------------------------------------------------------------------------------------------
# Layers and whiteouts.


@dataclass
class _LayerChanges:
    """One walked layer: its own entries, and what it hides in the layers below."""

    tree: Tree = field(default_factory=Tree)
    whiteouts: list[tuple[bytes, Node]] = field(default_factory=list)  # (path hidden, the .wh. member)
    opaque_dirs: list[bytes] = field(default_factory=list)  # directories whose lower contents are hidden
    # id() -> node, of the nodes that came from members (other directories are implied); holding the
    # nodes keeps their ids from being reused by nodes made later.
    members: dict[int, Node] = field(default_factory=dict)


def _walk_layer(layer: OciLayer, on_file: OnFile | None, lenient: bool, limits: TarLimits,
                budget: LayerBudget | None) -> _LayerChanges:
    changes = _LayerChanges()
    with layer.open() as blob:
        nodes = tar_nodes(blob, source=blob.where, lenient=lenient, limits=limits)
        fill_tree(changes.tree, _split_whiteouts(nodes, changes, lenient), on_file=on_file, lenient=lenient,
                  budget=budget)
    return changes


def _split_whiteouts(nodes, changes: _LayerChanges, lenient: bool):
    """Pass the layer's entries on; record its whiteouts and opaque markers instead of passing them."""
    for path, node in nodes:
        parent, _, name = path.rpartition(b"/")
        if not name.startswith(WHITEOUT_PREFIX):
            changes.members[id(node)] = node
            yield path, node
        elif name == OPAQUE_MARKER:
            changes.opaque_dirs.append(parent)
        elif name.startswith(WHITEOUT_PREFIX * 2):
            pass  # other ".wh..wh." names are AUFS bookkeeping (.wh..wh.plnk, .wh..wh.aufs), not content
        elif name[len(WHITEOUT_PREFIX) :] in (b"", b".", b".."):
            if not lenient:
                raise InputError(f"whiteout {name!r} names no entry", where=node.source)
            log.warning("%s: whiteout %r names no entry: skipped", node.source, name)
        else:
            hidden = name[len(WHITEOUT_PREFIX) :]
            changes.whiteouts.append((parent + b"/" + hidden if parent else hidden, node))


def _apply(merged: Tree, changes: _LayerChanges) -> None:
    """Put one layer over ``merged``, the tree of the layers below it."""
    # Whiteouts and opaque markers hide lower content only, never the layer's own: apply them first.
    for directory in changes.opaque_dirs:
        below = merged.lookup(directory)
        if below is not None and below.is_dir:
            below.children = {}
    for path, _marker in changes.whiteouts:
        merged.remove(path)
    for path, node in list(changes.tree.walk()):  # a list: merged.add rewires directories' children
        if node.is_dir and id(node) not in changes.members:
            below = merged.lookup(path)
            if below is not None and below.is_dir:
                continue  # a directory the layer only implies keeps the attributes it has below
        merged.add(path, node)


def _overlay_layer(changes: _LayerChanges, lower_dirs: dict[bytes, Node]) -> Tree:
    """The layer as an OverlayFS lower layer. ``lower_dirs`` maps a path to the directory Node that the
    layers below, stacked, show there; it is updated to include this layer."""
    tree = changes.tree
    opaque_dirs = list(changes.opaque_dirs)
    for path, marker in changes.whiteouts:
        own = tree.lookup(path)
        if own is None:
            whiteout = Node(mode=stat.S_IFCHR, uid=marker.uid, gid=marker.gid, mtime_ns=marker.mtime_ns,
                            source=marker.source)  # fmt: skip
            tree.add(path, whiteout)
        elif own.is_dir:  # deleted below, then made again in this layer: hide what is below
            opaque_dirs.append(path)
        # (the layer's own non-directory of that name hides the lower one by itself)
    for directory in opaque_dirs:
        node = tree.lookup(directory)
        if node is None:
            node = make_dir()
            tree.add(directory, node)
        if node.is_dir:
            node.xattrs[OVERLAY_OPAQUE_XATTR] = b"y"
    hidden = {path for path, _marker in changes.whiteouts}
    for path in [path for path in lower_dirs if _hidden(path, hidden, set(changes.opaque_dirs))]:
        del lower_dirs[path]
    for path, node in tree.walk():
        if not node.is_dir:
            continue
        if id(node) in changes.members:
            lower_dirs[path] = node
        elif path in lower_dirs:
            below = lower_dirs[path]
            xattrs = {name: value for name, value in below.xattrs.items() if name != OVERLAY_OPAQUE_XATTR}
            if OVERLAY_OPAQUE_XATTR in node.xattrs:
                xattrs[OVERLAY_OPAQUE_XATTR] = b"y"
            node.mode, node.uid, node.gid, node.mtime_ns, node.xattrs = (
                below.mode, below.uid, below.gid, below.mtime_ns, xattrs)  # fmt: skip
    tree.finish()
    return tree


def _hidden(path: bytes, whiteouts: set[bytes], opaque_dirs: set[bytes]) -> bool:
    """Whether a layer's whiteouts hide ``path`` below it: it or an ancestor is whited out, or an
    ancestor (not the directory itself) is opaque."""
    if path in whiteouts:
        return True
    while path:
        path = path.rpartition(b"/")[0]
        if path in whiteouts or path in opaque_dirs:
            return True
    return False


def walk_oci(
    path: str | os.PathLike,
    *,
    on_file: OnFile | None,
    platform: str = "linux/amd64",
    flatten: bool = True,
    lenient: bool = False,
    limits: TarLimits = DEFAULT_LIMITS,
    budget: LayerBudget | None = None,
) -> Tree | list[Tree]:
    """The image for ``platform`` in the OCI layout or docker-archive at ``path``: one finished Tree with
    whiteouts applied (``flatten``), or one finished Tree per layer, bottom first, with overlay whiteouts.

    ``on_file`` is called for each new regular file while its content is readable, exactly as in
    walk_tar: a build passes the chunker's per-file function; None gives metadata-only Trees. ``budget``
    (see walk_tar.fill_tree) counts the entries of all the image's layers together.
    """
    return walk_layers(oci_layer_streams(path, platform), on_file=on_file, flatten=flatten, lenient=lenient,
                       limits=limits, budget=budget)


def walk_layers(
    layers: list[OciLayer],
    *,
    on_file: OnFile | None,
    flatten: bool = True,
    lenient: bool = False,
    limits: TarLimits = DEFAULT_LIMITS,
    budget: LayerBudget | None = None,
) -> Tree | list[Tree]:
    """walk_oci for an image already opened (OciImage.layers), from any source."""
    if flatten:
        merged = Tree()
        for layer in layers:
            _apply(merged, _walk_layer(layer, on_file, lenient, limits, budget))
        merged.finish()
        return merged
    lower_dirs: dict[bytes, Node] = {}
    return [_overlay_layer(_walk_layer(layer, on_file, lenient, limits, budget), lower_dirs) for layer in layers]
