"""Sandboxes served by the node daemon: the composition of lazy_fetch's layer mounts and overlay's sandboxes.

    daemon = NodeDaemon(options)
    attach(daemon, layer_mode="kernel", runtime="runc")   # routes and start/stop hooks
    trio.run(serve_until_signalled, daemon)

``dsecfs daemon`` does this (cli/daemon_cmds.py), so lazy_fetch never imports overlay. The parts:

- ``DaemonLayers``, the LayerProvider of the node's SandboxManager: each layer a sandbox uses is mounted
  once per node by the daemon (``NodeDaemon.mount``, kernel mode unless told otherwise) at
  ``state_dir/sandbox/layers/<digest>`` and counted; the last release leaves it mounted, idle, for the
  daemon's ``idle_grace`` (lazy_fetch/idle_mounts.py), and an acquire meanwhile takes it as it is (no
  store request, no mount(2)); once the grace ends, or the daemon stops, it is unmounted. The mounts are the
  daemon's own, so ``dsecfs status`` lists them and a restarted daemon detaches them like any other.
  Before a layer's first mount every pack holding its chunks is checked to be in the store (by the
  daemon's mount, ``check_packs``, beside its other reads), so a layer whose data is gone fails ``up``
  with NotFoundError instead of failing reads (EIO) inside a command.
- ``SandboxService``: the HTTP routes (below) over a SandboxManager whose state lives in
  ``state_dir/sandbox/`` (its lock, ``sandboxes/``, ``runc/``), and the daemon's start and stop hooks.

Routes (JSON in and out; ``{sandbox}`` is a sandbox id or name; errors as every daemon route answers them)::

    POST /v1/sandboxes                   {base, workspace, toolkits: [...], name, store}  -> sandbox
    GET  /v1/sandboxes                   -> {sandboxes: [...], layers: [...], removed_at_start: [...]}
    GET  /v1/sandboxes/{sandbox}         -> sandbox
    POST /v1/sandboxes/{sandbox}/exec    {argv, env, cwd, runtime, network, memory_bytes, cpus, pids_limit,
                                          timeout, stdin (base64)}  -> {exit_code, stdout, stderr (base64),
                                          timed_out, truncated}
    POST /v1/sandboxes/{sandbox}/attach  {argv, env, ..., runtime, stdin, tty, rows, cols}, Upgrade: dsecfs-exec/1
                                         -> 101, then frames both ways (attach.py, dsec_fs/exec_frames.py)
    POST /v1/sandboxes/{sandbox}/down    {keep}  -> {}
    POST /v1/sandboxes/{sandbox}/commit  {name, store, keep_privileged}  -> {sandbox, layer, ref, store, stats, dropped}

A sandbox is SandboxState as JSON (overlay/sandbox.py). Sandbox layers come from the daemon's store; an
``up`` that names another store is refused (ConflictError) rather than quietly mixing stores. ``commit``
builds the sandbox's upper dir (stack.upper_to_tree: whiteouts and opaque directories kept) into a layer
in ``store`` (default: the daemon's) and points the ref ``name`` at it. The output exec (and an attached
command of the namespaces runtime) keeps counts against the node's EXEC_OUTPUT_BYTES, shared by every
command running (output_budget.py), until its answer is encoded.

Start (before the API answers, after the daemon detached the mounts a dead predecessor left):
SandboxManager.recover(). A daemon that died took the FUSE session its layer mounts read from, and the
new daemon has detached those mounts, so a sandbox that was running is no longer whole: recover unmounts
its overlay, kills its containers and removes its files. Sandboxes stopped with ``down --keep`` stay
listed. Layer directories no sandbox holds are removed.

Stop (SIGTERM): new requests are refused, calls of up, down and commit under way are waited for, runc
containers still running are killed (their exec answers exit code 137), and every running sandbox is
taken down with its upper dir kept (status ``stopped``): its layers cannot outlive the daemon, but its
changes can still be committed, or removed with ``down``, once a daemon runs again. Commands of the
``namespaces`` runtime cannot be killed from here; a handler waiting for one is abandoned.

Threads: the routes and DaemonLayers' async methods run in the daemon's trio loop, which holds every
table here, so they need no lock; ``DaemonLayers._turn`` makes calls on one layer take turns across the
awaits of a mount or unmount. SandboxManager calls block (mount(2), the runtime) and run in worker threads
(trio.to_thread) under limiters of their own: those threads call back into the loop
(trio.from_thread.run) for layers, and the daemon's own worker threads (mount(2) of a layer, store reads)
must never wait behind them for the default limiter, or an ``up`` would wait for itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import trio

from dsec_fs import api, exec_frames, mounts
from dsec_fs.api import MODES
from dsec_fs.errors import ConflictError, DsecError, InputError, NotFoundError, UnavailableError
from dsec_fs.digest import is_hex_digest
from dsec_fs.files import private_dir
from dsec_fs.layer import parse_ref, resolve
from dsec_fs.store import default_store_url, open_store
from erofs_builder.build import build_tree
from lazy_fetch.daemon import NodeDaemon
from lazy_fetch.http_api import Request, Response, Upgrade, json_response
from lazy_fetch.trace_holders import Holder, combination_id
from lazy_fetch.turns import Turns

from .attach import AttachCommand, relay
from .output_budget import OutputBudget
from .runtime import RUNTIMES, reap_containers
from .sandbox import LayerHandle, SandboxManager, SandboxSpec, SandboxState
from .stack import StackOptions

log = logging.getLogger(__name__)

SANDBOX_DIR = "sandbox"  # under the daemon's state directory
LAYER_DIR = "layers"  # under SANDBOX_DIR: one mountpoint per layer in use
LIFECYCLE_THREADS = 8  # up, down and commit calls at once (each mounts, or builds a layer)
EXEC_THREADS = 256  # commands running at once
# Bytes of output all the commands running at once keep (output_budget.py); each stream keeps at most
# runtime.MAX_OUTPUT (4 MiB) of its own, so 256 commands kept up to 2 GiB (2.7 GiB with their answers
# encoded) in the daemon that serves every sandbox's reads. 256 MiB still lets 32 commands at once answer
# their whole 4 MiB of stdout and stderr; past it, output is dropped and the answer says truncated.
EXEC_OUTPUT_BYTES = 256 << 20
STOP_POLL_SECONDS = 0.05


# ---- layers ------------------------------------------------------------------------------------------


@dataclass
class _HeldLayer:
    mountpoint: str
    users: int = 0


class DaemonLayers:
    """The LayerProvider of the node's sandboxes: layers mounted by the daemon, one mount per layer, counted.

    ``acquire``, ``release`` and ``adopt`` (the protocol) block, for SandboxManager's worker threads;
    they run their async twins in the daemon's loop (``token``) as system tasks, so a mount or unmount
    under way finishes even if the request that asked for it is cancelled. Everything else runs in that
    loop."""

    def __init__(self, daemon: NodeDaemon, directory: str, *, mode: str, token: trio.lowlevel.TrioToken):
        self.daemon = daemon
        self.directory = directory
        self.mode = mode
        self._token = token
        self._held: dict[str, _HeldLayer] = {}  # digest -> its mount and users
        self._turns = Turns()  # by digest: the calls on one layer take turns
        os.makedirs(directory, mode=0o755, exist_ok=True)

    # -- the LayerProvider protocol, for worker threads

    def resolve(self, layer_ref: str) -> str:
        return resolve(trio.from_thread.run(self.daemon.store, trio_token=self._token), layer_ref)

    def acquire(self, layer_ref: str, *, digest: str | None = None, holder: Holder | None = None,
                profile: bool = True, fill: str | None = None) -> LayerHandle:
        return trio.from_thread.run(functools.partial(self.acquire_async, layer_ref, profile, fill, digest=digest,
                                                      holder=holder), trio_token=self._token)

    def release(self, digest: str, *, holder: Holder | None = None) -> None:
        trio.from_thread.run(functools.partial(self.release_async, digest, holder=holder), trio_token=self._token)

    def adopt(self, handle: LayerHandle, *, holder: Holder | None = None) -> None:
        trio.from_thread.run(functools.partial(self.adopt_async, handle, holder=holder), trio_token=self._token)

    # -- in the daemon's loop

    def held(self) -> list[dict]:
        return [{"layer": digest, "mountpoint": held.mountpoint, "users": held.users,
                 "idle_until": self.daemon.idle.until(held.mountpoint)} for digest, held in sorted(self._held.items())]

    async def acquire_async(self, layer_ref: str, profile: bool = True, fill: str | None = None, *,
                            digest: str | None = None, holder: Holder | None = None) -> LayerHandle:
        store = await self.daemon.store()
        digest = digest or await trio.to_thread.run_sync(resolve, store, layer_ref)  # refs: cached for the daemon's ref_ttl
        name = None if is_hex_digest(layer_ref.lower()) else parse_ref(layer_ref)[0]
        async with self._turn(digest):
            held = self._held.get(digest)
            if held is None:
                held = self._held[digest] = _HeldLayer(await self._mount(digest, name=name, profile=profile, fill=fill,
                                                                         holder=holder))
            else:
                if not held.users:
                    self.daemon.idle.take(held.mountpoint)  # idle: used again within its grace
                if holder is not None:  # mounted for others: this sandbox's combination may prefetch more of it
                    await self._hold(held.mountpoint, holder, functools.partial(self.daemon.hold, profile=profile,
                                                                                fill=fill))
            held.users += 1
            return LayerHandle(digest, held.mountpoint)

    async def release_async(self, digest: str, *, holder: Holder | None = None) -> None:
        async with self._turn(digest):
            held = self._held.get(digest)
            if held is None:
                raise NotFoundError("no sandbox holds this layer", where=f"layer {digest}")
            held.users -= 1
            if holder is not None:
                await self._hold(held.mountpoint, holder, self.daemon.unhold)
            if held.users or self.daemon.idle.park(held.mountpoint, functools.partial(self._unmount_idle, digest)):
                return
            await self._unmount_held(digest, held)

    async def _unmount_idle(self, digest: str) -> None:
        """The grace of an idle layer ended (lazy_fetch/idle_mounts.py): unmount it, unless it found a user
        meanwhile."""
        async with self._turn(digest):
            held = self._held.get(digest)
            if held is not None and not held.users:
                await self._unmount_held(digest, held)

    async def _unmount_held(self, digest: str, held: _HeldLayer) -> None:
        del self._held[digest]
        try:
            await self._unmount(held.mountpoint)
        except BaseException:
            self._held[digest] = held  # still mounted: the next acquire uses it, the next release retries
            raise

    async def adopt_async(self, handle: LayerHandle, *, holder: Holder | None = None) -> None:
        async with self._turn(handle.digest):
            held = self._held.setdefault(handle.digest, _HeldLayer(handle.mountpoint))
            if held.mountpoint != handle.mountpoint:
                raise ConflictError(f"layer is mounted at {held.mountpoint} already", where=handle.mountpoint)
            if holder is not None:
                await self._hold(handle.mountpoint, holder, self.daemon.hold)
            held.users += 1

    @staticmethod
    async def _hold(mountpoint: str, holder: Holder, change: Callable[[str, Holder], Awaitable[None]]) -> None:
        """Tell the daemon who holds its mount (daemon.hold / unhold); a mount a dead daemon left, not in
        this daemon's table, has no trace to label."""
        try:
            await change(mountpoint, holder)
        except NotFoundError:
            pass

    async def remove_strays(self) -> None:
        """Remove the layer directories no sandbox holds (left by a crash between mkdir and mount, or
        after an unmount); one that still carries a mount no sandbox recorded is left alone, unless it is
        the daemon's (an idle layer of a daemon that died, adopted with the rest of its mounts): that one
        is idle here too, for a grace from now."""
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name in self._held:
                continue
            if path in self.daemon.table.mounts:
                held = self._held[name] = _HeldLayer(path)
                if not self.daemon.idle.park(path, functools.partial(self._unmount_idle, name)):
                    await self._unmount_held(name, held)
                continue
            if mounts.top_mount(path) is not None:  # from mountinfo: a stat could be a FUSE request to ourselves
                log.warning("%s is no layer of a sandbox, yet something is mounted there; leaving it", path)
                continue
            _remove_dir(path)

    async def _mount(self, digest: str, *, name: str | None, profile: bool, fill: str | None,
                     holder: Holder | None) -> str:
        mountpoint = os.path.join(self.directory, digest)
        os.makedirs(mountpoint, exist_ok=True)
        try:
            await self.daemon.mount(digest, mountpoint, mode=self.mode, name=name, profile=profile, fill=fill,
                                    holder=holder, check_packs=True)
        except BaseException:
            _remove_dir(mountpoint)
            raise
        return mountpoint

    async def _unmount(self, mountpoint: str) -> None:
        try:
            try:
                await self.daemon.unmount(mountpoint)
            except UnavailableError as exc:
                if not exc.transient:
                    raise
                # A process still runs in a sandbox whose overlay was detached lazily.
                await self.daemon.unmount(mountpoint, lazy=True)
        except NotFoundError:
            # Not this daemon's mount: one a dead daemon left (adopted by recover) that its successor did
            # not detach. It is ours all the same (our directory, a sandbox's recorded layer).
            if (identity := mounts.identity_at(mountpoint)) is not None:
                await trio.to_thread.run_sync(mounts.umount_identified, identity, mountpoint, True)
        _remove_dir(mountpoint)

    def _turn(self, digest: str) -> AbstractAsyncContextManager[None]:
        """Calls on one layer take turns (a mount or an unmount awaits)."""
        return self._turns.take(digest)


def _remove_dir(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)


# ---- the service -------------------------------------------------------------------------------------


class SandboxService:
    """Sandboxes over the daemon's layer mounts, behind its API; see the module docstring."""

    def __init__(self, daemon: NodeDaemon, *, layer_mode: str = "kernel", runtime: str = "runc",
                 stack_options: StackOptions = StackOptions()):
        if layer_mode not in MODES:
            raise InputError(f"unknown layer mode {layer_mode!r} (one of {', '.join(MODES)})", where="sandboxes")
        if runtime not in RUNTIMES:
            raise InputError(f"unknown runtime {runtime!r} (one of {', '.join(RUNTIMES)})", where="sandboxes")
        self.daemon = daemon
        self.root = os.path.join(os.path.realpath(daemon.state_dir), SANDBOX_DIR)
        self.layer_mode = layer_mode
        self.runtime = runtime
        self.stack_options = stack_options
        self.layers: DaemonLayers | None = None  # from start() on
        self.manager: SandboxManager | None = None
        self.removed_at_start: list[str] = []  # ids of the dead sandboxes recover() took apart
        self._lifecycle: trio.CapacityLimiter | None = None
        self._execs: trio.CapacityLimiter | None = None
        self._gathered: trio.CapacityLimiter | None = None
        self.output = OutputBudget(EXEC_OUTPUT_BYTES)  # what exec and gathered attach keep of output, at once
        self._busy = 0  # up, down and commit calls under way
        self._stopping = False

    def register(self) -> None:
        """Add the routes to the daemon's API and the start and stop hooks (before the daemon runs)."""
        daemon, api = self.daemon, self.daemon.api
        api.route("POST", "/v1/sandboxes", self._post_up)
        api.route("GET", "/v1/sandboxes", self._get_list)
        api.route("GET", "/v1/sandboxes/{sandbox}", self._get_one)
        api.route("POST", "/v1/sandboxes/{sandbox}/exec", self._post_exec)
        api.route("POST", "/v1/sandboxes/{sandbox}/attach", self._post_attach)
        api.route("POST", "/v1/sandboxes/{sandbox}/down", self._post_down)
        api.route("POST", "/v1/sandboxes/{sandbox}/commit", self._post_commit)
        daemon.on_start.append(self.start)
        daemon.on_stop.append(self.stop)

    # -- start and stop (the daemon's hooks)

    async def start(self) -> None:
        self._lifecycle = trio.CapacityLimiter(LIFECYCLE_THREADS)
        self._execs = trio.CapacityLimiter(EXEC_THREADS)
        # The threads of attached commands of the namespaces runtime (overlay/attach.py): their own, so
        # that commands which run on after their clients left never hold trio's default threads.
        self._gathered = trio.CapacityLimiter(EXEC_THREADS)
        private_dir(self.root)
        self.layers = DaemonLayers(self.daemon, os.path.join(self.root, LAYER_DIR), mode=self.layer_mode,
                                   token=trio.lowlevel.current_trio_token())
        self.manager = await self._in_thread(functools.partial(
            SandboxManager, self.root, self.layers, runtime=self.runtime, stack_options=self.stack_options))
        recovery = await self._in_thread(self.manager.recover)
        await self.layers.remove_strays()
        self.removed_at_start = recovery.removed
        log.info("sandboxes in %s (layers in %s mode, runtime %s): %d kept, %d dead ones removed", self.root,
                 self.layer_mode, self.runtime, len(self.manager.list()), len(recovery.removed))

    async def stop(self) -> None:
        if self.manager is None:
            return
        self._stopping = True
        while self._busy:
            await trio.sleep(STOP_POLL_SECONDS)
        await self._in_thread(self._stop_sandboxes)

    def _stop_sandboxes(self) -> None:
        """Kill the containers, take every running sandbox down keeping its upper dir, let go of the state."""
        manager = self.manager
        try:
            killed = reap_containers(manager.runc_root)
            if killed:
                log.warning("killed %d running containers", len(killed))
        except DsecError as exc:
            log.error("cannot kill the running containers: %s", exc)
        for state in manager.list():
            if state.status != "running":
                continue
            try:
                manager.down(state.id, keep=True)
                log.info("stopped sandbox %s (%s), its upper dir kept", state.id, state.name)
            except DsecError as exc:
                log.error("cannot stop sandbox %s (%s): %s", state.id, state.name, exc)
        manager.close()

    # -- routes

    async def _post_up(self, request: Request) -> api.SandboxInfo:
        body = request.decode(api.SandboxUpRequest)
        spec = SandboxSpec(base=body.base, workspace=body.workspace, toolkits=tuple(body.toolkits), name=body.name,
                           profile=body.profile, fill=body.fill)
        store = body.store
        ours = self._store_url()
        if store is not None and api.absolute_store(store) != api.absolute_store(ours):
            raise ConflictError(f"this daemon's sandboxes read layers from {ours}; start a daemon with --store "
                                "to use another store", where=f"store {store}")
        started = time.monotonic()
        state = await self._lifecycle_call(self.manager.up, spec)
        log.info("sandbox %s (%s) up in %.3f s: %s", state.id, state.name, time.monotonic() - started,
                 ", ".join(f"{layer.role} {layer.ref}" for layer in state.layers))
        return _state_json(state)

    async def _get_list(self, request: Request) -> api.SandboxList:
        self._check_serving()
        return api.SandboxList([_state_json(state) for state in self.manager.list()], self.layers.held(),
                               self.removed_at_start)

    async def _get_one(self, request: Request) -> api.SandboxInfo:
        self._check_serving()
        return _state_json(self.manager.get(request.params["sandbox"]))

    async def _post_exec(self, request: Request) -> Response:
        self._check_serving()
        body = request.decode(api.ExecRequest)
        with self.output.share() as keep:
            run = functools.partial(self.manager.exec, request.params["sandbox"], body.argv, **_run_options(body),
                                    stdin=body.stdin, output_share=keep)
            # Abandoned if the daemon stops meanwhile: a namespaces command cannot be killed from here.
            result = await trio.to_thread.run_sync(run, limiter=self._execs, abandon_on_cancel=True)
            return json_response(api.ExecResult(exit_code=result.exit_code, stdout=result.stdout,
                                                stderr=result.stderr, timed_out=result.timed_out,
                                                truncated=result.truncated))  # encoded while its share holds

    async def _post_attach(self, request: Request) -> Upgrade:
        self._check_serving()
        body = request.decode(api.AttachRequest)
        rootfs, options = self.manager.run_target(request.params["sandbox"], _run_options(body))
        command = AttachCommand(rootfs, body.argv, options, stdin=body.stdin, tty=body.tty, rows=body.rows,
                                cols=body.cols)
        command.check()

        async def run(stream, early: bytes) -> None:
            async with self._execs:
                await relay(stream, early, command, threads=self._gathered, output=self.output)

        return Upgrade(exec_frames.PROTOCOL, run)

    async def _post_down(self, request: Request) -> api.Empty:
        keep = request.decode(api.DownRequest).keep
        await self._lifecycle_call(functools.partial(self.manager.down, request.params["sandbox"], keep=keep))
        return api.Empty()

    async def _post_commit(self, request: Request) -> api.CommitResult:
        body = request.decode(api.CommitRequest)
        parse_ref(body.name)
        store = api.absolute_store(body.store or self._store_url())
        try:
            return await self._lifecycle_call(self._commit, request.params["sandbox"], body.name, store,
                                              body.keep_privileged)
        finally:
            self.daemon.ref_moved(store, body.name)  # the next up here finds the new layer, not a cached ref

    def _commit(self, key: str, name: str, store_url: str, keep_privileged: bool) -> api.CommitResult:
        """Build the sandbox's upper dir into a layer of ``store_url`` named ``name`` (a worker thread)."""
        state = self.manager.get(key)
        with open_store(store_url) as store:
            commit = self.manager.commit(
                state.id, lambda tree: build_tree(tree, store, name=name, source=f"sandbox {state.id} ({state.name})"),
                keep_privileged=keep_privileged)
        result = commit.published
        log.info("committed sandbox %s (%s) as %s, layer %s", state.id, state.name, name, result.digest)
        return api.CommitResult(sandbox=state.id, layer=result.digest, ref=name, store=store_url,
                                stats=result.manifest.stats, dropped=commit.dropped.to_dict())

    # -- helpers

    def _check_serving(self) -> None:
        if self.manager is None or self._stopping:
            raise UnavailableError("the daemon is shutting down", where="sandboxes", transient=True)

    def _store_url(self) -> str:
        return self.daemon.options.store_url or default_store_url()

    async def _lifecycle_call(self, function: Callable, *args):
        self._check_serving()
        self._busy += 1
        try:
            return await self._in_thread(function, *args)
        finally:
            self._busy -= 1

    async def _in_thread(self, function: Callable, *args):
        return await trio.to_thread.run_sync(function, *args, limiter=self._lifecycle)


def attach(daemon: NodeDaemon, *, layer_mode: str = "kernel", runtime: str = "runc",
           stack_options: StackOptions = StackOptions()) -> SandboxService:
    """Serve sandboxes from ``daemon`` (before it runs): routes on its API, recovery at start, stop at
    shutdown. ``layer_mode``: how sandbox layers are mounted; ``runtime``: exec's default."""
    service = SandboxService(daemon, layer_mode=layer_mode, runtime=runtime, stack_options=stack_options)
    service.register()
    return service


def _run_options(body: api.ExecRequest | api.AttachRequest) -> dict[str, Any]:
    """run_in_rootfs's keyword arguments from a request's fields (the runtime only if it names one)."""
    options: dict[str, Any] = dict(env=body.env, cwd=body.cwd, network=body.network, memory_bytes=body.memory_bytes,
                                   cpus=body.cpus, pids_limit=body.pids_limit, timeout=body.timeout)
    if body.runtime is not None:
        options["runtime"] = body.runtime
    return options


def _state_json(state: SandboxState) -> api.SandboxInfo:
    body = dataclasses.asdict(state)
    body["combination"] = combination_id([layer.digest for layer in state.layers]) if state.layers else ""
    return api.decode(body, api.SandboxInfo, where=f"sandbox {state.id}")


