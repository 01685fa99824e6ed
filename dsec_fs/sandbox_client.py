"""The sandbox SDK: sandboxes on a node, through its daemon's API (overlay/node_service.py serves it).

    from dsec_fs.client import Node

    with Node().sandbox(base="base/debian:12", workspace="ws/task-42:v1", toolkit="tk/agent:3") as sb:
        result = sb.exec(["/bin/sh", "-c", "cd /workspace && make test"], timeout=600)
        print(result.exit_code, result.stdout.decode())
        sb.commit("ws/task-42:v2")    # its changes, as a layer to stack over the layers it ran on
    # the block's end takes the sandbox down

``Node.sandbox(...)`` starts a sandbox and returns a ``Sandbox`` handle whose with-block ends with
``down()``; ``Node.sandbox_up(...)`` starts one and returns its ``SandboxInfo``; ``Node.sandboxes()``
lists them; ``Sandbox(node, id_or_name)`` is a handle of one that runs already. Any layer role may be
left out (not all of them); ``toolkit`` takes one ref or a list, the first the top layer.

Results are typed (``SandboxInfo``, ``ExecResult``, ``CommitResult``); fields a newer daemon adds are
ignored. Errors are the DsecError classes the CLI maps to exit codes, raised again from the daemon's
answer: NotFoundError (no such ref, layer, pack or sandbox), ConflictError (a name in use), InputError,
UnavailableError (no daemon answers, a stopped sandbox, a runtime that failed). A command's own failure
is no error: it is its ``exit_code``.

Limits: ``exec``'s stdout and stderr travel back whole in one answer (base64 in JSON), so a command
with a lot of output should write it to a file in the sandbox, or run with ``attach``, which relays its
output as it comes (and stdin, and a terminal: attach_client.py); ``exec``'s ``stdin`` is at most about
700 KiB (the API's requests are at most 1 MiB).

Threads: a Sandbox holds its node and its key only, so it is as thread-safe as Node (any thread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import quote

from . import api
from .api import CommitResult, ExecExit, ExecResult, SandboxInfo, SandboxLayerInfo  # noqa: F401 (the SDK's types)
from .attach_client import AttachedCommand
from .errors import InputError

if TYPE_CHECKING:
    from .client import Node

EXEC_ANSWER_GRACE = 60.0  # seconds an exec's answer may take beyond its command's timeout
EXEC_WAIT_UNBOUNDED = 7 * 86400.0  # how long an exec without a timeout is waited for


class Sandbox:
    """A sandbox on ``node``, by id or name. As a context manager it takes the sandbox down at the end of
    the block, unless ``down`` was called in it."""

    def __init__(self, node: Node, key: str, *, info: SandboxInfo | None = None):
        self.node = node
        self.key = key
        self.started = info  # what up answered, when this handle comes from Node.sandbox
        self._down = False

    def __repr__(self) -> str:
        return f"Sandbox({self.key!r} on {self.node.socket_path})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        if not self._down:
            self.down()

    # id and rootfs: from up's answer, else asked for.
    @property
    def id(self) -> str:
        return (self.started or self.info()).id

    @property
    def rootfs(self) -> str:
        return (self.started or self.info()).rootfs

    def info(self) -> SandboxInfo:
        return self.node.call("GET", self._path(), answer=SandboxInfo)

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
             stdin: bytes | None = None, timeout: float | None = None, network: bool = False,
             memory_bytes: int | None = None, cpus: float | None = None, pids_limit: int | None = None,
             runtime: str | None = None) -> ExecResult:
        """Run ``argv`` in the sandbox as root, in new pid, mount, ipc and uts namespaces, without network
        unless ``network``, with no new privileges, and wait for it. ``timeout`` (seconds) kills it;
        ``memory_bytes``, ``cpus`` (CPU seconds per second) and ``pids_limit`` bound it; ``runtime`` is
        runc (the daemon's default) or namespaces."""
        _check_argv(argv, self.key)
        body = api.ExecRequest(argv=list(argv), env=dict(env or {}), cwd=cwd, network=network,
                               memory_bytes=memory_bytes, cpus=cpus, pids_limit=pids_limit, timeout=timeout,
                               runtime=runtime, stdin=stdin)
        wait = EXEC_WAIT_UNBOUNDED if timeout is None else timeout + EXEC_ANSWER_GRACE
        return self.node.call("POST", self._path("exec"), body, answer=ExecResult, timeout=wait)

    def attach(self, argv: Sequence[str], *, stdin: bool = False, tty: bool = False, rows: int = 0, cols: int = 0,
               env: Mapping[str, str] | None = None, cwd: str = "/", timeout: float | None = None,
               network: bool = False, memory_bytes: int | None = None, cpus: float | None = None,
               pids_limit: int | None = None, runtime: str | None = None) -> AttachedCommand:
        """Start ``argv`` as ``exec`` does, its output relayed as it comes (attach_client.AttachedCommand):
        ``stdin`` to feed it (else /dev/null), ``tty`` to run it on a terminal of ``rows`` x ``cols``
        (runc only; stdout and stderr are the terminal then, stdin its keyboard). Returns once the daemon
        took the command on (errors found before that, such as no such sandbox, are raised here)."""
        _check_argv(argv, self.key)
        body = api.AttachRequest(argv=list(argv), env=dict(env or {}), cwd=cwd, network=network,
                                 memory_bytes=memory_bytes, cpus=cpus, pids_limit=pids_limit, timeout=timeout,
                                 runtime=runtime, stdin=stdin, tty=tty, rows=rows, cols=cols)
        return AttachedCommand.open(self.node, self._path("attach"), body)

    def down(self, *, keep: bool = False) -> None:
        """Unmount the sandbox and drop its layers; its upper dir is removed unless ``keep`` (then it stays,
        ``stopped``, for commit; a later ``down`` removes it)."""
        self.node.call("POST", self._path("down"), api.DownRequest(keep=keep), answer=api.Empty)
        self._down = True

    def commit(self, name: str, *, store: str | None = None, keep_privileged: bool = False) -> CommitResult:
        """Publish the sandbox's changes (its upper dir, whiteouts and opaque directories kept) as a layer
        named ``name`` (NAME:TAG) in ``store`` (default: the daemon's); stack it over the layers the sandbox
        ran on. Setuid/setgid bits, device nodes and file capabilities are left out (counted in
        ``dropped``) unless ``keep_privileged``. Commit between commands, or after ``down(keep=True)``."""
        body = api.CommitRequest(name=name, store=api.absolute_store(store), keep_privileged=keep_privileged)
        return self.node.call("POST", self._path("commit"), body, answer=CommitResult)

    def _path(self, action: str = "") -> str:
        return f"/v1/sandboxes/{quote(self.key, safe='')}" + (f"/{action}" if action else "")


def _check_argv(argv: Sequence[str], key: str) -> None:
    if isinstance(argv, (str, bytes)):
        raise InputError("argv is a list of strings; for a shell line use ['/bin/sh', '-c', line]",
                         where=f"exec in sandbox {key}")
