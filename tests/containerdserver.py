"""Debian's containerd (1.6) and ``dsecfs snapshotter`` for tests, each a subprocess stopped by its PID.

    with SnapshotterProcess(tmp / "snap", allow_store=url, daemon_socket=...) as snap, \\
            Containerd(tmp / "ctrd", snapshotter_socket=snap.socket) as ctrd:
        ctrd.ctr("images", "pull", "--plain-http", "--snapshotter", "dsecfs", ref)

containerd gets its own root, state, sockets and config (CRI disabled) under the directory given; its
proxy plugin ``dsecfs`` is the snapshotter's socket. ``ctr`` runs against it in namespace ``dsecfs-test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.s3server import ServerProcess, _die_with_parent

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
NAMESPACE = "dsecfs-test"
STARTUP_TIMEOUT = 30.0


def have_containerd() -> bool:
    return os.path.exists(CONTAINERD) and os.path.exists(CTR) and os.geteuid() == 0


def _wait_for_socket(process: subprocess.Popen, path: Path, timeout: float = STARTUP_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if path.exists():
            return True
        time.sleep(0.05)
    return False


class SnapshotterProcess(ServerProcess):
    def __init__(self, root: Path, *, allow_store: str | None = None, daemon_socket: str | None = None,
                 prefetch_dir: Path | None = None):
        super().__init__("dsecfs-snapshotter-")
        self.root = root
        self.socket = root / "snapshotter.sock"
        self.args = ["--root", str(root / "data"), "--socket", str(self.socket)]
        self.args += ["--allow-store", allow_store] if allow_store else []
        self.args += ["--daemon-socket", daemon_socket] if daemon_socket else []
        self.args += ["--prefetch-dir", str(prefetch_dir)] if prefetch_dir else []

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", "cli.main", "snapshotter", *self.args],
                                        stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent, cwd=os.path.dirname(os.path.dirname(__file__)))
        if not _wait_for_socket(self.process, self.socket):
            raise RuntimeError(f"dsecfs snapshotter did not start; its output:\n{self.output()}")


class Containerd(ServerProcess):
    def __init__(self, root: Path, *, snapshotter_socket: Path):
        super().__init__("containerd-")
        self.root = root
        self.socket = root / "containerd.sock"
        self.snapshotter_socket = snapshotter_socket

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{self.root / "root"}"\n'
            f'state = "{self.root / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.socket}"\n'
            f'[ttrpc]\n  address = "{self.socket}.ttrpc"\n'
            '[debug]\n  address = ""\n'
            f'[proxy_plugins.dsecfs]\n  type = "snapshot"\n  address = "{self.snapshotter_socket}"\n'
        )
        self.process = subprocess.Popen([CONTAINERD, "--config", str(config)], stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        if not _wait_for_socket(self.process, self.socket):
            raise RuntimeError(f"containerd did not start; its output:\n{self.output()}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([CTR, "--address", str(self.socket), "--namespace", NAMESPACE, *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr}\n"
                               f"containerd said:\n{self.output()[-3000:]}")
        return result
