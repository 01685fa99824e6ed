"""Attached commands: a command in a sandbox whose stdio the daemon relays to its client as it runs, over
the frames of dsec_fs/exec_frames.py (node_service.py's ``POST /v1/sandboxes/{sandbox}/attach``).

    command = AttachCommand(rootfs, argv, run_options, stdin=True, tty=True, rows=24, cols=80)
    command.check()                       # before the connection switches protocols
    await relay(client_stream, early_bytes, command, threads=limiter, output=budget)

runc runs the command in the foreground (runtime.RuncContainer), as exec does, with its stdin, stdout and
stderr on pipes, or, with ``tty``, all three on the slave of a pty the daemon opens: runc then gives the
command a terminal of its own (``process.terminal``: a pty in the container, the command its session
leader and the pty its controlling terminal), sets ours raw and copies between the two. So the command
sees a real terminal (``tty``, ``stty size``, job control), ^C typed by the user reaches it as SIGINT
through the terminal's line discipline, and a RESIZE frame sets our pty's size and sends SIGWINCH to runc,
which copies the size to the command's terminal. runc exits with the command's status (128 + N after
signal N), which the EXIT frame carries.

Bounds (hostile or careless clients): every pipe is read CHUNK bytes at a time and the next read waits
until the frame is sent, so a client that reads slowly slows the command (it blocks on a full pipe), and
the daemon holds at most a chunk per stream; a frame over MAX_PAYLOAD or of an unknown kind is refused
(an ERROR frame, and the command is killed). A client that closes its connection (or whose connection
breaks) has left: the command is killed (``runc delete --force``) and its bundle removed. ``timeout``
kills it as exec's does (exit code 137, ``timed_out``). The daemon's stop kills it too (node_service's
reap_containers): its client gets exit code 137, or a closed connection.
While a STDIN frame waits for a command that does not read, the client's connection is not read (that
is the backpressure), but it is watched (poll's RDHUP) for the client's leaving.

The namespaces runtime cannot give a terminal (UnsupportedError); without one, its command runs as exec
runs it (stdin gathered first, up to the API's request bound; output sent when it ends, the first
runtime.MAX_OUTPUT bytes of each stream as far as the node's output budget grants them (``output``,
output_budget.py), ExecExit.truncated saying it was cut), so that a client can attach whatever the runtime.

Threads: ``relay`` runs in the daemon's trio loop, a task per stream; no thread waits on the command
(trio reads the pipes and waits for runc's exit with a pidfd). The bundle is written in a worker thread.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import select
import signal
import struct
import subprocess
import termios
from dataclasses import dataclass, field
from tty import setraw

import trio

from dsec_fs import api, exec_frames
from dsec_fs.errors import DsecError, InputError, UnavailableError, UnsupportedError
from dsec_fs.exec_frames import CHUNK, FrameParser

from .output_budget import OutputBudget
from .runtime import SIGNAL_EXIT_BASE, RunOptions, RuncContainer, checked_command, exit_code, run_in_rootfs

log = logging.getLogger(__name__)

MAX_GATHERED_STDIN = 1 << 20  # bytes of stdin a namespaces command takes (as exec's request bound)
HANGUP_POLL = 0.2  # seconds between looks at a client's connection while its stdin waits for the command
REAP_SECONDS = 10.0  # after ``runc delete --force``, how long runc run may take to exit before SIGKILL


@dataclass
class AttachCommand:
    rootfs: str
    argv: list[str]
    options: dict  # run_in_rootfs's keyword arguments: runtime, runc_root, hostname, env, cwd, limits, timeout
    stdin: bool = False
    tty: bool = False
    rows: int = 0
    cols: int = 0

    def check(self) -> None:
        """InputError/UnsupportedError for what cannot run (before the connection switches protocols)."""
        self.rootfs, self.argv = checked_command(self.rootfs, self.argv)
        self.run_options()
        if self.tty and self.options.get("runtime") != "runc":
            raise UnsupportedError("a terminal needs the runc runtime", where=f"runtime {self.options.get('runtime')}")

    def run_options(self) -> RunOptions:
        fields = {k: v for k, v in self.options.items() if k not in ("runtime", "runc_root")}
        return RunOptions(**fields).checked()


async def relay(client: trio.SocketStream, early: bytes, command: AttachCommand, *,
                threads: trio.CapacityLimiter, output: OutputBudget) -> None:
    """Run ``command``, relaying its stdio with ``client`` until it ends (EXIT or ERROR sent) or the client
    leaves (the command killed). ``threads``: the limiter of the worker thread a runtime other than runc
    runs its command in (never trio's default one, which the daemon's own calls need); ``output``: the
    node's budget of output kept, which such a command's gathered output counts against."""
    session = _Session(client, early, threads, output)
    try:
        if command.options.get("runtime") == "runc":
            await session.run_runc(command)
        else:
            await session.run_gathered(command)
    except OSError as exc:  # no pty or descriptor left, no room for the bundle
        await session.send(exec_frames.ERROR, api.encode(api.error_body(UnavailableError(
            f"cannot start the command: {exc.strerror or exc}", where=f"attach in {command.rootfs}", transient=True))))
    except DsecError as exc:
        await session.send(exec_frames.ERROR, api.encode(api.error_body(exc)))


@dataclass
class _Session:
    client: trio.SocketStream
    early: bytes
    threads: trio.CapacityLimiter  # run_gathered's worker thread
    output: OutputBudget  # what run_gathered keeps of output counts against it (the node's)
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    gone: trio.CancelScope = field(default_factory=trio.CancelScope)  # cancelled when the client leaves
    timed_out: bool = False

    async def send(self, kind: int, payload: bytes) -> None:
        try:
            async with self.send_lock:
                await self.client.send_all(exec_frames.frame(kind, payload))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone.cancel()
            await trio.lowlevel.checkpoint()

    async def frames(self):
        """The client's frames; on its leaving, the session is cancelled. InputError at a refused frame."""
        parser = FrameParser({exec_frames.STDIN, exec_frames.STDIN_EOF, exec_frames.RESIZE})
        data = self.early
        while True:
            for item in parser.feed(data):
                yield item
            try:
                data = await self.client.receive_some(CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone.cancel()
                await trio.lowlevel.checkpoint()

    # -- runc: streamed

    async def run_runc(self, command: AttachCommand) -> None:
        terminal = (command.rows, command.cols) if command.tty else None
        container = await trio.to_thread.run_sync(
            lambda: RuncContainer.create(command.rootfs, command.argv, command.run_options(),
                                         command.options.get("runc_root"), terminal=terminal))
        process: trio.Process | None = None
        master = None
        try:
            with self.gone:
                if command.tty:
                    master_fd, slave_fd = os.openpty()
                    setraw(slave_fd)  # as runc will set it: no echo of early input on our side
                    master = trio.lowlevel.FdStream(master_fd)
                    if command.rows and command.cols:
                        _set_size(master_fd, command.rows, command.cols)
                    try:
                        process = await trio.lowlevel.open_process(
                            container.run_command(), stdin=slave_fd, stdout=slave_fd, stderr=slave_fd,
                            start_new_session=True)
                    finally:
                        os.close(slave_fd)
                    stdin, outputs = master, [(master, exec_frames.STDOUT)]
                else:
                    process = await trio.lowlevel.open_process(
                        container.run_command(), stdin=subprocess.PIPE if command.stdin else subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                    stdin = process.stdin
                    outputs = [(process.stdout, exec_frames.STDOUT), (process.stderr, exec_frames.STDERR)]
                exit_code = await self._serve(process, container, stdin if command.stdin else None, outputs,
                                              master, command.options.get("timeout"))
                failure = None if self.timed_out else container.failure(command.argv, command.rootfs)
                if failure is not None:
                    raise failure
                await self.send(exec_frames.EXIT, api.encode(api.ExecExit(exit_code, self.timed_out)))
            if self.gone.cancelled_caught:
                log.info("the client of %s left; its command was killed", container.id)
        finally:
            with trio.CancelScope(shield=True):
                await _delete(container, process)
                if master is not None:
                    master.close()
                await trio.to_thread.run_sync(container.remove)

    async def _serve(self, process: trio.Process, container: RuncContainer, stdin, outputs, master,
                     timeout: float | None) -> int:
        """Relay until the command's output ends and runc exited; its exit status."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._from_client, stdin, master, process)
            async with trio.open_nursery() as streams:
                for source, kind in outputs:
                    streams.start_soon(self._pump, source, kind)
                streams.start_soon(self._wait, process, container, timeout)
            nursery.cancel_scope.cancel()  # the client's further frames are of no use
        return SIGNAL_EXIT_BASE + signal.SIGKILL if self.timed_out else exit_code(process.returncode)

    async def _pump(self, source: trio.abc.ReceiveStream, kind: int) -> None:
        while True:
            try:
                data = await source.receive_some(CHUNK)
            except trio.BrokenResourceError:  # a pty's master reads EIO once every slave is closed
                return
            if not data:
                return
            await self.send(kind, data)

    async def _wait(self, process: trio.Process, container: RuncContainer, timeout: float | None) -> None:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await process.wait()
            return
        self.timed_out = True  # killing the container ends runc and closes the pipes: the pumps drain
        await trio.run_process(container.delete_command(), check=False, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await process.wait()

    async def _from_client(self, stdin, master, process: trio.Process) -> None:
        async for kind, payload in self._checked_frames():
            if kind == exec_frames.RESIZE:
                if master is not None:
                    rows, cols = exec_frames.parse_size(payload)
                    _set_size(master.fileno(), rows, cols)
                    if process.returncode is None:
                        process.send_signal(signal.SIGWINCH)  # runc copies the size to the command's terminal
            elif stdin is None:
                continue
            elif kind == exec_frames.STDIN_EOF:
                if master is None:
                    await stdin.aclose()
                    stdin = None
            else:
                try:
                    await self._feed(stdin, payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    stdin = None  # the command closed its stdin, or ended

    async def _feed(self, stdin: trio.abc.SendStream, payload: bytes) -> None:
        """Write to the command's stdin; while that waits (the command does not read), the client's
        connection is not read, so watch it for the client's leaving meanwhile."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_hangup)
            await stdin.send_all(payload)
            nursery.cancel_scope.cancel()

    async def _watch_hangup(self) -> None:
        """Cancel the session once the client closed its connection (or shut it down), looking every
        HANGUP_POLL seconds: poll's RDHUP is there even while bytes the client sent before wait unread."""
        poller = select.poll()
        poller.register(self.client.socket.fileno(), select.POLLRDHUP)
        while not poller.poll(0):
            await trio.sleep(HANGUP_POLL)
        self.gone.cancel()
        await trio.lowlevel.checkpoint()

    async def _checked_frames(self):
        try:
            async for item in self.frames():
                yield item
        except InputError as exc:
            await self.send(exec_frames.ERROR, api.encode(api.error_body(exc)))
            self.gone.cancel()  # a client that breaks the protocol is treated as gone: the command is killed
            await trio.lowlevel.checkpoint()

    # -- other runtimes: gathered

    async def run_gathered(self, command: AttachCommand) -> None:
        """Run as exec does (stdin first, the output at the end): the namespaces runtime."""
        with self.gone:
            data = bytearray()
            if command.stdin:
                async for kind, payload in self._checked_frames():
                    if kind == exec_frames.STDIN_EOF:
                        break
                    if kind == exec_frames.STDIN:
                        data += payload
                        if len(data) > MAX_GATHERED_STDIN:
                            raise InputError(f"stdin over {MAX_GATHERED_STDIN} bytes; the {command.options['runtime']} "
                                             "runtime takes it whole before the command starts", where="attach")
            with self.output.share() as keep:
                options = dict(command.options, stdin=bytes(data) if command.stdin else None, output_share=keep)
                result = await trio.to_thread.run_sync(
                    lambda: run_in_rootfs(command.rootfs, command.argv, **options), abandon_on_cancel=True,
                    limiter=self.threads)
                for kind, output in ((exec_frames.STDOUT, result.stdout), (exec_frames.STDERR, result.stderr)):
                    for start in range(0, len(output), CHUNK):
                        await self.send(kind, output[start:start + CHUNK])
            await self.send(exec_frames.EXIT, api.encode(api.ExecExit(result.exit_code, result.timed_out,
                                                                     result.truncated)))


async def _delete(container: RuncContainer, process: trio.Process | None) -> None:
    """Kill what is left of the container and reap ``runc run`` (shielded, from the finally)."""
    await trio.run_process(container.delete_command(), check=False, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if process is None:
        return
    with trio.move_on_after(REAP_SECONDS):
        await process.wait()
        return
    process.kill()
    await process.wait()


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
