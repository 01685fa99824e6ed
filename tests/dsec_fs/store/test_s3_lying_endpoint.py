"""An S3 endpoint that answers a ranged GET with the whole object, chunked, with neither Content-Range nor
Content-Length (what a proxy or a non-AWS server may do): a bounded read of a profile stays bounded and
fails as a store error naming the key. A real HTTP server on 127.0.0.1, because moto always sends both."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsec_fs.errors import UnsupportedError
from dsec_fs.store.s3 import S3Store

pytestmark = pytest.mark.s3

OBJECT = b"p" * (1 << 20)


class ChunkedWholeObject(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(OBJECT), 64 << 10):
            piece = OBJECT[start:start + (64 << 10)]
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as it should
                return
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChunkedWholeObject)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_get_at_most_without_content_range_or_length_stays_bounded(endpoint):
    store = S3Store("bucket", "p", endpoint_url=endpoint, region="us-east-1")
    with store:
        with pytest.raises(UnsupportedError) as refused:
            store.get_at_most("profiles/layers/ab/node", 100)
    assert "profiles/layers/ab/node" in refused.value.where
