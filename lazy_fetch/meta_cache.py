"""The node's copies of layer metadata, so that opening a layer again costs no store round trip.

    copies = MetaCache(os.path.join(cache_dir, "meta"), max_bytes=512 << 20)
    files = open_layer(store, digest, reads=copies)               # dsec_fs.layer: manifest, meta, blob map
    chunk_index.load_packs(copies.pack_indexes(store), manifest.packs)

What is kept, and why each copy is safe to use without asking the store:

    meta/<layer digest>       meta.erofs, decompressed: the layer digest is the sha256 of these bytes
    blobmap/<sha256>          the blob map, decompressed, named by the sha256 the manifest gives
    index/<pack id>           a pack's index object, as the store holds it (a pack id names one pack's
                              bytes for good; kept only once it decodes)
    manifest/<sha256 of the store URL and the layer digest>   the manifest, as manifest.json encodes it
                              (one store's: two stores may hold a layer in different packs); used for
                              MANIFEST_FRESH_SECONDS after it was read from the store, then read again

The first three are content-addressed: they never change, so they need no invalidation. A manifest is
not quite: gc's repack rewrites the pack list of the layers it repacks (dsec_fs/gc.py), and the old packs
go after gc's grace period. So a manifest copy is used for an hour at most (far below any grace period a
store runs gc with; their old packs still serve every chunk meanwhile), and only while the copies of all
its pack indexes are here (a repack removes the old indexes from the store at once, so an evicted one
could not be read again), then read again; if its pack list changed, the new packs' indexes are read as
they would be on a first open. A manifest is checked only for its form when it is read, so an open that
fails drops the copy of the manifest it read (``forget_manifest``): a body damaged on the way can still
parse, naming sizes or sha256s no object of the layer has, and its copy would fail every open of the
layer for the hour, on this node and after a restart.

Each file is ``HEADER`` (magic, the sha256 of the body, the time it was read from the store) and the body.
Every load checks the sha256 (and, for meta and blobmap, that it is the file's name: the content address
itself), so a file that rotted or was cut short is dropped and the object read from the store again;
nothing unverified is ever returned. Files are opened O_NOFOLLOW | O_NONBLOCK and read only if regular:
a symlink, a FIFO or a directory put in a file's place is removed, never followed or waited on. Writes are
atomic (dsec_fs.files.write_atomic), not synced: a file a power cut damaged fails its check.

Bounded: at most ``max_bytes`` of files, least recently used removed first (the order starts from the
files' mtimes when the cache opens, then follows loads and keeps). The directory is the daemon's private
cache directory's ``meta/`` (the chunk cache leaves other top-level names alone); made 0700.

Threads: every method blocks (file I/O; the constructor scans the directory, and the daemon makes it
before it serves) and may be called from any thread at once; ``_lock`` guards ``_entries`` and
``_bytes`` and is held over an unlink, never over a read, a write or a store call.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from dsec_fs import layer
from dsec_fs.digest import is_hex_digest, sha256, to_hex
from dsec_fs.errors import DsecError
from dsec_fs.files import private_dir, write_atomic
from dsec_fs.layer import Manifest
from dsec_fs.pack import decode_index
from dsec_fs.store import keys
from dsec_fs.store.base import Store, too_large
from dsec_fs.store.wrappers import StoreWrapper

from .cache_strays import remove_stray

log = logging.getLogger(__name__)

KINDS = ("manifest", "meta", "blobmap", "index")
CONTENT_ADDRESSED = frozenset({"meta", "blobmap"})  # the file's name is the sha256 of its body
MAGIC = b"dsecmc1\n"
HEADER = struct.Struct("<8s32sd")  # magic, sha256 of the body, unix time the body was read from the store
MANIFEST_FRESH_SECONDS = 3600.0
DEFAULT_META_CACHE_BYTES = 512 << 20
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class MetaCache:
    """Verified copies of layer metadata in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory = private_dir(directory)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.dropped = 0  # files that failed their check (or were no regular file) and were removed
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # path -> size, least recently used first
        self._bytes = 0
        found = []
        for kind in KINDS:
            found += self._scan(kind)
        for mtime, path, size in sorted(found):
            self._entries[path] = size
            self._bytes += size
        with self._lock:
            self._make_room()

    # -- what open_layer (dsec_fs.layer) asks for, in its threads

    def manifest(self, store: Store, digest: str) -> Manifest:
        name = _manifest_name(store, digest)
        copy = self._load("manifest", name)
        if copy is not None:
            body, read_at = copy
            if 0 <= time.time() - read_at < MANIFEST_FRESH_SECONDS:
                try:
                    manifest = Manifest.from_json(body, source=self._path("manifest", name))
                except DsecError:
                    manifest = None
                if manifest is None or manifest.layer != digest:
                    self._drop(self._path("manifest", name), "not the layer's manifest")
                elif all(os.path.exists(self._path("index", _index_name(store, pack))) for pack in manifest.packs):
                    return manifest
                # else: some of its pack indexes went (evicted): were its packs repacked meanwhile, the old
                # indexes are gone from the store too, so the pack list is read again with them.
        manifest = layer.read_manifest(store, digest)
        self._keep("manifest", name, manifest.to_json())
        return manifest

    def meta(self, store: Store, manifest: Manifest) -> bytes:
        return self._content(manifest.layer, lambda: layer.read_meta(store, manifest), "meta")

    def blobmap(self, store: Store, manifest: Manifest) -> bytes:
        return self._content(manifest.blobmap_sha256, lambda: layer.read_blobmap(store, manifest), "blobmap")

    def forget_manifest(self, store: Store, digest: str) -> None:
        """An open of layer ``digest`` from ``store`` failed: its next open reads the manifest from the
        store, not from a copy (the module docstring says why)."""
        self._remove(self._path("manifest", _manifest_name(store, digest)))

    def pack_indexes(self, store: Store) -> Store:
        """``store``, with the pack index objects it is asked for answered from here (for
        ChunkIndex.load_packs)."""
        return _PackIndexes(store, self)

    def _content(self, name: str, read, kind: str) -> bytes:
        copy = self._load(kind, name)
        if copy is not None:
            return copy[0]
        data = read()  # verified against ``name`` by dsec_fs.layer
        self._keep(kind, name, data)
        return data

    # -- files

    def _path(self, kind: str, name: str) -> str:
        return os.path.join(self.directory, kind, name)

    def _load(self, kind: str, name: str) -> tuple[bytes, float] | None:
        """The verified body of the copy and when it was read from the store, or None (absent, or
        dropped because it failed its check)."""
        path = self._path(kind, name)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            self._count_miss()
            return None
        except OSError as exc:  # ELOOP: a symlink in the file's place
            self._drop(path, exc.strerror or "cannot be opened")
            self._count_miss()
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_bytes + HEADER.size:
                problem = "not a regular file" if not stat.S_ISREG(st.st_mode) else "too big"
                data = None
            else:
                data = _read_all(fd, st.st_size)
                problem = _check(data, kind, name)
        except OSError as exc:
            problem, data = exc.strerror or "cannot be read", None
        finally:
            os.close(fd)
        if problem is not None:
            self._drop(path, problem)
            self._count_miss()
            return None
        _magic, _digest, read_at = HEADER.unpack_from(data)
        with self._lock:
            self.hits += 1
            if path in self._entries:
                self._entries.move_to_end(path)
        return data[HEADER.size:], read_at

    def _keep(self, kind: str, name: str, body: bytes) -> None:
        """Write a copy (best effort: a full disk only costs the next open a store read)."""
        size = HEADER.size + len(body)
        if size > self.max_bytes:
            return
        path = self._path(kind, name)
        header = HEADER.pack(MAGIC, sha256(body), time.time())
        try:
            write_atomic(path, header + body, sync=False)
        except OSError as exc:
            log.warning("cannot keep a copy of %s %s in %s: %s", kind, name[:12], self.directory, exc.strerror)
            return
        with self._lock:
            self._bytes += size - self._entries.pop(path, 0)
            self._entries[path] = size
            self._make_room()

    def _drop(self, path: str, why: str) -> None:
        log.warning("dropping the metadata copy %s: %s; reading it from the store again", path, why)
        with self._lock:
            self.dropped += 1
        self._remove(path)

    def _remove(self, path: str) -> None:
        """The copy at ``path`` goes, from the disk and from the count of what is kept."""
        with self._lock:
            self._bytes -= self._entries.pop(path, 0)
            remove_stray(path)

    def _count_miss(self) -> None:
        with self._lock:
            self.misses += 1

    def _make_room(self) -> None:
        """With ``_lock`` held: remove the least recently used files until the rest fit the bound."""
        while self._bytes > self.max_bytes and self._entries:
            path, size = self._entries.popitem(last=False)
            self._bytes -= size
            remove_stray(path)

    def _scan(self, kind: str) -> list[tuple[float, str, int]]:
        """(mtime, path, size) of the copies in ``kind``'s directory, made if missing; what is no regular
        file with a digest for a name (a temporary file a crash left, a symlink, a FIFO) is removed."""
        directory = os.path.join(self.directory, kind)
        try:
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode):
                remove_stray(directory)
        except FileNotFoundError:
            pass
        private_dir(directory)
        found = []
        for entry in os.scandir(directory):
            st = entry.stat(follow_symlinks=False)
            if is_hex_digest(entry.name) and stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, entry.path, st.st_size))
            else:
                log.info("removing %s from the metadata cache: not a copy", entry.path)
                remove_stray(entry.path)
        return found


class _PackIndexes(StoreWrapper):
    """The pack index objects from the node's copies; every other key from the store."""

    def __init__(self, inner: Store, copies: MetaCache):
        super().__init__(inner)
        self.copies = copies

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset or length is not None or not _is_index_key(key):
            return self.inner.get(key, offset, length)
        return self._index(key, lambda: self.inner.get(key))

    def get_at_most(self, key: str, limit: int) -> bytes:
        """How ChunkIndex reads an index object (a bound on it: dsec_fs.pack.MAX_INDEX_BYTES)."""
        if not _is_index_key(key):
            return self.inner.get_at_most(key, limit)
        data = self._index(key, lambda: self.inner.get_at_most(key, limit))
        if len(data) > limit:  # a copy kept by a read without the bound
            raise too_large(key, len(data), limit)
        return data

    def _index(self, key: str, read: Callable[[], bytes]) -> bytes:
        """The index object at ``key`` from the node's copy, else ``read()`` and kept if it decodes."""
        name = _index_name(self.inner, keys.id_from_key(key))
        copy = self.copies._load("index", name)
        if copy is not None:
            return copy[0]
        data = read()
        decode_index(data, source=key)  # keep only what decodes (the caller decodes it again, and says why not)
        self.copies._keep("index", name, data)
        return data


def _is_index_key(key: str) -> bool:
    pack_id = keys.id_from_key(key)
    return key == keys.index(pack_id) and is_hex_digest(pack_id)


def _manifest_name(store: Store, digest: str) -> str:
    """Two stores may hold one layer in different packs: a manifest copy is the store's and the layer's."""
    return to_hex(sha256(f"{store.url}\n{digest}".encode()))


def _index_name(store: Store, pack_id: str) -> str:
    """A pack index copy is the store's too: an index object is not named by its own content (the pack id
    is the pack's sha256), so another store's writer could publish a different one under the same id."""
    return to_hex(sha256(f"{store.url}\n{pack_id}".encode()))


def _check(data: bytes, kind: str, name: str) -> str | None:
    """Why ``data`` (a whole file) is not a good copy of ``kind`` ``name``, or None."""
    if len(data) < HEADER.size:
        return "shorter than its header"
    magic, digest, _read_at = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "bad magic"
    actual = sha256(memoryview(data)[HEADER.size:])
    if actual != digest:
        return "sha256 mismatch"
    if kind in CONTENT_ADDRESSED and to_hex(actual) != name:
        return "its body is not the object its name gives"
    return None


def _read_all(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left > 0:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
