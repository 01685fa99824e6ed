"""The scheduler service over real HTTP on 127.0.0.1: the dsecfs API and the Kubernetes extender API.

The extender requests are what kube-scheduler's HTTPExtender marshals (k8s.io/kube-scheduler/extender/v1
ExtenderArgs: Go field names as keys, the Pod and NodeList in their own API JSON), in both of its forms:
full Node objects (nodeCacheCapable: false) and names only (nodeCacheCapable: true).
"""

from __future__ import annotations

import copy
import http.client
import json

import pytest

from overlay.sched_service import SchedService

BASE = "a3" * 32  # layer digests, as node daemons report them
WORKSPACE = "b4" * 32
TOOLKIT = "c5" * 32
MiB = 1 << 20

FILTER_RESULT_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


@pytest.fixture
def service():
    svc = SchedService(port=0).start()
    try:
        yield svc
    finally:
        svc.stop()


def call(svc: SchedService, method: str, path: str, body: object = None) -> tuple[int, object]:
    host, port = svc.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def k8s_node(name: str) -> dict:
    return {
        "metadata": {
            "name": name, "uid": f"uid-{name}", "resourceVersion": "81723",
            "creationTimestamp": "2025-01-10T09:12:44Z",
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "node.kubernetes.io/instance-type": "m6i.4xlarge", "dsecfs.io/daemon": "true"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": "10.244.3.0/24", "providerID": f"aws:///us-east-1a/i-{name}"},
        "status": {
            "capacity": {"cpu": "16", "memory": "65023768Ki", "pods": "110", "ephemeral-storage": "203070Mi"},
            "allocatable": {"cpu": "15890m", "memory": "64307992Ki", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": "2025-01-10T10:00:00Z",
                            "lastTransitionTime": "2025-01-10T09:13:10Z"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.3.17"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.30.2", "containerRuntimeVersion": "containerd://1.7.18",
                         "operatingSystem": "linux", "architecture": "amd64"},
        },
    }


def sandbox_pod(annotations: dict | None) -> dict:
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": "rollout-7f9c2-0413", "namespace": "agents", "uid": "5d1c3e0a-9b7e-4e1f-8f1e-2a6b9c0d7e11",
            "resourceVersion": "90412", "creationTimestamp": "2025-01-10T10:02:31Z",
            "labels": {"app": "agent-sandbox", "rollout": "7f9c2"},
            "annotations": annotations,
        },
        "spec": {
            "schedulerName": "default-scheduler", "restartPolicy": "Never",
            "runtimeClassName": "dsecfs",
            "containers": [{
                "name": "sandbox", "image": "registry.example.com/dsecfs/shim:0.1",
                "command": ["/usr/bin/dsecfs-shim"], "args": ["--", "python", "-m", "agent"],
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
            }],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300}],
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


LAYER_ANNOTATIONS = {"dsecfs.io/base": BASE, "dsecfs.io/workspace": WORKSPACE, "dsecfs.io/toolkit": TOOLKIT,
                     "kubectl.kubernetes.io/last-applied-configuration": "{}"}
CANDIDATES = ["node-a", "node-b", "node-c", "node-d"]


def extender_args(annotations: dict | None = LAYER_ANNOTATIONS, node_cache_capable: bool = False) -> dict:
    if node_cache_capable:
        return {"Pod": sandbox_pod(annotations), "Nodes": None, "NodeNames": list(CANDIDATES)}
    return {"Pod": sandbox_pod(annotations),
            "Nodes": {"metadata": {"resourceVersion": "90500"}, "items": [k8s_node(n) for n in CANDIDATES]},
            "NodeNames": None}


@pytest.fixture
def cluster(service):
    """node-a holds every layer, node-b only the toolkit, node-c nothing and is full; node-d never registered."""
    for name in ("node-a", "node-b", "node-c"):
        assert call(service, "POST", "/v1/nodes/register", {"name": name, "capacity": 32})[0] == 200
    sizes = {BASE: 64 * MiB, WORKSPACE: 128 * MiB, TOOLKIT: 96 * MiB}
    call(service, "POST", "/v1/nodes/node-a/report", {"running": 1, "cached": sizes, "sizes": sizes})
    call(service, "POST", "/v1/nodes/node-b/report", {"running": 1, "cached": {TOOLKIT: 96 * MiB}})
    call(service, "POST", "/v1/nodes/node-c/report", {"running": 32, "cached": {}})
    return service


def test_register_report_place(service):
    status, body = call(service, "POST", "/v1/nodes/register", {"name": "n1", "capacity": 8})
    assert status == 200 and body["node"]["name"] == "n1" and body["node"]["capacity"] == 8
    call(service, "POST", "/v1/nodes/register", {"name": "n2", "capacity": 8})
    status, body = call(service, "POST", "/v1/nodes/n2/report",
                        {"running": 0, "cached": {BASE: 10 * MiB, WORKSPACE: 50 * MiB}})
    assert status == 200 and body["node"]["cached_bytes"] == 60 * MiB
    request = {"layers": [BASE, WORKSPACE, TOOLKIT]}
    assert call(service, "POST", "/v1/place", request) == (200, {"node": "n2"})
    assert call(service, "POST", "/v1/place", request) == (200, {"node": "n2"})
    # Two of eight slots busy now outweigh the cache (load weight 4): the idle node gets the third.
    assert call(service, "POST", "/v1/place", request) == (200, {"node": "n1"})
    status, body = call(service, "GET", "/v1/nodes")
    assert status == 200 and [(n["name"], n["running"]) for n in body["nodes"]] == [("n1", 1), ("n2", 2)]
    call(service, "POST", "/v1/nodes/n1/report", {"running": 8})
    call(service, "POST", "/v1/nodes/n2/report", {"running": 8})
    status, body = call(service, "POST", "/v1/place", request)
    assert status == 503 and body["error"] == "unavailable" and "free slot" in body["message"]


def test_api_errors_are_clear(service):
    status, body = call(service, "POST", "/v1/nodes/ghost/report", {"running": 1})
    assert status == 404 and body["error"] == "not-found" and "ghost" in f"{body['where']} {body['message']}"
    status, body = call(service, "POST", "/v1/nodes/register", {"name": "n1", "capacity": -3})
    assert status == 400 and body["error"] == "input"
    status, body = call(service, "POST", "/v1/place", {"layers": []})
    assert status == 400 and "layers" in f"{body['where']} {body['message']}"
    status, body = call(service, "POST", "/v1/place", b"{not json")
    assert status == 400 and body["error"] == "input" and "not JSON" in body["message"]
    assert call(service, "POST", "/v1/nope", {})[0] == 404


@pytest.mark.parametrize("node_cache_capable", [False, True], ids=["NodeList", "NodeNames"])
def test_extender_filter(cluster, node_cache_capable):
    args = extender_args(node_cache_capable=node_cache_capable)
    status, result = call(cluster, "POST", "/extender/filter", args)
    assert status == 200
    assert set(result) == FILTER_RESULT_KEYS
    assert result["Error"] == ""
    assert result["NodeNames"] == ["node-a", "node-b"]
    assert set(result["FailedNodes"]) == {"node-c"} and "slots busy" in result["FailedNodes"]["node-c"]
    assert set(result["FailedAndUnresolvableNodes"]) == {"node-d"}
    if node_cache_capable:
        assert result["Nodes"] is None
    else:  # the full Node objects of the nodes that passed, untouched, in a NodeList
        assert result["Nodes"]["items"] == [k8s_node("node-a"), k8s_node("node-b")]
        assert result["Nodes"]["metadata"] == {"resourceVersion": "90500"}


@pytest.mark.parametrize("node_cache_capable", [False, True], ids=["NodeList", "NodeNames"])
def test_extender_prioritize_scores_cached_nodes_higher(cluster, node_cache_capable):
    status, result = call(cluster, "POST", "/extender/prioritize", extender_args(node_cache_capable=node_cache_capable))
    assert status == 200
    assert isinstance(result, list) and all(set(entry) == {"Host", "Score"} for entry in result)
    scores = {entry["Host"]: entry["Score"] for entry in result}
    assert list(scores) == CANDIDATES
    assert all(isinstance(s, int) and 0 <= s <= 10 for s in scores.values())  # MinExtenderPriority..Max
    assert scores["node-a"] > scores["node-b"] > scores["node-c"]
    assert scores["node-d"] == 0  # no daemon: nothing cached


def test_pods_without_layers_pass_through(cluster):
    args = extender_args(annotations={"team": "infra"})
    status, result = call(cluster, "POST", "/extender/filter", args)
    assert status == 200 and result["NodeNames"] == CANDIDATES and result["FailedNodes"] == {}
    assert [item["metadata"]["name"] for item in result["Nodes"]["items"]] == CANDIDATES
    args["Pod"]["metadata"]["annotations"] = None  # a pod with no annotations at all
    status, result = call(cluster, "POST", "/extender/prioritize", args)
    assert status == 200 and result == [{"Host": name, "Score": 0} for name in CANDIDATES]


def test_bad_extender_args(cluster):
    broken = extender_args()
    del broken["Pod"]
    status, result = call(cluster, "POST", "/extender/filter", broken)
    assert status == 200 and set(result) == FILTER_RESULT_KEYS and "Pod" in result["Error"]
    status, result = call(cluster, "POST", "/extender/prioritize", broken)
    assert status == 400 and result["error"] == "input"
    nameless = copy.deepcopy(extender_args())
    del nameless["Nodes"]["items"][1]["metadata"]["name"]
    status, result = call(cluster, "POST", "/extender/filter", nameless)
    assert status == 200 and "metadata.name" in result["Error"]


def test_refs_in_annotations_are_resolved_and_cached():
    resolved = []
    refs = {"base/debian:12": BASE, "ws/task-413:v2": WORKSPACE, "toolkit/harness:3": TOOLKIT}

    def resolve(ref: str) -> str:
        resolved.append(ref)
        return refs[ref]

    with SchedService(port=0, resolve=resolve) as svc:
        call(svc, "POST", "/v1/nodes/register", {"name": "node-a", "capacity": 8})
        call(svc, "POST", "/v1/nodes/register", {"name": "node-b", "capacity": 8})
        call(svc, "POST", "/v1/nodes/node-b/report", {"cached": {WORKSPACE: 128 * MiB, TOOLKIT: 96 * MiB}})
        annotations = {"dsecfs.io/base": "base/debian:12", "dsecfs.io/workspace": "ws/task-413:v2",
                       "dsecfs.io/toolkit": "toolkit/harness:3"}
        args = {"Pod": sandbox_pod(annotations), "Nodes": None, "NodeNames": ["node-a", "node-b"]}
        for _ in range(3):
            status, result = call(svc, "POST", "/extender/prioritize", args)
            assert status == 200
            scores = {entry["Host"]: entry["Score"] for entry in result}
            assert scores["node-b"] > scores["node-a"]
    assert sorted(resolved) == sorted(refs)  # once each, then from the cache
