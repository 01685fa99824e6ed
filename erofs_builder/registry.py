"""A client of the OCI distribution API: image references, credentials, auth, manifests and blobs.

References: ``docker://HOST[:PORT]/REPO[:TAG][@sha256:HEX]``; a name without a host (``debian:12``) is on
Docker Hub (``docker.io/library/debian``), the tag defaults to ``latest``.

Auth, as a registry asks for it in its 401's ``WWW-Authenticate``: none, ``Basic`` (the credentials go
with every request), or ``Bearer`` (the token flow: the credentials, if any, go to the realm named by the
challenge, which answers a token for the challenge's scope; tokens are cached per scope). Credentials
come from ``$REGISTRY_AUTH_FILE`` (containers-auth.json), else ``$DOCKER_CONFIG/config.json`` or
``~/.docker/config.json``: the ``auths`` entry for the host, ``auth`` (base64 "user:password") or
``username`` / ``password``. Credential helpers are not run. Credentials and tokens are never logged
and never sent to another host: a redirect to another host (blob storage) goes without them, and a token
realm over plain HTTP is refused unless the registry itself is plain HTTP (``plain_http``).

Errors: a missing manifest or blob is NotFoundError; a refused login, or any other 4xx, is
UnavailableError(transient=False) naming the registry's error code; connection failures, 429 and 5xx are
retried with jittered exponential backoff (dsec_fs.backoff) and then raise UnavailableError(transient=True);
so is a manifest or token answer that breaks off before its Content-Length, and an answer not whole
within ``RegistryOptions.timeout`` (``_Deadline``: each read's own timeout never fires on a registry that
sends a byte at a time). A blob's whole transfer, down (its stream, resumes included) or up (its PUT,
retries included), has a deadline scaled to its size, ``transfer_seconds``: ``timeout`` and the size at
``min_rate`` bytes a second; past it an UnavailableError names the registry, repository and digest. A
request's socket timeout is the same figure for its body (``sendall`` counts the whole body against it).
A blob stream that breaks mid-way is resumed with a Range request from where it stopped. What the registry sends is not trusted:
manifests fetched by digest are checked against it, JSON is size-limited (and its nesting: one deeper
than Python's recursion limit is refused), and blob content is verified by the caller
(walk_oci.VerifiedBlob) while it streams.

Threads: a RegistryClient is used by one thread at a time (its token cache has no lock); each request
opens its own connection, so streams from one client may be read one after the other. A ``_Deadline``'s
timer runs in a thread of its own (threading.Timer) and only shuts sockets down.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from dsec_fs.backoff import backoff_delay
from dsec_fs.errors import InputError, IntegrityError, NotFoundError, UnavailableError

log = logging.getLogger(__name__)

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
MAX_MANIFEST_SIZE = 4 << 20  # registries refuse manifests over 4 MiB
MAX_ERROR_BODY = 4096
MAX_REDIRECTS = 5
RETRIED_STATUS = {408, 429, 500, 502, 503, 504}
USER_AGENT = "dsecfs"
# A repository path component and a tag, as the distribution spec writes them.
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class ImageRef:
    """One image in a registry: a tag, a digest, or both (then the digest decides)."""

    host: str  # "host[:port]" as written (docker.io for Docker Hub)
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest if there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> ImageRef:
        return ImageRef(self.host, self.repository, self.tag, digest)

    def __str__(self) -> str:
        return f"docker://{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")


def parse_image_ref(text: str) -> ImageRef:
    """``docker://HOST[:PORT]/REPO[:TAG][@sha256:HEX]`` (the ``docker://`` is optional) as an ImageRef."""
    rest = text.removeprefix("docker://")
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise InputError(f"digest {digest!r} is not sha256:<64 hex digits>", where=text)
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        host, path = first, remainder
    else:
        host, path = DOCKER_HUB, rest if "/" in rest else f"library/{rest}"
    tag = None
    name, colon, maybe_tag = path.rpartition(":")
    if colon and "/" not in maybe_tag:
        path, tag = name, maybe_tag
        if not _TAG.fullmatch(tag):
            raise InputError(f"tag {tag!r} is not a valid tag", where=text)
    if not _REPO.fullmatch(path):
        raise InputError(f"repository {path!r} is not a valid repository name (lower case, '/'-separated)",
                         where=text)
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(host, path, tag, digest)


# ---------------------------------------------------------------------------------------------------------
# Credentials.


def auth_file_paths() -> list[str]:
    """Where credentials are looked for, in order."""
    paths = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        paths.append(os.environ["REGISTRY_AUTH_FILE"])
    docker_dir = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    paths.append(os.path.join(docker_dir, "config.json"))
    return paths


def _auth_key_host(key: str) -> str:
    """The host an ``auths`` key names: keys may be "host", "https://host" or "https://host/v1/"."""
    if "://" in key:
        key = key.split("://", 1)[1]
    host = key.split("/", 1)[0]
    return DOCKER_HUB if host in ("index.docker.io", DOCKER_HUB_API) else host


def load_credentials(host: str, paths: Iterable[str] | None = None) -> tuple[str, str] | None:
    """(user, password) for ``host`` from the first auth file that has an entry for it, else None."""
    for path in auth_file_paths() if paths is None else paths:
        try:
            with open(path, "rb") as f:
                config = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read the auth file: {exc}", where=path) from None
        auths = config.get("auths") if isinstance(config, dict) else None
        for key, entry in (auths or {}).items():
            if _auth_key_host(key) != host or not isinstance(entry, dict):
                continue
            if entry.get("auth"):
                try:
                    user, _, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    raise InputError(f"the 'auth' entry for {host} is not base64 of user:password",
                                     where=path) from None
                return user, password
            if entry.get("username"):
                return entry["username"], entry.get("password", "")
    return None


# ---------------------------------------------------------------------------------------------------------
# The client.


@dataclass(frozen=True)
class RegistryOptions:
    """How to reach registries: ``plain_http`` for local ones without TLS; ``credentials`` (user,
    password) instead of the auth files; ``auth_files`` instead of the default list (auth_file_paths)."""

    plain_http: bool = False
    credentials: tuple[str, str] | None = None
    auth_files: tuple[str, ...] | None = None
    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0
    timeout: float = 60.0  # seconds for a request and its answer (a blob's: the floor of its deadline)
    # Bytes a second a blob's transfer must keep up on average, over and above ``timeout``: 1 MiB/s (8
    # Mbit/s, below any link one pulls sandbox images over) gives a 1 GiB layer 18 minutes; a registry
    # that sends or takes a byte every few seconds is given up on within ``timeout`` for a small blob.
    min_rate: float = float(1 << 20)


class RegistryClient:
    """The distribution API of one registry host, for one repository's pulls and pushes at a time."""

    def __init__(self, host: str, options: RegistryOptions = RegistryOptions()):
        self.host = host
        self.options = options
        self._api_host = DOCKER_HUB_API if host == DOCKER_HUB else host
        self._scheme = "http" if options.plain_http else "https"
        self._credentials = options.credentials or load_credentials(host, options.auth_files)
        self._auth: dict[str, str] = {}  # scope -> Authorization header value
        self._ssl = None if options.plain_http else ssl.create_default_context()

    def transfer_seconds(self, size: int) -> float:
        """The time a transfer of ``size`` bytes may take: ``timeout``, and ``size`` at ``min_rate``."""
        return self.options.timeout + size / self.options.min_rate

    def _transfer_deadline(self, size: int) -> _Deadline:
        return _Deadline(self.transfer_seconds(size), basis=f"{size:,} bytes: {self.options.timeout:g} s and the size "
                                                            f"at {self.options.min_rate:g} bytes a second")

    # -- the public calls ------------------------------------------------------------------------------

    def get_manifest(self, repository: str, reference: str, accept: Iterable[str]) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of a manifest or index, by tag or digest."""
        where = f"{self.host}/{repository}:{reference}" if not reference.startswith("sha256:") else \
            f"{self.host}/{repository}@{reference}"
        response, data = self._exchange("GET", f"/v2/{repository}/manifests/{reference}", scope=_pull(repository),
                                        headers={"Accept": ", ".join(accept)}, where=where, what="manifest",
                                        read_limit=MAX_MANIFEST_SIZE)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise IntegrityError(f"the registry sent a manifest whose sha256 is {digest}", where=where)
        media_type = (response.getheader("Content-Type") or "").split(";")[0].strip()
        return data, media_type, digest

    def open_blob(self, repository: str, digest: str, size: int) -> BlobStream:
        """A stream of a blob's bytes (not verified here: see walk_oci.VerifiedBlob)."""
        return BlobStream(self, repository, digest, size)

    def has_blob(self, repository: str, digest: str) -> bool:
        where = f"{self.host}/{repository}@{digest}"
        try:
            with self._request("HEAD", f"/v2/{repository}/blobs/{digest}", scope=_push(repository),
                                        where=where, what="blob"):
                return True
        except NotFoundError:
            return False

    def push_blob(self, repository: str, data: bytes) -> tuple[str, bool]:
        """Upload ``data`` as a blob unless the repository has it: (its digest, whether it was uploaded)."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has_blob(repository, digest):
            return digest, False
        where = f"{self.host}/{repository}: upload of {digest}"
        deadline = self._transfer_deadline(len(data))
        try:
            self._upload(repository, data, digest, where, deadline)
        finally:
            deadline.cancel()
        return digest, True

    def _upload(self, repository: str, data: bytes, digest: str, where: str, deadline: _Deadline) -> None:
        with self._request("POST", f"/v2/{repository}/blobs/uploads/", scope=_push(repository),
                                    where=where, what="upload", ok=(202,), body=b"") as started:
            location = started.getheader("Location")
        if not location:
            raise UnavailableError("the registry started an upload but named no Location", where=where,
                                   transient=False)
        url = urllib.parse.urlsplit(location)
        query = urllib.parse.parse_qsl(url.query) + [("digest", digest)]
        target = urllib.parse.urlunsplit((url.scheme, url.netloc, url.path, urllib.parse.urlencode(query), ""))
        with self._request("PUT", target, scope=_push(repository), where=where, what="upload",
                                    ok=(201,), body=data,
                                    headers={"Content-Type": "application/octet-stream"}, deadline=deadline):
            pass

    def put_manifest(self, repository: str, reference: str, data: bytes, media_type: str) -> str:
        where = f"{self.host}/{repository}:{reference}"
        with self._request("PUT", f"/v2/{repository}/manifests/{reference}", scope=_push(repository),
                                    where=where, what="manifest", ok=(201,), body=data,
                                    headers={"Content-Type": media_type}):
            pass
        return "sha256:" + hashlib.sha256(data).hexdigest()

    # -- requests ----------------------------------------------------------------------------------------

    def _blob_response(self, repository: str, digest: str, offset: int, where: str,
                       deadline: _Deadline) -> http.client.HTTPResponse:
        """The blob from ``offset`` on: 200 or 206, or 416 when it has no bytes there."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        return self._request("GET", f"/v2/{repository}/blobs/{digest}", scope=_pull(repository), where=where,
                             what="blob", headers=headers, ok=(200, 206, 416) if offset else (200,),
                             deadline=deadline)

    def _request(self, method: str, target: str, *, scope: str, where: str, what: str,
                 headers: dict[str, str] | None = None, body: bytes | None = None,
                 ok: tuple[int, ...] = (200,), deadline: _Deadline | None = None) -> http.client.HTTPResponse:
        """The response to one API call, once auth, redirects and retries are dealt with; its status is
        in ``ok`` (else a DsecError). ``target`` is a path on the registry or an absolute URL."""
        return self._exchange(method, target, scope=scope, where=where, what=what, headers=headers, body=body,
                              ok=ok, deadline=deadline)[0]

    def _exchange(self, method: str, target: str, *, scope: str, where: str, what: str,
                  headers: dict[str, str] | None = None, body: bytes | None = None, ok: tuple[int, ...] = (200,),
                  read_limit: int | None = None, deadline: _Deadline | None = None
                  ) -> tuple[http.client.HTTPResponse, bytes]:
        """``_request``, and with ``read_limit`` its answer's body too (b"" without), read whole within the
        same retries: an answer that breaks off (fewer bytes than its Content-Length, a chunk cut short, a
        timeout) is a failed attempt like a connection that fails, not a shorter document (a manifest by
        tag would be taken for what the registry sent; by digest it would read as corrupt). More than
        ``read_limit`` bytes is an InputError. ``deadline``: a blob transfer's, over every attempt and
        the caller's reads of the answer (not cancelled here); without it each attempt has ``timeout``."""
        attempt = 1
        authenticated = False
        transfer = deadline
        while True:
            deadline = transfer or _Deadline(self.options.timeout)
            try:
                try:
                    response = self._send_following(method, target, scope, headers or {}, body, where, deadline)
                except ssl.SSLError as exc:  # retrying a failed handshake or a bad certificate does not help
                    raise UnavailableError(f"{what}: TLS failed ({exc.reason or exc}); a registry without TLS "
                                           "needs --plain-http", where=where, transient=False) from None
                except (OSError, http.client.HTTPException) as exc:
                    response, problem = None, _failure(exc, deadline)
                else:
                    if response.status in ok:
                        if read_limit is None:
                            return response, b""
                        try:
                            with response:
                                data = _read_whole(response, read_limit)
                        except (OSError, http.client.HTTPException) as exc:
                            problem = f"the answer broke off ({_failure(exc, deadline)})"
                        else:
                            if len(data) > read_limit:
                                raise InputError(f"{what} of more than {read_limit} bytes", where=where)
                            return response, data
                    else:
                        problem = f"HTTP {response.status} {_error_summary(response)}"
                        response.close()
                        if response.status == 401 and not authenticated:
                            self._authenticate(response, scope, where)
                            authenticated = True
                            continue
                        if response.status in (401, 403):
                            whose = "the credentials for " + self.host if self._credentials else "anonymous access"
                            raise UnavailableError(f"{what} refused ({problem}): {whose} not accepted",
                                                   where=where, transient=False)
                        if response.status == 404:
                            raise NotFoundError(f"no such {what} ({problem})", where=where)
                        if response.status not in RETRIED_STATUS:
                            raise UnavailableError(f"{what}: {problem}", where=where, transient=False)
            finally:
                if deadline is not transfer:
                    deadline.cancel()
            if deadline.expired and deadline is transfer:
                raise UnavailableError(f"{what}: {problem}", where=where)
            if attempt >= self.options.attempts:
                raise UnavailableError(f"{what}: {problem} (gave up after {attempt} attempts)", where=where)
            delay = backoff_delay(attempt, self.options.base_delay, self.options.max_delay)
            log.info("%s: %s %s failed (%s), retrying in %.2fs", where, method, what, problem, delay)
            time.sleep(delay)
            attempt += 1

    def _send_following(self, method: str, target: str, scope: str, headers: dict[str, str], body: bytes | None,
                        where: str, deadline: _Deadline) -> http.client.HTTPResponse:
        """Send one request, following redirects; the Authorization header stays with the registry host."""
        url = target if "://" in target else f"{self._scheme}://{self._api_host}{target}"
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            # One connection per request: "close" hands the socket to the response, which closes it.
            sent = {"User-Agent": USER_AGENT, "Connection": "close", **headers}
            if parts.netloc == self._api_host and scope in self._auth:
                sent["Authorization"] = self._auth[scope]
            response = self._send(method, parts, sent, body, deadline)
            location = response.getheader("Location")
            if response.status not in (301, 302, 303, 307, 308) or not location or method not in ("GET", "HEAD"):
                return response
            response.close()
            url = urllib.parse.urljoin(url, location)
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise UnavailableError("redirected to a non-HTTP URL", where=where, transient=False)
        raise UnavailableError(f"more than {MAX_REDIRECTS} redirects", where=where, transient=False)

    def _send(self, method: str, parts: urllib.parse.SplitResult, headers: dict[str, str],
              body: bytes | None, deadline: _Deadline) -> http.client.HTTPResponse:
        """One request and its answer's head; ``deadline`` shuts the connection down when it passes."""
        timeout = self.transfer_seconds(len(body or b""))  # each read's; the body's sendall, all of it
        if parts.scheme == "https":
            connection = http.client.HTTPSConnection(parts.netloc, timeout=timeout,
                                                     context=self._ssl or ssl.create_default_context())
        else:
            connection = http.client.HTTPConnection(parts.netloc, timeout=timeout)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            connection.connect()
            deadline.watch(connection.sock)
            connection.request(method, path or "/", body=body, headers=headers)
            response = connection.getresponse()
        except BaseException:
            connection.close()
            raise
        # The response keeps the socket open until it is read or closed; the connection object can go.
        return response

    # -- auth --------------------------------------------------------------------------------------------

    def _authenticate(self, response: http.client.HTTPResponse, scope: str, where: str) -> None:
        """Answer a 401's challenge: set the Authorization header for ``scope``."""
        challenge = response.getheader("WWW-Authenticate") or ""
        kind, _, params_text = challenge.partition(" ")
        params = dict(_CHALLENGE_PARAM.findall(params_text))
        if kind.lower() == "basic":
            if not self._credentials:
                raise UnavailableError(f"the registry asks for a login and no credentials for {self.host} were "
                                       f"found (looked in {', '.join(self._auth_sources())})", where=where,
                                       transient=False)
            self._auth[scope] = "Basic " + _basic(*self._credentials)
        elif kind.lower() == "bearer" and params.get("realm"):
            self._auth[scope] = "Bearer " + self._token(params, scope, where)
        else:
            raise UnavailableError(f"unsupported authentication challenge {kind or '(none)'!r}", where=where,
                                   transient=False)

    def _auth_sources(self) -> list[str]:
        return list(self.options.auth_files) if self.options.auth_files is not None else auth_file_paths()

    def _token(self, challenge: dict[str, str], scope: str, where: str) -> str:
        realm = urllib.parse.urlsplit(challenge["realm"])
        if realm.scheme != "https" and not (realm.scheme == "http" and self.options.plain_http):
            raise UnavailableError(f"token realm {challenge['realm']!r} is not https (allowed with plain HTTP "
                                   "registries only)", where=where, transient=False)
        query = [("service", challenge["service"])] if "service" in challenge else []
        query.append(("scope", challenge.get("scope") or scope))
        url = urllib.parse.urlunsplit(realm._replace(query=urllib.parse.urlencode(query)))
        headers = {"User-Agent": USER_AGENT, "Connection": "close"}
        if self._credentials:
            headers["Authorization"] = "Basic " + _basic(*self._credentials)
        attempt = 1
        while True:
            deadline = _Deadline(self.options.timeout)
            try:
                response = self._send("GET", urllib.parse.urlsplit(url), headers, None, deadline)
                with response:
                    data = _read_whole(response, MAX_MANIFEST_SIZE)
                status = response.status
            except (OSError, http.client.HTTPException) as exc:
                status, data = None, _failure(exc, deadline).encode()
            finally:
                deadline.cancel()
            if status == 200:
                break
            if status is not None and status not in RETRIED_STATUS:
                raise UnavailableError(f"the token server {realm.netloc} refused a token for {scope!r} "
                                       f"(HTTP {status}): the credentials for {self.host} not accepted",
                                       where=where, transient=False)
            if attempt >= self.options.attempts:
                raise UnavailableError(f"the token server {realm.netloc} did not answer ({status})", where=where)
            time.sleep(backoff_delay(attempt, self.options.base_delay, self.options.max_delay))
            attempt += 1
        try:
            answer = json.loads(data)
            token = answer.get("token") or answer.get("access_token")
        except (ValueError, AttributeError, RecursionError):
            token = None
        if not isinstance(token, str) or not token:
            raise UnavailableError(f"the token server {realm.netloc} answered no token", where=where,
                                   transient=False)
        return token


class BlobStream:
    """A blob's bytes as a stream; a connection that breaks mid-way is resumed with a Range request."""

    def __init__(self, client: RegistryClient, repository: str, digest: str, size: int):
        self._client = client
        self._repository = repository
        self._digest = digest
        self._size = size
        self._offset = 0
        self.where = f"{client.host}/{repository}@{digest}"
        self._deadline = client._transfer_deadline(size)  # the whole transfer's, resumes included
        try:
            self._response: http.client.HTTPResponse | None = client._blob_response(repository, digest, 0,
                                                                                    self.where, self._deadline)
        except BaseException:
            self._deadline.cancel()
            raise

    def read(self, n: int = -1) -> bytes:
        attempt = 1
        while True:
            if self._response is None:
                self._response = self._reopen()
                if self._response is None:
                    return b""  # the registry has no bytes past this offset
            try:
                data = self._response.read() if n < 0 else self._response.read(n)
            except (OSError, http.client.HTTPException) as exc:
                problem = _failure(exc, self._deadline)
            else:
                # Short of the descriptor's size with the response at its end: a dropped connection looks
                # the same as a short blob, so ask once more from here (a short blob then gets a 416).
                if data or n == 0 or self._offset >= self._size:
                    self._offset += len(data)
                    if self._offset >= self._size:
                        self._deadline.cancel()  # its timer thread need not wait on
                    return data
                problem = "the connection ended early"
            self._response.close()
            self._response = None
            if self._deadline.expired:
                raise UnavailableError(f"blob read at offset {self._offset}: {self._deadline.message()}",
                                       where=self.where)
            if attempt >= self._client.options.attempts:
                raise UnavailableError(f"blob read at offset {self._offset}: {problem} (gave up after {attempt} "
                                       "attempts)", where=self.where)
            delay = backoff_delay(attempt, self._client.options.base_delay, self._client.options.max_delay)
            log.info("%s: blob read at offset %d failed (%s), resuming in %.2fs", self.where, self._offset,
                     problem, delay)
            time.sleep(delay)
            attempt += 1

    def _reopen(self) -> http.client.HTTPResponse | None:
        response = self._client._blob_response(self._repository, self._digest, self._offset, self.where,
                                               self._deadline)
        if response.status == 416:
            response.close()
            return None
        if response.status == 200 and self._offset:  # the registry ignored Range: skip what we have
            left = self._offset
            while left:
                skipped = response.read(min(left, 1 << 20))
                if not skipped:
                    break
                left -= len(skipped)
        return response

    def close(self) -> None:
        self._deadline.cancel()
        if self._response is not None:
            self._response.close()
            self._response = None


def _pull(repository: str) -> str:
    return f"repository:{repository}:pull"


def _push(repository: str) -> str:
    return f"repository:{repository}:pull,push"


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


class _Deadline:
    """An exchange's time, from its start to the end of what the caller reads of its answer under it: when
    ``seconds`` pass first, the sockets it watches are shut down, so the read waiting on one returns (an
    error, or the answer cut short). Each read's own timeout never fires on a registry that sends a byte
    at a time, which would make a build wait for ever. ``_lock`` guards ``_sockets`` and ``expired``."""

    def __init__(self, seconds: float, *, basis: str = ""):
        self.seconds = seconds
        self.basis = basis  # how ``seconds`` were reckoned, for the error (a blob transfer's)
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut_down(sock)

    def cancel(self) -> None:
        self._timer.cancel()

    def message(self) -> str:
        return f"no whole answer within {self.seconds:g} s" + (f" ({self.basis})" if self.basis else "")

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already, or never connected
        pass


def _failure(exc: BaseException, deadline: _Deadline) -> str:
    """What went wrong with an attempt, for the error or the log: the deadline, when it ended it."""
    if deadline.expired:
        return deadline.message()
    return f"{type(exc).__name__}: {exc}"


def _read_whole(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The answer's body up to ``limit`` + 1 bytes (more than ``limit``: too big, the caller says so);
    http.client.IncompleteRead if the connection ended before the Content-Length it promised (http.client
    hands over the bytes it got as if they were all: a chunked body cut short raises it itself)."""
    data = response.read(limit + 1)
    if response.length:  # promised bytes that never came
        raise http.client.IncompleteRead(data, response.length)
    return data


def _error_summary(response: http.client.HTTPResponse) -> str:
    """The registry's error codes from a failed response's body (the spec's {"errors": [{"code": ...}]})."""
    try:
        body = json.loads(response.read(MAX_ERROR_BODY))
        codes = [str(error.get("code"))[:64] for error in body.get("errors", []) if isinstance(error, dict)]
    except (ValueError, AttributeError, TypeError, RecursionError, OSError, http.client.HTTPException):
        codes = []
    return (response.reason or "") + (f" ({', '.join(codes)})" if codes else "")
