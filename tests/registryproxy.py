"""Faults the real registry does not make on demand, in front of it: a proxy that answers a manifest's
first request with 503 and redirects every blob GET to a separate "blob storage" server (another port,
so another host to the client), which breaks its first answer for each blob half-way. ``manifest_fault``
says what a manifest's first request gets instead of the empty 503: "nested-503", a 503 whose body nests
JSON arrays 4,096 deep (deeper than Python's recursion limit); "cut", the registry's answer with its
Content-Length and half its body, then the connection closed. ``blob_fault="drip"``: every blob GET is
answered by the front itself, its head at once and its body a byte every DRIP_SECONDS; ``upload_fault=
"drip"``: uploads (POST, PUT) are passed to the registry, and a PUT's answer sent back a byte every
DRIP_SECONDS (a registry that takes the blob and never quite answers). A drip ends when the front stops.

    with FaultyFront(registry) as front:   # front.address instead of registry.address
        ...
    front.storage_requests                 # [(path, headers)] the storage server got

The storage server reads blobs straight from the registry's files (DockerRegistry.blob_path) and honours
``Range: bytes=N-``. Both servers run in threads of the test process, stopped on exit.
"""

from __future__ import annotations

import http.client
import http.server
import re
import threading

from registryserver import DockerRegistry

DRIP_SECONDS = 0.2
_BLOB_PATH = re.compile(r"/v2/(.+)/blobs/(sha256:[0-9a-f]{64})")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


class FaultyFront:
    def __init__(self, registry: DockerRegistry, manifest_fault: str = "503", *, blob_fault: str = "",
                 upload_fault: str = ""):
        self.registry = registry
        self.manifest_fault = manifest_fault
        self.blob_fault = blob_fault
        self.upload_fault = upload_fault
        self._stopping = threading.Event()
        self.manifest_failures: set[str] = set()  # paths already answered 503 once
        self.truncated: set[str] = set()  # blobs whose first storage answer was cut
        self.front_requests: list[tuple[str, dict]] = []
        self.storage_requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()  # guards the sets and lists above
        self._front = _Server(("127.0.0.1", 0), self._front_handler())
        self._storage = _Server(("127.0.0.1", 0), self._storage_handler())
        self._threads = [threading.Thread(target=server.serve_forever, daemon=True)
                         for server in (self._front, self._storage)]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._front.server_address[1]}"

    def _front_handler(self):
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                with front._lock:
                    front.front_requests.append((self.path, dict(self.headers)))
                    first_try = "/manifests/" in self.path and self.path not in front.manifest_failures
                    front.manifest_failures.add(self.path)
                blob = _BLOB_PATH.fullmatch(self.path)
                if blob and self.command == "GET" and front.blob_fault == "drip":
                    data = front.registry.blob_path(blob.group(2)).read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self._drip(data)
                    return
                if first_try and front.manifest_fault == "cut":
                    self._forward(cut=True)
                    return
                if first_try:
                    body = b"[" * 4096 if front.manifest_fault == "nested-503" else b""
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if blob and self.command == "GET" and "Authorization" in self.headers:
                    self.send_response(307)
                    self.send_header("Location", f"http://127.0.0.1:{front._storage.server_address[1]}"
                                                 f"/storage/{blob.group(2)}?signature=abc")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._forward()

            def do_POST(self) -> None:
                self._pass_upload(drip=False)

            def do_PUT(self) -> None:
                self._pass_upload(drip=front.upload_fault == "drip")

            def _pass_upload(self, drip: bool) -> None:
                """The request to the registry as it came (its Host too: the registry names the front in
                the Location it answers), the answer back, dripped or whole."""
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream = http.client.HTTPConnection(front.registry.address, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                answer = response.read()
                upstream.close()
                head = [f"HTTP/1.1 {response.status} {response.reason}\r\n"]
                head += [f"{key}: {value}\r\n" for key, value in response.getheaders()
                         if key.lower() not in ("connection", "transfer-encoding", "content-length")]
                head.append(f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n")
                raw = "".join(head).encode() + answer
                self.close_connection = True
                if drip:
                    self._drip(raw)
                else:
                    self.wfile.write(raw)

            def _drip(self, data: bytes) -> None:
                self.close_connection = True
                for byte in data:
                    if front._stopping.wait(DRIP_SECONDS):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return

            def _forward(self, cut: bool = False) -> None:
                upstream = http.client.HTTPConnection(front.registry.address, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, headers=headers)
                response = upstream.getresponse()
                body = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body[:len(body) // 2] if cut else body)
                if cut:
                    self.wfile.flush()
                    self.close_connection = True
                upstream.close()

        return Handler

    def _storage_handler(self):
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                with front._lock:
                    front.storage_requests.append((self.path, dict(self.headers)))
                digest = self.path.split("/storage/", 1)[1].split("?", 1)[0]
                data = front.registry.blob_path(digest).read_bytes()
                offset = int(re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-")).group(1))
                with front._lock:
                    cut = digest not in front.truncated
                    front.truncated.add(digest)
                self.send_response(206 if offset else 200)
                self.send_header("Content-Length", str(len(data) - offset))
                self.end_headers()
                # The first answer promises the whole blob and stops half-way: a dropped connection.
                self.wfile.write(data[offset:offset + (len(data) - offset) // 2] if cut else data[offset:])
                self.wfile.flush()
                self.close_connection = True

        return Handler

    def __enter__(self) -> FaultyFront:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        for server in (self._front, self._storage):
            server.shutdown()
            server.server_close()
