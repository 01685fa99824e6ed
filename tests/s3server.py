"""A real moto S3 server on 127.0.0.1 for tests: a subprocess speaking HTTP, stopped by its PID.

    with MotoServer() as server:
        server.create_bucket("dsecfs-test")
        os.environ.update(server.env())        # credentials, region, DSECFS_S3_ENDPOINT
        store = open_store("s3://dsecfs-test/some/prefix")

The server keeps everything in memory and accepts any credentials; ``env()`` gives fake ones and points
boto3 away from the user's ~/.aws so that nothing real is ever read or used. Buckets are created with a
plain HTTP PUT, so this helper needs neither boto3 nor moto in the test process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

STARTUP_TIMEOUT = 30.0
# Straight to the server, whatever http_proxy says.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, so even a killed pytest leaves no server."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick; another process may race us to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_http(process: subprocess.Popen, url: str, timeout: float = STARTUP_TIMEOUT) -> bool:
    """Whether the server ``process`` answers HTTP at ``url`` (with any status) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with _http.open(url, timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answered, if not with 200
        except OSError:
            time.sleep(0.05)
    return False


def stop_process(process: subprocess.Popen | None) -> None:
    """Stop a server by its PID: SIGTERM, then SIGKILL after 5 s (nothing if it is gone or None)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ServerProcess:
    """A server run as a subprocess (``start`` is the subclass's), its output kept in a temporary file,
    stopped by its PID on ``stop`` and at the end of a ``with``."""

    def __init__(self, log_prefix: str):
        self.process: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(prefix=log_prefix)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL after 5 s); safe to call twice."""
        stop_process(self.process)
        self.process = None

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


class MotoServer(ServerProcess):
    def __init__(self, host: str = "127.0.0.1", server_env: dict[str, str] | None = None):
        """``server_env`` adds to the server's environment, e.g. {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}
        makes moto check credentials (it accepts anything by default)."""
        super().__init__("moto-server-")
        self.host = host
        self.server_env = server_env or {}
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, port: int | None = None) -> None:
        """Start the server and return once it answers HTTP: on ``port`` (to bring a stopped server back
        where its clients expect it; the data is gone, moto keeps it in memory), else on a free port,
        trying another if that one was taken meanwhile."""
        for _ in range(1 if port else 3):
            self.port = port or free_port(self.host)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env(), **self.server_env},
                preexec_fn=_die_with_parent,
            )
            if self._wait_until_up():
                return
            self.stop()
        raise RuntimeError(f"moto server did not start; its output:\n{self.output()}")

    def _wait_until_up(self) -> bool:
        return wait_for_http(self.process, self.url + "/")

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.url}/{name}", method="PUT")
        with _http.open(request, timeout=10) as response:
            if response.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {response.status}")

    def env(self) -> dict[str, str]:
        """Environment for boto3 (in this process or a child) to talk to this server and nothing else."""
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": f"{self.host},localhost",
            "no_proxy": f"{self.host},localhost",
        }
        if self.port is not None:
            env["DSECFS_S3_ENDPOINT"] = self.url
            env["AWS_ENDPOINT_URL"] = self.url
        return env
