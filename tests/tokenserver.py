"""A small token server for the registry's bearer flow, as docker-registry's ``auth: token`` expects one.

    with TokenServer(tmp, users={"bob": "pw"}) as tokens:
        DockerRegistry(root, token=tokens)     # the registry trusts tokens.certificate

It answers ``GET /token?service=...&scope=repository:NAME:ACTIONS`` for a request with a right Basic
login with {"token": JWT}: an ES256 JWT whose x5c header carries a self-signed certificate (the one the
registry's rootcertbundle holds), granting the asked actions. Requests are recorded (``requests``) so
tests can see what the client sent. Serves from a thread of the test process; stopped on exit.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import secrets
import threading
import time
import urllib.parse
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

SERVICE = "dsecfs-test-registry"
ISSUER = "dsecfs-test-token-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    def __init__(self, root: Path, users: dict[str, str]):
        self.users = users
        self.requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()  # guards requests
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(hours=1))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .sign(self._key, hashes.SHA256()))
        root.mkdir(parents=True, exist_ok=True)
        self.certificate = root / "token-cert.pem"
        self.certificate.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def token(self, user: str, scope: str) -> str:
        access = []
        for item in filter(None, scope.split(" ")):
            kind, name, actions = item.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256",
                  "x5c": [base64.b64encode(self._cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {"iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": secrets.token_hex(8), "access": access}
        signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self._key.sign(signed.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signed}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                with server._lock:
                    server.requests.append((self.path, dict(self.headers)))
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                login = self.headers.get("Authorization", "")
                user, _, password = base64.b64decode(login[6:]).decode().partition(":") \
                    if login.startswith("Basic ") else ("", "", "")
                if url.path != "/token" or query.get("service") != SERVICE or server.users.get(user) != password:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"token": server.token(user, query.get("scope", ""))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def __enter__(self) -> TokenServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
