"""The node daemon's API server (lazy_fetch/http_api.py: h11 on trio, bodies typed by dsec_fs/api.py with
msgspec) against hypercorn + starlette on the same trio, side by side: one JSON route (a mount request
decoded into api.MountRequest, an api.MountInfo answered) on a unix socket, each server in its own
process, N requests in a row from http.client with a new connection each (as dsec_fs.client makes them).

    .venv/bin/pip install hypercorn starlette      # for this benchmark only: not dependencies of dsecfs
    .venv/bin/python bench/bench_api.py [--requests 2000] [--rounds 3]

Reports per server: start-up to the first answer, microseconds per request, resident memory after the
run, and the ratios hypercorn/h11. This is the measurement behind keeping the hand-written server (see
"Threads of the node daemon" in docs/architecture.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BODY = b'{"layer": "base/debian:12", "mountpoint": "/mnt/x"}'

H11_SERVER = """
import sys, trio
sys.path.insert(0, %r)
from dsec_fs import api
from lazy_fetch.http_api import HttpApi
http = HttpApi()
async def post(request):
    body = request.decode(api.MountRequest)
    return api.MountInfo(mountpoint=body.mountpoint, mode=body.mode, layer=body.layer)
http.route("POST", "/v1/mounts", post)
async def main():
    async with trio.open_nursery() as nursery:
        await nursery.start(http.serve, sys.argv[1])
        print("ready", flush=True)
trio.run(main)
""" % ROOT

ASGI_SERVER = """
import os, sys, trio
sys.path.insert(0, %r)
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from dsec_fs import api
async def post(request):
    body = api.decode(await request.body(), api.MountRequest, where="POST /v1/mounts")
    return Response(api.encode(api.MountInfo(mountpoint=body.mountpoint, mode=body.mode, layer=body.layer)),
                    media_type="application/json")
app = Starlette(routes=[Route("/v1/mounts", post, methods=["POST"])])
config = Config()
config.bind = ["unix:" + sys.argv[1]]
config.accesslog = config.errorlog = None
async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, app, config)
        while not os.path.exists(sys.argv[1]):
            await trio.sleep(0.01)
        print("ready", flush=True)
trio.run(main)
""" % ROOT


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost")
        self.path_ = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.path_)


def _requests(path: str, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        connection = _Unix(path)
        connection.request("POST", "/v1/mounts", body=BODY, headers={"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["layer"] == "base/debian:12"
        connection.close()
    return (time.perf_counter() - start) / count


def _run(code: str, path: str, count: int) -> dict:
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE)
    try:
        server.stdout.readline()
        while True:  # hypercorn makes the socket file at bind(), a moment before listen()
            try:
                _requests(path, 1)
                break
            except ConnectionRefusedError:
                time.sleep(0.005)
        ready = time.perf_counter() - started
        _requests(path, 50)  # warm-up
        per_request = _requests(path, count)
        with open(f"/proc/{server.pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    finally:
        server.kill()
        server.wait()
    return {"start_s": ready, "us_per_request": per_request * 1e6, "rss_mib": rss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import hypercorn  # noqa: F401
        import starlette  # noqa: F401
    except ImportError:
        raise SystemExit("needs hypercorn and starlette: .venv/bin/pip install hypercorn starlette")
    results: dict[str, list[dict]] = {"h11": [], "hypercorn+starlette": []}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):  # the sides alternate, so both see the same load
            sides = (("h11", H11_SERVER), ("hypercorn+starlette", ASGI_SERVER))
            for name, code in sides if round_ % 2 == 0 else sides[::-1]:
                results[name].append(_run(code, os.path.join(work, f"{name}.sock"), args.requests))
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}
    summary["ratio hypercorn/h11"] = {key: summary["hypercorn+starlette"][key] / summary["h11"][key]
                                      for key in summary["h11"]}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
