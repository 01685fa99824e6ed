"""Compare two layers: which paths B adds, removes or changes relative to A, what changed in each, and how
many chunks the two layers share.

Everything comes from metadata: each layer's meta.erofs (through the reader, which validates what it
reads) and its blob map. File contents are compared by their chunk digest lists: a file's chunk indexes
name blob blocks, the blob map names the chunk at each block, and equal lists mean equal bytes (the
builder stores every all-zero chunk as a hole, so equal content always gives equal lists). No chunk is
fetched. Only when the two layers were built with different chunk sizes are the lists not comparable;
then regular files of equal size are compared by the sha256 of their data, fetched from the store
(``LayerDiff.content_by`` says which way was used).

Paths are compared name by name: a hard-linked file is reported once for each of its names, and a change
to the link structure (a name added to or removed from an inode) shows as ``nlink`` on every name of
that inode. Fields of a path that exists in both layers, in the order they are reported:

    type     file, dir, symlink, chr, blk, fifo, sock
    mode     permission bits with setuid/setgid/sticky (octal)
    uid, gid
    mtime    nanoseconds since the epoch
    content  regular files: the bytes (reported with the two sizes)
    target   symlinks: the target
    rdev     character and block devices: major:minor
    xattrs   the names whose presence or value differs
    nlink    non-directories: the number of names of the inode

When the type differs only type and the metadata common to every type (mode, uid, gid, mtime, xattrs)
are compared.

Threads: plain blocking functions, safe from any thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec_fs.errors import FormatError, UnsupportedError
from dsec_fs.layer import open_layer
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .blob import StoreBlob
from dsec_fs.blobmap import EncodedBlobMap
from .ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from .ondisk.inode import LAYOUT_CHUNK_BASED
from .reader import ErofsImage, Stat

FIELDS = ("type", "mode", "uid", "gid", "mtime", "content", "target", "rdev", "xattrs", "nlink")
READ_BYTES = 8 << 20  # data hashed per read when chunk sizes differ

_TYPE_NAMES = {
    stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "sock",
}


def file_chunks(image: ErofsImage, blob_map: EncodedBlobMap, nid: int) -> list[bytes | None]:
    """The chunk digests of regular file ``nid`` in order, None for a hole, read from its chunk indexes and
    the layer's blob map (no data is read). FormatError when an index does not point at the start of a
    blob-map chunk whose length is the length that chunk of the file must have."""
    size = image.stat(nid).size
    if size == 0:
        return []
    where = f"{image.source}: inode nid {nid}"
    if image.inode(nid).layout != LAYOUT_CHUNK_BASED:
        raise UnsupportedError("regular file data stored in the image itself (not chunk-based)", where=where)
    chunk_size = image.chunk_size(nid)
    if chunk_size != blob_map.chunk_size:
        raise FormatError(f"inode nid {nid}", None, f"chunk size {chunk_size}, the blob map's is "
                          f"{blob_map.chunk_size}", source=image.source)
    digests: list[bytes | None] = []
    for k, (device, blkaddr) in enumerate(image.chunk_map(nid)):
        if blkaddr == HOLE:
            digests.append(None)
            continue
        if device != BLOB_DEVICE_ID or blkaddr >= blob_map.blocks:
            raise FormatError(f"chunk index {k} of nid {nid}", None, f"points at device {device} block {blkaddr}, "
                              f"outside the blob ({blob_map.blocks} blocks)", source=image.source)
        start, digest, length = blob_map.entries[blob_map.locate(blkaddr)]
        expected = min(chunk_size, size - k * chunk_size)
        if start != blkaddr or length != expected:
            raise FormatError(f"chunk index {k} of nid {nid}", None,
                              f"blob block {blkaddr} is not the start of a {expected}-byte chunk of the blob map",
                              source=image.source)
        digests.append(digest)
    return digests


@dataclass(frozen=True)
class Change:
    """A path present in both layers whose inode differs. ``a`` and ``b`` hold, for each changed field,
    its JSON-ready value in A and in B (for ``content``: the file sizes; for ``xattrs``: the names that
    differ, as present on that side)."""

    path: bytes
    fields: tuple[str, ...]  # a subsequence of FIELDS
    a: dict[str, object]
    b: dict[str, object]


@dataclass(frozen=True)
class ChunkDelta:
    """Chunks (distinct, by digest) of the two blob maps."""

    shared: int  # in both layers
    shared_bytes: int
    new: int  # in B only: what a node holding A must fetch to hold B
    new_bytes: int
    dropped: int  # in A only
    dropped_bytes: int


@dataclass
class LayerDiff:
    """Paths in tree order (parents first, siblings in byte order), the root being b""."""

    a: str  # layer digests
    b: str
    chunks: ChunkDelta
    content_by: str  # "chunks": digest lists compared; "data": contents hashed (the chunk sizes differ)
    added: list[bytes] = field(default_factory=list)  # paths in B only (every name below an added directory)
    removed: list[bytes] = field(default_factory=list)  # paths in A only
    changed: list[Change] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: paths as "/..." strings (undecodable bytes as \\xNN escapes)."""
        return {
            "a": self.a,
            "b": self.b,
            "added": [_show_path(p) for p in self.added],
            "removed": [_show_path(p) for p in self.removed],
            "changed": [{"path": _show_path(c.path), "fields": list(c.fields), "a": c.a, "b": c.b}
                        for c in self.changed],
            "chunks": dataclasses.asdict(self.chunks),
            "content_by": self.content_by,
        }

    def text(self) -> str:
        """The diff for people: a summary, then one line per path (+ added, - removed, ~ changed)."""
        c = self.chunks
        lines = [f"a        {self.a}", f"b        {self.b}",
                 f"paths    {len(self.added):,} added, {len(self.removed):,} removed, {len(self.changed):,} changed",
                 f"chunks   {c.shared:,} shared ({_show_bytes(c.shared_bytes)}), {c.new:,} new in b "
                 f"({_show_bytes(c.new_bytes)}), {c.dropped:,} only in a ({_show_bytes(c.dropped_bytes)})"]
        if self.content_by != "chunks":
            lines.append("content  compared by data (the layers' chunk sizes differ)")
        entries = ([(p, f"+ {_show_path(p)}") for p in self.added]
                   + [(p, f"- {_show_path(p)}") for p in self.removed]
                   + [(c.path, f"~ {_show_path(c.path)}  {_describe(c)}") for c in self.changed])
        lines += [line for _path, line in sorted(entries, key=lambda entry: _tree_order(entry[0]))]
        return "\n".join(lines)


def diff_layers(store: Store, a: str, b: str) -> LayerDiff:
    """Compare layer ``b`` with layer ``a`` (refs or digests) on ``store``; reads metadata only, unless the
    two layers' chunk sizes differ (then regular files of equal size are fetched and hashed)."""
    files_a, files_b = open_layer(store, a), open_layer(store, b)
    map_a = EncodedBlobMap(files_a.blobmap, source=keys.layer_blobmap(files_a.digest))
    map_b = EncodedBlobMap(files_b.blobmap, source=keys.layer_blobmap(files_b.digest))
    comparable = map_a.chunk_size == map_b.chunk_size
    images = [ErofsImage(files.meta, source=keys.layer_meta(files.digest),
                         blob=None if comparable else StoreBlob.for_layer(store, files))
              for files in (files_a, files_b)]
    return diff_images(images[0], map_a, images[1], map_b, a=files_a.digest, b=files_b.digest)


def diff_images(image_a: ErofsImage, map_a: EncodedBlobMap, image_b: ErofsImage, map_b: EncodedBlobMap, *,
                a: str = "", b: str = "") -> LayerDiff:
    """Compare two images with their blob maps. If the chunk sizes differ, both images need their blob
    (``ErofsImage(blob=...)``) to hash file data; ``a`` and ``b`` name the layers in the result."""
    paths_a, paths_b = dict(image_a.walk()), dict(image_b.walk())
    by_chunks = map_a.chunk_size == map_b.chunk_size
    content_a = _ContentKeys(image_a, map_a, by_chunks)
    content_b = _ContentKeys(image_b, map_b, by_chunks)
    result = LayerDiff(a=a, b=b, chunks=_chunk_delta(map_a, map_b), content_by="chunks" if by_chunks else "data")
    for path in sorted(paths_a.keys() | paths_b.keys(), key=_tree_order):
        nid_a, nid_b = paths_a.get(path), paths_b.get(path)
        if nid_a is None:
            result.added.append(path)
        elif nid_b is None:
            result.removed.append(path)
        else:
            change = _compare(path, image_a, nid_a, content_a, image_b, nid_b, content_b)
            if change is not None:
                result.changed.append(change)
    return result


class _ContentKeys:
    """What a regular file's content is compared by, computed once per inode (hard links share it)."""

    def __init__(self, image: ErofsImage, blob_map: EncodedBlobMap, by_chunks: bool):
        self.image = image
        self.blob_map = blob_map
        self.by_chunks = by_chunks
        self._keys: dict[int, object] = {}

    def key(self, nid: int) -> object:
        found = self._keys.get(nid)
        if found is None:
            if self.by_chunks:
                found = tuple(file_chunks(self.image, self.blob_map, nid))
            else:
                found = self._data_digest(nid)
            self._keys[nid] = found
        return found

    def _data_digest(self, nid: int) -> bytes:
        digest = hashlib.sha256()
        size = self.image.stat(nid).size
        for offset in range(0, size, READ_BYTES):
            digest.update(self.image.read(nid, offset, READ_BYTES))
        return digest.digest()


def _compare(path: bytes, image_a: ErofsImage, nid_a: int, content_a: _ContentKeys,
             image_b: ErofsImage, nid_b: int, content_b: _ContentKeys) -> Change | None:
    st_a, st_b = image_a.stat(nid_a), image_b.stat(nid_b)
    kind = stat.S_IFMT(st_a.mode)
    same_type = kind == stat.S_IFMT(st_b.mode)
    changes: dict[str, tuple[object, object]] = {}  # filled in FIELDS order

    def check(name: str, value_a: object, value_b: object) -> None:
        if value_a != value_b:
            changes[name] = (value_a, value_b)

    check("type", _TYPE_NAMES[kind], _TYPE_NAMES[stat.S_IFMT(st_b.mode)])
    check("mode", f"{stat.S_IMODE(st_a.mode):04o}", f"{stat.S_IMODE(st_b.mode):04o}")
    check("uid", st_a.uid, st_b.uid)
    check("gid", st_a.gid, st_b.gid)
    check("mtime", st_a.mtime_ns, st_b.mtime_ns)
    if same_type and kind == stat.S_IFREG:
        if st_a.size != st_b.size or content_a.key(nid_a) != content_b.key(nid_b):
            changes["content"] = (st_a.size, st_b.size)
    elif same_type and kind == stat.S_IFLNK:
        check("target", _show(image_a.readlink(nid_a)), _show(image_b.readlink(nid_b)))
    elif same_type and kind in (stat.S_IFCHR, stat.S_IFBLK):
        check("rdev", _show_rdev(st_a), _show_rdev(st_b))
    xattrs_a, xattrs_b = image_a.xattrs(nid_a), image_b.xattrs(nid_b)
    differing = sorted(name for name in xattrs_a.keys() | xattrs_b.keys() if xattrs_a.get(name) != xattrs_b.get(name))
    if differing:
        changes["xattrs"] = (_names(differing, xattrs_a), _names(differing, xattrs_b))
    if same_type and kind != stat.S_IFDIR:
        check("nlink", st_a.nlink, st_b.nlink)
    if not changes:
        return None
    return Change(path, tuple(changes), {name: a for name, (a, _b) in changes.items()},
                  {name: b for name, (_a, b) in changes.items()})


def _chunk_delta(map_a: EncodedBlobMap, map_b: EncodedBlobMap) -> ChunkDelta:
    lengths_a = {digest: length for _blkaddr, digest, length in map_a.entries}
    lengths_b = {digest: length for _blkaddr, digest, length in map_b.entries}
    shared = lengths_a.keys() & lengths_b.keys()
    new = lengths_b.keys() - lengths_a.keys()
    dropped = lengths_a.keys() - lengths_b.keys()
    return ChunkDelta(
        shared=len(shared), shared_bytes=sum(lengths_b[d] for d in shared),
        new=len(new), new_bytes=sum(lengths_b[d] for d in new),
        dropped=len(dropped), dropped_bytes=sum(lengths_a[d] for d in dropped),
    )


def _tree_order(path: bytes) -> list[bytes]:
    """Parents before children, siblings in byte order: the order Tree.walk and ErofsImage.walk use."""
    return path.split(b"/") if path else []


def _names(differing: list[bytes], xattrs: dict[bytes, bytes]) -> list[str]:
    return [_show(name) for name in differing if name in xattrs]


def _show(data: bytes) -> str:
    return data.decode("utf-8", "backslashreplace")


def _show_path(path: bytes) -> str:
    return "/" + _show(path)


def _show_rdev(st: Stat) -> str:
    return f"{st.rdev[0]}:{st.rdev[1]}"


def _show_time(ns: int) -> str:
    seconds, nanos = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos:09d}Z"


def _show_bytes(size: int) -> str:
    return f"{size:,} bytes"


def _show_names(names: list[str]) -> str:
    return "{" + ", ".join(names) + "}"


# How text() shows a field's value; str() for the others.
_TEXT: dict[str, Callable] = {"mtime": _show_time, "content": _show_bytes, "xattrs": _show_names}


def _describe(change: Change) -> str:
    def show(name: str, value: object) -> str:
        return _TEXT.get(name, str)(value)

    return "; ".join(f"{name} {show(name, change.a[name])} -> {show(name, change.b[name])}" for name in change.fields)
