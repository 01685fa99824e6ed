"""Mount layers on this node, in kernel or fuse mode, through the process's one FUSE session.

Both modes show the same tree with the same bytes:

- kernel mode: the layer's meta.erofs is written to ``state_dir/meta/<digest>.erofs``; its virtual blob is
  served as the file ``state_dir/fuse/blobs/<blob id>``; the kernel's EROFS driver mounts meta.erofs with
  ``device=`` that file (a file-backed mount, Linux 6.12+). Lookups, stat and readdir never leave the
  kernel, and data read once stays in the page cache; only page-cache misses reach the daemon, as reads
  of the blob file.
- fuse mode: the daemon serves the layer's whole tree at ``state_dir/fuse/layers/<digest>/`` (a
  LayerTree, read by the userspace EROFS reader) and bind-mounts that directory at the mountpoint.

Why one FUSE session for everything. pyfuse3 keeps its session in module globals, so a process has one
FUSE session, and one session has one mountpoint. The alternatives were a child process per fuse-mode
mount, or one session whose tree holds every layer, bind-mounted where each layer belongs. We serve one
SessionTree (fs_core) at ``state_dir/fuse``: ``blobs/`` for kernel mode and ``layers/<digest>/`` for fuse
mode, with one bind mount (mount(2) MS_BIND) per fuse-mode mountpoint, because:
- every read goes through the daemon's one chunk fetcher and cache, so a chunk is fetched once per node
  (single flight) and its bytes are cached once, whichever layers and modes use it; child processes
  would each need their own fetcher, or an IPC hop per read;
- it is the only way kernel mode and fuse mode can run in one pyfuse3 process at all;
- there are no processes to start, watch and reap, and a bind mount costs nothing;
- the same code works for fusepy, which could run several sessions in one process but has no need to.
The price: in fuse mode st_ino is ``slot << 40 | nid`` rather than the bare nid (fs_core.SessionTree) and
all fuse-mode layers share one st_dev. Inode numbers stay unique, and a layer mounted twice is one
directory bind-mounted twice.

State directory::

    state_dir/lock                  flock()ed while a LayerMounter owns the directory
    state_dir/fuse/                 the FUSE session (blobs/, layers/)
    state_dir/meta/<digest>.erofs   meta images of kernel-mode mounts
    state_dir/fuse-session.json     raw binding: the session's device, INIT parameters and inode numbers
    state_dir/fuse-holder.sock      raw binding: the FUSE fd holder (fuse_holder.py) listens here

Restarts (raw binding; "Daemon restarts" in docs/architecture.md): the session is mounted by fuse_raw and
a holder process keeps a copy of its fd, so it outlives a daemon that dies; ``open_mounter`` of the next
daemon takes it over (``_take_session``), rebuilds the SessionTree with the inode numbers saved in
fuse-session.json (saved whenever a blob or tree is added, before mount(2) shows it to the kernel), has
the daemon adopt its mounts (``adopt_layer``: served again, not mounted again), and only then serves.

Order: mounting adds the blob (or the tree) first, then calls mount(2); unmounting calls umount2 first,
then drops the blob (or tree); closing unmounts every layer, then the FUSE session. Blobs, trees and meta
images are shared by the mounts that need them and dropped with the last one. A mount detached lazily
(``unmount(..., lazy=True)``, for a busy mountpoint) may still be read by processes that hold files open,
so what it needs stays served until the mounter closes.

Threads: every method runs in the trio loop that opened the mounter (the daemon's loop), which is also
the loop that serves FUSE. mount(2), umount2 and file writes run in worker threads (trio.to_thread): the
kernel reads the blob during mount(2) and looks up the bind source, and this loop must stay free to
answer, or the mount deadlocks. Mounts of different layers at different mountpoints run at once (a
stack's layers are mounted side by side): ``LayerMounter._turns`` (turns.py) makes the calls on one
mountpoint take turns, and so the calls on one layer (its meta image or tree: whether a mount is its
first user, and writes it, or its last, and removes it, is decided and done in one turn). ``_mounts``,
``_detached`` and the use counts of blobs change only between awaits, so a blob two layers share (one
blob id) needs no turn: adding and removing it are synchronous.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import trio

from dsec_fs import mounts
from dsec_fs.api import BINDINGS, MODES
from dsec_fs.files import lock_directory, private_dir, unlink_if_present, write_state_file
from dsec_fs.errors import (ConflictError, DsecError, InputError, IntegrityError, NotFoundError, UnavailableError,
                            UnsupportedError)
from dsec_fs.layer import LayerFiles
from dsec_fs.store import keys
from erofs_builder.reader import ErofsImage

from . import fuse_holder, fuse_raw
from .fs_core import Blob, LayerTree, SessionTree
from .turns import Turns

log = logging.getLogger(__name__)

SESSION_FILE = "fuse-session.json"  # raw: what a daemon needs to take the FUSE session over
HOLDER_SOCKET = "fuse-holder.sock"  # raw: where the FUSE fd holder listens
DEFAULT_READ_AHEAD = 1 << 20  # bytes the kernel reads ahead in a layer's file, both modes (open_mounter)


@dataclass(frozen=True)
class LayerMount:
    mountpoint: str  # absolute
    mode: str  # "kernel" | "fuse"
    layer: str  # layer digest
    blob_id: str
    identity: mounts.MountIdentity  # what was mounted: the unmount goes by it, not by the path's names


def fuse_options() -> list[str]:
    """libfuse mount options for the session: read-only, permission checks by the kernel, and visible to
    every user (sandboxes run as other uids) when this process may allow that. libfuse mounts nosuid,nodev,
    as kernel-mode layers are (dsec_fs.mounts.LAYER_FLAGS): an image's setuid bits and device nodes give
    no one on the host anything."""
    options = ["fsname=dsecfs", "subtype=dsecfs", "ro", "default_permissions"]
    if _allow_other_permitted():
        options.append("allow_other")
    return options


def _allow_other_permitted() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.split("#")[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def _serve_function(binding: str):
    """The chosen adapter's serve(); only that FUSE library gets imported."""
    if binding == "pyfuse3":
        from . import fuse_pyfuse3 as adapter
    elif binding == "fusepy":
        from . import fuse_fusepy as adapter
    elif binding == "raw":
        adapter = fuse_raw
    else:
        raise InputError(f"unknown FUSE binding {binding!r} (one of {', '.join(BINDINGS)})", where="fuse binding")
    return adapter.serve


class LayerMounter:
    """Mounts layers in either mode through one SessionTree served over FUSE; see ``open_mounter``."""

    def __init__(self, state_dir: str, session: SessionTree, *, read_ahead: int = DEFAULT_READ_AHEAD):
        self.state_dir = state_dir
        self.read_ahead = read_ahead  # bytes the kernel reads ahead in a layer's file (0: its default)
        self.fuse_dir = os.path.join(state_dir, "fuse")
        self.meta_dir = os.path.join(state_dir, "meta")
        self.session = session
        self._mounts: dict[str, LayerMount] = {}  # mountpoint -> live mount, in mount order
        self._detached: list[LayerMount] = []  # lazily detached mounts, whose resources stay until close
        self._users: Counter[tuple[str, str]] = Counter()  # ("blob"|"meta"|"tree", id) -> mounts using it
        self._turns = Turns()  # by ("mountpoint", path) and ("layer", digest): see the module docstring
        # raw binding: the session survives this process (fuse_holder) and ``session_state`` (the FUSE
        # session's device, the INIT parameters, the inode numbers) is saved for the daemon that takes it
        # over; ``resumed``: this mounter took over such a session, and may adopt its mounts.
        self.session_state: dict | None = None
        self.resumed = False
        self.holder_path = os.path.join(state_dir, HOLDER_SOCKET)

    def mounts(self) -> list[LayerMount]:
        return list(self._mounts.values())

    def blob_path(self, blob_id: str) -> str:
        return os.path.join(self.fuse_dir, SessionTree.BLOBS.decode(), blob_id)

    def layer_path(self, digest: str) -> str:
        return os.path.join(self.fuse_dir, SessionTree.LAYERS.decode(), digest)

    def meta_path(self, digest: str) -> str:
        return os.path.join(self.meta_dir, f"{digest}.erofs")

    async def mount_layer(self, layer: LayerFiles, blob: Blob, mountpoint: str, *, mode: str = "kernel") -> LayerMount:
        """Mount ``layer`` at ``mountpoint``, its data read from ``blob`` (the layer's virtual blob)."""
        if mode not in MODES:
            raise InputError(f"unknown mount mode {mode!r} (one of {', '.join(MODES)})", where=mountpoint)
        mountpoint = os.path.abspath(mountpoint)
        async with self._turns.take(("mountpoint", mountpoint), ("layer", layer.digest)):
            return await self._mount(layer, blob, mountpoint, mode)

    async def adopt_layer(self, layer: LayerFiles, blob: Blob, mountpoint: str, *, mode: str) -> LayerMount:
        """List a mount that the daemon which died before us made through the session we took over (it is
        still there, and the kernel reads through it): serve what it needs, under the inode numbers it
        had, without mounting anything. Call it before the session is served (``open_mounter``'s
        ``adopt``); nothing may stat the mountpoint meanwhile, as nobody answers its FUSE requests yet."""
        if not self.resumed:
            raise ConflictError("only a FUSE session taken over has mounts to adopt", where=mountpoint)
        mountpoint = os.path.abspath(mountpoint)
        async with self._turns.take(("mountpoint", mountpoint), ("layer", layer.digest)):
            return await self._mount(layer, blob, mountpoint, mode, adopt=True)

    async def _mount(self, layer: LayerFiles, blob: Blob, mountpoint: str, mode: str, *,
                     adopt: bool = False) -> LayerMount:
        if mountpoint in self._mounts:
            raise ConflictError("a layer is already mounted here", where=mountpoint)
        expected = layer.manifest.blob_blocks * layer.manifest.block_size
        if blob.size != expected:
            raise IntegrityError(f"the blob has {blob.size} bytes, the manifest says {expected}",
                                 where=f"layer {layer.digest}")
        blob_id = layer.manifest.blob_id
        async with contextlib.AsyncExitStack() as undo:
            if mode == "kernel":
                await self._retain(("blob", blob_id), undo, self.session.blobs.add, blob_id, blob)
                meta = ("meta", layer.digest)
                # One worker-thread call for the meta image and mount(2), not three: each hand-over to a
                # worker and back waited for a core and the GIL, 15-20 ms of a first-ever `up` behind a
                # fill's threads (docs/benchmarks.md, issue 13, branch up13).
                identity = await trio.to_thread.run_sync(self._place_meta_and_mount, layer, mountpoint, blob_id,
                                                         not self._users[meta], adopt)
                self._users[meta] += 1
                undo.push_async_callback(self._release, meta)
            else:
                tree = LayerTree(ErofsImage(layer.meta, source=keys.layer_meta(layer.digest)), blob)
                await self._retain(("tree", layer.digest), undo, self.session.add_layer, layer.digest, tree)
                identity = await trio.to_thread.run_sync(self._bind, layer.digest, mountpoint, adopt)
            undo.pop_all()
        mount = LayerMount(mountpoint, mode, layer.digest, blob_id, identity)
        self._mounts[mountpoint] = mount
        return mount

    async def unmount(self, mount: LayerMount | str, *, lazy: bool = False) -> None:
        """Unmount a layer (by LayerMount or mountpoint). Busy: UnavailableError(transient=True), and the
        mount stays; ``lazy`` detaches it anyway (MNT_DETACH), its data served until the mounter closes."""
        mountpoint = os.path.abspath(mount if isinstance(mount, str) else mount.mountpoint)
        async with self._turns.take(("mountpoint", mountpoint)):
            found = self._mounts.get(mountpoint)
            if found is None:
                raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
            async with self._turns.take(("layer", found.layer)):
                await self._unmount(found, lazy)

    async def _unmount(self, found: LayerMount, lazy: bool) -> None:
        mountpoint = found.mountpoint
        if not await trio.to_thread.run_sync(mounts.umount_identified, found.identity, mountpoint, lazy):
            log.warning("%s was unmounted by someone else", mountpoint)
        del self._mounts[mountpoint]
        if lazy:
            self._detached.append(found)
        else:
            await self._release_all(found)

    async def _release_all(self, mount: LayerMount) -> None:
        if mount.mode == "kernel":
            await self._release(("meta", mount.layer))
            await self._release(("blob", mount.blob_id))
        else:
            await self._release(("tree", mount.layer))

    async def _retain(self, key: tuple[str, str], undo: contextlib.AsyncExitStack, create, *args) -> None:
        """Count one more user of ``key`` ("blob" or "tree", and its id); ``create(*args)`` makes it for the
        first one. ``undo`` releases it again if the mount fails, so does a session file that cannot be
        written (a full disk): a blob or tree left served with no user counted refused every later mount of
        its layer ("already served")."""
        first = not self._users[key]
        if first:
            create(*args)
        self._users[key] += 1
        undo.push_async_callback(self._release, key)
        if first:
            self.save_session_state()  # its inode numbers, before the kernel learns them

    async def _release(self, key: tuple[str, str]) -> None:
        """Count one user of ``key`` less; the last one removes it."""
        self._users[key] -= 1
        if self._users[key]:
            return
        del self._users[key]
        kind, name = key
        if kind == "blob":
            self.session.blobs.remove(name)
        elif kind == "tree":
            self.session.remove_layer(name)
        else:
            await trio.to_thread.run_sync(os.unlink, self.meta_path(name))

    def _place_meta_and_mount(self, layer: LayerFiles, mountpoint: str, blob_id: str, write: bool,
                              adopt: bool) -> mounts.MountIdentity:
        """A worker thread's part of a kernel-mode mount (the blob is served already): check that the state
        directory can hold an image the kernel takes (not when adopting: the mount is there), write
        meta.erofs if ``write`` (its first user; whole under a temporary name, then renamed: a full disk is
        UnavailableError naming the file, and nothing of it is left), then mount(2) it, unless adopting. A
        failed mount removes the image it wrote. Returns the identity of the mount."""
        meta_path = self.meta_path(layer.digest)
        if not adopt:  # before the meta image is written where it could not be used
            _check_image_filesystem(meta_path)
        if write:
            write_state_file(meta_path, layer.meta, what="the layer's meta image")
        if adopt:
            return _adopted_identity(mountpoint)
        try:
            _mount_erofs_direct(meta_path, mountpoint, self.blob_path(blob_id), self.read_ahead)
        except BaseException:
            if write:
                unlink_if_present(meta_path)
            raise
        return mounts.new_mount_identity(mountpoint)

    def _bind(self, digest: str, mountpoint: str, adopt: bool) -> mounts.MountIdentity:
        """A worker thread's part of a fuse-mode mount: bind the layer's tree at ``mountpoint`` (unless
        adopting: it is there); returns the identity of the mount."""
        if adopt:
            return _adopted_identity(mountpoint)
        mounts.mount(self.layer_path(digest), mountpoint, "none", mounts.MS_BIND)
        return mounts.new_mount_identity(mountpoint)

    def save_session_state(self, **changes) -> None:
        """raw binding: update ``session_state`` with ``changes`` and the session's inode numbers, and
        write it to SESSION_FILE (atomically: a daemon that dies right after must leave it whole). Not
        synced: only a daemon taking the session over from its holder process reads it, on the same boot
        (a machine crash ends the holder and the session with it), and the page cache outlives the daemon.
        Small, and written once per new blob or layer, so it is written in the trio thread. UnavailableError
        if it cannot be written (a full disk)."""
        if self.session_state is None:
            return
        self.session_state.update(changes, numbers=self.session.numbers())
        write_state_file(os.path.join(self.state_dir, SESSION_FILE),
                         json.dumps(self.session_state, indent=1).encode(), what="the FUSE session file")

    async def close(self) -> None:
        """Unmount every layer (lazily where busy), newest first; the FUSE session is the caller's to end.
        A mount that cannot be detached at all is logged and skipped, so the others still go."""
        for mount in reversed(self.mounts()):
            await unmount_or_detach(self.unmount, mount.mountpoint)
        while self._detached:
            mount = self._detached.pop()
            async with self._turns.take(("layer", mount.layer)):
                await self._release_all(mount)


async def unmount_or_detach(unmount: Callable[..., Awaitable[object]], mountpoint: str) -> None:
    """``unmount(mountpoint)``, or where the mount is busy ``unmount(mountpoint, lazy=True)``: what a
    closing mounter or a stopping daemon does to each of its mounts. One that cannot be detached at all is
    logged and skipped, so that the caller goes on with the others."""
    try:
        try:
            await unmount(mountpoint)
        except UnavailableError:  # busy
            await unmount(mountpoint, lazy=True)
    except DsecError as exc:
        log.error("cannot unmount %s: %s", mountpoint, exc)


@contextlib.asynccontextmanager
async def open_mounter(state_dir: str, *, binding: str = "raw",
                       adopt: Callable[[LayerMounter], Awaitable[None]] | None = None,
                       read_ahead: int = DEFAULT_READ_AHEAD) -> AsyncIterator[LayerMounter]:
    """Own ``state_dir``, serve its FUSE session as a task of the calling trio loop, and yield a
    LayerMounter; on exit unmount every layer, then the session. One per process (one FUSE session).
    ``read_ahead``: how far the kernel reads ahead in a layer's files, in one request to the daemon
    (0 leaves the kernel's default, 128 KiB): set on the session for fuse mode (a file's pages come in
    bigger requests, and in bigger folios: warm reads from the page cache 7-8 to 14 GB/s, after
    drop_caches 0.62 to 0.85 GB/s in a side-by-side check), and on each kernel-mode mount
    (``_mount_erofs_direct``).

    With the raw binding the session outlives a daemon that dies (see "Daemon restarts" in
    docs/architecture.md): if the last one left it, this mounter takes it over, calls ``adopt(mounter)``
    to re-add what its mounts need (``adopt_layer``) before anything is served, then has the requests the
    dead daemon had taken sent again. Otherwise (and with the other bindings) what a dead daemon left is
    detached and a new session mounted."""
    serve = _serve_function(binding)
    private_dir(state_dir)  # layers and blobs below are the node's, not its users'
    lock_fd = lock_directory(state_dir, what="another daemon")
    try:
        mounter = LayerMounter(state_dir, SessionTree(), read_ahead=read_ahead)
        try:
            async with trio.open_nursery() as nursery:
                if binding == "raw":
                    await nursery.start(_serve_raw_session, serve, mounter, adopt)
                    await trio.to_thread.run_sync(_refuse_flush, mounter.fuse_dir)
                else:
                    await trio.to_thread.run_sync(_reset_state, mounter)
                    await nursery.start(_serve_session, serve, mounter)
                if read_ahead:  # stat(2) of the session: from a worker thread, as this one serves it
                    await trio.to_thread.run_sync(_set_read_ahead, mounts.set_fuse_read_ahead, mounter.fuse_dir,
                                                  read_ahead)
                try:
                    yield mounter
                finally:
                    try:
                        with trio.CancelScope(shield=True):
                            await mounter.close()
                    finally:
                        nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The nursery is ours, not the caller's: a single error comes out as itself.
            raise (group.exceptions[0] if len(group.exceptions) == 1 else group) from None
    finally:
        os.close(lock_fd)


async def _serve_session(serve, mounter: LayerMounter, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the session until cancelled; a session that ends by itself (unmounted from outside) is an
    error, because every layer mounted through it is dead."""
    await serve(mounter.session, mounter.fuse_dir, fuse_options(), task_status=task_status)
    raise UnavailableError("the FUSE session was unmounted from outside", where=mounter.fuse_dir, transient=False)


async def _serve_raw_session(serve, mounter: LayerMounter, adopt, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """raw binding: take over the session a daemon that died left with its holder, or mount a new one and
    start a holder for it; serve it until cancelled. Leaving (a normal stop, or an error; a killed daemon
    runs none of this) unmounts the session and stops the holder, which ends the connection."""
    taken = await trio.to_thread.run_sync(_take_session, mounter)
    holder = None
    if taken is None:
        await trio.to_thread.run_sync(_reset_state, mounter)
        fd = await trio.to_thread.run_sync(fuse_raw.mount, mounter.fuse_dir, fuse_options())
        params = None
    else:
        fd, params, state = taken
    try:
        if taken is None:
            holder = await trio.to_thread.run_sync(fuse_holder.spawn, mounter.holder_path, fd)
            mounter.session_state = {"device": mounts.mount_device(mounter.fuse_dir), "params": None}
            mounter.save_session_state()
        else:
            mounter.session = SessionTree(state["numbers"])
            mounter.session_state = state
            mounter.resumed = True
            log.info("took over the FUSE session at %s from a daemon that died", mounter.fuse_dir)
            if adopt is not None:
                await adopt(mounter)
        await serve(mounter.session, fd, params=params,
                    on_init=lambda negotiated: mounter.save_session_state(params=negotiated.to_json()),
                    task_status=task_status)
    finally:
        with trio.CancelScope(shield=True):
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
            await trio.to_thread.run_sync(_end_raw_session, mounter, holder)
    raise UnavailableError("the FUSE session was unmounted from outside", where=mounter.fuse_dir, transient=False)


def _take_session(mounter: LayerMounter) -> tuple[int, fuse_raw.SessionParams, dict] | None:
    """(fd, SessionParams, saved session state) of the session a daemon that died left to its holder, if
    there is one and it is still mounted and alive; else None (the holder, if any, is stopped later by
    _reset_state). Touches nothing inside the session: nobody serves it yet."""
    fd = fuse_holder.take(mounter.holder_path)
    if fd is None:
        return None
    try:
        with open(os.path.join(mounter.state_dir, SESSION_FILE)) as f:
            state = json.load(f)
        params = fuse_raw.SessionParams.from_json(state["params"])
        if not isinstance(state["numbers"], dict):
            raise TypeError("no inode numbers")
        device = mounts.mount_device(mounter.fuse_dir)
        if device is None or device != state["device"]:
            raise ValueError(f"the session is no longer mounted at {mounter.fuse_dir}")
        if not fuse_raw.connection_alive(fd):
            raise ValueError("the kernel aborted the connection")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot take over the FUSE session at %s (%s): starting a new one", mounter.fuse_dir, exc)
        os.close(fd)
        return None
    return fd, params, state


def _refuse_flush(fuse_dir: str) -> None:
    """Open and close the session's flush-probe, so that the kernel sends its first FLUSH now and learns
    (ENOSYS) to send none on this connection again, before any layer is mounted: a close(2) of a file
    here then never waits for a daemon, even while none runs (fuse_raw ``_Session.flush``). A taken-over
    connection learnt it already, unless the daemon that died did not get this far."""
    os.close(os.open(os.path.join(fuse_dir, SessionTree.FLUSH_PROBE.decode()), os.O_RDONLY | os.O_CLOEXEC))


def _end_raw_session(mounter: LayerMounter, holder) -> None:
    """Unmount the session (lazily: layers detached while busy may still hold it) and stop its holder,
    reaping it if it is our child; the kernel ends the connection once neither holds the fd."""
    stopped = fuse_holder.stop(mounter.holder_path)
    if holder is not None:
        if not stopped:  # its socket is gone (state directory removed under us): it would wait forever
            log.warning("the FUSE fd holder %d does not answer at %s: terminating it", holder.pid,
                        mounter.holder_path)
            holder.terminate()
        holder.wait()
    unlink_if_present(os.path.join(mounter.state_dir, SESSION_FILE))
    if mounts.mount_device(mounter.fuse_dir) is not None:
        try:
            mounts.umount(mounter.fuse_dir, lazy=True)
        except DsecError as exc:
            log.warning("unmounting the FUSE session: %s", exc)


def _adopted_identity(mountpoint: str) -> mounts.MountIdentity:
    """The identity of a mount being adopted, from /proc/self/mountinfo alone: nobody serves the FUSE
    session yet, so nothing may look the mountpoint up."""
    identity = mounts.identity_at(mountpoint)
    if identity is None:
        raise NotFoundError("nothing is mounted here any more", where=mountpoint)
    return identity


# Filesystems whose files the kernel's file-backed EROFS refuses as an image (ENOTBLK): no direct I/O.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def _check_image_filesystem(meta_path: str) -> None:
    fstype = mounts.filesystem_of(meta_path).fstype
    if fstype in MEMORY_FILESYSTEMS:
        raise UnsupportedError(f"kernel-mode mounts need the daemon's state directory on a disk filesystem, not "
                               f"{fstype}: the kernel's file-backed EROFS refuses an image there (ENOTBLK). Start "
                               f"the daemon with --state-dir on a disk (the default /var/lib/dsecfs/state is), or "
                               f"mount in fuse mode", where=os.path.dirname(meta_path))


def _mount_erofs_direct(meta_path: str, mountpoint: str, blob_path: str, read_ahead: int) -> None:
    """mount_erofs with ``directio``: the kernel reads the blob file straight from the daemon, only the
    ranges EROFS asks for, instead of through the blob file's own page cache. File data is then cached
    once (in the EROFS files' pages, not also in the blob's), and readahead on the blob cannot run on into
    the next file's chunks and fetch them. Kernels before 6.13 do not know the option (6.12 reads backing
    files directly anyway), so a refused mount is tried again without it; a real problem fails again.

    EROFS then asks the daemon for what it reads ahead in a file, in one request per window: 128 KiB by
    default, one or two at a time, which held warm sequential reads to about 0.8 GB/s, one Python round
    trip per 128 KiB. ``read_ahead`` bytes (the mount's read_ahead_kb; 0 leaves the default) make those
    requests bigger and fewer. Readahead stays inside the file being read (so inside its own chunks),
    and a page fault of a mapped file reads around it as far: a little more of a big library may be
    fetched than it touches (numpy's import: the kernel asks 74.9 MB at 1 MiB, 52.8 MB at 128 KiB). The
    two cannot be set apart from here: the kernel copies read_ahead_kb into each file's readahead state
    when it is opened, and read(2)'s readahead and a fault's read-around both use that one number
    (docs/benchmarks.md, issue 13, "A walk's window stays in its directory")."""
    options = mounts.erofs_options([blob_path])
    try:
        mounts.mount(meta_path, mountpoint, "erofs", mounts.LAYER_FLAGS, f"{options},directio")
    except DsecError as exc:
        mounts.mount_erofs(meta_path, mountpoint, [blob_path])
        log.warning("mounted %s without directio, which the kernel refused: %s", mountpoint, exc)
    if read_ahead:
        _set_read_ahead(mounts.set_read_ahead, mountpoint, read_ahead)


def _set_read_ahead(setter, mountpoint: str, read_ahead: int) -> None:
    """``setter`` (a mounts.set_*read_ahead), logging rather than raising: a tuning knob, the mount is
    good without it."""
    try:
        if not setter(mountpoint, read_ahead):
            log.info("cannot set the readahead of %s: the kernel does not say which device info is its",
                     mountpoint)
    except OSError as exc:
        log.warning("cannot set the readahead of %s: %s", mountpoint, exc)


def _reset_state(mounter: LayerMounter) -> None:
    """Clear what a daemon that died may have left: the holder of its session (raw binding), its FUSE
    session mount (dead, once no holder keeps it: ENOTCONN) and meta images. Safe because the caller holds
    the state directory's lock."""
    if fuse_holder.stop(mounter.holder_path):
        log.warning("stopped the FUSE fd holder a daemon that died left: its mounts are dead now")
    unlink_if_present(mounter.holder_path)  # a holder that was killed leaves its socket
    unlink_if_present(os.path.join(mounter.state_dir, SESSION_FILE))
    if mounts.mount_device(mounter.fuse_dir) is not None:
        mounts.umount(mounter.fuse_dir, lazy=True)
    os.makedirs(mounter.fuse_dir, mode=0o700, exist_ok=True)
    shutil.rmtree(mounter.meta_dir, ignore_errors=True)
    os.makedirs(mounter.meta_dir, mode=0o700)
