"""The scheduler as a small HTTP service: node daemons register and report, clients ask for a placement,
and kube-scheduler calls it as a scheduler extender.

dsecfs API (JSON in, JSON out; errors answer the one error format of dsec_fs/api.py, ``{"error": kind,
"message", "where"}``, as the node daemon does: 400 for bad input, 404 for an unknown node, 503 when every
node is full):

    POST /v1/nodes/register      {"name": "node-1", "capacity": 16}
    POST /v1/nodes/{name}/report {"capacity": 16, "running": 3, "cached": {layer: bytes}, "sizes": {layer: bytes}}
                                 every field optional; "cached" is the node's whole cache (see Scheduler.report)
    POST /v1/place               {"layers": [layer, ...], "sizes": {layer: bytes}}  ->  {"node": "node-1"}
    GET  /v1/nodes               {"nodes": [{"name", "capacity", "running", "cached_layers", "cached_bytes"}]}

Kubernetes scheduler extender (configure kube-scheduler with ``urlPrefix: http://HOST:PORT/extender``,
``filterVerb: filter``, ``prioritizeVerb: prioritize``; ``nodeCacheCapable`` either way). The wire types
are those of k8s.io/kube-scheduler/extender/v1 (types.go), whose Go fields carry no json tags, so the
JSON keys are the Go field names:

    POST /extender/filter      ExtenderArgs {"Pod", "Nodes", "NodeNames"}
                               -> ExtenderFilterResult {"Nodes", "NodeNames", "FailedNodes",
                                  "FailedAndUnresolvableNodes", "Error"}
    POST /extender/prioritize  ExtenderArgs -> HostPriorityList [{"Host", "Score"}], Score in
                               MinExtenderPriority..MaxExtenderPriority (0..10)

A sandbox pod names its layers in annotations (POD_LAYER_ANNOTATIONS), as layer digests or, when the
service has a resolver (``dsecfs sched serve --store``), refs. Pods without them are not ours: filter
passes every node and prioritize scores them all 0. For our pods, filter fails nodes with no dsecfs
daemon registered (FailedAndUnresolvableNodes: preemption cannot help) and nodes whose slots are all
busy (FailedNodes); prioritize gives the Affinity score as an extender priority. kube-scheduler reads
``Error`` from a filter answer; a prioritize answer has no such field, so a bad prioritize request gets
HTTP 400, which kube-scheduler reports as the extender failing.

Connections are bounded (overlay/http_bounds.py: how many, how long idle, how long a request may take),
since any local user can reach the port.

Threads: BoundedHTTPServer runs each connection in its own thread; ``_lock`` serialises every call into
the Scheduler (which is not thread-safe) and the resolver's cache. ``start`` serves from a background
thread, ``stop`` shuts it down; ``serve_forever`` serves from the caller's thread (the CLI).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import unquote

from dsec_fs import api
from dsec_fs.errors import DsecError, InputError, NotFoundError, UnavailableError

from .http_bounds import BoundedHandler, BoundedHTTPServer, ConnectionBounds
from .scheduler import Affinity, Scheduler

log = logging.getLogger(__name__)

POD_LAYER_ANNOTATIONS = ("dsecfs.io/base", "dsecfs.io/workspace", "dsecfs.io/toolkit")
MAX_BODY = 64 << 20  # an ExtenderArgs with a full NodeList of thousands of nodes runs to megabytes
REF_TTL = 30.0  # seconds a resolved ref is trusted: a tag may move to a new layer

_REPORT = re.compile(r"/v1/nodes/([^/]+)/report")


class SchedService:
    """The HTTP front of one Scheduler (whose policy must be Affinity: the extender reports its scores)."""

    def __init__(self, scheduler: Scheduler | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 resolve: Callable[[str], str] | None = None, bounds: ConnectionBounds = ConnectionBounds()):
        self.scheduler = scheduler if scheduler is not None else Scheduler(Affinity())
        if not isinstance(self.scheduler.policy, Affinity):
            raise InputError("the service needs the affinity policy: the extender answers with its scores",
                             where=f"policy {self.scheduler.policy.name}")
        self._resolve = resolve
        self._resolved: dict[str, tuple[str, float]] = {}  # ref -> (layer digest, when resolved)
        self._lock = threading.Lock()
        try:
            self._server = BoundedHTTPServer((host, port), _Handler, bounds)
        except OSError as exc:
            raise UnavailableError(f"cannot listen: {exc.strerror or exc}", where=f"{host}:{port}",
                                   transient=False) from None
        self._server.service = self
        self._thread: threading.Thread | None = None

    @property
    def connections(self) -> int:
        return self._server.connections

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "SchedService":
        self._server.start_reaper()
        # A short poll interval: stop() waits up to one interval for the serving loop to notice.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="sched-service", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.start_reaper()
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "SchedService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the dsecfs API

    def register(self, body: dict) -> dict:
        with self._lock:
            node = self.scheduler.register(body.get("name"), body.get("capacity"))
            return {"node": node.to_dict()}

    def report(self, name: str, body: dict) -> dict:
        with self._lock:
            self.scheduler.report(name, capacity=body.get("capacity"), running=body.get("running"),
                                  cached=body.get("cached"), sizes=body.get("sizes"))
            return {"node": self.scheduler.node(name).to_dict()}

    def place(self, body: dict) -> dict:
        layers = body.get("layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(x, str) and x for x in layers):
            raise InputError("layers must be a non-empty list of layer digests", where="POST /v1/place")
        with self._lock:
            return {"node": self.scheduler.place(layers, body.get("sizes"))}

    def list_nodes(self) -> dict:
        with self._lock:
            return {"nodes": [node.to_dict() for node in self.scheduler.nodes]}

    # --- the Kubernetes scheduler extender

    def extender_filter(self, args: dict) -> dict:
        """ExtenderArgs -> ExtenderFilterResult."""
        names, items = _candidates(args)
        layers = self._pod_layers(args)
        passed, failed, unresolvable = [], {}, {}
        with self._lock:
            for name in names:
                node = self.scheduler.by_name.get(name)
                if layers is None:
                    passed.append(name)
                elif node is None:
                    unresolvable[name] = "dsecfs: no node daemon registered with the scheduler"
                elif node.running >= node.capacity:
                    failed[name] = f"dsecfs: all {node.capacity} sandbox slots busy"
                else:
                    passed.append(name)
        kept = set(passed)
        nodes = None
        if items is not None:
            nodes = {k: v for k, v in args["Nodes"].items() if k != "items"}
            nodes["items"] = [item for item in items if _node_name(item) in kept]
        return {"Nodes": nodes, "NodeNames": passed, "FailedNodes": failed,
                "FailedAndUnresolvableNodes": unresolvable, "Error": ""}

    def extender_prioritize(self, args: dict) -> list[dict]:
        """ExtenderArgs -> HostPriorityList."""
        names, _items = _candidates(args)
        layers = self._pod_layers(args)
        if layers is None:
            return [{"Host": name, "Score": 0} for name in names]
        sched = self.scheduler
        affinity: Affinity = sched.policy
        priorities = []
        with self._lock:
            total = sched.request_bytes(layers)
            for name in names:
                node = sched.by_name.get(name)
                score = 0
                if node is not None:
                    score = affinity.extender_priority(
                        affinity.score(sched.cached_bytes(name, layers), total, node.load))
                priorities.append({"Host": name, "Score": score})
        return priorities

    def _pod_layers(self, args: dict) -> list[str] | None:
        """The layers a pod's annotations name (refs resolved), or None for a pod that names none."""
        pod = args.get("Pod")
        if not isinstance(pod, dict):
            raise InputError("ExtenderArgs has no Pod object", where="ExtenderArgs.Pod")
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        if not isinstance(annotations, dict):
            raise InputError("metadata.annotations must be an object", where="ExtenderArgs.Pod")
        named = [annotations[key] for key in POD_LAYER_ANNOTATIONS if annotations.get(key)]
        if not named:
            return None
        if not all(isinstance(value, str) for value in named):
            raise InputError(f"the {', '.join(POD_LAYER_ANNOTATIONS)} annotations must be strings",
                             where="ExtenderArgs.Pod.metadata.annotations")
        return [self._layer(value) for value in named]

    def _layer(self, value: str) -> str:
        if self._resolve is None:
            return value
        now = time.monotonic()
        with self._lock:
            hit = self._resolved.get(value)
        if hit is not None and now - hit[1] < REF_TTL:
            return hit[0]
        digest = self._resolve(value)  # outside the lock: it may ask a remote store
        with self._lock:
            self._resolved[value] = (digest, now)
        return digest


def _node_name(item: object) -> str:
    name = item.get("metadata", {}).get("name") if isinstance(item, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError("a node in Nodes.items has no metadata.name", where="ExtenderArgs.Nodes")
    return name


def _candidates(args: object) -> tuple[list[str], list[dict] | None]:
    """Candidate node names of an ExtenderArgs, and the Node objects when it carries a NodeList."""
    if not isinstance(args, dict):
        raise InputError("expected an ExtenderArgs object", where="ExtenderArgs")
    if isinstance(args.get("Nodes"), dict):
        items = args["Nodes"].get("items") or []
        if not isinstance(items, list):
            raise InputError("Nodes.items must be a list", where="ExtenderArgs.Nodes")
        return [_node_name(item) for item in items], items
    names = args.get("NodeNames")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return list(names), None
    raise InputError("neither Nodes nor NodeNames names the candidate nodes", where="ExtenderArgs")


class _Handler(BoundedHandler):
    server_version = "dsecfs-sched"
    protocol_version = "HTTP/1.1"  # keep-alive: kube-scheduler calls twice per pod

    def do_GET(self) -> None:
        if self.path == "/v1/nodes":
            self._answer(lambda: self.server.service.list_nodes())
        else:
            self._answer(self._no_such_path)

    def do_POST(self) -> None:
        service: SchedService = self.server.service
        report = _REPORT.fullmatch(self.path)
        if self.path == "/extender/filter":
            self._answer(lambda: service.extender_filter(self._body()), error_in_body=True)
        elif self.path == "/extender/prioritize":
            self._answer(lambda: service.extender_prioritize(self._body()))
        elif self.path == "/v1/nodes/register":
            self._answer(lambda: service.register(self._body()))
        elif report:
            self._answer(lambda: service.report(unquote(report.group(1)), self._body()))
        elif self.path == "/v1/place":
            self._answer(lambda: service.place(self._body()))
        else:
            self._answer(self._no_such_path)

    def _no_such_path(self) -> None:
        self._read()  # drain the body, so the connection stays usable
        raise NotFoundError("no such path", where=f"{self.command} {self.path}")

    def _read(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise InputError(f"request body of {length} bytes is over {MAX_BODY}", where=self.path)
        return self.rfile.read(length)

    def _body(self) -> dict:
        data = self._read()
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise InputError(f"not JSON: {exc}", where=self.path) from None
        if not isinstance(body, dict):
            raise InputError("expected a JSON object", where=self.path)
        return body

    def _answer(self, call: Callable[[], object], *, error_in_body: bool = False) -> None:
        try:
            result = call()
        except DsecError as exc:
            if error_in_body:  # the extender filter protocol: HTTP 200, the failure in "Error"
                self._send(HTTPStatus.OK, {"Nodes": None, "NodeNames": None, "FailedNodes": {},
                                           "FailedAndUnresolvableNodes": {}, "Error": str(exc)})
            else:
                self._send(HTTPStatus(api.error_status(exc)), api.error_body(exc))
            return
        self._send(HTTPStatus.OK, result)

    def _send(self, status: HTTPStatus, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)
