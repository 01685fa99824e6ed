"""Take a layer out of the store: as a mountable image pair (export) or as a directory tree (extract).

``export_layer`` writes out_dir/meta.erofs and out_dir/blob, the virtual blob materialised (every chunk
at blkaddr * 4096, zero-padded, the file exactly blob_blocks * 4096 bytes, sparse where it can be), so
that ``mount -t erofs -o device=out_dir/blob out_dir/meta.erofs`` and ``fsck.erofs --device=...`` work
without dsecfs. Each file is written under a temporary name and renamed into place, 0600 whatever the
umask: the blob holds every byte of every file of the layer, a 0600 root file's too, and meta.erofs the
names in every directory (a node's blob files are 0400 for the same reason, lazy_fetch/fs_core.py).

``extract_layer`` / ``extract_image`` recreate the tree on disk: every inode kind, owners, modes with
setuid/setgid/sticky, xattrs, symlinks as stored, hard links, sparse holes and nanosecond mtimes. As root,
by default without what the layer's author could use to gain privileges on this host (privileged.py:
setuid/setgid bits, device nodes other than whiteouts, file capabilities), counted in
``ExtractStats.dropped``; ``keep_privileged`` restores them too, as tar -p does.

Safety: the layer is untrusted. Every file is created relative to an open descriptor of its parent
directory (dir_fd) with O_NOFOLLOW / O_EXCL semantics, and each directory descriptor is opened from its
parent's with O_NOFOLLOW, so nothing the layer contains (a symlink named like a directory, "..", a name
reused) can make extract write outside out_dir or through a symlink. Names were validated by the reader
(no "/", no NUL, no "." or ".." entries other than the directory's own).

Order matters for what survives: chown clears setuid bits and security.capability, so an inode gets
chown, then its xattrs, then chmod, then its mtime; a directory gets all of that only after its last
entry was created (writing entries changes its mtime and may need write permission), deepest first.

Threads: plain blocking functions, safe from any thread (each call uses its own descriptors).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dsec_fs.errors import ConflictError, DsecError, FormatError, UnavailableError, UnsupportedError
from dsec_fs.files import write_atomic
from dsec_fs.layer import open_layer
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .blob import BATCH_BYTES, StoreBlob, chunk_batches
from .ondisk.chunk_index import HOLE
from .ondisk.inode import LAYOUT_CHUNK_BASED
from .privileged import Dropped, is_device, unprivileged_mode, unprivileged_xattrs
from .reader import ErofsImage, Stat

META_NAME = "meta.erofs"
BLOB_NAME = "blob"
READ_BYTES = 8 << 20  # file data read through the reader per call when extracting
# Extract meets files in the order their chunks were laid out, so it reads the blob ahead in large
# merged requests instead of one request per small file.
READAHEAD_BYTES = 16 << 20


@dataclass(frozen=True)
class ExportResult:
    meta_path: str
    blob_path: str
    blob_size: int  # bytes of the blob file (blob_blocks * block size)


@dataclass
class ExtractStats:
    entries: int = 0  # names created, the root included
    files: int = 0  # regular-file inodes written (hard links count once)
    bytes: int = 0  # data bytes written (holes excluded)
    hard_links: int = 0  # names made with link() to an inode created before
    dropped: Dropped = field(default_factory=Dropped)  # privileged parts left out (privileged.py)


def export_layer(store: Store, ref_or_digest: str, out_dir: str | os.PathLike) -> ExportResult:
    """Write the layer's meta.erofs and materialised blob into ``out_dir`` (created if missing)."""
    files = open_layer(store, ref_or_digest)
    blob = StoreBlob.for_layer(store, files)
    blobmap = blob.blobmap
    image = ErofsImage(files.meta, source=keys.layer_meta(files.digest))
    # The pair must mount: the image's only extra device has to be exactly this blob.
    slots = image.devices
    if len(slots) != 1 or slots[0].tag != blobmap.blob_id.encode() or slots[0].blocks != blobmap.blocks:
        raise FormatError("device table", None, f"does not describe the layer's blob {blobmap.blob_id} "
                          f"({blobmap.blocks} blocks)", source=image.source)
    out_dir = os.fspath(out_dir)
    with _os_errors(out_dir):
        os.makedirs(out_dir, exist_ok=True)
    meta_path, blob_path = os.path.join(out_dir, META_NAME), os.path.join(out_dir, BLOB_NAME)

    def write_blob(fd: int) -> None:
        os.ftruncate(fd, blob.size)  # padding stays a hole
        for batch in chunk_batches(blobmap.entries, BATCH_BYTES):
            chunks = blob.fetch(batch)
            for blkaddr, digest, _length in batch:
                _pwrite_all(fd, chunks[digest], blkaddr * blobmap.block_size)

    _write_atomically(meta_path, lambda fd: _pwrite_all(fd, files.meta, 0))
    _write_atomically(blob_path, write_blob)
    return ExportResult(meta_path=meta_path, blob_path=blob_path, blob_size=blob.size)


def extract_layer(store: Store, ref_or_digest: str, out_dir: str | os.PathLike, *, exist_ok: bool = False,
                  same_owner: bool | None = None, keep_privileged: bool | None = None) -> ExtractStats:
    """Recreate the layer's tree in ``out_dir``, fetching file data from the store (verified)."""
    files = open_layer(store, ref_or_digest)
    blob = StoreBlob.for_layer(store, files, readahead_bytes=READAHEAD_BYTES)
    image = ErofsImage(files.meta, blob=blob, source=keys.layer_meta(files.digest))
    return extract_image(image, out_dir, exist_ok=exist_ok, same_owner=same_owner, keep_privileged=keep_privileged)


def extract_image(image: ErofsImage, out_dir: str | os.PathLike, *, exist_ok: bool = False,
                  same_owner: bool | None = None, keep_privileged: bool | None = None) -> ExtractStats:
    """Recreate the tree of ``image`` in ``out_dir``; the image's root becomes ``out_dir`` itself.

    ``out_dir`` is created if missing and must be empty unless ``exist_ok`` (even then no name may
    already exist: ConflictError). ``same_owner`` (default: when running as root) sets uid and gid.
    ``keep_privileged`` (default: when not running as root) keeps setuid/setgid bits, device nodes and
    file capabilities (see the module docstring).
    """
    out_dir = os.fspath(out_dir)
    with _os_errors(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        root_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with _os_errors(out_dir):
            entries = os.listdir(root_fd)
        if entries and not exist_ok:
            raise ConflictError("output directory is not empty", where=out_dir)
        as_root = os.geteuid() == 0
        extractor = _Extractor(image, root_fd, out_dir, as_root if same_owner is None else same_owner,
                               not as_root if keep_privileged is None else keep_privileged)
        extractor.run()
        return extractor.stats
    finally:
        os.close(root_fd)


def _os_error(exc: OSError, where: str) -> DsecError:
    message = f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    if exc.errno == errno.EEXIST:
        return ConflictError(f"already exists: {message}", where=where)
    if exc.errno in (errno.EOPNOTSUPP, errno.EPERM, errno.EINVAL):
        return UnsupportedError(f"cannot recreate this here: {message}", where=where)
    return UnavailableError(message, where=where, transient=False)


@contextlib.contextmanager
def _os_errors(where: str) -> Iterator[None]:
    """Turn an OSError of the output side into the DsecError class that says what kind it is."""
    try:
        yield
    except OSError as exc:
        raise _os_error(exc, where) from None


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_atomically(path: str, fill: Callable[[int], None]) -> None:
    """``fill(fd)`` a new file (0600) that then replaces ``path`` in one rename (dsec_fs.files.write_atomic)."""
    with _os_errors(path):
        write_atomic(path, fill)


class _Extractor:
    """One extraction: walks the image depth first, keeping an open descriptor for each directory on the
    current path (so the number of open descriptors is the tree's depth)."""

    def __init__(self, image: ErofsImage, root_fd: int, out_dir: str, same_owner: bool, keep_privileged: bool):
        self.image = image
        self.root_fd = root_fd
        self.out_dir = out_dir
        self.same_owner = same_owner
        self.keep_privileged = keep_privileged
        self.stats = ExtractStats()
        self.first_path: dict[int, bytes] = {}  # nid -> where its first name was created (non-directories)

    def run(self) -> None:
        stack: list[tuple[bytes, int, int]] = []  # (path, nid, fd) of the open directories, root first
        try:
            for path, nid in self.image.walk():
                self.stats.entries += 1
                if not path:
                    stack.append((path, nid, os.dup(self.root_fd)))
                    continue
                parent, _, name = path.rpartition(b"/")
                while stack[-1][0] != parent:
                    self._finish_dir(*stack.pop())
                fd = self._create(path, nid, name, stack[-1][2])
                if fd is not None:
                    stack.append((path, nid, fd))
            while stack:
                self._finish_dir(*stack.pop())
        finally:
            for _path, _nid, fd in stack:
                os.close(fd)

    def _os_error(self, exc: OSError, path: bytes) -> DsecError:
        return _os_error(exc, os.path.join(self.out_dir, os.fsdecode(path)))

    def _create(self, path: bytes, nid: int, name: bytes, dir_fd: int) -> int | None:
        """Create one entry; returns the descriptor of a new directory (finished later), else None."""
        st = self.image.stat(nid)
        mode = st.mode
        try:
            if stat.S_ISDIR(mode):
                os.mkdir(name, 0o700, dir_fd=dir_fd)
                return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            if not self.keep_privileged and is_device(mode, os.makedev(*st.rdev)):
                if nid not in self.first_path:
                    self.first_path[nid] = b""  # left out: its other names too, counted once
                    self.stats.dropped.devices += 1
                return None
            first = self.first_path.get(nid)
            if first is not None:
                self._link(first, name, dir_fd)
                return None
            self.first_path[nid] = path
            if stat.S_ISREG(mode):
                self._write_file(nid, st, name, dir_fd)
                return None
            if stat.S_ISLNK(mode):
                os.symlink(self.image.readlink(nid), name, dir_fd=dir_fd)
            else:
                # Character and block devices, FIFOs, and sockets (mknod makes an unbound socket inode).
                os.mknod(name, stat.S_IFMT(mode) | 0o600, os.makedev(*st.rdev), dir_fd=dir_fd)
            self._set_attributes_at(nid, st, name, dir_fd)
            return None
        except OSError as exc:
            raise self._os_error(exc, path) from None

    def _link(self, first: bytes, name: bytes, dir_fd: int) -> None:
        source_dir, _, source_name = first.rpartition(b"/")
        source_fd = self._open_dir(source_dir)
        try:
            os.link(source_name, name, src_dir_fd=source_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(source_fd)
        self.stats.hard_links += 1

    def _open_dir(self, path: bytes) -> int:
        """Open a directory we created, one component at a time, never through a symlink."""
        fd = os.dup(self.root_fd)
        for component in path.split(b"/") if path else []:
            try:
                next_fd = os.open(component, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            finally:
                os.close(fd)
            fd = next_fd
        return fd

    def _write_file(self, nid: int, st: Stat, name: bytes, dir_fd: int) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            for offset, length in self._data_ranges(nid, st.size):
                for piece in range(offset, offset + length, READ_BYTES):
                    data = self.image.read(nid, piece, min(READ_BYTES, offset + length - piece))
                    _pwrite_all(fd, data, piece)
                    self.stats.bytes += len(data)
            os.ftruncate(fd, st.size)  # a trailing hole, and the size of an all-hole file
            self._set_attributes_fd(nid, st, fd)
        finally:
            os.close(fd)
        self.stats.files += 1

    def _data_ranges(self, nid: int, size: int) -> list[tuple[int, int]]:
        """(offset, length) of the file's ranges that are not holes, neighbouring chunks merged."""
        if self.image.inode(nid).layout != LAYOUT_CHUNK_BASED:
            return [(0, size)] if size else []
        chunk_size = self.image.chunk_size(nid)
        ranges: list[tuple[int, int]] = []
        for k, (_device, blkaddr) in enumerate(self.image.chunk_map(nid)):
            if blkaddr == HOLE:
                continue
            start, length = k * chunk_size, min(chunk_size, size - k * chunk_size)
            if ranges and sum(ranges[-1]) == start:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            else:
                ranges.append((start, length))
        return ranges

    def _mode_and_xattrs(self, nid: int, st: Stat) -> tuple[int, dict[bytes, bytes]]:
        """The permission bits and xattrs to give the inode, its privileged parts dropped unless kept."""
        xattrs = self.image.xattrs(nid)
        if self.keep_privileged:
            return stat.S_IMODE(st.mode), xattrs
        dropped = self.stats.dropped
        return stat.S_IMODE(unprivileged_mode(st.mode, dropped)), unprivileged_xattrs(xattrs, dropped)

    def _set_attributes_fd(self, nid: int, st: Stat, fd: int) -> None:
        """Owner, xattrs, mode, mtime of an inode we hold open (regular files and directories)."""
        if self.same_owner:
            os.fchown(fd, st.uid, st.gid)
        mode, xattrs = self._mode_and_xattrs(nid, st)
        for xname, value in xattrs.items():
            os.setxattr(fd, xname, value)
        os.fchmod(fd, mode)
        os.utime(fd, ns=(st.mtime_ns, st.mtime_ns))

    def _set_attributes_at(self, nid: int, st: Stat, name: bytes, dir_fd: int) -> None:
        """The same for inodes that cannot be opened safely (symlinks, devices, FIFOs, sockets)."""
        if self.same_owner:
            os.chown(name, st.uid, st.gid, dir_fd=dir_fd, follow_symlinks=False)
        mode, xattrs = self._mode_and_xattrs(nid, st)
        if xattrs:
            # setxattr has no dir_fd form; the /proc path resolves through our descriptor, and the last
            # component is not followed.
            proc_path = b"/proc/self/fd/%d/%s" % (dir_fd, name)
            for xname, value in xattrs.items():
                os.setxattr(proc_path, xname, value, follow_symlinks=False)
        if not stat.S_ISLNK(st.mode):  # a symlink's mode is always 0777 on Linux
            os.chmod(name, mode, dir_fd=dir_fd, follow_symlinks=False)
        os.utime(name, ns=(st.mtime_ns, st.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)

    def _finish_dir(self, path: bytes, nid: int, fd: int) -> None:
        try:
            self._set_attributes_fd(nid, self.image.stat(nid), fd)
        except OSError as exc:
            raise self._os_error(exc, path) from None
        finally:
            os.close(fd)
