"""An S3 endpoint that answers a ranged GET with the whole object, chunked, with neither Content-Range nor
Content-Length (what a proxy or a non-AWS server may do): a bounded read of a profile stays bounded and
fails as a store error naming the key. A real HTTP server on 127.0.0.1, because moto always sends both."""

from __future__ import annotations

import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsec_fs.errors import CorruptError, UnsupportedError
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


class WholePackIgnoringRange(BaseHTTPRequestHandler):
    """Answers any GET with a 256 MiB object, Range ignored (a 200 with its Content-Length); ``sent``
    counts the bytes the client took before it closed the connection."""

    protocol_version = "HTTP/1.1"
    size = 256 << 20
    sent = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", str(self.size))
        self.end_headers()
        piece = bytes(1 << 20)
        for _ in range(self.size >> 20):
            try:
                self.wfile.write(piece)
            except (BrokenPipeError, ConnectionResetError):
                return
            type(self).sent += len(piece)

    def log_message(self, *args):
        pass


class UnsizedObject(BaseHTTPRequestHandler):
    """Answers any GET with OBJECT, the answer's end being the connection's (no Content-Length, not
    chunked: HTTP/1.0), so a client cannot know its size before reading it."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(OBJECT)

    def log_message(self, *args):
        pass


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")


@pytest.fixture
def endpoint(credentials):
    yield from _serve(ChunkedWholeObject)


@pytest.fixture
def range_ignoring_endpoint(credentials):
    WholePackIgnoringRange.sent = 0
    yield from _serve(WholePackIgnoringRange)


def test_a_ranged_get_answered_with_the_whole_object_reads_no_more_than_the_range(range_ignoring_endpoint):
    """A chunk's ranged GET of a pack, answered with all 256 MiB of it: a CorruptError naming the key,
    the connection dropped after a byte past the range (before, the whole answer was read into memory)."""
    store = S3Store("bucket", "p", endpoint_url=range_ignoring_endpoint, region="us-east-1")
    with store:
        with pytest.raises(CorruptError) as refused:
            store.get("packs/ab/" + "ab" * 32, 4096, 100)
    assert "packs/ab/" in refused.value.where
    assert WholePackIgnoringRange.sent < 64 << 20


def test_get_at_most_without_content_range_or_length_stays_bounded(endpoint):
    store = S3Store("bucket", "p", endpoint_url=endpoint, region="us-east-1")
    with store:
        with pytest.raises(UnsupportedError) as refused:
            store.get_at_most("profiles/layers/ab/node", 100)
    assert "profiles/layers/ab/node" in refused.value.where


@pytest.fixture
def unsized_endpoint(credentials):
    yield from _serve(UnsizedObject)


def test_a_bounded_read_of_an_answer_of_unknown_length_allocates_what_comes_not_the_limit(unsized_endpoint):
    """A layer's metadata is read with the manifest's size as the limit, which a lying manifest makes
    gigabytes: reading an answer whose length nobody said must not allocate all of the limit at once."""
    store = S3Store("bucket", "p", endpoint_url=unsized_endpoint, region="us-east-1")
    with store:
        tracemalloc.start()
        try:
            data = store.get_at_most("layers/ab/meta.erofs", 3 << 30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert data == OBJECT
    assert peak < 64 << 20, f"{peak} bytes allocated for an answer of {len(OBJECT)}"
