"""containerd benchmark (issue 15): from the start of a pull to a first command's output, the dsecfs
snapshotter against containerd's overlayfs snapshotter with a normal pull, same image, same registry.

    .venv/bin/python bench/bench_containerd.py [--rounds 3] [--work DIR]

The image: the cached Debian + python3 rootfs (/var/cache/dsecfs-test/debian-python3, about 220 MB) as
one gzip layer, plus a small app layer; pushed with skopeo to Debian's docker-registry on 127.0.0.1 and
converted with `dsecfs convert` into a local FilesystemStore. The first command: ``python3 -c ...``
printing a line (python3 reads its binary, libraries and part of its standard library).

Both sides reach the registry through one delaying proxy (20 ms before each request's answer, every
answer's bytes through one shared 100 MB/s link); the dsecfs side reads the store through the node
daemon's LatencyStore with the same figures (``--latency 20 --bandwidth 100``). A round, each side:
a fresh containerd (its own root: empty content store and snapshots), drop_caches, then timed:

- ``overlayfs``: ``ctr images pull`` (every layer fetched and unpacked) and ``ctr run --rm`` of the
  command with containerd's overlayfs snapshotter;
- ``dsecfs``: ``dsecfs image pull`` of the converted image (manifest and config only) and ``ctr run
  --rm --snapshotter dsecfs``, with a fresh node daemon (empty chunk cache) and snapshotter;
- ``dsecfs+prefetch``: the same with the snapshotter's ``--prefetch-dir`` holding each layer's prefetch
  list, learned (``dsecfs prefetch build``'s learn_prefetch_list) from the traces of one untimed cold run
  of the same command before the rounds: the best case, as in bench_coldstart.py.

Sides rotate which goes first. Goal: dsecfs at most 0.25x overlayfs (median of the rounds), checked on
the best dsecfs side; exits 1 if it is missed. Needs root, containerd, docker-registry, skopeo, runc.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from benchlib import drop_caches, log  # noqa: E402
from containerdserver import Containerd, SnapshotterProcess  # noqa: E402
from dsec_fs.client import Node  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder.convert import convert_image  # noqa: E402
from erofs_builder.registry import RegistryOptions  # noqa: E402
from ociimage import TAR, TAR_GZIP, layer_tar, member, single_image  # noqa: E402
from registryserver import DockerRegistry  # noqa: E402

ROOTFS = "/var/cache/dsecfs-test/debian-python3"
LATENCY_MS = 20
BANDWIDTH_MBPS = 100
GOAL = 0.25
COMMAND = ["python3", "-c", "import json, sys; print('hello from', sys.version.split()[0])"]


class DelayingProxy:
    """An HTTP forwarder to ``upstream``: LATENCY_MS before each answer, all answers through one link of
    BANDWIDTH_MBPS (``_link`` guards the link's clock: when its next byte may go)."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self._link = threading.Lock()
        self._free_at = 0.0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward()

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                time.sleep(LATENCY_MS / 1000)
                self.send_response(response.status)
                chunked = response.getheader("Content-Length") is None and self.command != "HEAD"
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "keep-alive"):
                        self.send_header(key, value)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while self.command != "HEAD" and (piece := response.read(256 << 10)):
                    proxy._wait_for_link(len(piece))
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                upstream.close()

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def _wait_for_link(self, size: int) -> None:
        with self._link:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + size / (BANDWIDTH_MBPS * 1e6)
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def make_image(work: Path, registry: DockerRegistry) -> tuple[str, str, int]:
    """Push the image, convert it; (source name, converted name, compressed image bytes)."""
    base = work / "rootfs.tar"
    subprocess.run(["tar", "--numeric-owner", "--format=posix", "-C", ROOTFS, "-cf", str(base), "."], check=True)
    app = layer_tar(member("opt/app/config.json", json.dumps({"app": "bench"}).encode()))
    layout = single_image(work / "image", (TAR_GZIP, base.read_bytes()), (TAR, app))
    base.unlink()
    registry.push(layout.root, "bench/python:1")
    store = FilesystemStore(str(work / "store"))
    plain = RegistryOptions(plain_http=True, auth_files=())
    convert_image(f"docker://{registry.address}/bench/python:1", f"docker://{registry.address}/bench/python:1-dsecfs",
                  store, registry=plain)
    size = sum(d["size"] for d in registry.inspect_raw("bench/python:1")["layers"])
    return "bench/python:1", "bench/python:1-dsecfs", size


def run_overlayfs(work: Path, proxy: DelayingProxy, name: str, dummy_snapshotter: Path) -> tuple[float, float]:
    """(pull seconds, run seconds)."""
    with Containerd(work, snapshotter_socket=dummy_snapshotter) as ctrd:
        drop_caches()
        start = time.monotonic()
        ctrd.ctr("images", "pull", "--plain-http", f"{proxy.address}/{name}")
        pulled = time.monotonic()
        out = ctrd.ctr("run", "--rm", f"{proxy.address}/{name}", "bench", *COMMAND).stdout
        ran = time.monotonic()
        assert out.startswith("hello from"), out
        ctrd.ctr("images", "rm", "--sync", f"{proxy.address}/{name}")
    return pulled - start, ran - pulled


def run_dsecfs(work: Path, proxy: DelayingProxy, name: str, store_url: str,
               prefetch_dir: Path | None = None) -> tuple[float, float, int, dict[str, str]]:
    """(pull seconds, run seconds, bytes the daemon fetched, {layer: its mount's trace file})."""
    from overlay.containerd_client import ContainerdClient
    from overlay.image_pull import pull_image

    daemon = Node.start_daemon(str(work / "d.sock"), state_dir=str(work / "dstate"), cache_dir=str(work / "dcache"),
                               store=store_url, latency_ms=LATENCY_MS, bandwidth_mbps=BANDWIDTH_MBPS,
                               log_file=str(work / "daemon.log"))
    try:
        with SnapshotterProcess(work / "snap", allow_store=store_url, daemon_socket=str(work / "d.sock"),
                                prefetch_dir=prefetch_dir) as snap, \
                Containerd(work / "ctrd", snapshotter_socket=snap.socket) as ctrd:
            drop_caches()
            start = time.monotonic()
            with ContainerdClient(str(ctrd.socket), "dsecfs-test") as client:
                pulled = pull_image(f"docker://{proxy.address}/{name}", client,
                                    registry=RegistryOptions(plain_http=True, auth_files=()))
            pull_done = time.monotonic()
            out = ctrd.ctr("run", "--rm", "--snapshotter", "dsecfs", pulled.name, "bench", *COMMAND).stdout
            ran = time.monotonic()
            assert out.startswith("hello from"), out
            fetched = sum(layer.bytes_fetched for layer in daemon.node.status().layers)
            traces = {m.layer: m.trace for m in daemon.node.mounts()}
            ctrd.ctr("images", "rm", "--sync", pulled.name)
    finally:
        daemon.stop()
    return pull_done - start, ran - pull_done, fetched, traces


def learn_lists(work: Path, proxy: DelayingProxy, name: str, store_url: str, prefetch_dir: Path) -> None:
    """One untimed cold dsecfs run; each layer's list from its trace into ``prefetch_dir``."""
    from lazy_fetch.analysis import learn_prefetch_list
    from lazy_fetch.prefetch_list import save

    _pull, _run, _fetched, traces = run_dsecfs(work, proxy, name, store_url)
    prefetch_dir.mkdir(parents=True, exist_ok=True)
    with FilesystemStore(store_url[len("file://"):]) as store:
        for layer, trace in traces.items():
            save(learn_prefetch_list([trace], store), str(prefetch_dir / f"{layer}.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=None, help="scratch directory (default: a new one in /tmp)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (containerd, mounts, drop_caches)")
    if not os.path.isdir(os.path.join(ROOTFS, "usr")):
        raise SystemExit(f"{ROOTFS} is missing: run bench/bench_coldstart.py once to make it")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-ctrd-"))
    sides = ["overlayfs", "dsecfs", "dsecfs+prefetch"]
    results: dict[str, list[float]] = {side: [] for side in sides}
    phases: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    fetched: dict[str, list[int]] = {"dsecfs": [], "dsecfs+prefetch": []}
    try:
        with DockerRegistry(work / "registry") as registry:
            log("pushing and converting the image")
            name, converted, image_bytes = make_image(work, registry)
            store_url = FilesystemStore(str(work / "store")).url
            proxy = DelayingProxy(registry.address)
            # The overlayfs side's containerd needs a dsecfs proxy entry too (same config): a socket
            # nobody serves, never used by it.
            idle_socket = work / "idle.sock"
            prefetch_dir = work / "prefetch"
            try:
                log("learning prefetch lists from one cold run")
                learn_lists(work / "learn", proxy, converted, store_url, prefetch_dir)
                for k in range(args.rounds):
                    order = sides[k % 3:] + sides[:k % 3]
                    for side in order:
                        round_dir = work / f"{side}-{k}"
                        if side == "overlayfs":
                            pull_s, run_s = run_overlayfs(round_dir, proxy, name, idle_socket)
                        else:
                            lists = prefetch_dir if side == "dsecfs+prefetch" else None
                            pull_s, run_s, got, _traces = run_dsecfs(round_dir, proxy, converted, store_url, lists)
                            fetched[side].append(got)
                        results[side].append(pull_s + run_s)
                        phases[side].append((pull_s, run_s))
                        log(f"round {k} {side}: {pull_s + run_s:.2f} s (pull {pull_s:.2f}, run {run_s:.2f})")
                        shutil.rmtree(round_dir, ignore_errors=True)
            finally:
                proxy.close()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    medians = {side: statistics.median(results[side]) for side in sides}
    ratios = {side: medians[side] / medians["overlayfs"] for side in sides}
    print(f"{'side':<16} {'median s':>9} {'pull s':>7} {'run s':>7} {'ratio':>7} {'fetched MB':>11}")
    for side in sides:
        pulls, runs = zip(*phases[side])
        got = f"{statistics.median(fetched[side]) / 1e6:.1f}" if side in fetched else ""
        print(f"{side:<16} {medians[side]:>9.2f} {statistics.median(pulls):>7.2f} {statistics.median(runs):>7.2f} "
              f"{ratios[side]:>7.3f} {got:>11}")
    best = min(ratios["dsecfs"], ratios["dsecfs+prefetch"])
    print(f"image {image_bytes / 1e6:.0f} MB compressed; goal dsecfs <= {GOAL} of overlayfs: "
          f"{'met' if best <= GOAL else 'missed'} ({best:.3f})")
    print(json.dumps({"image_bytes": image_bytes, "rounds": args.rounds, "seconds": results, "phases_s": phases,
                      "bytes_fetched": fetched, "medians_s": medians, "ratios": ratios, "goal": GOAL,
                      "met": best <= GOAL}, indent=2))
    sys.exit(0 if best <= GOAL else 1)


if __name__ == "__main__":
    main()
