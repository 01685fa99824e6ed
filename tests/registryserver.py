"""Debian's real docker-registry (distribution 2.8) on 127.0.0.1 for tests, and skopeo to push to it.

    with DockerRegistry(tmp_path / "registry") as registry:          # htpasswd={"user": "pw"} for basic auth
        registry.push(layout_dir, "test/img:v1")                      # skopeo copy oci:... docker://...
        # or token=TokenServer(...) (tests/tokenserver.py) for the bearer flow
        build_layer(f"docker://{registry.address}/test/img:v1", store, registry=RegistryOptions(plain_http=True))

The registry keeps its blobs under ``root`` (``blob_path`` finds one, for corruption tests) and logs
every request (``access_log``). It runs as a subprocess stopped by its PID, and dies with the test
process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.s3server import ServerProcess, _die_with_parent, free_port, wait_for_http

REGISTRY = "/usr/bin/docker-registry"
SKOPEO = "/usr/bin/skopeo"


def have_registry_tools() -> bool:
    return os.path.exists(REGISTRY) and os.path.exists(SKOPEO) and shutil.which("htpasswd") is not None


class DockerRegistry(ServerProcess):
    def __init__(self, root: Path, htpasswd: dict[str, str] | None = None, token=None):
        """``htpasswd`` {user: password} for basic auth; ``token`` a tokenserver.TokenServer for bearer."""
        super().__init__("docker-registry-")
        self.root = root
        self.htpasswd = htpasswd
        self.token = token
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.htpasswd:
            lines = [subprocess.run(["htpasswd", "-nbB", user, password], check=True, capture_output=True,
                                    text=True).stdout.strip() for user, password in self.htpasswd.items()]
            (self.root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: dsecfs-test\n    path: {self.root / 'htpasswd'}\n"
        if self.token is not None:
            from tokenserver import ISSUER, SERVICE

            auth = (f"auth:\n  token:\n    realm: {self.token.realm}\n    service: {SERVICE}\n"
                    f"    issuer: {ISSUER}\n    rootcertbundle: {self.token.certificate}\n")
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.address}\n" + auth
        )
        return config

    def start(self) -> None:
        for _ in range(3):
            self.port = free_port()
            self.process = subprocess.Popen([REGISTRY, "serve", str(self._write_config())], stdin=subprocess.DEVNULL,
                                            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            if self._wait_until_up():
                return
            self.stop()
        raise RuntimeError(f"docker-registry did not start; its output:\n{self.output()}")

    def _wait_until_up(self) -> bool:
        return wait_for_http(self.process, f"http://{self.address}/v2/")  # 401 too: it wants a login

    def access_log(self) -> list[str]:
        """The request lines the registry served so far, e.g. 'GET /v2/test/img/blobs/sha256:... HTTP/1.1'."""
        return [line.split('"')[1] for line in self.output().splitlines() if line.count('"') >= 2
                and line.split('"')[1].split(" ")[0] in ("GET", "HEAD", "PUT", "POST", "PATCH", "DELETE")]

    def blob_path(self, digest: str) -> Path:
        hex_digest = digest.removeprefix("sha256:")
        return self.root / "data" / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"

    def push(self, layout: Path, name: str, *, all_images: bool = False, creds: str | None = None) -> None:
        """skopeo copy of the layout's image (or index, with ``all_images``) to NAME:TAG here."""
        command = [SKOPEO, "--policy", str(skopeo_policy(self.root)), "copy", "-q", "--dest-tls-verify=false"]
        command += ["--all"] if all_images else []
        command += [f"--dest-creds={creds}"] if creds else []
        result = subprocess.run(command + [f"oci:{layout}", f"docker://{self.address}/{name}"],
                                capture_output=True, text=True, env=skopeo_env(self.root), timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"skopeo copy failed: {result.stderr}")

    def inspect_raw(self, name: str, creds: str | None = None) -> dict:
        """The manifest NAME:TAG (or @digest) as skopeo reads it from here."""
        command = [SKOPEO, "--policy", str(skopeo_policy(self.root)), "inspect", "--raw", "--tls-verify=false"]
        command += [f"--creds={creds}"] if creds else []
        result = subprocess.run(command + [f"docker://{self.address}/{name}"], capture_output=True, text=True,
                                env=skopeo_env(self.root), timeout=60, check=True)
        return json.loads(result.stdout)


def skopeo_env(home: Path) -> dict[str, str]:
    """skopeo's environment with its own HOME: it reads none of the user's auth files."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "XDG_RUNTIME_DIR": str(home),
            "REGISTRY_AUTH_FILE": str(home / "auth.json")}


def skopeo_policy(home: Path) -> Path:
    """A signature policy accepting anything (test images are unsigned), whatever /etc/containers says."""
    policy = home / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    return policy
