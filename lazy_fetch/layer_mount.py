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

Order: mounting adds the blob (or the tree) first, then calls mount(2); unmounting calls umount2 first,
then drops the blob (or tree); closing unmounts every layer, then the FUSE session. Blobs, trees and meta
images are shared by the mounts that need them and dropped with the last one. A mount detached lazily
(``unmount(..., lazy=True)``, for a busy mountpoint) may still be read by processes that hold files open,
so what it needs stays served until the mounter closes.

Threads: every method runs in the trio loop that opened the mounter (the daemon's loop), which is also
the loop that serves FUSE. mount(2), umount2 and file writes run in worker threads (trio.to_thread): the
kernel reads the blob during mount(2) and looks up the bind source, and this loop must stay free to
answer, or the mount deadlocks. ``LayerMounter._lock`` (a trio.Lock) makes mount and unmount calls
take turns, so the mount table and the use counts change one call at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import trio

from dsec_fs import mounts
from dsec_fs.errors import ConflictError, DsecError, InputError, IntegrityError, NotFoundError, UnavailableError
from dsec_fs.layer import LayerFiles
from dsec_fs.store import keys
from erofs_builder.reader import ErofsImage

from .fs_core import Blob, LayerTree, SessionTree

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = "/run/dsecfs"
MODES = ("kernel", "fuse")
BINDINGS = ("pyfuse3", "fusepy")


@dataclass(frozen=True)
class LayerMount:
    mountpoint: str  # absolute
    mode: str  # "kernel" | "fuse"
    layer: str  # layer digest
    blob_id: str


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
    else:
        raise InputError(f"unknown FUSE binding {binding!r} (one of {', '.join(BINDINGS)})", where="fuse binding")
    return adapter.serve


class LayerMounter:
    """Mounts layers in either mode through one SessionTree served over FUSE; see ``open_mounter``."""

    def __init__(self, state_dir: str, session: SessionTree):
        self.state_dir = state_dir
        self.fuse_dir = os.path.join(state_dir, "fuse")
        self.meta_dir = os.path.join(state_dir, "meta")
        self.session = session
        self._mounts: dict[str, LayerMount] = {}  # mountpoint -> live mount, in mount order
        self._detached: list[LayerMount] = []  # lazily detached mounts, whose resources stay until close
        self._users: Counter[tuple[str, str]] = Counter()  # ("blob"|"meta"|"tree", id) -> mounts using it
        self._lock = trio.Lock()

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
        async with self._lock:
            return await self._mount(layer, blob, os.path.abspath(mountpoint), mode)

    async def _mount(self, layer: LayerFiles, blob: Blob, mountpoint: str, mode: str) -> LayerMount:
        if mountpoint in self._mounts:
            raise ConflictError("a layer is already mounted here", where=mountpoint)
        expected = layer.manifest.blob_blocks * layer.manifest.block_size
        if blob.size != expected:
            raise IntegrityError(f"the blob has {blob.size} bytes, the manifest says {expected}",
                                 where=f"layer {layer.digest}")
        mount = LayerMount(mountpoint, mode, layer.digest, layer.manifest.blob_id)
        async with contextlib.AsyncExitStack() as undo:
            if mode == "kernel":
                await self._retain(("blob", mount.blob_id), undo, self.session.blobs.add, mount.blob_id, blob)
                await self._retain(("meta", layer.digest), undo, self._write_meta, layer)
                await trio.to_thread.run_sync(_mount_erofs_direct, self.meta_path(layer.digest), mountpoint,
                                              self.blob_path(mount.blob_id))
            else:
                tree = LayerTree(ErofsImage(layer.meta, source=keys.layer_meta(layer.digest)), blob)
                await self._retain(("tree", layer.digest), undo, self.session.add_layer, layer.digest, tree)
                await trio.to_thread.run_sync(mounts.mount, self.layer_path(layer.digest), mountpoint, "none",
                                              mounts.MS_BIND)
            undo.pop_all()
        self._mounts[mountpoint] = mount
        return mount

    async def unmount(self, mount: LayerMount | str, *, lazy: bool = False) -> None:
        """Unmount a layer (by LayerMount or mountpoint). Busy: UnavailableError(transient=True), and the
        mount stays; ``lazy`` detaches it anyway (MNT_DETACH), its data served until the mounter closes."""
        async with self._lock:
            await self._unmount(os.path.abspath(mount if isinstance(mount, str) else mount.mountpoint), lazy)

    async def _unmount(self, mountpoint: str, lazy: bool) -> None:
        found = self._mounts.get(mountpoint)
        if found is None:
            raise NotFoundError("no layer is mounted here by this daemon", where=mountpoint)
        try:
            await trio.to_thread.run_sync(mounts.umount, mountpoint, lazy)
        except UnavailableError:
            if await trio.to_thread.run_sync(mounts.is_mountpoint, mountpoint):
                raise
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
        """Count one more user of ``key`` ("blob", "meta" or "tree", and its id); ``create(*args)`` makes
        it for the first one (in a worker thread for meta files, which touch the disk). ``undo`` releases
        it again if the mount fails."""
        if not self._users[key]:
            if key[0] == "meta":
                await trio.to_thread.run_sync(create, *args)
            else:
                create(*args)
        self._users[key] += 1
        undo.push_async_callback(self._release, key)

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

    def _write_meta(self, layer: LayerFiles) -> None:
        """meta.erofs as a file for mount(2), written whole under a temporary name, then renamed."""
        path = self.meta_path(layer.digest)
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "wb") as f:
            f.write(layer.meta)
        os.rename(tmp, path)

    async def close(self) -> None:
        """Unmount every layer (lazily where busy), newest first; the FUSE session is the caller's to end.
        A mount that cannot be detached at all is logged and skipped, so the others still go."""
        for mount in reversed(self.mounts()):
            try:
                await self.unmount(mount)
            except UnavailableError:
                try:
                    await self.unmount(mount, lazy=True)
                except DsecError as exc:
                    log.error("cannot unmount %s: %s", mount.mountpoint, exc)
        for mount in self._detached:
            await self._release_all(mount)
        self._detached.clear()


@contextlib.asynccontextmanager
async def open_mounter(state_dir: str = DEFAULT_STATE_DIR, *, binding: str = "pyfuse3") -> AsyncIterator[LayerMounter]:
    """Own ``state_dir``, serve its FUSE session as a task of the calling trio loop, and yield a
    LayerMounter; on exit unmount every layer, then the session. One per process (one FUSE session)."""
    serve = _serve_function(binding)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)  # layers and blobs below are the node's, not its users'
    lock_fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConflictError("another daemon uses this state directory", where=state_dir) from None
        mounter = LayerMounter(state_dir, SessionTree())
        await trio.to_thread.run_sync(_reset_state, mounter)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(_serve_session, serve, mounter)
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


def _mount_erofs_direct(meta_path: str, mountpoint: str, blob_path: str) -> None:
    """mount_erofs with ``directio``: the kernel reads the blob file straight from the daemon, only the
    ranges EROFS asks for, instead of through the blob file's own page cache. File data is then cached
    once (in the EROFS files' pages, not also in the blob's), and readahead on the blob cannot run on into
    the next file's chunks and fetch them. Kernels before 6.13 do not know the option (6.12 reads backing
    files directly anyway), so a refused mount is tried again without it; a real problem fails again."""
    options = mounts.erofs_options([blob_path])
    try:
        mounts.mount(meta_path, mountpoint, "erofs", mounts.LAYER_FLAGS, f"{options},directio")
    except DsecError as exc:
        mounts.mount_erofs(meta_path, mountpoint, [blob_path])
        log.warning("mounted %s without directio, which the kernel refused: %s", mountpoint, exc)


def _reset_state(mounter: LayerMounter) -> None:
    """Clear what a daemon that died may have left: its FUSE session mount (dead: ENOTCONN) and meta images.
    Safe because the caller holds the state directory's lock."""
    if mounts.is_mountpoint(mounter.fuse_dir):
        mounts.umount(mounter.fuse_dir, lazy=True)
    os.makedirs(mounter.fuse_dir, mode=0o700, exist_ok=True)
    shutil.rmtree(mounter.meta_dir, ignore_errors=True)
    os.makedirs(mounter.meta_dir, mode=0o700)
