"""A registry as build input: the image a ``docker://`` reference names, for walk_oci to walk.

The reference's manifest is fetched by tag or digest; an index (or Docker manifest list) leads to the
manifest for the platform exactly as in a layout (walk_oci.image_from_index), a manifest is the image.
Nested indexes and manifests are fetched by digest and checked against it, the config too; each layer is
streamed from the registry straight into the tar walker (no copy on disk), hashed as it goes
(walk_oci.VerifiedBlob: a corrupt layer is an IntegrityError naming its digest, raised before the build
publishes anything).

Threads: everything runs in the calling thread; layers are opened one after the other.
"""

from __future__ import annotations

from dsec_fs.errors import InputError, UnsupportedError

from .registry import ImageRef, RegistryClient, RegistryOptions
from .walk_oci import (
    INDEX_TYPES, MANIFEST_TYPES, MAX_JSON_SIZE, OCI_INDEX, OCI_MANIFEST, Descriptor, OciImage, VerifiedBlob,
    image_from_manifest, manifest_in_index, parse_json, parse_platform,
)

ACCEPTED_MANIFESTS = sorted(INDEX_TYPES | MANIFEST_TYPES)


class RegistrySource:
    """One repository of a registry as a walk_oci.ImageSource."""

    def __init__(self, ref: ImageRef, client: RegistryClient):
        self.ref = ref
        self.client = client
        self.where = str(ref)
        self._documents: dict[str, bytes] = {}  # digest -> manifest bytes already fetched (the top one)

    def top(self) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of the manifest or index the reference names."""
        data, media_type, digest = self.client.get_manifest(self.ref.repository, self.ref.reference,
                                                            ACCEPTED_MANIFESTS)
        self._documents[digest] = data
        return data, media_type, digest

    def read_document(self, descriptor: Descriptor, what: str) -> bytes:
        data = self._documents.get(descriptor.digest)
        if data is None:
            data, _media_type, _digest = self.client.get_manifest(self.ref.repository, descriptor.digest,
                                                                  ACCEPTED_MANIFESTS)
            self._documents[descriptor.digest] = data
        return data

    def read_blob(self, descriptor: Descriptor, what: str) -> bytes:
        if descriptor.size > MAX_JSON_SIZE:
            raise InputError(f"{what} of {descriptor.size} bytes: more than {MAX_JSON_SIZE}", where=self.where)
        with self._open(descriptor, what) as blob:
            parts = []
            while part := blob.read(1 << 20):  # a resumed stream answers in pieces
                parts.append(part)
            return b"".join(parts)

    def open_layer(self, descriptor: Descriptor) -> VerifiedBlob:
        return self._open(descriptor, f"layer {descriptor.digest}")

    def _open(self, descriptor: Descriptor, what: str) -> VerifiedBlob:
        stream = self.client.open_blob(self.ref.repository, descriptor.digest, descriptor.size)
        return VerifiedBlob(stream, descriptor.digest, descriptor.size, f"{self.where}: {what}")


def open_registry_image(ref: ImageRef, platform: str = "linux/amd64",
                        options: RegistryOptions = RegistryOptions()) -> OciImage:
    """The image for ``platform`` that ``ref`` names; its layers stream from the registry when opened."""
    source, descriptor = resolve_manifest(ref, platform, options)
    return image_from_manifest(source, descriptor, parse_platform(platform))


def resolve_manifest(ref: ImageRef, platform: str = "linux/amd64",
                     options: RegistryOptions = RegistryOptions()) -> tuple[RegistrySource, Descriptor]:
    """The source and the image manifest's descriptor for ``platform`` that ``ref`` names (an index
    followed to it); the manifest is fetched already (``read_document`` gives it without a request)."""
    want = parse_platform(platform)
    source = RegistrySource(ref, RegistryClient(ref.host, options))
    data, media_type, digest = source.top()
    document = parse_json(data, f"{source.where}: manifest")
    if not isinstance(document, dict):
        raise InputError("the manifest is not a JSON object", where=source.where)
    # The Content-Type names the kind; an older registry may send the JSON's own mediaType only.
    kind = document.get("mediaType") if media_type not in INDEX_TYPES | MANIFEST_TYPES else media_type
    if kind is None and "manifests" in document:
        kind = OCI_INDEX
    if kind in INDEX_TYPES:
        descriptor = manifest_in_index(source, document, f"index {digest}", want)
        source.read_document(descriptor, f"manifest {descriptor.digest}")  # fetched once, kept
        return source, descriptor
    if kind is not None and kind not in MANIFEST_TYPES:
        raise UnsupportedError(f"manifest of media type {kind!r}", where=source.where)
    return source, Descriptor(kind or OCI_MANIFEST, digest, len(data), None)
