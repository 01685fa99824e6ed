"""Incremental builds: a layer's build-info side object, and taking a parent layer's chunk lists for the
files that have not changed since the parent was built, so a rebuild reads only what changed.

Whether a file changed is decided by its stat identity as walk_directory records it: (st_dev, st_ino,
size, mtime_ns, ctime_ns). The ctime cannot be set from userspace and moves on every write, so a file
rewritten in place with the same size and its mtime put back (``touch -d``) still shows a new identity.
meta.erofs keeps only the mtime, so every layer built from a directory gets a side object,
``layers/<digest>/buildinfo``, mapping each regular file's path to the identity it had when it was read.
It is written before manifest.json (the manifest is published last), it is optional (a parent without
one, or with one that fails validation, gives a warning and every file is read), and it only ever lets
the builder skip a read: the chunk digests themselves come from the parent's meta.erofs and blob map,
which open_layer checked against the manifest.

Reuse rule. A regular file of the new tree is not opened, and takes its chunk digests from the parent,
when one of its names
- is recorded in the parent's build info with exactly the identity the walk sees now, and
- names a regular file in the parent's image with the same size and mtime whose chunk indexes point at
  chunks of the parent's blob map (``_ChunkLists``: anything else there and the file is read),
and the store still holds all those chunks (checked by the chunker). Every other file is read and
chunked as usual, so its content hash decides; chunks the store holds are not uploaded again either way.

Racily clean files. File times come from a coarse clock (a jiffy on local filesystems, a second or two on
some others), so a write just after the parent read a file, within the same tick, could leave its
identity unchanged. A file is therefore recorded only if its ctime is more than RACY_NS older than both
the scan's start on the wall clock and the newest ctime the walk saw on the same device (that
filesystem's own clock, so the rule holds even when it is skewed against ours): any write after the
walk gets a later ctime than every recorded one, and so does a write during the walk unless the
filesystem's clock lags ours by more than RACY_NS. A file changed just before a build is read again by
the next one, which costs a read, never a wrong chunk list; so are the files written in the last RACY_NS
before a tree went quiet, until something newer in it shows that the filesystem's clock has moved on.

Build-info format (integers little-endian): ``_HEADER``, then one zstd frame (dsec_fs.compress) holding
the body: entries, each ``_ENTRY`` followed by its path (relative to the layer root, components joined
by b"/", as Tree paths). A hard-linked file has an entry per name. ``decode_buildinfo`` validates
everything and raises FormatError naming the field and its offset.

Threads: everything here runs in the build's calling thread.
"""

from __future__ import annotations

import logging
import stat
import struct
from collections.abc import Iterator

from dsec_fs import compress
from dsec_fs.digest import DIGEST_SIZE, from_hex, sha256, to_hex
from dsec_fs.errors import CorruptError, FormatError, NotFoundError, UnsupportedError
from dsec_fs.layer import open_layer
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from dsec_fs.blobmap import BlobMap
from .ondisk import INODE_SLOT_SIZE, chunk_index, dirent, inode, xattr
from .ondisk.superblock import Superblock
from .reader import ErofsImage
from .tree import Node, Tree

log = logging.getLogger(__name__)

MAGIC = b"DSECBINF"
VERSION = 1
NS_PER_S = 1_000_000_000
RACY_NS = 2_000_000_000  # covers filesystems with 1 s and 2 s timestamps, and a jiffy everywhere else
MAX_BODY = 1 << 30  # a bound on what decode will decompress: ~10 million files
MAX_PATH = 1 << 16  # a bound on one path; Tree paths are far shorter in practice

_HEADER = struct.Struct(
    "<"
    "8s"  # magic: b"DSECBINF"
    "I"  # version: VERSION
    "I"  # count: number of entries in the body
    "Q"  # body_size: bytes of the body once decompressed (at most MAX_BODY)
    f"{DIGEST_SIZE}s"  # body_sha256: sha256 of the decompressed body
    f"{DIGEST_SIZE}s"  # layer: the layer this describes (raw sha256 of its meta.erofs)
)

_ENTRY = struct.Struct(
    "<"
    "Q"  # st_dev of the source file
    "Q"  # st_ino
    "Q"  # size in bytes (never 0: empty files need no reading and are not recorded)
    "q"  # mtime_ns
    "q"  # ctime_ns
    "I"  # path_length: bytes of the path that follows (1..MAX_PATH)
)

_I_FORMAT = struct.Struct("<H")  # the first field of every inode: version bit | data layout << 1

# (st_dev, st_ino, size, mtime_ns, ctime_ns): Node.identity as walk_directory sets it.
Identity = tuple[int, int, int, int, int]


def encode_buildinfo(tree: Tree, layer: str, scanned_at_ns: int) -> bytes:
    """The build info of ``layer`` built from ``tree`` (a walk_directory tree whose walk started at
    ``scanned_at_ns``, wall clock): every non-empty regular file that is not racily clean (see above)."""
    newest: dict[int, int] = {}  # st_dev -> the newest ctime the walk saw on that device
    for node in tree.nodes():
        if node.identity is not None:
            dev, ctime_ns = node.identity[0], node.identity[4]
            newest[dev] = max(newest.get(dev, ctime_ns), ctime_ns)
    body = bytearray()
    count = 0
    for path, node in tree.walk():
        identity = node.identity
        if (identity is not None and node.size and node.is_reg
                and identity[4] < min(scanned_at_ns, newest[identity[0]]) - RACY_NS):
            body += _ENTRY.pack(*identity, len(path))
            body += path
            count += 1
    header = _HEADER.pack(MAGIC, VERSION, count, len(body), sha256(body), from_hex(layer, what="layer digest"))
    return header + compress.compress(body)


def decode_buildinfo(data: bytes, *, layer: str, source: str) -> dict[bytes, Identity]:
    """Path -> identity from a build-info object, which must describe ``layer``; FormatError otherwise."""

    def fail(structure: str, offset: int, message: str) -> FormatError:
        return FormatError(structure, offset, message, source=source)

    if len(data) < _HEADER.size:
        raise fail("build info header", 0, f"{len(data)} bytes, the header alone is {_HEADER.size}")
    magic, version, count, body_size, body_sha256, described = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise fail("build info header", 0, f"bad magic {magic!r}")
    if version != VERSION:
        raise fail("build info header", 8, f"unknown version {version}")
    if body_size > MAX_BODY:
        raise fail("build info header", 16, f"body of {body_size} bytes, more than {MAX_BODY}")
    if to_hex(described) != layer:
        raise fail("build info header", 56, f"describes layer {to_hex(described)}, not {layer}")
    try:
        body = compress.decompress(memoryview(data)[_HEADER.size:], body_size, what=source)
    except CorruptError as exc:
        raise fail("build info body", _HEADER.size, exc.message) from None
    if sha256(body) != body_sha256:
        raise fail("build info header", 24, "sha256 of the body does not match")

    identities: dict[bytes, Identity] = {}
    offset = 0  # in the decompressed body
    for number in range(count):
        if offset + _ENTRY.size > len(body):
            raise fail(f"build info entry {number}", offset, "body ends inside the entry")
        *identity, path_length = _ENTRY.unpack_from(body, offset)
        path = body[offset + _ENTRY.size:offset + _ENTRY.size + path_length]
        if not 0 < path_length <= MAX_PATH or len(path) != path_length:
            raise fail(f"build info entry {number}", offset + 40, f"path of {path_length} bytes")
        # A tree path: no empty component (a leading, trailing or doubled "/"), no NUL.
        if path[:1] == b"/" or path[-1:] == b"/" or b"//" in path or b"\0" in path:
            raise fail(f"build info entry {number}", offset + _ENTRY.size, f"path {path[:64]!r} is not a tree path")
        if identity[2] == 0:
            raise fail(f"build info entry {number}", offset + 16, "size 0")
        if path in identities:
            raise fail(f"build info entry {number}", offset + _ENTRY.size, f"path {path[:64]!r} recorded twice")
        identities[path] = tuple(identity)
        offset += _ENTRY.size + path_length
    if offset != len(body):
        raise fail("build info body", offset, f"{len(body) - offset} bytes after the last of {count} entries")
    return identities


class ParentLayer:
    """A published layer whose chunk lists an incremental build may take for unchanged files."""

    def __init__(self, digest: str, meta: bytes, blob_map: BlobMap, identities: dict[bytes, Identity]):
        self.digest = digest
        self.meta = meta
        self.image = ErofsImage(meta, source=keys.layer_meta(digest))
        self.blob_map = blob_map
        self.identities = identities  # empty: nothing can be reused (the build reads every file)

    @classmethod
    def load(cls, store: Store, ref_or_digest: str, *, chunk_size: int) -> "ParentLayer":
        """Open the parent (NotFoundError if it is not published). A parent built with another chunk size,
        or whose build info is missing or fails validation, is usable but gives nothing: a warning is
        logged and the build reads every file."""
        files = open_layer(store, ref_or_digest)
        blob_map = BlobMap.decode(files.blobmap, source=keys.layer_blobmap(files.digest))
        identities: dict[bytes, Identity] = {}
        key = keys.layer_buildinfo(files.digest)
        if blob_map.chunk_size != chunk_size:
            log.warning("parent layer %s has chunk size %d, this build %d: every file is read",
                        files.digest, blob_map.chunk_size, chunk_size)
        else:
            try:
                identities = decode_buildinfo(store.get(key), layer=files.digest, source=key)
            except NotFoundError:
                log.warning("parent layer %s has no build info (not built from a directory?): every file is read",
                            files.digest)
            except CorruptError as exc:
                log.warning("parent layer's build info is unusable, every file is read: %s", exc)
        return cls(files.digest, files.meta, blob_map, identities)

    def reusable_chunks(self, tree: Tree) -> dict[Node, list[bytes | None]]:
        """Chunk digests for each regular file of ``tree`` (a walk_directory tree) that the reuse rule lets
        the build take from the parent without reading it."""
        if not self.identities:
            return {}
        chunks = _ChunkLists(self.meta, self.image.superblock, self.blob_map)
        found: dict[Node, list[bytes | None]] = {}
        try:
            for path, node, nid in self._files_in_both(tree):
                if node not in found and self.identities.get(path) == node.identity:
                    digests = chunks.of(nid, node.size, node.mtime_ns)
                    if digests is not None:
                        found[node] = digests
        except (CorruptError, UnsupportedError) as exc:
            log.warning("cannot take chunk lists from the parent layer, every file is read: %s", exc)
            return {}
        return found

    def _files_in_both(self, tree: Tree) -> Iterator[tuple[bytes, Node, int]]:
        """(path, node, parent's nid) of every regular file of ``tree`` whose path is a regular file in the
        parent's image too. Walks the two directory trees side by side, following the new tree (which is
        finite whatever the image holds), so no other inode of the parent is read."""
        stack: list[tuple[bytes, Node, int]] = [(b"", tree.root, self.image.root_nid)]
        while stack:
            prefix, directory, nid = stack.pop()
            entries = {name: (child_nid, ftype) for name, child_nid, ftype in self.image.readdir(nid)}
            for name, child in directory.children.items():
                match = entries.get(name)
                if match is None:
                    continue
                if child.is_dir and match[1] == dirent.FT_DIR:
                    stack.append((prefix + name + b"/", child, match[0]))
                elif child.is_reg and match[1] == dirent.FT_REG:
                    yield prefix + name, child, match[0]


class _ChunkLists:
    """Regular files' chunk digests read straight from a parent image's inodes and chunk indexes.

    Only a file that matched the build info by path and identity is looked at, and its list is only ever
    used if everything about it is as our writer makes it: a chunk-based regular file of the expected
    size and mtime, chunks of the blob map's size, and each index naming device 1 at the first block of
    a blob-map chunk of exactly that chunk's length (or a hole). Anything else answers None and the file
    is read, so this skips the reader's general validation (and its caches) without trusting more.
    """

    def __init__(self, meta: bytes, superblock: Superblock, blob_map: BlobMap):
        self._meta = meta
        self._meta_offset = superblock.meta_blkaddr * superblock.block_size
        self._build_time_ns = superblock.build_time * NS_PER_S + superblock.build_time_nsec
        self._chunk_size = blob_map.chunk_size
        self._chunk_format = chunk_index.chunk_format(blob_map.chunk_bits, superblock.blkszbits)
        self._chunk_at = {blkaddr: (digest, length) for blkaddr, digest, length in blob_map.entries}

    def of(self, nid: int, size: int, mtime_ns: int) -> list[bytes | None] | None:
        """The digests of regular file ``nid``, if it has ``size`` bytes, mtime ``mtime_ns`` and sound
        chunk indexes; else None."""
        offset = self._meta_offset + nid * INODE_SLOT_SIZE
        try:
            (i_format,) = _I_FORMAT.unpack_from(self._meta, offset)
            if i_format & inode.VERSION_EXTENDED:
                (_, icount, mode, _, i_size, i_u, _, _, _, mtime, mtime_nsec, _, _) = inode.EXTENDED.unpack_from(
                    self._meta, offset)
                header_size = inode.EXTENDED.size
                i_mtime_ns = (mtime - (1 << 64) if mtime >= 1 << 63 else mtime) * NS_PER_S + mtime_nsec
            else:
                (_, icount, mode, _, i_size, _, i_u, _, _, _, _) = inode.COMPACT.unpack_from(self._meta, offset)
                header_size = inode.COMPACT.size
                i_mtime_ns = self._build_time_ns
        except struct.error:  # past the end of the image
            return None
        if (i_format != inode.VERSION_COMPACT | inode.LAYOUT_CHUNK_BASED << 1
                and i_format != inode.VERSION_EXTENDED | inode.LAYOUT_CHUNK_BASED << 1):
            return None
        if not stat.S_ISREG(mode) or i_size != size or i_mtime_ns != mtime_ns or i_u & 0xFFFF != self._chunk_format:
            return None
        xattr_size = xattr.XATTR_HEADER.size + 4 * (icount - 1) if icount else 0
        start = chunk_index.array_offset(offset + header_size + xattr_size)
        count = -(-size // self._chunk_size)
        array = self._meta[start:start + count * chunk_index.CHUNK_INDEX.size]
        if len(array) != count * chunk_index.CHUNK_INDEX.size:
            return None
        digests: list[bytes | None] = []
        for number, (_advise, device, blkaddr) in enumerate(chunk_index.CHUNK_INDEX.iter_unpack(array)):
            if blkaddr == chunk_index.HOLE:
                digests.append(None)
                continue
            chunk = self._chunk_at.get(blkaddr)
            if (device != chunk_index.BLOB_DEVICE_ID or chunk is None
                    or chunk[1] != min(self._chunk_size, size - number * self._chunk_size)):
                return None
            digests.append(chunk[0])
        return digests
