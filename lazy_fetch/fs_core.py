"""The filesystem core behind the FUSE adapters: what a mounted layer (or blob directory) looks like.

Nothing here knows FUSE. The adapters (fuse_pyfuse3.py, fuse_fusepy.py, fuse_raw.py) translate requests
into calls on one of three filesystems, all with the same methods (``Filesystem`` below), and map
``FsError`` to an errno:

- ``LayerTree``: fuse mode. The whole tree of one layer, read from its meta.erofs by the userspace reader
  (erofs_builder.reader); file data comes from the layer's virtual blob, fetched lazily. The inode number
  of an entry is its EROFS nid, except the root's, which is 1 (FUSE's root inode); nids start after the
  superblock (nid >= 36), so they never collide with 1, and a layer's numbers are the same on every mount.
- ``BlobDirectory``: kernel mode. One flat directory of read-only files, one per layer blob, named by blob
  id; the kernel's EROFS driver mounts meta.erofs with ``device=`` one of these files and reads blocks from
  it. Files are added and removed while the directory is served.
- ``SessionTree``: everything one process serves through its single FUSE session (pyfuse3 allows only one
  per process): ``blobs/`` (a BlobDirectory) and ``layers/<layer digest>/`` (a LayerTree each). Its inode
  numbers are ``slot << SLOT_SHIFT | inode number inside the part``, so the low bits of a layer's
  numbers are still its nids.

Blob errors (UnavailableError, CorruptError/IntegrityError, NotFoundError, ...) fail the one read that
met them with EIO and are logged with where they happened; nothing is cached about the failure, so the
next read tries again.

Directory offsets (``readdir(ino, start)``): each entry carries the offset to pass back to continue after
it. A layer directory never changes, so its offset is the entry's index plus one. Entries of the
synthetic directories (BlobDirectory, SessionTree) come and go, so they are listed in inode-number order
and their offset is their inode number, which is never reused: a listing resumed after a change neither
repeats nor skips an entry that stayed. Synthetic directories have no "." and ".." entries (FUSE does not
need them); layer directories list theirs, as the kernel's EROFS driver does.

Caching hints: ``Attributes.immutable`` says attributes never change while served (everything but the
synthetic directories); ``names_immutable(dir)`` says a directory's names never change (layer
directories). The adapters turn these into long kernel cache timeouts or none.

Threads: every method may be called from any thread at the same time, except that the async ``read``
runs in the trio loop that owns the blobs. The reader needs no lock (see erofs_builder/reader.py).
``LayerTree._lock`` guards its LRU of chunk maps; ``BlobDirectory._lock`` and ``SessionTree._lock`` guard
their tables, which the daemon's trio thread changes while FUSE threads (fusepy) read them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Protocol

from dsec_fs.errors import ConflictError, DsecError, FormatError, NotFoundError, UnsupportedError
from erofs_builder.ondisk import chunk_index
from erofs_builder.ondisk.inode import LAYOUT_CHUNK_BASED
from erofs_builder.reader import ErofsImage

log = logging.getLogger(__name__)

ROOT_INO = 1  # FUSE's root inode (pyfuse3.ROOT_INODE, FUSE_ROOT_ID)
# A blob file holds every byte of its layer, 0600 files included: root's alone (the daemon mounts EROFS
# on it as root; the kernel checks this mode, as the session is mounted default_permissions).
BLOB_FILE_MODE = 0o400
SLOT_SHIFT = 40  # SessionTree: the low 40 bits are the inode number inside a part (an EROFS nid < 2**40)
CHUNK_MAPS_KEPT = 64  # files whose chunk map LayerTree keeps parsed: those being read right now
# (nid, file offset) of the file bytes a LayerTree is reading from its blob right now, set around each
# blob read (in the reading task's context), so a blob that traces reads can name the file (the daemon's).
FILE_READ: ContextVar[tuple[int, int] | None] = ContextVar("FILE_READ", default=None)


class FsError(DsecError):
    """A request the filesystem answers with an errno (ENOENT, ENOTDIR, ENODATA, EIO, ...)."""

    kind = "fs"

    def __init__(self, errno_: int, message: str, *, where: str):
        self.errno = errno_
        super().__init__(message, where=where)


@dataclass(frozen=True, slots=True)
class Attributes:
    """What stat(2) shows for an inode; atime and ctime read as mtime (as on EROFS)."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    rdev: int = 0  # os.makedev(major, minor) of device nodes
    immutable: bool = True  # never changes while served, so the kernel may cache it for long


@dataclass(frozen=True, slots=True)
class DirEntry:
    name: bytes
    ino: int
    next: int  # pass as ``start`` to readdir to continue after this entry


class Blob(Protocol):
    """A layer's virtual blob as lazy_fetch.blob_reader.LayerBlob provides it."""

    size: int

    async def read(self, offset: int, length: int) -> bytes: ...


class Filesystem(Protocol):
    """What the FUSE adapters call. Errors: FsError carries the errno; anything else is a bug -> EIO."""

    def lookup(self, parent: int, name: bytes) -> Attributes: ...

    def getattr(self, ino: int) -> Attributes: ...

    def readdir(self, ino: int, start: int) -> Iterator[DirEntry]: ...

    def names_immutable(self, ino: int) -> bool: ...

    def readlink(self, ino: int) -> bytes: ...

    def listxattr(self, ino: int) -> list[bytes]: ...

    def getxattr(self, ino: int, name: bytes) -> bytes: ...

    async def read(self, ino: int, offset: int, size: int) -> bytes: ...


def errno_for(exc: Exception, operation: str) -> int:
    """The errno an adapter answers for an exception a core call raised; logs what is not an FsError."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, DsecError):
        log.error("%s failed: %s", operation, exc)
    else:
        log.error("%s failed with an unexpected error: %r", operation, exc, exc_info=exc)
    return errno.EIO


async def read_blob(blob: Blob, offset: int, length: int, *, what: str) -> bytes:
    """``blob.read`` that turns any failure into FsError(EIO), logged with the blob range and ``what``."""
    try:
        data = await blob.read(offset, length)
    except DsecError as exc:
        log.error("%s: blob bytes [%d, %d) failed: %s", what, offset, offset + length, exc)
        raise FsError(errno.EIO, f"blob bytes [{offset}, {offset + length}) failed: {exc}", where=what) from None
    if len(data) != length:
        log.error("%s: blob returned %d of %d bytes at offset %d", what, len(data), length, offset)
        raise FsError(errno.EIO, f"blob returned {len(data)} of {length} bytes at {offset}", where=what)
    return data


def _not_found(where: str) -> FsError:
    return FsError(errno.ENOENT, "no such file or directory", where=where)


class LayerTree:
    """One layer's tree (fuse mode): metadata from ``image``, file data from ``blob`` (EROFS device 1)."""

    def __init__(self, image: ErofsImage, blob: Blob):
        self.image = image
        self.blob = blob
        self._lock = threading.Lock()
        self._chunk_maps: OrderedDict[int, list[tuple[int, int]]] = OrderedDict()  # nid -> chunk map, LRU

    def _nid(self, ino: int) -> int:
        return self.image.root_nid if ino == ROOT_INO else ino

    def _ino(self, nid: int) -> int:
        if nid == self.image.root_nid:
            return ROOT_INO
        if nid == ROOT_INO:  # cannot happen in a valid image: nid 1 would lie inside the superblock
            raise FormatError("dirent", None, "names nid 1", source=self.image.source)
        return nid

    def _where(self, ino: int) -> str:
        return f"{self.image.source}: inode nid {self._nid(ino)}"

    def _mode(self, ino: int) -> int:
        return self.image.stat(self._nid(ino)).mode

    def getattr(self, ino: int) -> Attributes:
        st = self.image.stat(self._nid(ino))
        return Attributes(ino=ino, mode=st.mode, nlink=st.nlink, uid=st.uid, gid=st.gid, size=st.size,
                          mtime_ns=st.mtime_ns, rdev=os.makedev(*st.rdev))

    def lookup(self, parent: int, name: bytes) -> Attributes:
        if not stat.S_ISDIR(self._mode(parent)):
            raise FsError(errno.ENOTDIR, "not a directory", where=self._where(parent))
        nid = self.image.lookup(self._nid(parent), name)
        if nid is None:
            raise _not_found(f"{self._where(parent)} entry {name[:64]!r}")
        return self.getattr(self._ino(nid))

    def readdir(self, ino: int, start: int) -> Iterator[DirEntry]:
        if not stat.S_ISDIR(self._mode(ino)):
            raise FsError(errno.ENOTDIR, "not a directory", where=self._where(ino))
        entries = self.image.readdir(self._nid(ino))
        for index in range(start, len(entries)):
            name, nid, _ftype = entries[index]
            yield DirEntry(name, self._ino(nid), index + 1)

    def names_immutable(self, ino: int) -> bool:
        return True

    def readlink(self, ino: int) -> bytes:
        if not stat.S_ISLNK(self._mode(ino)):
            raise FsError(errno.EINVAL, "not a symlink", where=self._where(ino))
        return self.image.readlink(self._nid(ino))

    def listxattr(self, ino: int) -> list[bytes]:
        return list(self.image.xattrs(self._nid(ino)))

    def getxattr(self, ino: int, name: bytes) -> bytes:
        value = self.image.xattrs(self._nid(ino)).get(name)
        if value is None:
            raise FsError(errno.ENODATA, f"no xattr {name[:64]!r}", where=self._where(ino))
        return value

    async def read(self, ino: int, offset: int, size: int) -> bytes:
        """Bytes [offset, offset+size) of a regular file, cut at its end; holes read as zeros."""
        nid = self._nid(ino)
        st = self.image.stat(nid)
        if not stat.S_ISREG(st.mode):
            raise FsError(errno.EISDIR if stat.S_ISDIR(st.mode) else errno.EINVAL, "not a regular file",
                          where=self._where(ino))
        end = min(offset + size, st.size)
        if offset >= end:
            return b""
        if self.image.inode(nid).layout != LAYOUT_CHUNK_BASED:
            return self.image.read(nid, offset, end - offset)  # FLAT data inside meta.erofs (mkfs.erofs images)
        pieces = []
        position = offset
        for blob_offset, length in self._extents(nid, offset, end):
            if blob_offset is None:
                pieces.append(bytes(length))
            else:
                where = f"{self._where(ino)} bytes [{offset}, {end})"
                token = FILE_READ.set((nid, position))
                try:
                    pieces.append(await read_blob(self.blob, blob_offset, length, what=where))
                finally:
                    FILE_READ.reset(token)
            position += length
        return b"".join(pieces)

    def _extents(self, nid: int, offset: int, end: int) -> list[tuple[int | None, int]]:
        """(blob offset or None for a hole, length) covering [offset, end) of a chunk-based file, in order;
        chunks that lie back to back in the blob are merged, so each extent is one blob read."""
        chunk_size = self.image.chunk_size(nid)
        chunk_map = self._chunk_map(nid)
        block_size = self.image.block_size
        extents: list[list] = []  # [blob offset | None, length]
        pos = offset
        while pos < end:
            k = pos // chunk_size
            stop = min(end, (k + 1) * chunk_size)
            device, blkaddr = chunk_map[k]
            if blkaddr == chunk_index.HOLE:
                blob_pos = None
            elif device == chunk_index.BLOB_DEVICE_ID:
                blob_pos = blkaddr * block_size + pos - k * chunk_size
            else:
                raise UnsupportedError(f"chunk {k} is on device {device}; only the layer's blob (device 1) is "
                                       "served", where=f"{self.image.source}: inode nid {nid}")
            last = extents[-1] if extents else None
            if last and ((blob_pos is None and last[0] is None)
                         or (blob_pos is not None and last[0] is not None and last[0] + last[1] == blob_pos)):
                last[1] += stop - pos
            else:
                extents.append([blob_pos, stop - pos])
            pos = stop
        return [(blob_pos, length) for blob_pos, length in extents]

    def _chunk_map(self, nid: int) -> list[tuple[int, int]]:
        with self._lock:
            found = self._chunk_maps.get(nid)
            if found is not None:
                self._chunk_maps.move_to_end(nid)
                return found
        found = self.image.chunk_map(nid)  # parsed outside the lock: two threads may both parse it
        with self._lock:
            self._chunk_maps[nid] = found
            if len(self._chunk_maps) > CHUNK_MAPS_KEPT:
                self._chunk_maps.popitem(last=False)
        return found


def _synthetic_dir(ino: int, nlink: int, mtime_ns: int) -> Attributes:
    """A directory the daemon makes up: root-owned, read-only, changing as entries come and go."""
    return Attributes(ino=ino, mode=stat.S_IFDIR | 0o555, nlink=nlink, uid=0, gid=0, size=0,
                      mtime_ns=mtime_ns, immutable=False)


class BlobDirectory:
    """Kernel mode: one flat directory of read-only files, one per layer blob (name = blob id, size =
    the blob's size, content = blob.read).

    A name keeps its inode number for the life of the directory, even across remove and add: names are
    blob ids, which name content, so a name that comes back is the same bytes and pages the kernel
    still caches for that inode stay right. A new name never reuses an old number. ``inos`` (from
    ``inos()`` of the directory a daemon that died served on the same FUSE connection) carries the numbers
    over, so the kernel's inodes and open files keep meaning the same blobs.
    """

    def __init__(self, blobs: Mapping[str, Blob] | None = None, *, inos: Mapping[str, int] | None = None):
        self._lock = threading.Lock()
        self._blobs: dict[int, tuple[bytes, Blob]] = {}  # ino -> (name, blob), present now
        # every name ever added -> its ino
        self._ino_of: dict[bytes, int] = {name.encode(): ino for name, ino in (inos or {}).items()}
        self._next_ino = max(self._ino_of.values(), default=ROOT_INO) + 1
        self._created_ns = time.time_ns()  # the mtime of every blob file: their content never changes
        self._mtime_ns = self._created_ns  # of the directory: last add or remove
        for name in sorted(blobs or {}):
            self.add(name, blobs[name])

    def add(self, name: str, blob: Blob) -> None:
        key = name.encode()
        with self._lock:
            ino = self._ino_of.setdefault(key, self._next_ino)
            self._next_ino = max(self._next_ino, ino + 1)
            if ino in self._blobs:
                raise ConflictError("a blob of this name is already served", where=f"blob {name}")
            self._blobs[ino] = (key, blob)
            self._mtime_ns = time.time_ns()

    def remove(self, name: str) -> None:
        with self._lock:
            ino = self._ino_of.get(name.encode())
            if self._blobs.pop(ino, None) is None:
                raise NotFoundError("no blob of this name is served", where=f"blob {name}")
            self._mtime_ns = time.time_ns()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return self._ino_of.get(name.encode()) in self._blobs

    def inos(self) -> dict[str, int]:
        """Every name ever added -> its inode number (to give a directory that takes over)."""
        with self._lock:
            return {name.decode(): ino for name, ino in self._ino_of.items()}

    def _blob(self, ino: int) -> tuple[bytes, Blob]:
        with self._lock:
            found = self._blobs.get(ino)
        if found is None:
            raise _not_found(f"blob directory inode {ino}")
        return found

    def getattr(self, ino: int) -> Attributes:
        if ino == ROOT_INO:
            with self._lock:
                return _synthetic_dir(ROOT_INO, 2, self._mtime_ns)
        _name, blob = self._blob(ino)
        return Attributes(ino=ino, mode=stat.S_IFREG | BLOB_FILE_MODE, nlink=1, uid=0, gid=0, size=blob.size,
                          mtime_ns=self._created_ns)

    def lookup(self, parent: int, name: bytes) -> Attributes:
        if parent != ROOT_INO:
            raise FsError(errno.ENOTDIR, "not a directory", where=f"blob directory inode {parent}")
        with self._lock:
            ino = self._ino_of.get(name)
        if ino is None:
            raise _not_found(f"blob {name[:64]!r}")
        return self.getattr(ino)

    def readdir(self, ino: int, start: int) -> Iterator[DirEntry]:
        if ino != ROOT_INO:
            raise FsError(errno.ENOTDIR, "not a directory", where=f"blob directory inode {ino}")
        with self._lock:
            listing = sorted((child, name) for child, (name, _blob) in self._blobs.items() if child > start)
        for child, name in listing:
            yield DirEntry(name, child, child)

    def names_immutable(self, ino: int) -> bool:
        return False

    def readlink(self, ino: int) -> bytes:
        raise FsError(errno.EINVAL, "not a symlink", where=f"blob directory inode {ino}")

    def listxattr(self, ino: int) -> list[bytes]:
        self.getattr(ino)
        return []

    def getxattr(self, ino: int, name: bytes) -> bytes:
        self.getattr(ino)
        raise FsError(errno.ENODATA, f"no xattr {name[:64]!r}", where=f"blob directory inode {ino}")

    async def read(self, ino: int, offset: int, size: int) -> bytes:
        if ino == ROOT_INO:
            raise FsError(errno.EISDIR, "is a directory", where="blob directory")
        name, blob = self._blob(ino)
        end = min(offset + size, blob.size)
        if offset >= end:
            return b""
        return await read_blob(blob, offset, end - offset, what=f"blob {name.decode()}")


# SessionTree's parts, by slot (the high bits of an inode number).
_OWN_SLOT = 0  # the session's own directories
_BLOBS_SLOT = 1  # blobs/
_FIRST_LAYER_SLOT = 2  # layers/<digest>/, one slot per layer digest
_LAYERS_DIR_INO = ROOT_INO + 1  # layers/, in the session's own slot
_FLUSH_PROBE_INO = ROOT_INO + 2  # flush-probe, in the session's own slot
_LOCAL_MASK = (1 << SLOT_SHIFT) - 1


class SessionTree:
    """Everything one process serves over its FUSE session::

        /                   the session's mountpoint (e.g. /run/dsecfs/fuse)
        /blobs/<blob id>    kernel mode: the files EROFS mounts use as device=
        /layers/<digest>/   fuse mode: a layer's tree, bind-mounted where the layer is mounted
        /flush-probe        an empty file: opened and closed once per connection (fuse_raw: FLUSH)

    A layer digest gets a slot the first time it is added and keeps it for the session, so its inode
    numbers do not change across remove and add (the digest names the content, so cached pages stay
    right), and two different layers never share an inode number. ``numbers`` (``numbers()`` of the tree
    a daemon that died served on the same FUSE connection) carries the blob numbers and layer slots over.
    """

    BLOBS = b"blobs"
    LAYERS = b"layers"
    FLUSH_PROBE = b"flush-probe"

    def __init__(self, numbers: Mapping[str, Mapping[str, int]] | None = None):
        numbers = numbers or {}
        self.blobs = BlobDirectory(inos=numbers.get("blobs"))
        self._lock = threading.Lock()
        self._trees: dict[int, tuple[bytes, LayerTree]] = {}  # slot -> (digest, tree), present now
        # every digest ever added -> its slot
        self._slot_of: dict[bytes, int] = {digest.encode(): slot for digest, slot in numbers.get("layers", {}).items()}
        self._next_slot = max(self._slot_of.values(), default=_FIRST_LAYER_SLOT - 1) + 1
        self._mtime_ns = time.time_ns()  # of layers/: last add or remove

    def numbers(self) -> dict[str, dict[str, int]]:
        """{"blobs": blob id -> inode number, "layers": digest -> slot}, for every one ever added."""
        with self._lock:
            layers = {digest.decode(): slot for digest, slot in self._slot_of.items()}
        return {"blobs": self.blobs.inos(), "layers": layers}

    def add_layer(self, digest: str, tree: LayerTree) -> None:
        key = digest.encode()
        with self._lock:
            slot = self._slot_of.setdefault(key, self._next_slot)
            self._next_slot = max(self._next_slot, slot + 1)
            if slot in self._trees:
                raise ConflictError("this layer is already served", where=f"layer {digest}")
            if slot >> (64 - SLOT_SHIFT):
                raise UnsupportedError("no inode numbers left in this FUSE session", where=f"layer {digest}")
            self._trees[slot] = (key, tree)
            self._mtime_ns = time.time_ns()

    def remove_layer(self, digest: str) -> None:
        with self._lock:
            slot = self._slot_of.get(digest.encode())
            if self._trees.pop(slot, None) is None:
                raise NotFoundError("this layer is not served", where=f"layer {digest}")
            self._mtime_ns = time.time_ns()

    def has_layer(self, digest: str) -> bool:
        with self._lock:
            return self._slot_of.get(digest.encode()) in self._trees

    # ---- routing: (slot, inode number in the part) <-> the session's inode numbers --------------------

    def _part(self, ino: int) -> tuple[Filesystem | None, int, int]:
        """(the part serving ``ino`` or None for the session's own directories, slot, local ino)."""
        slot, local = ino >> SLOT_SHIFT, ino & _LOCAL_MASK
        if slot == _OWN_SLOT:
            if local not in (ROOT_INO, _LAYERS_DIR_INO, _FLUSH_PROBE_INO):
                raise _not_found(f"session inode {ino}")
            return None, slot, local
        if slot == _BLOBS_SLOT:
            return self.blobs, slot, local
        with self._lock:
            found = self._trees.get(slot)
        if found is None:
            raise _not_found(f"session inode {ino} (layer no longer served)")
        return found[1], slot, local

    @staticmethod
    def _global_ino(slot: int, local: int) -> int:
        if local > _LOCAL_MASK:
            raise UnsupportedError(f"inode number {local} needs more than {SLOT_SHIFT} bits",
                                   where=f"session slot {slot}")
        return slot << SLOT_SHIFT | local

    def _global(self, slot: int, attrs: Attributes) -> Attributes:
        return replace(attrs, ino=self._global_ino(slot, attrs.ino))

    def _layer_slots(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return sorted((slot, digest) for slot, (digest, _tree) in self._trees.items())

    def getattr(self, ino: int) -> Attributes:
        part, slot, local = self._part(ino)
        if part is not None:
            return self._global(slot, part.getattr(local))
        if local == ROOT_INO:
            return _synthetic_dir(ROOT_INO, 4, self._mtime_ns)
        if local == _FLUSH_PROBE_INO:
            return Attributes(ino=ino, mode=stat.S_IFREG | 0o444, nlink=1, uid=0, gid=0, size=0, mtime_ns=0)
        return _synthetic_dir(_LAYERS_DIR_INO, 2 + len(self._layer_slots()), self._mtime_ns)

    def lookup(self, parent: int, name: bytes) -> Attributes:
        part, slot, local = self._part(parent)
        if part is not None:
            return self._global(slot, part.lookup(local, name))
        if local == ROOT_INO:
            if name == self.BLOBS:
                return self._global(_BLOBS_SLOT, self.blobs.getattr(ROOT_INO))
            if name == self.LAYERS:
                return self.getattr(_LAYERS_DIR_INO)
            if name == self.FLUSH_PROBE:
                return self.getattr(_FLUSH_PROBE_INO)
            raise _not_found(f"session entry {name[:64]!r}")
        with self._lock:
            slot = self._slot_of.get(name)
            found = self._trees.get(slot)
        if found is None:
            raise _not_found(f"layer {name[:64]!r}")
        return self._global(slot, found[1].getattr(ROOT_INO))

    def readdir(self, ino: int, start: int) -> Iterator[DirEntry]:
        part, slot, local = self._part(ino)
        if part is not None:
            for entry in part.readdir(local, start):
                yield replace(entry, ino=self._global_ino(slot, entry.ino))
        elif local == ROOT_INO:
            own = [(self.BLOBS, _BLOBS_SLOT << SLOT_SHIFT | ROOT_INO), (self.LAYERS, _LAYERS_DIR_INO),
                   (self.FLUSH_PROBE, _FLUSH_PROBE_INO)]
            for offset, (name, child) in enumerate(own, start=1):
                if offset > start:
                    yield DirEntry(name, child, offset)
        else:
            for layer_slot, digest in self._layer_slots():
                if layer_slot > start:
                    yield DirEntry(digest, layer_slot << SLOT_SHIFT | ROOT_INO, layer_slot)

    def names_immutable(self, ino: int) -> bool:
        part, _slot, local = self._part(ino)
        return part is not None and part.names_immutable(local)

    def readlink(self, ino: int) -> bytes:
        part, _slot, local = self._part(ino)
        if part is None:
            raise FsError(errno.EINVAL, "not a symlink", where=f"session inode {ino}")
        return part.readlink(local)

    def listxattr(self, ino: int) -> list[bytes]:
        part, _slot, local = self._part(ino)
        return [] if part is None else part.listxattr(local)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        part, _slot, local = self._part(ino)
        if part is None:
            raise FsError(errno.ENODATA, f"no xattr {name[:64]!r}", where=f"session inode {ino}")
        return part.getxattr(local, name)

    async def read(self, ino: int, offset: int, size: int) -> bytes:
        part, _slot, local = self._part(ino)
        if part is None:
            if local == _FLUSH_PROBE_INO:
                return b""
            raise FsError(errno.EISDIR, "is a directory", where=f"session inode {ino}")
        return await part.read(local, offset, size)
