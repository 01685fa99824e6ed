"""The node daemon's HTTP API, defined once: request and response types, and the one error format.

The server (lazy_fetch/routes.py, overlay/node_service.py) decodes each request body into its type here
and answers with the response types here; the SDK client (client.py, sandbox_client.py) sends the
request types and decodes the answers into the same types. msgspec does the checking: a body that is not
a JSON object of the right fields and types is one InputError naming the field (``$.mountpoint``), never a
handler crash. Requests refuse unknown fields (a misspelt option is an error, not ignored); responses
ignore them, so an older client keeps working with a newer daemon. Strings are bounded (MAX_PATH,
MAX_NAME) so no field can make the server hold more than the body limit.

Errors, in every HTTP service of dsecfs (the node daemon, the scheduler service): the status is
``STATUS_BY_KIND[kind]`` and the body ``{"error": kind, "message": ..., "where": ..., "transient": ...}``
(``transient`` for UnavailableError only). ``error_from_body`` raises the same DsecError class again on
the client side.

Threads: types and pure functions; any thread.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, TypeVar

import msgspec

from . import exec_frames
from .errors import (
    ConflictError,
    CorruptError,
    DsecError,
    InputError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)

MAX_PATH = 4096  # PATH_MAX
MAX_NAME = 1024  # refs, digests, modes, URLs
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Count = Annotated[int, msgspec.Meta(ge=0)]

# The choices some fields take, here so that every side (the daemon, the CLI's help) names the same.
MODES = ("kernel", "fuse")  # kernel: EROFS over the daemon's FUSE blob file; fuse: the whole tree over FUSE
BINDINGS = ("pyfuse3", "fusepy", "raw")  # raw: mounts survive a daemon restart (docs/architecture.md)
# What a mount fetches in the background besides what is read: none; its profile (or its prefetch list);
# layer: that, then the rest of the layer in blob order, until the cache bound; auto: the profile if
# there is one (or a list), else the whole layer (docs/benchmarks.md, issue 13, says why it is the default).
FILLS = ("auto", "none", "profile", "layer")
DEFAULT_FILL = "auto"

# HTTP status of each DsecError kind; a client maps the kind back to the class.
STATUS_BY_KIND = {
    "input": 400,
    "not-found": 404,
    "conflict": 409,
    "unsupported": 422,
    "corrupt": 500,
    "unavailable": 503,
}
ERROR_CLASSES: dict[str, type[DsecError]] = {
    cls.kind: cls for cls in (InputError, NotFoundError, ConflictError, UnsupportedError, UnavailableError,
                              CorruptError)
}


class _Request(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class _Response(msgspec.Struct, frozen=True):
    pass


# ---- requests ------------------------------------------------------------------------------------------


class MountRequest(_Request):
    layer: Name  # a ref or a layer digest
    mountpoint: Path  # an existing directory, absolute
    mode: Name = "kernel"  # kernel | fuse
    store: Name | None = None  # default: the daemon's
    prefetch: Path | None = None  # a prefetch list to fetch in the background
    fuse_binding: Name | None = None  # fail unless the daemon serves FUSE with this binding
    profile: bool = True  # prefetch by the layer's access profile in the store (when no list is given)
    name: Name | None = None  # the layer's ref name, when ``layer`` is a digest (whose profile to use)
    fill: Name | None = None  # none | profile | layer (lazy_fetch/daemon.py FILLS); default: the daemon's


class UmountRequest(_Request):
    mountpoint: Path
    lazy: bool = False


class PrefetchRequest(_Request):
    mountpoint: Path
    list: Path


class EvictRequest(_Request):
    to: Count = 0  # bytes to keep


class SandboxUpRequest(_Request):
    base: Name | None = None
    workspace: Name | None = None
    toolkits: Annotated[list[Name], msgspec.Meta(max_length=64)] = []  # the first on top
    name: Name | None = None
    store: Name | None = None  # must be the daemon's own store if given
    profile: bool = True  # layers this sandbox mounts first prefetch by their access profiles
    fill: Name | None = None  # and fetch this in the background (none | profile | layer); default: the daemon's


class _ExecOptions(_Request):
    """What a command runs with, for exec and attach."""
    argv: Annotated[list[Annotated[str, msgspec.Meta(max_length=1 << 17)]], msgspec.Meta(min_length=1)]
    env: dict[str, str] = {}
    cwd: Path = "/"
    network: bool = False
    memory_bytes: Count | None = None
    cpus: Annotated[float, msgspec.Meta(gt=0)] | None = None
    pids_limit: Count | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    runtime: Name | None = None  # runc | namespaces; default: the daemon's


class ExecRequest(_ExecOptions):
    stdin: bytes | None = None  # base64 in JSON


WindowSide = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]


class AttachRequest(_ExecOptions):
    """A command whose stdio is relayed over the upgraded connection (dsec_fs/exec_frames.py)."""
    stdin: bool = False  # STDIN frames feed its stdin (else /dev/null; with tty, the terminal's input is ignored)
    tty: bool = False  # run it on a terminal (runc only): stdout and stderr are the terminal, STDOUT frames
    rows: WindowSide = 0  # the terminal's size (0: leave runc's default); RESIZE frames change it
    cols: WindowSide = 0


class DownRequest(_Request):
    keep: bool = False  # keep the upper dir (stopped), for commit


class CommitRequest(_Request):
    name: Name  # NAME:TAG of the new layer
    store: Name | None = None  # default: the daemon's
    keep_privileged: bool = False  # keep setuid/setgid bits, device nodes, file capabilities (else dropped)


# ---- responses -----------------------------------------------------------------------------------------


class MountInfo(_Response):
    mountpoint: str
    mode: str  # kernel | fuse
    layer: str  # layer digest
    ref: str = ""  # how the mount named the layer (a ref or the digest)
    store: str = ""
    blob_id: str = ""
    trace: str = ""  # the access trace file it started ("" when tracing is off; later segments: trace_segments.py)
    prefetch: str = ""  # the prefetch list it was mounted with, "profile:combination|layer|name", or ""
    created: str = ""
    chunks: int = 0  # distinct chunks of the layer
    data_bytes: int = 0  # their bytes
    prefetch_chunks: int = 0  # chunks the prefetch (list or profile) was to fetch
    profile_key: str = ""  # the store prefix of the profile it prefetched by (keys.*_profiles)
    idle_until: str = ""  # an idle sandbox layer (no sandbox uses it): when it is unmounted, unless used again


class UmountInfo(_Response):
    mountpoint: str


class LayerStatus(_Response):
    layer: str
    mounts: int = 0
    data_bytes: int = 0
    used_bytes: int = 0  # of data_bytes, bytes served to readers since the daemon started
    fetched_ratio: float = 0.0  # used_bytes / data_bytes
    reads: int = 0
    read_errors: int = 0
    chunks_fetched: int = 0  # from the store
    bytes_fetched: int = 0
    cache_hits: int = 0  # chunk lookups the disk cache answered
    cache_misses: int = 0
    fetch_errors: int = 0
    corrupt: int = 0
    timeouts: int = 0
    abandoned: int = 0  # store reads given up on at their deadline whose threads were still in the store
    refused: int = 0  # reads failed at once: their store object had too many reads stuck
    # how well the prefetch (a list or a profile) predicted the reads, in chunk bytes:
    prefetched_bytes: int = 0
    prefetched_read_bytes: int = 0  # prefetched, then read
    prefetched_unread_bytes: int = 0  # prefetched, never read (so far)
    read_not_prefetched_bytes: int = 0  # read, never prefetched
    # "" (off, or not mounted), "deferred" (its file map waits for the layer's first read that waits for
    # the store: the node holds some of its chunks), "pending" (the map is being built), "ready", "refused"
    # (the map could not be read from the layer's image: no readahead; the daemon's log says why)
    miss_readahead: str = ""


class PrefetchInfo(_Response):
    layer: str
    list: str
    chunks: int = 0  # the list's and the fill's
    bytes: int = 0
    fill_chunks: int = 0  # of those, the fill's (the rest of the layer, fetched after the list)
    fill_skipped: bool = False  # fill auto found the store fast: the fill was not made
    state: str = ""  # running | done | cancelled | failed
    done_chunks: int = 0
    done_bytes: int = 0
    failed_chunks: int = 0
    started: str = ""
    finished: str = ""


class CacheInfo(_Response):
    directory: str = ""
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rotten: int = 0
    frames: int = 0  # entries a fill kept as fetched (zstd frames), not read nor checked yet
    bad_frames: int = 0  # such frames dropped since the daemon started: not their chunk when first read
    reconciled: int = 0
    memory_entries: int = 0
    memory_bytes: int = 0
    memory_max_bytes: int = 0
    memory_hits: int = 0
    memory_misses: int = 0
    evicted: int = 0  # chunks the call that returned this evicted (cache_evict)


class NodeStatus(_Response):
    pid: int
    version: str = ""
    started: str = ""
    socket: str = ""
    state_dir: str = ""
    cache_dir: str = ""
    store: str = ""  # the daemon's default store
    fuse_binding: str = ""
    mounts: list[MountInfo] = []
    layers: list[LayerStatus] = []
    prefetches: list[PrefetchInfo] = []
    cache: CacheInfo = CacheInfo()
    cleaned: list[str] = []  # stale mountpoints detached when the daemon started
    connections: int = 0  # API connections open now


class SandboxLayerInfo(_Response):
    role: str  # toolkit | workspace | base
    ref: str  # as the sandbox was asked for it
    digest: str
    mountpoint: str = ""  # where the daemon mounts the layer, shared by every sandbox using it


class SandboxInfo(_Response):
    id: str
    name: str = ""
    status: str = ""  # running; stopped (down with keep, or the daemon stopped); creating; stopping
    rootfs: str = ""  # the sandbox's root, on the node
    upper: str = ""  # its writes
    created: str = ""
    layers: tuple[SandboxLayerInfo, ...] = ()  # top first
    combination: str = ""  # the id of its stack of layers: its traces and combination profiles name it


class SandboxList(_Response):
    sandboxes: list[SandboxInfo] = []
    layers: list[dict] = []  # the layers held for sandboxes: {layer, mountpoint, users, idle_until}
    removed_at_start: list[str] = []


class ExecResult(_Response):
    exit_code: int  # the command's; 128 + N when signal N killed it (137 after the timeout)
    stdout: bytes  # base64 in JSON
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False  # stdout or stderr passed the daemon's bound (overlay/runtime.py MAX_OUTPUT,
    # 4 MiB): each holds its first bytes, the rest was dropped; attach streams output of any size


class ExecExit(_Response):
    """The EXIT frame of an attached command."""
    exit_code: int  # as ExecResult's
    timed_out: bool = False
    truncated: bool = False  # as ExecResult's: only the namespaces runtime, which gathers the output, cuts it


class CommitResult(_Response):
    sandbox: str  # id
    layer: str  # digest of the new layer
    ref: str
    store: str
    stats: dict = {}  # the build's statistics (files, bytes, chunks, ...)
    dropped: dict = {}  # privileged parts left out: setuid, setgid, devices, capabilities (counts)


class Empty(_Response):
    pass


class MountList(_Response):
    mounts: list[MountInfo] = []


class PrefetchList(_Response):
    prefetches: list[PrefetchInfo] = []


def absolute_store(url: str | None) -> str | None:
    """A local store path made absolute: the daemon's working directory is not the caller's."""
    return url if url is None or "://" in url else os.path.abspath(url)


# ---- the routes ----------------------------------------------------------------------------------------


class Endpoint(msgspec.Struct, frozen=True):
    method: str
    path: str  # {name}: one path segment
    summary: str
    request: type | None = None  # the body's type; None: no body
    response: type | None = None  # None: not JSON (the Prometheus text of /metrics)
    upgrade: str | None = None  # the protocol a 101 answer switches to (dsec_fs/exec_frames.py)


# Every route of the node daemon's API: lazy_fetch/routes.py and overlay/node_service.py serve exactly
# these (tests/dsec_fs/test_api.py checks), docs/openapi.json is made from them (``python -m dsec_fs.api``).
ROUTES = (
    Endpoint("GET", "/v1/status", "the daemon: mounts, layers, cache, prefetches", response=NodeStatus),
    Endpoint("GET", "/v1/mounts", "the layers this daemon mounted", response=MountList),
    Endpoint("POST", "/v1/mounts", "mount a layer", MountRequest, MountInfo),
    Endpoint("POST", "/v1/umount", "unmount a layer this daemon mounted", UmountRequest, UmountInfo),
    Endpoint("GET", "/v1/prefetch", "prefetch jobs, running and ended", response=PrefetchList),
    Endpoint("POST", "/v1/prefetch", "fetch a prefetch list for a mounted layer", PrefetchRequest, PrefetchInfo),
    Endpoint("GET", "/v1/cache", "the chunk cache", response=CacheInfo),
    Endpoint("POST", "/v1/cache/evict", "evict the caches down to a size", EvictRequest, CacheInfo),
    Endpoint("GET", "/metrics", "Prometheus metrics (text exposition format)"),
    Endpoint("POST", "/v1/sandboxes", "start a sandbox", SandboxUpRequest, SandboxInfo),
    Endpoint("GET", "/v1/sandboxes", "the sandboxes and the layers held for them", response=SandboxList),
    Endpoint("GET", "/v1/sandboxes/{sandbox}", "one sandbox, by id or name", response=SandboxInfo),
    Endpoint("POST", "/v1/sandboxes/{sandbox}/exec", "run a command in a sandbox", ExecRequest, ExecResult),
    Endpoint("POST", "/v1/sandboxes/{sandbox}/attach", "run a command in a sandbox, its stdio relayed over the "
             "connection (frames of dsec_fs/exec_frames.py), on a terminal if asked", AttachRequest,
             upgrade=exec_frames.PROTOCOL),
    Endpoint("POST", "/v1/sandboxes/{sandbox}/down", "take a sandbox down", DownRequest, Empty),
    Endpoint("POST", "/v1/sandboxes/{sandbox}/commit", "publish a sandbox's changes as a layer", CommitRequest,
             CommitResult),
)


class ErrorBody(_Response, omit_defaults=True):
    error: str  # the kind: input | not-found | conflict | unsupported | corrupt | unavailable | internal
    message: str
    where: str | None
    transient: bool | None = None  # UnavailableError only (left out of the body otherwise)


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of ROUTES (docs/openapi.json)."""
    types = [t for e in ROUTES for t in (e.request, e.response) if t is not None] + [ErrorBody, ExecExit]
    (*schemas,), components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, schemas))
    paths: dict[str, dict] = {}
    for e in ROUTES:
        error = {"description": "an error (status by kind: " + ", ".join(f"{k} {v}" for k, v in
                                                                         STATUS_BY_KIND.items()) + ")",
                 "content": {"application/json": {"schema": ref[ErrorBody]}}}
        if e.upgrade is not None:
            ok_status, ok = "101", {"description": f"switching to {e.upgrade}: frames both ways, see dsec_fs/exec_frames.py",
                                    "headers": {"upgrade": {"schema": {"const": e.upgrade}}}}
        else:
            ok_status, ok = "200", {"description": e.summary}
            ok["content"] = ({"application/json": {"schema": ref[e.response]}} if e.response is not None
                             else {"text/plain": {"schema": {"type": "string"}}})
        operation: dict[str, Any] = {"summary": e.summary, "responses": {ok_status: ok, "default": error}}
        if e.request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[e.request]}}}
        names = [part[1:-1] for part in e.path.split("/") if part.startswith("{")]
        if names:
            operation["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for n in names]
        paths.setdefault(e.path, {})[e.method.lower()] = operation
    return {"openapi": "3.1.0",
            "info": {"title": "dsecfs node daemon", "version": "1",
                     "description": "HTTP/1.1 over the daemon's unix socket (0600, root); see dsec_fs/api.py."},
            "paths": paths, "components": {"schemas": components}}


# ---- coding --------------------------------------------------------------------------------------------

T = TypeVar("T")


def decode(data: bytes | Any, type_: type[T], *, where: str) -> T:
    """``data`` (a JSON body; an empty body is {}; or a value already parsed) as a ``type_``; InputError
    (requests) or UnavailableError (answers of a daemon) naming the field at fault."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return msgspec.json.decode(bytes(data) or b"{}", type=type_)
        return msgspec.convert(data, type_)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        if issubclass(type_, _Request):
            raise InputError(f"bad request body: {exc}", where=where) from None
        raise UnavailableError(f"the daemon's answer is not a {type_.__name__}: {exc}", where=where,
                               transient=False) from None


def encode(value: Any) -> bytes:
    """A value (types here, dicts, lists) as a JSON body."""
    return msgspec.json.encode(value) + b"\n"


def to_builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def error_body(exc: DsecError) -> dict[str, Any]:
    return to_builtins(ErrorBody(exc.kind, exc.message, exc.where,
                                 exc.transient if isinstance(exc, UnavailableError) else None))


def error_status(exc: DsecError) -> int:
    return STATUS_BY_KIND.get(exc.kind, 500)


def error_from_body(value: Any, status: int, request: str) -> DsecError:
    """The DsecError an error answer (``error_body``) stands for."""
    if not isinstance(value, dict):
        return UnavailableError(f"{request}: HTTP {status}: {str(value)[:200]}", where="daemon", transient=False)
    kind, message, where = value.get("error"), str(value.get("message", "")), value.get("where")
    cls = ERROR_CLASSES.get(kind)
    if cls is UnavailableError:
        return UnavailableError(message, where=where, transient=bool(value.get("transient", True)))
    if cls is None:
        return DsecError(f"{message} (daemon error {kind!r}, HTTP {status})", where=where)
    return cls(message, where=where)


if __name__ == "__main__":
    print(json.dumps(openapi(), indent=1, sort_keys=True))
