"""Incremental builds: a layer's build-info side object, and what a rebuild may take from a parent layer
(a layer built earlier from the same directory), so that it reads only what changed.

Whether a source entry changed is decided by its stat identity (walk_dir.stat_identity): (st_dev,
st_ino, size, mtime_ns, ctime_ns, mode). The ctime cannot be set from userspace and moves on every
write, chmod, chown, xattr change and link count change, so a file rewritten in place with the same size
and its mtime put back (``touch -d``) still shows a new identity; a directory's mtime and ctime move when
a name is added to it, removed or renamed. meta.erofs keeps only the mtime, so every layer built from a
directory gets a side object, ``layers/<digest>/buildinfo``: every name of the tree, in listing order
(walk_dir.scan_directory: the root, then each directory's names in byte order, directories depth
first), with the identity its entry had when the build scanned it. It is written before manifest.json
(the manifest is published last), it is optional (a parent without one, or with one that fails
validation, gives a warning and every file is read), and it only ever lets the builder skip work: what
the new layer holds comes from the parent's meta.erofs and blob map, which open_layer checked against
the manifest, or from the source itself.

A rebuild uses it in one of two ways (build.py):
- the patch path (patch.py): one lstat per name of the parent's build info finds every name still there
  (a directory whose identity is trusted and equal still has the same names: its ctime would have
  moved, and the racy rule below covers a move within the same clock tick), and every name whose
  identity differs (or was not trusted) turns out to be a regular file whose content, size or mtime
  changed in a way that keeps the image's layout, or a directory that lists the same names; the
  parent's meta.erofs and blob map are then patched for those files alone;
- otherwise the full path: the tree is walked and laid out again, and a regular file is not opened, and
  takes its chunk digests from the parent, when one of its names
  - is recorded in the parent's build info, trusted, with exactly the identity the walk sees now, and
  - names a regular file in the parent's image with the same size and mtime whose chunk indexes point
    at chunks of the parent's blob map (``_ChunkLists``: anything else there and the file is read),
  and the store still holds all those chunks (checked by the chunker). Every other file is read and
  chunked as usual, so its content hash decides; chunks the store holds are not uploaded again either
  way.

Racily clean entries. File times come from a coarse clock (a jiffy on local filesystems, a second or two
on some others), so a change just after the parent scanned an entry, within the same tick, could leave
its identity unchanged. An identity is therefore trusted only if its ctime is more than RACY_NS older
than both the scan's start on the wall clock and the newest ctime the scan saw on the same device (that
filesystem's own clock, so the rule holds even when it is skewed against ours): any change after the
scan gets a later ctime than every trusted one, and so does a change during the scan unless the
filesystem's clock lags ours by more than RACY_NS. Other entries are recorded with the RACY flag; a
rebuild treats them as changed: it compares them with the parent's image (the patch path) or reads them
(the full path), which costs work, never a wrong layer. So are the entries changed in the last RACY_NS
before a tree went quiet, until something newer in it shows that the filesystem's clock has moved on.

Build-info format, version 2 (integers little-endian): ``_HEADER``, then one zstd frame
(dsec_fs.compress) holding the body:
- ``count`` records (``_RECORD``): each name's identity, in listing order (the root first);
- ``count`` flag bytes, one per record: 0, or RACY (1): the identity is not to be trusted;
- ``shared`` u32 (``_SHARED``), ascending: the indexes of the blob-map entries that the layer's chunk
  indexes name more than once (a chunk two files share, or one file has twice): the patch path replaces
  a chunk in place only where no other chunk index names it;
- the ``count`` tree paths, in the records' order, each followed by a NUL: relative to the layer root,
  components joined by b"/" (the root is the empty path). A hard-linked file has a record per name.
``decode_buildinfo`` validates everything and raises FormatError naming the field and its offset.
Version 1 (only regular files' identities, no flags, no shared chunks) is refused as unusable: the
rebuild then reads every file, as for a missing build info.

Threads: everything here runs in the build's calling thread.
"""

from __future__ import annotations

import functools
import logging
import operator
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from dsec_fs import compress
from dsec_fs.digest import DIGEST_SIZE, from_hex, sha256, to_hex
from dsec_fs.errors import CorruptError, FormatError, NotFoundError, UnsupportedError
from dsec_fs.layer import Manifest, open_layer
from dsec_fs.store import keys
from dsec_fs.store.base import Store, get_small

from dsec_fs.blobmap import EncodedBlobMap, blob_map_chunk_size
from .ondisk import INODE_SLOT_SIZE, chunk_index, dirent, inode, xattr
from .ondisk.superblock import Superblock
from .reader import ErofsImage
from .tree import Node, Tree

log = logging.getLogger(__name__)

MAGIC = b"DSECBINF"
VERSION = 2
NS_PER_S = 1_000_000_000
RACY_NS = 2_000_000_000  # covers filesystems with 1 s and 2 s timestamps, and a jiffy everywhere else
RACY = 1  # flag: the record's identity is not trusted
MAX_BODY = 1 << 30  # a bound on what decode will decompress: ~10 million names
# zstd level of the body: as small as the chunks' level 3 gives here (records in listing order, paths that
# share prefixes), in three quarters of the time
_LEVEL = 1

_HEADER = struct.Struct(
    "<"
    "8s"  # 0 magic: b"DSECBINF"
    "I"  # 8 version: VERSION
    "I"  # 12 count: names in the tree, the root included (at least 1)
    "I"  # 16 shared: entries of the shared-chunk list
    "I"  # 20 reserved: 0
    "Q"  # 24 body_size: bytes of the body once decompressed (at most MAX_BODY)
    f"{DIGEST_SIZE}s"  # 32 frame_sha256: sha256 of the zstd frame that follows (checked before decompressing)
    f"{DIGEST_SIZE}s"  # 64 layer: the layer this describes (raw sha256 of its meta.erofs)
)
# Bytes of a stored build info read at most: its header and the longest frame of a MAX_BODY body. Anyone
# who writes the store can grow the object; past this it is unusable (a FormatError naming the key).
MAX_STORED = _HEADER.size + compress.frame_bound(MAX_BODY)

_RECORD = struct.Struct(
    "<"
    "Q"  # 0 st_dev of the source entry
    "Q"  # 8 st_ino
    "Q"  # 16 st_size
    "q"  # 24 st_mtime_ns
    "q"  # 32 st_ctime_ns
    "I"  # 40 st_mode
)
_SHARED = struct.Struct("<I")  # index of a blob-map entry named by more than one chunk index
# (offset in a record, memoryview format) of the fields record_column gathers
DEV_FIELD, MTIME_FIELD, CTIME_FIELD = (0, "Q"), (24, "q"), (32, "q")

_NUL_TO_SLASH = bytes.maketrans(b"\0", b"/")
# What each pair of bytes _split_paths refuses means, in a list of NUL-terminated paths after the root's.
_BAD_PAIRS = {b"\0\0": "an empty path after the root", b"\0/": "a path starting with '/'",
              b"/\0": "a path ending with '/'", b"//": "an empty path component"}

_I_FORMAT = struct.Struct("<H")  # the first field of every inode: version bit | data layout << 1

# (st_dev, st_ino, size, mtime_ns, ctime_ns, mode): walk_dir.stat_identity, Node.identity of a walked node.
Identity = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class BuildInfo:
    """A decoded build info: every name of the tree its layer was built from, with its identity."""

    paths: list[bytes]  # listing order (walk_dir.listing_order), the root (b"") first
    racy: bytes  # racy[k]: RACY when identities[k] is not to be trusted, else 0
    shared: list[int]  # blob-map entries named by more than one chunk index, ascending
    records: bytes  # the identities as encoded (``records_of``: unpacked one at a time, at C speed)
    paths_blob: bytes  # the paths as encoded

    @functools.cached_property
    def identities(self) -> list[Identity]:
        """identities[k]: the identity of paths[k]'s entry when it was scanned. Unpacked when first asked
        for (the full path's): the patch path's scan compares the records one at a time as it goes
        (``records_of``), so that 8,743 tuples are not made, kept and freed (~1 ms on Debian's tree)."""
        return list(records_of(self.records))

    def trusted_files(self) -> dict[bytes, Identity]:
        """Path -> identity of every non-empty regular file whose identity is trusted (the reuse rule)."""
        return {path: identity for path, identity, flag in zip(self.paths, self.identities, self.racy)
                if not flag and stat.S_ISREG(identity[5]) and identity[2]}


def encode_buildinfo(entries: Iterable[tuple[bytes, Identity]], shared: list[int], layer: str | None,
                     scanned_at_ns: int) -> bytearray:
    """The build info of ``layer``, built from a tree whose scan started at ``scanned_at_ns`` (wall clock):
    ``entries`` is (path, identity) of every name, in listing order; ``shared``: the indexes of the
    blob-map entries that the layer's chunk indexes name more than once (blob_layout.BlobLayout.shared).
    With ``layer`` None, the layer is named afterwards (``name_layer``): a build encodes its build info
    before it writes meta.erofs, whose digest the layer's is, so that the buffers of the one are gone
    before the other is made."""
    # Built in place, each identity packed as it comes, not joined from lists of pieces or kept as tuples:
    # at 1,000,000 names a list of the identities is ~180 MB at the build's peak (a walked file's
    # identity tuple is made when asked for, walk_dir.WalkedFile; its meta.erofs and tree are alive).
    records = bytearray()
    paths = bytearray()
    pack = _RECORD.pack
    for path, identity in entries:
        records += pack(*identity)
        paths += path
        paths.append(0)
    return _encode(records, shared, paths, layer, scanned_at_ns)


def rescanned_records(parent: BuildInfo, changed: dict[int, Identity]) -> bytearray:
    """The records of ``parent`` with the identity of each name number k in ``changed`` replaced by
    ``changed[k]``: those of a scan that found the same names (patch.py)."""
    records = bytearray(parent.records)
    for number, identity in changed.items():
        _RECORD.pack_into(records, number * _RECORD.size, *identity)
    return records


def encode_rescanned(parent: BuildInfo, records: bytearray, layer: str | None, scanned_at_ns: int) -> bytearray:
    """The build info of ``layer``, built by patching ``parent``'s layer for a scan that found the same
    names (so the same paths and, see patch.py, the same shared chunks) with the identities ``records``
    (``rescanned_records``, which become the new build info's: the caller's no more). With ``layer``
    None, as ``encode_buildinfo`` (a rebuild encodes it while its changed files are read, before the
    layer digest is known)."""
    return _encode(records, parent.shared, parent.paths_blob, layer, scanned_at_ns)


def name_layer(info: bytearray, layer: str) -> bytearray:
    """A build info encoded with no layer (``encode_buildinfo``), made to name ``layer``, in place (a
    copy would double it: ~40 MB at 1,000,000 names, while the layer is published)."""
    at = _HEADER.size - DIGEST_SIZE  # the header's last field
    info[at:_HEADER.size] = from_hex(layer, what="layer digest")
    return info


def _encode(records: bytearray, shared: list[int], paths_blob: bytes | bytearray, layer: str | None,
            scanned_at_ns: int) -> bytearray:
    """The build info of the identities ``records`` (a fresh bytearray, the caller's no more, which
    becomes its body)."""
    count = len(records) // _RECORD.size
    devices = set(record_column(records, DEV_FIELD))
    if len(devices) == 1:  # the usual case, at C speed: one clock
        ctimes = record_column(records, CTIME_FIELD)
        trusted_before = min(scanned_at_ns, max(ctimes)) - RACY_NS
        racy = bytes(map(trusted_before.__le__, ctimes))  # True is RACY
    else:
        newest: dict[int, int] = {}  # st_dev -> the newest ctime the scan saw on that device
        for dev, _ino, _size, _mtime_ns, ctime_ns, _mode in records_of(records):
            if newest.get(dev, ctime_ns - 1) < ctime_ns:
                newest[dev] = ctime_ns
        bound = {dev: min(scanned_at_ns, ctime_ns) - RACY_NS for dev, ctime_ns in newest.items()}
        racy = bytes([RACY if fields[4] >= bound[fields[0]] else 0 for fields in records_of(records)])
    body = records
    body += racy
    body += b"".join(_SHARED.pack(index) for index in shared)
    body += paths_blob
    frame = compress.compress(body, level=_LEVEL)
    described = bytes(DIGEST_SIZE) if layer is None else from_hex(layer, what="layer digest")
    info = bytearray(_HEADER.pack(MAGIC, VERSION, count, len(shared), 0, len(body), sha256(frame), described))
    info += frame
    return info


def decode_buildinfo(data: bytes, *, layer: str, source: str) -> BuildInfo:
    """The build info in ``data``, which must describe ``layer``; FormatError otherwise."""

    def fail(structure: str, offset: int, message: str) -> FormatError:
        return FormatError(structure, offset, message, source=source)

    if len(data) < _HEADER.size:
        raise fail("build info header", 0, f"{len(data)} bytes, the header alone is {_HEADER.size}")
    magic, version, count, shared_count, reserved, body_size, frame_sha256, described = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise fail("build info header", 0, f"bad magic {magic!r}")
    if version != VERSION:
        raise fail("build info header", 8, f"unknown version {version}" + (
            " (written by an older dsecfs, without what a rebuild needs)" if version == 1 else ""))
    if count == 0:
        raise fail("build info header", 12, "no names (the root is always one)")
    if reserved:
        raise fail("build info header", 20, f"reserved field is {reserved:#x}, expected 0")
    if body_size > MAX_BODY:
        raise fail("build info header", 24, f"body of {body_size} bytes, more than {MAX_BODY}")
    paths_at = count * (_RECORD.size + 1) + shared_count * _SHARED.size
    if paths_at + count > body_size:
        raise fail("build info header", 24, f"body of {body_size} bytes cannot hold {count} names and "
                   f"{shared_count} shared chunks")
    if to_hex(described) != layer:
        raise fail("build info header", 64, f"describes layer {to_hex(described)}, not {layer}")
    frame = memoryview(data)[_HEADER.size:]
    if sha256(frame) != frame_sha256:  # every bit of it: zstd ignores some (padding, window size)
        raise fail("build info header", 32, "sha256 of the compressed body does not match")
    try:
        body = compress.decompress(frame, body_size, what=source)
    except CorruptError as exc:
        raise fail("build info body", _HEADER.size, exc.message) from None

    racy_at = count * _RECORD.size
    racy = body[racy_at:racy_at + count]
    if racy.translate(None, bytes([0, RACY])):
        bad = next(k for k, flag in enumerate(racy) if flag not in (0, RACY))
        raise fail(f"build info flags of name {bad}", racy_at + bad, f"unknown flags {racy[bad]:#x}")
    shared_at = racy_at + count
    shared = [index for (index,) in _SHARED.iter_unpack(body[shared_at:paths_at])]
    if any(shared[k] >= shared[k + 1] for k in range(len(shared) - 1)):
        raise fail("build info shared chunks", shared_at, "indexes are not strictly ascending")
    paths_blob = body[paths_at:]
    paths = _split_paths(paths_blob, count, fail, paths_at)
    records = body[:racy_at]
    return BuildInfo(paths=paths, racy=racy, shared=shared, records=records, paths_blob=paths_blob)


def records_of(records: bytes | bytearray) -> Iterator[Identity]:
    """The identities of encoded ``records``, one after another (made as they are asked for)."""
    return _RECORD.iter_unpack(records)


def record_at(records: bytes | bytearray, number: int) -> Identity:
    """The identity of record ``number`` of encoded ``records``."""
    return _RECORD.unpack_from(records, number * _RECORD.size)


def record_column(records: bytes | bytearray, field: tuple[int, str]) -> memoryview:
    """One 8-byte field of every record of ``records`` (``DEV_FIELD``, ``MTIME_FIELD``, ``CTIME_FIELD``),
    in the records' order, gathered at C speed: byte k of each field is a slice with the records' stride,
    eight slice copies in all, instead of a tuple a record."""
    offset, code = field
    count = len(records) // _RECORD.size
    column = bytearray(8 * count)
    for byte in range(8):
        column[byte::8] = records[offset + byte::_RECORD.size]
    return memoryview(column).cast(code)


def _split_paths(blob: bytes, count: int, fail, offset: int) -> list[bytes]:
    """The ``count`` tree paths of ``blob``: each NUL-terminated, the root (empty) first and only there; no
    empty component (a leading, trailing or doubled "/"), no path twice. Checked on the whole blob at
    once: in a path list that starts with the root's empty path, each of these shows as a byte pair."""
    paths = blob.split(b"\0")
    if len(paths) != count + 1 or paths[-1]:
        raise fail("build info paths", offset, f"{len(paths) - 1} NUL-terminated paths, expected {count}")
    if paths[0]:
        raise fail("build info paths", offset, "the first path is not the root's (empty)")
    at = blob.translate(_NUL_TO_SLASH).find(b"//")  # each of the four pairs, in one search
    if at >= 0:
        raise fail("build info paths", offset + at, _BAD_PAIRS[blob[at:at + 2]])
    del paths[-1]  # after the last NUL
    if len(set(paths)) != count:
        raise fail("build info paths", offset, "a path appears twice")
    return paths


def _read_buildinfo(store: Store, layer: str) -> BuildInfo | None:
    """The build info of published ``layer``; None, with a warning, if it is missing or unusable."""
    key = keys.layer_buildinfo(layer)
    try:
        return decode_buildinfo(get_small(store, key, MAX_STORED, "build info"), layer=layer, source=key)
    except NotFoundError:
        log.warning("parent layer %s has no build info (not built from a directory?): every file is read", layer)
    except CorruptError as exc:
        log.warning("parent layer's build info is unusable, every file is read: %s", exc)
    return None


class ParentLayer:
    """A published layer that an incremental build may patch, or take chunk lists from for unchanged files."""

    def __init__(self, digest: str, manifest: Manifest, meta: bytes, blob_map_bytes: bytes, info: BuildInfo | None):
        self.digest = digest
        self.manifest = manifest
        self.meta = meta
        self.image = ErofsImage(meta, source=keys.layer_meta(digest))
        self.blob_map_bytes = blob_map_bytes  # as stored (decompressed), which the patch path copies
        self.info = info  # None: nothing can be reused (the build reads every file)

    @functools.cached_property
    def blob_map(self) -> EncodedBlobMap:
        """The blob map read in place (FormatError if it does not validate) when first asked for."""
        return EncodedBlobMap(self.blob_map_bytes, source=keys.layer_blobmap(self.digest))

    @classmethod
    def load(cls, store: Store, ref_or_digest: str, *, chunk_size: int,
             on_buildinfo: Callable[[BuildInfo], object] | None = None) -> "ParentLayer":
        """Open the parent (NotFoundError if it is not published). A parent built with another chunk size,
        or whose build info is missing or fails validation, is usable but gives nothing: a warning is
        logged and the build reads every file. The blob map's bytes are verified against the manifest
        here, and read in place (``blob_map``) on first use. ``on_buildinfo(info)`` runs in the calling thread
        once the build info is decoded, while meta.erofs and the blob map are still being read (the patch
        path starts its scan there, patch.SourceScan); what it raises is raised here."""
        found: list[BuildInfo | None] = [None]

        def read_buildinfo(manifest: Manifest) -> None:  # while open_layer reads meta.erofs and the blob map
            if manifest.chunk_size == chunk_size:
                found[0] = _read_buildinfo(store, manifest.layer)
                if found[0] is not None and on_buildinfo is not None:
                    on_buildinfo(found[0])

        files = open_layer(store, ref_or_digest, on_manifest=read_buildinfo)
        info = found[0]
        map_chunk_size = blob_map_chunk_size(files.blobmap)
        if map_chunk_size is None:  # not even a header: the decode says what is wrong, and where
            EncodedBlobMap(files.blobmap, source=keys.layer_blobmap(files.digest))
        if chunk_size != map_chunk_size or chunk_size != files.manifest.chunk_size:
            log.warning("parent layer %s has chunk size %d, this build %d: every file is read",
                        files.digest, map_chunk_size, chunk_size)
            info = None
        return cls(files.digest, files.manifest, files.meta, files.blobmap, info)

    def chunk_lists(self) -> "_ChunkLists":
        """The chunk digests of the parent's regular files, read from its image on demand (for many files:
        the blob map's entries by blkaddr in a dict)."""
        blob_map = self.blob_map
        chunk_at = dict(zip(map(operator.itemgetter(0), blob_map.entries), blob_map.entries))  # at C speed
        return _ChunkLists(self.meta, self.image.superblock, blob_map.chunk_size, blob_map.chunk_bits, chunk_at.get)

    def few_chunk_lists(self) -> "_ChunkLists":
        """``chunk_lists`` for a few files (the patch path's): looked up in the blob map in place."""
        blob_map = self.blob_map
        return _ChunkLists(self.meta, self.image.superblock, blob_map.chunk_size, blob_map.chunk_bits,
                           blob_map.starting_at)

    def reusable_chunks(self, tree: Tree) -> dict[Node, list[bytes | None]]:
        """Chunk digests for each regular file of ``tree`` (a walk_directory tree) that the reuse rule lets
        the build take from the parent without reading it."""
        identities = self.info.trusted_files() if self.info is not None else {}
        if not identities:
            return {}
        chunks = self.chunk_lists()
        found: dict[Node, list[bytes | None]] = {}
        try:
            for path, node, nid in self._files_in_both(tree):
                if node not in found and identities.get(path) == node.identity:
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

    def __init__(self, meta: bytes, superblock: Superblock, chunk_size: int, chunk_bits: int,
                 chunk_at: Callable[[int], tuple[int, bytes, int] | None]):
        self._meta = meta
        self._meta_offset = superblock.meta_blkaddr * superblock.block_size
        self._build_time_ns = superblock.build_time * NS_PER_S + superblock.build_time_nsec
        self._chunk_size = chunk_size
        self._chunk_format = chunk_index.chunk_format(chunk_bits, superblock.blkszbits)
        self._chunk_at = chunk_at  # blkaddr -> the blob-map entry (blkaddr, digest, length) starting there

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
            chunk = self._chunk_at(blkaddr)
            if (device != chunk_index.BLOB_DEVICE_ID or chunk is None
                    or chunk[2] != min(self._chunk_size, size - number * self._chunk_size)):
                return None
            digests.append(chunk[1])
        return digests
