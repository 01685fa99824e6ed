"""containerd's Snapshots gRPC service over overlay.snapshotter.Snapshots, on a unix socket: the adapter that
imports grpcio (stubs in overlay/containerd_api/, generated from the protos there by generate.sh).

containerd reaches it as a proxy plugin (its config.toml):

    [proxy_plugins.dsecfs]
      type = "snapshot"
      address = "/run/dsecfs/snapshotter.sock"

DsecError classes become the status codes containerd's errdefs read: NotFoundError NOT_FOUND, ConflictError
ALREADY_EXISTS (how a remote Prepare says "already there"), InputError FAILED_PRECONDITION, UnsupportedError
UNIMPLEMENTED, UnavailableError UNAVAILABLE, CorruptError DATA_LOSS. The socket is made 0600: whoever can
call Prepare can make the node mount things.

Threads: grpcio calls the servicer from a pool of 8 threads; Snapshots serialises them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from dsec_fs.errors import (
    ConflictError, CorruptError, DsecError, InputError, NotFoundError, UnavailableError, UnsupportedError,
)

from .containerd_api import snapshots_pb2, snapshots_pb2_grpc, types_pb2
from .snapshotter import Mount, SnapshotInfo, Snapshots

log = logging.getLogger(__name__)

_CODES = [(NotFoundError, grpc.StatusCode.NOT_FOUND), (ConflictError, grpc.StatusCode.ALREADY_EXISTS),
          (InputError, grpc.StatusCode.FAILED_PRECONDITION), (UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
          (UnavailableError, grpc.StatusCode.UNAVAILABLE), (CorruptError, grpc.StatusCode.DATA_LOSS)]


def _mounts(mounts: list[Mount]) -> list[types_pb2.Mount]:
    return [types_pb2.Mount(type=m.type, source=m.source, options=m.options) for m in mounts]


def _time(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _info(info: SnapshotInfo) -> snapshots_pb2.Info:
    return snapshots_pb2.Info(name=info.name, parent=info.parent, kind=info.kind, labels=info.labels,
                              created_at=_time(info.created), updated_at=_time(info.updated))


def _answering(method):
    """Run a servicer method, turning a DsecError into the gRPC status containerd expects."""
    def call(self, request, context):
        try:
            return method(self, request, context)
        except DsecError as exc:
            code = next(code for cls, code in _CODES + [(DsecError, grpc.StatusCode.UNKNOWN)] if isinstance(exc, cls))
            if code != grpc.StatusCode.ALREADY_EXISTS:
                log.info("%s: %s", method.__name__, exc)
            context.abort(code, str(exc))
    call.__name__ = method.__name__
    return call


class SnapshotsServicer(snapshots_pb2_grpc.SnapshotsServicer):
    def __init__(self, snapshots: Snapshots):
        self.snapshots = snapshots

    @_answering
    def Prepare(self, request, context):
        mounts = self.snapshots.prepare(request.key, request.parent, dict(request.labels))
        return snapshots_pb2.PrepareSnapshotResponse(mounts=_mounts(mounts))

    @_answering
    def View(self, request, context):
        mounts = self.snapshots.view(request.key, request.parent, dict(request.labels))
        return snapshots_pb2.ViewSnapshotResponse(mounts=_mounts(mounts))

    @_answering
    def Mounts(self, request, context):
        return snapshots_pb2.MountsResponse(mounts=_mounts(self.snapshots.mounts(request.key)))

    @_answering
    def Commit(self, request, context):
        self.snapshots.commit(request.name, request.key, dict(request.labels))
        return empty_pb2.Empty()

    @_answering
    def Remove(self, request, context):
        self.snapshots.remove(request.key)
        return empty_pb2.Empty()

    @_answering
    def Stat(self, request, context):
        return snapshots_pb2.StatSnapshotResponse(info=_info(self.snapshots.stat(request.key)))

    @_answering
    def Update(self, request, context):
        info = self.snapshots.update(request.info.name, dict(request.info.labels), list(request.update_mask.paths))
        return snapshots_pb2.UpdateSnapshotResponse(info=_info(info))

    @_answering
    def List(self, request, context):
        # Filters are containerd's to apply: its metadata store checks every snapshot it is given.
        infos = [_info(info) for info in self.snapshots.list()]
        return iter([snapshots_pb2.ListSnapshotsResponse(info=infos[k:k + 100]) for k in range(0, len(infos), 100)])

    @_answering
    def Usage(self, request, context):
        size, inodes = self.snapshots.usage(request.key)
        return snapshots_pb2.UsageResponse(size=size, inodes=inodes)

    @_answering
    def Cleanup(self, request, context):
        self.snapshots.cleanup()
        return empty_pb2.Empty()


def serve(snapshots: Snapshots, socket_path: str, stop: threading.Event | None = None) -> None:
    """Serve on ``socket_path`` until SIGTERM / SIGINT (or ``stop`` is set); then stop taking calls and
    finish those under way."""
    stop = stop or threading.Event()
    os.makedirs(os.path.dirname(os.path.abspath(socket_path)), exist_ok=True)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapshots"))
    snapshots_pb2_grpc.add_SnapshotsServicer_to_server(SnapshotsServicer(snapshots), server)
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port("unix:" + os.path.abspath(socket_path))
        server.start()
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info("serving containerd snapshots on %s", socket_path)
    try:
        stop.wait()
    finally:
        server.stop(grace=10).wait()
