"""The calls ``dsecfs image pull`` makes to containerd's gRPC API (leases, content, snapshots, diff, images):
the client-side adapter that imports grpcio (stubs in overlay/containerd_api/).

Every call names containerd's namespace in the ``containerd-namespace`` metadata, and, inside
``lease()``, the lease in ``containerd-lease``, so that containerd's gc keeps what the calls create
until the image record holds it. gRPC errors become DsecError classes: NOT_FOUND NotFoundError,
ALREADY_EXISTS ConflictError, UNAVAILABLE (and a socket nobody answers) UnavailableError, the rest
InputError naming the call.

Threads: one caller at a time (``_lease`` is plain state).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterable, Iterator

import grpc
from google.protobuf import field_mask_pb2

from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError, UnavailableError

from .containerd_api import (
    content_pb2, content_pb2_grpc, diff_pb2, diff_pb2_grpc, images_pb2, images_pb2_grpc, leases_pb2,
    leases_pb2_grpc, snapshots_pb2, snapshots_pb2_grpc, types_pb2,
)

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
DEFAULT_NAMESPACE = "default"
LEASE_EXPIRY = 3600  # seconds: a pull that dies leaves a lease containerd's gc drops after this
CALL_TIMEOUT = 300.0


class ContainerdClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, namespace: str = DEFAULT_NAMESPACE):
        self.address = address
        self.namespace = namespace
        self._channel = grpc.insecure_channel("unix:" + address)
        self._leases = leases_pb2_grpc.LeasesStub(self._channel)
        self._content = content_pb2_grpc.ContentStub(self._channel)
        self._snapshots = snapshots_pb2_grpc.SnapshotsStub(self._channel)
        self._images = images_pb2_grpc.ImagesStub(self._channel)
        self._diff = diff_pb2_grpc.DiffStub(self._channel)
        self._lease: str | None = None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ContainerdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- leases ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self) -> Iterator[str]:
        """A lease for the calls made inside the ``with``, deleted at its end."""
        lease_id = f"dsecfs-pull-{secrets.token_hex(8)}"
        expire = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + LEASE_EXPIRY))
        self._call("create lease", self._leases.Create,
                   leases_pb2.CreateRequest(id=lease_id, labels={"containerd.io/gc.expire": expire}))
        self._lease = lease_id
        try:
            yield lease_id
        finally:
            self._lease = None
            self._call("delete lease", self._leases.Delete, leases_pb2.DeleteRequest(id=lease_id))

    # -- content --------------------------------------------------------------------------------------------

    def has_content(self, digest: str) -> bool:
        try:
            self._call(f"content {digest}", self._content.Info, content_pb2.InfoRequest(digest=digest))
        except NotFoundError:
            return False
        return True

    def write_content(self, digest: str, size: int, pieces: Iterable[bytes], labels: dict[str, str]) -> None:
        """Put a blob into the content store, streamed from ``pieces``, with its gc labels (containerd checks
        its size and digest at the commit); one that is there already keeps its content and gets the labels."""
        ref = f"dsecfs-{digest}"

        def requests() -> Iterator[content_pb2.WriteContentRequest]:
            offset = 0
            for piece in pieces:
                yield content_pb2.WriteContentRequest(action=content_pb2.WRITE, ref=ref, total=size,
                                                      expected=digest, offset=offset, data=piece)
                offset += len(piece)
            yield content_pb2.WriteContentRequest(action=content_pb2.COMMIT, ref=ref, total=size, expected=digest,
                                                  offset=offset, labels=labels)

        try:
            self._call(f"write content {digest}", self._content.Write, requests(), stream=True)
        except ConflictError:
            info = content_pb2.Info(digest=digest, labels=labels)
            mask = field_mask_pb2.FieldMask(paths=[f"labels.{key}" for key in labels])
            self._call(f"label content {digest}", self._content.Update,
                       content_pb2.UpdateRequest(info=info, update_mask=mask))

    # -- snapshots ------------------------------------------------------------------------------------------

    def prepare(self, snapshotter: str, key: str, parent: str, labels: dict[str, str]) -> list[types_pb2.Mount]:
        request = snapshots_pb2.PrepareSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent, labels=labels)
        return list(self._call(f"prepare snapshot {key}", self._snapshots.Prepare, request).mounts)

    def stat(self, snapshotter: str, key: str) -> snapshots_pb2.Info:
        request = snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key)
        return self._call(f"stat snapshot {key}", self._snapshots.Stat, request).info

    def commit(self, snapshotter: str, name: str, key: str) -> None:
        request = snapshots_pb2.CommitSnapshotRequest(snapshotter=snapshotter, name=name, key=key)
        self._call(f"commit snapshot {key} as {name}", self._snapshots.Commit, request)

    def apply(self, layer: types_pb2.Descriptor, mounts: list[types_pb2.Mount]) -> types_pb2.Descriptor:
        """Unpack the layer blob (in the content store) into ``mounts``; the descriptor of what was applied
        (its digest is the uncompressed layer's: the diff_id)."""
        request = diff_pb2.ApplyRequest(diff=layer, mounts=mounts)
        return self._call(f"apply layer {layer.digest}", self._diff.Apply, request).applied

    def remove(self, snapshotter: str, key: str) -> None:
        request = snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key)
        self._call(f"remove snapshot {key}", self._snapshots.Remove, request)

    # -- images ---------------------------------------------------------------------------------------------

    def put_image(self, name: str, target: types_pb2.Descriptor) -> None:
        """Create the image record ``name`` pointing at ``target``, or point the existing one there."""
        image = images_pb2.Image(name=name, target=target)
        try:
            self._call(f"create image {name}", self._images.Create, images_pb2.CreateImageRequest(image=image))
        except ConflictError:
            mask = field_mask_pb2.FieldMask(paths=["target"])
            self._call(f"update image {name}", self._images.Update,
                       images_pb2.UpdateImageRequest(image=image, update_mask=mask))

    # -- calls ------------------------------------------------------------------------------------------------

    def _call(self, what: str, method, request, *, stream: bool = False):
        """One call's answer (all of a streamed answer's messages, with ``stream``)."""
        metadata = [("containerd-namespace", self.namespace)]
        if self._lease:
            metadata.append(("containerd-lease", self._lease))
        where = f"containerd {self.address}"
        try:
            answer = method(request, metadata=metadata, timeout=CALL_TIMEOUT)
            return list(answer) if stream else answer
        except grpc.RpcError as exc:
            raise _error(exc, what, where) from None


def _error(exc: grpc.RpcError, what: str, where: str) -> DsecError:
    code, details = exc.code(), exc.details() or ""
    message = f"{what}: {details or code.name}"
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(message, where=where)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return ConflictError(message, where=where)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UnavailableError(message, where=where)
    return InputError(f"{message} ({code.name})", where=where)
