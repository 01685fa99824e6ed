"""Builds from a real registry (Debian's docker-registry on 127.0.0.1, images pushed by skopeo from layouts
the tests write): the same layers as from the layout, tags and digests, multi-platform indexes, basic auth
with credentials from the auth files, and the errors for a missing tag, bad credentials and a corrupt blob,
none of which publishes anything."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from dsec_fs.errors import IntegrityError, NotFoundError, UnavailableError
from dsec_fs.layer import list_refs
from dsec_fs.store import FilesystemStore
from erofs_builder.build import build_image_layers, build_layer
from erofs_builder.registry import RegistryClient, RegistryOptions
from erofs_builder.walk_oci import OCI_MANIFEST

from ociimage import OCI_INDEX, TAR, TAR_GZIP, TAR_ZSTD, Layout, directory, layer_tar, member, single_image
from registryserver import DockerRegistry, have_registry_tools

pytestmark = pytest.mark.skipif(not have_registry_tools(), reason="needs docker-registry, skopeo and htpasswd")

PLAIN = RegistryOptions(plain_http=True, auth_files=())
LAYERS = [
    (TAR_GZIP, layer_tar(directory("etc"), member("etc/a", b"a1" * 5000), member("etc/b", b"b1"),
                         member("bin-tool", b"\x7fELF" + bytes(70000), mode=0o755))),
    (TAR_ZSTD, layer_tar(member("etc/.wh.a", b""), member("etc/c", b"c2"))),
    (TAR, layer_tar(member("top", b"uncompressed layer"))),
]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with DockerRegistry(tmp_path_factory.mktemp("registry")) as server:
        yield server


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory) -> tuple[str, Layout]:
    """The three-layer image, pushed as test/three:v1; (its docker:// reference, the layout)."""
    layout = single_image(tmp_path_factory.mktemp("three"), *LAYERS)
    registry.push(layout.root, "test/three:v1")
    return f"docker://{registry.address}/test/three:v1", layout


def store_at(path: Path) -> FilesystemStore:
    return FilesystemStore(str(path))


def published(store) -> tuple[dict, list[str]]:
    """The store's refs and layer manifests: what a failed build must not have left."""
    return list_refs(store), sorted(store.list("layers/"))


def dsecfs(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_a_registry_image_builds_the_layers_its_layout_builds(registry, pushed, tmp_path):
    ref, layout = pushed
    before = len(registry.access_log())
    flat = build_layer(ref, store_at(tmp_path / "a"), registry=PLAIN, name="three:flat")
    assert flat.digest == build_layer(layout.root, store_at(tmp_path / "b")).digest
    blob_gets = [line for line in registry.access_log()[before:] if line.startswith("GET ") and "/blobs/" in line]
    # The config, then each layer once: streamed into the build, not downloaded first and read again.
    assert len(blob_gets) == 1 + len(LAYERS)
    layers = build_image_layers(ref, store_at(tmp_path / "a"), registry=PLAIN)
    assert [r.digest for r in layers] == [r.digest for r in build_image_layers(layout.root, store_at(tmp_path / "b"))]
    assert store_at(tmp_path / "a").get("layers/" + flat.digest + "/manifest.json")  # published under its digest
    assert json.loads(store_at(tmp_path / "a").get(f"layers/{flat.digest}/manifest.json"))["source"] == ref


def test_a_digest_reference_pins_the_manifest(registry, pushed, tmp_path):
    ref, layout = pushed
    client = RegistryClient(registry.address, PLAIN)
    _data, _media_type, digest = client.get_manifest("test/three", "v1", ["application/vnd.oci.image.manifest.v1+json"])
    by_digest = f"docker://{registry.address}/test/three@{digest}"
    assert build_layer(by_digest, store_at(tmp_path / "s"), registry=PLAIN).digest == \
        build_layer(layout.root, store_at(tmp_path / "t")).digest
    with pytest.raises(NotFoundError, match="no such manifest"):
        build_layer(f"docker://{registry.address}/test/three@sha256:{'0' * 64}", store_at(tmp_path / "s"),
                    registry=PLAIN)


def test_a_missing_tag_is_not_found_and_publishes_nothing(registry, pushed, tmp_path):
    store = store_at(tmp_path / "store")
    missing = f"docker://{registry.address}/test/three:nope"
    with pytest.raises(NotFoundError, match=r"test/three:nope.*no such manifest.*MANIFEST_UNKNOWN"):
        build_layer(missing, store, registry=PLAIN, name="x:1")
    result = dsecfs("build", "--plain-http", "--store", str(tmp_path / "store"), "--name", "x:1", missing)
    assert result.returncode == 6, result.stderr
    assert "not-found error" in result.stderr and "test/three:nope" in result.stderr
    assert published(store) == ({}, [])


def test_an_index_gives_the_image_for_the_platform(registry, tmp_path):
    layout = Layout(tmp_path / "multi")
    amd64 = layout.image([(TAR_GZIP, layer_tar(member("arch", b"amd64")))])
    arm64 = layout.image([(TAR_GZIP, layer_tar(member("arch", b"arm64")))], arch="arm64")
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {**amd64, "platform": {"os": "linux", "architecture": "amd64"}},
        {**arm64, "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}}]}  # fmt: skip
    layout.index(layout.blob(json.dumps(index).encode(), OCI_INDEX))
    registry.push(layout.root, "test/multi:v1", all_images=True)
    assert registry.inspect_raw("test/multi:v1")["mediaType"] == OCI_INDEX
    ref = f"docker://{registry.address}/test/multi:v1"
    for platform in ("linux/amd64", "linux/arm64"):
        from_registry = build_layer(ref, store_at(tmp_path / "s"), registry=PLAIN, platform=platform)
        assert from_registry.digest == build_layer(layout.root, store_at(tmp_path / "t"), platform=platform).digest
    with pytest.raises(Exception, match=r"no image for platform linux/s390x.*linux/amd64.*linux/arm64/v8"):
        build_layer(ref, store_at(tmp_path / "s"), registry=PLAIN, platform="linux/s390x")


def test_a_corrupt_blob_names_its_digest_and_publishes_nothing(registry, tmp_path):
    layout = single_image(tmp_path / "c", (TAR_GZIP, layer_tar(member("f", b"only in this image " * 1000))))
    registry.push(layout.root, "test/corrupt:v1")
    manifest = registry.inspect_raw("test/corrupt:v1")
    digest = manifest["layers"][0]["digest"]
    blob = registry.blob_path(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash tells
    blob.write_bytes(bytes(data))
    store = store_at(tmp_path / "store")
    ref = f"docker://{registry.address}/test/corrupt:v1"
    with pytest.raises(IntegrityError, match=digest):
        build_layer(ref, store, registry=PLAIN, name="c:1")
    result = dsecfs("build", "--plain-http", "--store", str(tmp_path / "store"), "--name", "c:1", ref)
    assert result.returncode == 3 and "corrupt error" in result.stderr and digest in result.stderr, result.stderr
    assert published(store) == ({}, [])


# ---------------------------------------------------------------------------------------------------------
# Basic auth (htpasswd), credentials from the auth files.


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    with DockerRegistry(tmp_path_factory.mktemp("auth-registry"), htpasswd={"alice": "s3cret"}) as server:
        layout = single_image(tmp_path_factory.mktemp("private"), (TAR_GZIP, layer_tar(member("secret", b"x"))))
        server.push(layout.root, "private/img:v1", creds="alice:s3cret")
        yield server


def auth_file(path: Path, host: str, user: str, password: str, *, split: bool = False) -> Path:
    entry = {"username": user, "password": password} if split else \
        {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}
    path.write_text(json.dumps({"auths": {host: entry}}))
    return path


def test_basic_auth_with_credentials_from_the_auth_files(auth_registry, tmp_path, monkeypatch):
    ref = f"docker://{auth_registry.address}/private/img:v1"
    store = store_at(tmp_path / "store")
    with pytest.raises(UnavailableError, match="no credentials") as no_login:
        build_layer(ref, store, registry=PLAIN)
    assert not no_login.value.transient
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file(tmp_path / "auth.json", auth_registry.address,
                                                           "alice", "s3cret")))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
    first = build_layer(ref, store, registry=RegistryOptions(plain_http=True))
    # ~/.docker/config.json (here $DOCKER_CONFIG/config.json), with a URL key and separate fields.
    monkeypatch.delenv("REGISTRY_AUTH_FILE")
    (tmp_path / "docker").mkdir()
    auth_file(tmp_path / "docker" / "config.json", f"http://{auth_registry.address}/v1/", "alice", "s3cret",
              split=True)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    assert build_layer(ref, store, registry=RegistryOptions(plain_http=True)).digest == first.digest


def test_bad_credentials_are_refused_clearly_and_publish_nothing(auth_registry, tmp_path):
    ref = f"docker://{auth_registry.address}/private/img:v1"
    store = store_at(tmp_path / "store")
    wrong = auth_file(tmp_path / "auth.json", auth_registry.address, "alice", "wrong-password")
    with pytest.raises(UnavailableError, match=f"credentials for {auth_registry.address} not accepted") as refused:
        build_layer(ref, store, registry=RegistryOptions(plain_http=True, auth_files=(str(wrong),)))
    assert not refused.value.transient
    env = {"PATH": "/usr/bin:/bin", "REGISTRY_AUTH_FILE": str(wrong), "HOME": str(tmp_path)}
    result = dsecfs("build", "--plain-http", "--store", str(tmp_path / "store"), "--name", "p:1", ref, env=env)
    assert result.returncode == 5 and "not accepted" in result.stderr, result.stderr
    assert "wrong-password" not in result.stderr + result.stdout
    assert published(store) == ({}, [])


def test_retries_redirects_and_a_broken_blob_stream_resumed(auth_registry, tmp_path):
    """503 on the manifest, every blob redirected to another host (which must not get the credentials),
    and each blob's first answer cut half-way: the build still gives the layout's layer."""
    from registryproxy import FaultyFront

    layout = single_image(tmp_path / "big", *LAYERS)
    auth_registry.push(layout.root, "private/big:v1", creds="alice:s3cret")
    with FaultyFront(auth_registry) as front:
        files = (str(auth_file(tmp_path / "auth.json", front.address, "alice", "s3cret")),)
        options = RegistryOptions(plain_http=True, auth_files=files, base_delay=0.01)
        result = build_layer(f"docker://{front.address}/private/big:v1", store_at(tmp_path / "s"), registry=options)
    assert result.digest == build_layer(layout.root, store_at(tmp_path / "t")).digest
    assert any(path.endswith("/manifests/v1") for path in front.manifest_failures)
    assert any("Authorization" in headers for _path, headers in front.front_requests)
    assert front.storage_requests and not any("Authorization" in headers for _path, headers in front.storage_requests)
    resumed = [headers["Range"] for _path, headers in front.storage_requests if "Range" in headers]
    assert len(resumed) >= len(LAYERS)  # every layer (and the config) resumed after its cut


@pytest.mark.parametrize("fault", ["cut", "nested-503"])
def test_a_manifest_answer_cut_short_or_a_hostile_error_body_is_retried(registry, pushed, tmp_path, fault):
    """A manifest's first answer cut half-way (its Content-Length promised more), or a 503 whose body nests
    JSON arrays deeper than Python's recursion limit: both are failed attempts, retried, by tag and by
    digest. Before: the half manifest was taken for the whole one (by tag "not valid JSON", an InputError;
    by digest an IntegrityError, as if the registry held a corrupt manifest), and the error body raised
    RecursionError out of the client (a traceback from the CLI)."""
    from registryproxy import FaultyFront

    ref, layout = pushed
    expected = build_layer(layout.root, store_at(tmp_path / "t")).digest
    digest = RegistryClient(registry.address, PLAIN).get_manifest("test/three", "v1", [OCI_MANIFEST])[2]
    with FaultyFront(registry, manifest_fault=fault) as front:
        options = RegistryOptions(plain_http=True, auth_files=(), base_delay=0.01)
        for reference in (f"docker://{front.address}/test/three:v1", f"docker://{front.address}/test/three@{digest}"):
            assert build_layer(reference, store_at(tmp_path / "s"), registry=options).digest == expected
    assert {path.rpartition("/")[2] for path in front.manifest_failures} >= {"v1", digest}


def test_a_token_server_answering_json_nested_past_the_recursion_limit_is_an_unavailable_registry():
    """A token realm whose answer nests JSON arrays deeper than Python's recursion limit: UnavailableError
    naming the token server (before: RecursionError out of the client, a traceback from the CLI)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.startswith("/token"):
                self.send_response(200)
                self.send_header("Content-Length", "4096")
                self.end_headers()
                self.wfile.write(b"[" * 4096)
                return
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{port}/token",service="x"')
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{port}", RegistryOptions(plain_http=True, auth_files=(), attempts=2,
                                                                    base_delay=0.01))
        with pytest.raises(UnavailableError, match=f"token server 127.0.0.1:{port} answered no token"):
            client.get_manifest("team/app", "v1", [OCI_MANIFEST])
    finally:
        server.shutdown()
        server.server_close()


def test_a_registry_that_sends_its_answer_a_byte_at_a_time_is_given_up_on():
    """A registry that answers every request a byte every 0.2 s: each read gets a byte long before its
    timeout (1 s here), so before, fetching a manifest took as long as the registry liked (the answer's
    head alone, a few hundred bytes, a minute; a build waited for ever on a registry that never ends its
    headers). Now each attempt ends after ``timeout`` seconds: UnavailableError naming the manifest, the
    registry and the deadline, after ``attempts`` attempts."""
    import http.server
    import threading

    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n" \
                     + b"X-Padding: " + b"x" * 1000 + b"\r\n\r\n{}"
            for byte in answer:
                if stop.wait(0.2):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    outcome = []

    def fetch() -> None:
        client = RegistryClient(f"127.0.0.1:{server.server_address[1]}",
                                RegistryOptions(plain_http=True, auth_files=(), attempts=2, base_delay=0.01,
                                                timeout=1.0))
        try:
            outcome.append(client.get_manifest("team/app", "v1", [OCI_MANIFEST]))
        except Exception as exc:
            outcome.append(exc)

    fetching = threading.Thread(target=fetch, daemon=True)
    try:
        fetching.start()
        fetching.join(30)
        assert not fetching.is_alive(), "still waiting for the answer after 30 s"
        assert isinstance(outcome[0], UnavailableError), outcome
        assert "no whole answer within 1 s (gave up after 2 attempts)" in str(outcome[0])
        assert outcome[0].where.startswith(f"127.0.0.1:{server.server_address[1]}/team/app")
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_the_bearer_token_flow(tmp_path):
    """The registry's 401 names a token realm; the login goes there (only), the token to the registry."""
    from tokenserver import TokenServer

    with TokenServer(tmp_path / "tokens", users={"bob": "t0ken-pw"}) as tokens, \
            DockerRegistry(tmp_path / "registry", token=tokens) as registry:
        layout = single_image(tmp_path / "img", *LAYERS[:2])
        registry.push(layout.root, "team/app:v1", creds="bob:t0ken-pw")
        ref = f"docker://{registry.address}/team/app:v1"
        with pytest.raises(UnavailableError, match="token server .* refused a token") as refused:
            build_layer(ref, store_at(tmp_path / "s"), registry=RegistryOptions(plain_http=True, auth_files=()))
        assert not refused.value.transient
        with pytest.raises(UnavailableError, match="TLS failed .*WRONG_VERSION_NUMBER.*--plain-http") as tls:
            build_layer(ref, store_at(tmp_path / "s"), registry=RegistryOptions(auth_files=()))
        assert not tls.value.transient
        asked = len(tokens.requests)
        good = RegistryOptions(plain_http=True, auth_files=(str(auth_file(tmp_path / "a.json", registry.address,
                                                                             "bob", "t0ken-pw")),))
        result = build_layer(ref, store_at(tmp_path / "s"), registry=good)
        assert result.digest == build_layer(layout.root, store_at(tmp_path / "t")).digest
        ours = tokens.requests[asked:]
        assert len(ours) == 1 and "scope=repository%3Ateam%2Fapp%3Apull" in ours[0][0]  # one token, reused
        assert ours[0][1]["Authorization"] == "Basic " + base64.b64encode(b"bob:t0ken-pw").decode()
        # Pushing asks for a pull,push token of the target repository.
        from erofs_builder.convert import convert_image

        converted = convert_image(ref, f"docker://{registry.address}/team/app:v1-dsecfs", store_at(tmp_path / "s"),
                                  registry=good)
        assert registry.inspect_raw("team/app:v1-dsecfs", creds="bob:t0ken-pw")["layers"][0]["digest"] == \
            "sha256:" + converted.layers[0].digest
        # (the registry's challenge names the actions in either order: Go's map order)
        scopes = [value for path, _ in tokens.requests[asked:]
                  for name, value in urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query) if name == "scope"]
        assert any(scope.rpartition(":")[0] == "repository:team/app" and
                   set(scope.rpartition(":")[2].split(",")) == {"pull", "push"} for scope in scopes), scopes


def _within(seconds: float, call) -> object:
    """``call()``'s result or the exception it raised; AssertionError if it has not ended in ``seconds``."""
    import threading

    outcome = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still transferring after {seconds} s"
    return outcome[0]


def test_a_registry_that_drips_a_blob_is_given_up_on_at_the_blobs_deadline(registry, pushed, tmp_path):
    """Every blob's body sent a byte every 0.2 s (tests/registryproxy.py): each read gets its byte long
    before its timeout, so before, a build pulled the image's config (a few hundred bytes) for a minute or
    more and each layer for hours. Now a blob's whole transfer has ``timeout`` (1 s here) and its size at
    ``min_rate``: UnavailableError naming the registry, the repository and the blob's digest; nothing
    published."""
    from registryproxy import FaultyFront

    store = store_at(tmp_path / "s")
    with FaultyFront(registry, blob_fault="drip") as front:
        options = RegistryOptions(plain_http=True, auth_files=(), base_delay=0.01, timeout=1.0)
        outcome = _within(60, lambda: build_layer(f"docker://{front.address}/test/three:v1", store, registry=options))
    assert isinstance(outcome, UnavailableError), outcome
    assert outcome.where.startswith(f"{front.address}/test/three@sha256:"), outcome.where
    assert "no whole answer within 1" in outcome.message and "bytes a second" in outcome.message
    assert published(store) == ({}, [])


def test_an_upload_whose_answer_drips_is_given_up_on_at_its_deadline(registry):
    """A registry that takes an upload's PUT and sends its answer a byte every 0.2 s: before, uploads had
    no deadline at all, so the push waited as long as the registry liked. Now the upload's deadline is
    ``timeout`` and its size at ``min_rate``: UnavailableError naming the registry, the repository and
    the blob's digest."""
    import hashlib

    from registryproxy import FaultyFront

    data = bytes(range(256)) * 1200
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with FaultyFront(registry, upload_fault="drip") as front:
        client = RegistryClient(front.address, RegistryOptions(plain_http=True, auth_files=(), base_delay=0.01,
                                                               timeout=1.0))
        outcome = _within(60, lambda: client.push_blob("test/upload", data))
    assert isinstance(outcome, UnavailableError), outcome
    assert outcome.where == f"{front.address}/test/upload: upload of {digest}"
    assert "no whole answer within 1.29" in outcome.message and "307,200 bytes" in outcome.message


def test_the_registry_commands_take_the_transfer_deadline_from_their_flags(registry, pushed, tmp_path):
    """``dsecfs build --registry-timeout 1s`` through a registry that drips every blob: given up on at 1 s and
    the blob's size at --registry-min-rate (before, no flag set it: a minute's wait at the least), naming
    the blob; nothing published."""
    from registryproxy import FaultyFront

    store = tmp_path / "s"
    with FaultyFront(registry, blob_fault="drip") as front:
        done = dsecfs("build", f"docker://{front.address}/test/three:v1", "--plain-http", "--store", str(store),
                      "--registry-timeout", "1s", "--registry-min-rate", "1MiB", "--json")
    assert done.returncode != 0, done.stdout
    error = json.loads(done.stdout)["error"]
    assert error["class"] == "UnavailableError" and "no whole answer within 1" in error["message"], error
    assert error["where"].startswith(f"{front.address}/test/three@sha256:")
    assert published(store_at(store)) == ({}, [])
