"""Sandboxes on one node: layers stacked with OverlayFS, a private upper dir, commands run by the runtime shim.

A sandbox is (base, workspace, toolkits...) layer refs and a name. ``SandboxManager.up`` resolves every
ref (side by side), names the stack's combination (lazy_fetch/trace_holders.combination_id of the
digests, top first), and acquires every layer, as a holder of its role, ref and combination (what its
traces are labelled with and its profiles looked up by), from a ``LayerProvider`` (reference-counted
layer mounts: the node daemon's implementation sits on its LayerMounter; ``ExportedLayers`` here mounts layers exported from a store with kernel EROFS, for
use without a daemon and for tests), stacks them (stack.mount_stack, top first: toolkits in the order
given, workspace, base) over a fresh upper dir, and records the sandbox in a JSON state file. ``exec``
runs a command in it (runtime.run_in_rootfs), ``commit`` reads its upper dir as a Tree to publish as a
layer (stack.upper_to_tree, privileged parts dropped; build it with erofs_builder.build.build_tree), ``down`` takes it apart.

State directory (one manager per directory, held with flock)::

    state_dir/lock
    state_dir/sandboxes/<id>.json     SandboxState, rewritten (atomically) at every step of up and down
    state_dir/sandboxes/<id>/upper    the sandbox's writes; its root takes the top layer's mode and owner
    state_dir/sandboxes/<id>/work     OverlayFS's work dir
    state_dir/sandboxes/<id>/rootfs   the OverlayFS stack: the sandbox's root
    state_dir/runc/                   runc's state for the containers of exec

Status: ``creating`` -> ``running`` -> (``stopping``) -> gone, or ``stopped`` after ``down(keep=True)``
(overlay unmounted and layers released, upper dir and state kept, for commit). ``up`` records each layer
in the state file as soon as it is acquired, and undoes everything if any step fails: unmount, release,
remove the state file and the directories. Nothing is synced to disk: mounts do not outlive a reboot,
and ``recover`` cleans up whatever they leave.

Restart. A daemon that starts again calls ``recover()`` once, before any ``up``: it deletes containers
left in state_dir/runc, keeps the sandboxes that are still whole (status running, overlay mounted, every
layer mountpoint mounted), taking over their layer references (``LayerProvider.adopt``), and removes the
rest: a dead sandbox's overlay is unmounted, its layers are released (a dead process's references are
adopted first, then released) and its files removed. A ``down(keep=True)`` cut short by a crash loses its
upper dir.

Threads: every method blocks (mount(2), the runtime) and may be called from any thread (the daemon uses
trio.to_thread; its LayerProvider calls back into its loop). ``_lock`` guards ``_sandboxes`` (id -> state)
and name reservations; it is never held across a mount, a provider call or a command. A sandbox in
``creating`` or ``stopping`` belongs to the thread doing it; other calls on it get UnavailableError.
``ExportedLayers._lock`` guards its use counts and is held across an export and mount (simple, serial).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from dsec_fs import mounts
from dsec_fs.files import lock_directory, unlink_if_present, write_atomic
from dsec_fs.trees import remove_tree_or_log
from dsec_fs.errors import ConflictError, CorruptError, DsecError, InputError, NotFoundError, UnavailableError
from dsec_fs.layer import resolve, utc_now
from dsec_fs.store.base import Store
from erofs_builder.chunker import DEFAULT_CHUNK_SIZE
from erofs_builder.export import export_layer
from erofs_builder.limits import DEFAULT_LAYER_LIMITS, LayerBudget, LayerLimits
from erofs_builder.privileged import Dropped, drop_privileged
from erofs_builder.tree import Tree
from lazy_fetch.trace_holders import Holder, combination_id

from .runtime import RunResult, containers_frozen, reap_containers, run_in_rootfs
from .stack import StackOptions, mount_stack, unmount_stack, upper_to_tree

log = logging.getLogger(__name__)

STATE_VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(frozen=True)
class LayerHandle:
    digest: str  # sha256 hex of the layer's meta.erofs
    mountpoint: str  # where the layer is mounted, read-only, for as long as it is acquired


class LayerProvider(Protocol):
    """Reference-counted layer mounts: a layer stays mounted while anyone holds it."""

    def resolve(self, layer_ref: str) -> str:
        """The digest of the layer a ref (or digest) names."""

    def acquire(self, layer_ref: str, *, digest: str | None = None, holder: Holder | None = None,
                profile: bool = True, fill: str | None = None) -> LayerHandle:
        """Mount the layer (a ref or a digest, ``digest`` if resolved already) if no one holds it yet
        (prefetching by its access profile, the one of ``holder``'s combination first, unless ``profile``
        is False, and filling as ``fill`` says, where the provider fetches lazily); count one more user,
        ``holder`` (who it is for: trace_holders.py)."""

    def release(self, digest: str, *, holder: Holder | None = None) -> None:
        """One user fewer (``holder``, as acquired); the last one unmounts the layer."""

    def adopt(self, handle: LayerHandle, *, holder: Holder | None = None) -> None:
        """Count one more user of a layer an earlier process mounted at ``handle.mountpoint``.

        The mount may be gone (recover adopts a dead sandbox's layers to release them); the last release
        then only cleans up after it."""


@dataclass(frozen=True)
class SandboxSpec:
    base: str | None = None  # layer refs or digests; any role may be missing, but not all
    workspace: str | None = None
    toolkits: Sequence[str] = ()  # the first is the top layer
    name: str | None = None  # default: the sandbox id
    profile: bool = True  # layers mounted for it prefetch by their access profiles (lazy_fetch/profile.py)
    fill: str | None = None  # and fetch this in the background (none | profile | layer); None: the daemon's

    def layers(self) -> list[tuple[str, str]]:
        """(role, ref) of every layer, top first."""
        roles = [("toolkit", ref) for ref in self.toolkits] + [("workspace", self.workspace), ("base", self.base)]
        return [(role, ref) for role, ref in roles if ref is not None]


@dataclass(frozen=True)
class SandboxLayer:
    role: str  # "toolkit" | "workspace" | "base"
    ref: str  # as the spec named it
    digest: str
    mountpoint: str


@dataclass(frozen=True)
class SandboxState:
    id: str
    name: str
    status: str  # "creating" | "running" | "stopping" | "stopped"
    layers: tuple[SandboxLayer, ...]  # top first
    rootfs: str  # the OverlayFS target: the sandbox's root
    upper: str
    work: str
    created: str  # ISO-8601 UTC
    pid: int  # the process that holds the sandbox's layer references

    def to_json(self) -> bytes:
        body = dataclasses.asdict(self)
        return json.dumps({"version": STATE_VERSION, **body}, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> "SandboxState":
        try:
            body = json.loads(data)
            if body.pop("version") != STATE_VERSION:
                raise ValueError("unknown version")
            body["layers"] = tuple(SandboxLayer(**layer) for layer in body["layers"])
            state = cls(**body)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptError(f"not a sandbox state: {exc}", where=source) from None
        return state


@dataclass(frozen=True)
class Commit:
    tree: Tree  # the upper dir, ready to build (erofs_builder.build.build_tree)
    dropped: Dropped  # the privileged parts left out (all zero with keep_privileged)
    published: object = None  # what commit's ``publish`` returned


@dataclass(frozen=True)
class Recovery:
    live: list[SandboxState]  # still whole: kept, now held by this process
    removed: list[str]  # ids of the dead sandboxes that were taken apart


class SandboxManager:
    """The sandboxes of one state directory; see the module docstring."""

    def __init__(self, state_dir: str | os.PathLike, layer_provider: LayerProvider, *, runtime: str = "runc",
                 stack_options: StackOptions = StackOptions()):
        self.state_dir = os.path.abspath(os.fsdecode(state_dir))
        self.sandboxes_dir = os.path.join(self.state_dir, "sandboxes")
        self.runc_root = os.path.join(self.state_dir, "runc")
        self.layers = layer_provider
        self.runtime = runtime  # exec's default
        self.stack_options = stack_options
        self._lock = threading.Lock()
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        self._lock_fd = lock_directory(self.state_dir, what="another sandbox manager")
        self._sandboxes: dict[str, SandboxState] = {state.id: state for state in self._load_states()}

    def close(self) -> None:
        """Let go of the state directory. Sandboxes stay up; a later manager recovers them."""
        os.close(self._lock_fd)

    def __enter__(self) -> "SandboxManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- queries ----------------------------------------------------------------------------------------

    def list(self) -> list[SandboxState]:
        with self._lock:
            return sorted(self._sandboxes.values(), key=lambda state: (state.created, state.id))

    def get(self, key: str) -> SandboxState:
        """The sandbox with this id, or else this name (NotFoundError)."""
        with self._lock:
            return self._find(key)

    def _find(self, key: str) -> SandboxState:
        state = self._sandboxes.get(key)
        if state is None:
            state = next((s for s in self._sandboxes.values() if s.name == key), None)
        if state is None:
            raise NotFoundError("no such sandbox", where=f"sandbox {key}")
        return state

    # --- lifecycle --------------------------------------------------------------------------------------

    def up(self, spec: SandboxSpec) -> SandboxState:
        """Acquire the layers, stack them over a new upper dir, and return the running sandbox."""
        layer_refs = spec.layers()
        if not layer_refs:
            raise InputError("a sandbox needs at least one layer", where=f"sandbox {spec.name or '(unnamed)'}")
        sandbox_id = "sb-" + secrets.token_hex(6)
        name = spec.name if spec.name is not None else sandbox_id
        if not _NAME.fullmatch(name):
            raise InputError("a sandbox name is 1 to 63 letters, digits, '_', '.', '-', starting with a letter "
                             "or digit", where=f"sandbox name {name!r}")
        directory = os.path.join(self.sandboxes_dir, sandbox_id)
        state = SandboxState(
            id=sandbox_id, name=name, status="creating", layers=(), rootfs=os.path.join(directory, "rootfs"),
            upper=os.path.join(directory, "upper"), work=os.path.join(directory, "work"), created=utc_now(),
            pid=os.getpid())
        with self._lock:
            if any(other.name == name or other.id == name for other in self._sandboxes.values()):
                raise ConflictError("a sandbox with this name exists", where=f"sandbox {name}")
            self._sandboxes[sandbox_id] = state
        undo: list[Callable[[], None]] = []
        try:
            os.mkdir(directory, mode=0o700)
            # Refuses while the root is still mounted (an unmount below failed): recover() finishes then.
            undo.append(lambda: self._remove_files(state))
            for path in (state.upper, state.work, state.rootfs):
                os.mkdir(path, mode=0o755)
            state = self._save(state)
            with ThreadPoolExecutor(max_workers=min(8, len(layer_refs)), thread_name_prefix="resolve") as pool:
                digests = list(pool.map(self.layers.resolve, [ref for _role, ref in layer_refs]))
            combination = combination_id(digests)
            handles = self._acquire_all([(ref, digest, Holder(role, ref, combination))
                                         for (role, ref), digest in zip(layer_refs, digests)], spec, undo)
            state = self._save(dataclasses.replace(state, layers=tuple(
                SandboxLayer(role, ref, handle.digest, handle.mountpoint)
                for (role, ref), handle in zip(layer_refs, handles))))
            lowers = [layer.mountpoint for layer in state.layers]
            _take_root_attributes(state.upper, lowers[0])
            mount_stack(lowers, state.upper, state.work, state.rootfs, options=self.stack_options)
            undo.append(lambda: unmount_stack(state.rootfs))
            state = self._save(dataclasses.replace(state, status="running"))
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except Exception:
                    log.exception("sandbox %s: undoing a failed up", sandbox_id)
            with self._lock:
                del self._sandboxes[sandbox_id]
            raise
        return state

    def _acquire_all(self, layers: list[tuple[str, str, Holder]], spec: SandboxSpec,
                     undo: list[Callable[[], None]]) -> list[LayerHandle]:
        """Acquire every layer (ref, digest, holder) at once, each in a thread of its own: a layer's open is
        a few store round trips in a row, and the layers of a stack need not wait for each other. Each one
        acquired is released by ``undo``; the first failure (in the stack's order) is raised once all have
        ended."""
        with ThreadPoolExecutor(max_workers=len(layers), thread_name_prefix="sandbox-layer") as pool:
            acquiring = [pool.submit(self.layers.acquire, ref, digest=digest, holder=holder, profile=spec.profile,
                                     fill=spec.fill) for ref, digest, holder in layers]
        for (_ref, _digest, holder), future in zip(layers, acquiring):
            if future.exception() is None:
                undo.append(lambda digest=future.result().digest, holder=holder: self.layers.release(
                    digest, holder=holder))
        return [future.result() for future in acquiring]

    def exec(self, key: str, argv: Sequence[str], **options) -> RunResult:
        """Run ``argv`` in the sandbox; ``options`` are run_in_rootfs's (runtime, env, cwd, limits, ...)."""
        rootfs, options = self.run_target(key, options)
        return run_in_rootfs(rootfs, argv, **options)

    def run_target(self, key: str, options: dict) -> tuple[str, dict]:
        """The root of the running sandbox ``key`` and run_in_rootfs's ``options`` with this sandbox's
        defaults (runtime, hostname, runc_root) added; for exec, and for commands relayed elsewhere."""
        with self._lock:
            state = self._find(key)
        if state.status != "running":
            raise UnavailableError(f"sandbox is {state.status}", where=f"sandbox {state.name}",
                                   transient=state.status == "creating")
        options = {"runtime": self.runtime, "hostname": state.name.replace("_", "-"), **options}
        if options["runtime"] == "runc":
            options.setdefault("runc_root", self.runc_root)
        return state.rootfs, options

    def commit(self, key: str, publish: Callable[[Tree], object] | None = None, *,
               keep_privileged: bool = False, limits: LayerLimits = DEFAULT_LAYER_LIMITS) -> Commit:
        """The sandbox's changes as a Tree (stack.upper_to_tree): a layer to stack over the ones it ran on,
        without setuid/setgid bits, device nodes and file capabilities unless ``keep_privileged``
        (erofs_builder.privileged; whiteouts stay). ``publish(tree)`` (a build_tree call, which reads the
        files) runs before the sandbox goes on; its result is ``Commit.published``. An upper dir past
        ``limits`` (as a build's chunks would count it) is refused (InputError) once the walk gets past
        them: a sandbox's process may have made millions of names, which the walk, in the caller's memory
        (the daemon's), would otherwise hold whole before the build's own check.

        The walk and the reads see the upper dir only, whatever runs in the sandbox meanwhile (walk_dir):
        a command that changes the upper dir then can make the commit fail with InputError, never reach
        outside. The sandbox's runc containers are frozen until ``publish`` returns
        (runtime.containers_frozen), so a command of the runc runtime cannot even do that.
        """
        with self._lock:
            state = self._find(key)
        if state.status not in ("running", "stopped"):
            raise UnavailableError(f"sandbox is {state.status}", where=f"sandbox {state.name}")
        with containers_frozen(self.runc_root, state.rootfs):
            tree = upper_to_tree(state.upper, LayerBudget(limits, DEFAULT_CHUNK_SIZE))
            dropped = Dropped()
            if not keep_privileged:
                dropped = drop_privileged(tree)
                tree.finish()
                if dropped.total():
                    log.info("sandbox %s: commit dropped %s", state.id, dropped.to_dict())
            published = publish(tree) if publish is not None else None
        return Commit(tree, dropped, published)

    def down(self, key: str, *, keep: bool = False) -> None:
        """Unmount the sandbox and release its layers; ``keep`` leaves its upper dir and state (``stopped``).

        ``down`` of a stopped sandbox removes it. If the overlay cannot be unmounted, the error is raised and
        the sandbox stays ``stopping`` until recover() takes it apart.
        """
        with self._lock:
            state = self._find(key)
            if state.status not in ("running", "stopped"):
                raise UnavailableError(f"sandbox is {state.status}", where=f"sandbox {state.name}")
            was_running = state.status == "running"
            state = dataclasses.replace(state, status="stopping")
            self._sandboxes[state.id] = state
        if was_running:
            self._save(state)
            self._take_apart(state)
        if keep and was_running:
            self._save(dataclasses.replace(state, status="stopped"))
        else:
            self._remove_files(state)
            with self._lock:
                del self._sandboxes[state.id]

    def recover(self) -> Recovery:
        """After a restart: keep what is whole, take apart the rest; see the module docstring."""
        reap_containers(self.runc_root)
        with self._lock:
            states = self._load_states()
            self._sandboxes = {state.id: state for state in states}
        live, dead = [], []
        for state in states:
            if state.status == "stopped":
                continue
            (live if self._is_whole(state) else dead).append(state)
        recovered = []
        for state in live:
            if state.pid != os.getpid():
                for layer in state.layers:
                    self.layers.adopt(LayerHandle(layer.digest, layer.mountpoint), holder=holder_of(state, layer))
                state = self._save(dataclasses.replace(state, pid=os.getpid()))
            recovered.append(state)
        for state in dead:
            log.warning("sandbox %s (%s) is %s but not whole: taking it apart", state.id, state.name, state.status)
            self._take_apart(state)
            self._remove_files(state)
        with self._lock:
            for state in recovered:
                self._sandboxes[state.id] = state
            for state in dead:
                del self._sandboxes[state.id]
        self._remove_strays()
        return Recovery(live=recovered, removed=[state.id for state in dead])

    # --- helpers ----------------------------------------------------------------------------------------

    def _state_path(self, sandbox_id: str) -> str:
        return os.path.join(self.sandboxes_dir, sandbox_id + ".json")

    def _save(self, state: SandboxState) -> SandboxState:
        """Write ``state`` to its file (atomically) and to the table; returns it."""
        write_atomic(self._state_path(state.id), state.to_json(), sync=False, tmp_prefix="")
        with self._lock:
            self._sandboxes[state.id] = state
        return state

    def _load_states(self) -> list[SandboxState]:
        states = []
        for entry in sorted(os.listdir(self.sandboxes_dir)):
            if not entry.endswith(".json"):
                continue
            path = os.path.join(self.sandboxes_dir, entry)
            with open(path, "rb") as f:
                data = f.read()
            try:
                states.append(SandboxState.from_json(data, source=path))
            except CorruptError:
                # recover() removes it and its directory as strays (nothing tells which layers it held).
                log.exception("ignoring an unreadable sandbox state")
        return states

    def _is_whole(self, state: SandboxState) -> bool:
        return (state.status == "running" and mounts.is_mountpoint(state.rootfs)
                and all(mounts.is_mountpoint(layer.mountpoint) for layer in state.layers))

    def _take_apart(self, state: SandboxState) -> None:
        """Unmount the overlay and give back every layer reference the sandbox holds."""
        if mounts.is_mountpoint(state.rootfs):
            unmount_stack(state.rootfs)
        foreign = state.pid != os.getpid()
        for layer in state.layers:
            try:
                holder = holder_of(state, layer)
                if foreign:
                    # The process that acquired it is gone: take its reference over, then drop it.
                    self.layers.adopt(LayerHandle(layer.digest, layer.mountpoint), holder=holder)
                self.layers.release(layer.digest, holder=holder)
            except DsecError:
                log.exception("sandbox %s: releasing layer %s", state.id, layer.digest)

    def _remove_files(self, state: SandboxState) -> None:
        if mounts.is_mountpoint(state.rootfs):
            raise UnavailableError("the sandbox's root is still mounted", where=state.rootfs, transient=False)
        # Its upper dir is a tree the sandbox's processes made, nested any depth (remove_tree).
        remove_tree_or_log(os.path.dirname(state.rootfs), "the sandbox directory")
        unlink_if_present(self._state_path(state.id))

    def _remove_strays(self) -> None:
        """Whatever in sandboxes/ belongs to no known sandbox: a directory whose state file was never
        written (a crash in up) or cannot be read, temporary state files."""
        with self._lock:
            known = set(self._sandboxes)
        for entry in os.listdir(self.sandboxes_dir):
            path = os.path.join(self.sandboxes_dir, entry)
            if ".json.tmp-" in entry:
                unlink_if_present(path)
                continue
            if entry.split(".", 1)[0] in known:
                continue
            if os.path.isdir(path):
                rootfs = os.path.join(path, "rootfs")
                if mounts.is_mountpoint(rootfs):
                    unmount_stack(rootfs)
                remove_tree_or_log(path, "the stray sandbox directory")
            else:
                unlink_if_present(path)


def holder_of(state: SandboxState, layer: SandboxLayer) -> Holder:
    """Who ``state``'s ``layer`` is held for: its role, ref and the sandbox's combination."""
    return Holder(layer.role, layer.ref, combination_id([each.digest for each in state.layers]))


def _take_root_attributes(upper: str, top_layer: str) -> None:
    """The stack's root shows the upper dir's own mode and owner: make them the top layer's."""
    st = os.stat(top_layer)
    os.chown(upper, st.st_uid, st.st_gid)
    os.chmod(upper, stat.S_IMODE(st.st_mode))


class ExportedLayers:
    """A LayerProvider without a daemon: layers exported from ``store`` (meta.erofs and the whole blob,
    erofs_builder.export) into ``cache_dir/<digest>/`` and mounted with kernel EROFS at
    ``cache_dir/<digest>/mnt``. Nothing is fetched lazily. The last release unmounts the layer and
    removes its directory; ``close`` does so for every layer still held.
    """

    def __init__(self, store: Store, cache_dir: str | os.PathLike):
        self.store = store
        self.cache_dir = os.path.abspath(os.fsdecode(cache_dir))
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}  # digest -> holders
        self._mountpoints: dict[str, str] = {}  # digest -> where it is mounted

    def resolve(self, layer_ref: str) -> str:
        return resolve(self.store, layer_ref)

    def acquire(self, layer_ref: str, *, digest: str | None = None, holder: Holder | None = None,
                profile: bool = True, fill: str | None = None) -> LayerHandle:
        """Export the layer to local files (nothing is fetched lazily or traced: ``holder``, ``profile``
        and ``fill`` have no use here)."""
        digest = digest or resolve(self.store, layer_ref)
        with self._lock:
            if digest not in self._users:
                directory = os.path.join(self.cache_dir, digest)
                mountpoint = os.path.join(directory, "mnt")
                try:
                    exported = export_layer(self.store, digest, directory)
                    os.makedirs(mountpoint, exist_ok=True)
                    mounts.mount_erofs(exported.meta_path, mountpoint, [exported.blob_path])
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)
                    raise
                self._users[digest], self._mountpoints[digest] = 0, mountpoint
            self._users[digest] += 1
            return LayerHandle(digest, self._mountpoints[digest])

    def release(self, digest: str, *, holder: Holder | None = None) -> None:
        with self._lock:
            if digest not in self._users:
                raise NotFoundError("layer is not held", where=f"layer {digest}")
            self._users[digest] -= 1
            if self._users[digest] == 0:
                self._unmount(digest)

    def adopt(self, handle: LayerHandle, *, holder: Holder | None = None) -> None:
        with self._lock:
            known = self._mountpoints.setdefault(handle.digest, handle.mountpoint)
            if known != handle.mountpoint:
                raise ConflictError(f"layer is mounted at {known} already", where=handle.mountpoint)
            self._users[handle.digest] = self._users.get(handle.digest, 0) + 1

    def held(self) -> dict[str, int]:
        """digest -> number of holders, for every mounted layer."""
        with self._lock:
            return dict(self._users)

    def close(self) -> None:
        with self._lock:
            for digest in list(self._users):
                self._unmount(digest)

    def _unmount(self, digest: str) -> None:
        mountpoint = self._mountpoints.pop(digest)
        del self._users[digest]
        if mounts.is_mountpoint(mountpoint):
            mounts.umount_or_detach(mountpoint)
        shutil.rmtree(os.path.dirname(mountpoint), ignore_errors=True)
