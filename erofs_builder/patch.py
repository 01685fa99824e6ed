"""Rebuild a layer by patching its parent's meta.erofs and blob map, when all that changed in the source
since the parent was built is the content, size or mtime of regular files, in ways that keep the image's
layout. The result is byte for byte the layer a full build of the same tree gives (the same meta.erofs,
so the same digest, and the same blob map), for the cost of one lstat per name plus reading the changed
files.

Steps (build.py calls them in this order; any ``None`` sends the build down the full path):
1. ``scan_changes``: lstat every name of the parent's build info (incremental.py) in the source and
   compare its identity with the recorded one; no directory is listed. Every recorded name must still be
   there. A name whose identity is trusted and equal is unchanged, and for a directory that includes its
   names: adding, removing or renaming a name moves the directory's ctime (and mtime), and the racy rule
   of incremental.py covers a change within the same clock tick, as for a file's content. So the tree
   has the same names, in the same listing order, once every other directory (a "suspect") lists exactly
   the names the parent's image holds for it. Any other name must still be the same inode (st_dev,
   st_ino) and, but for a regular file's size, mtime and content, have the metadata the parent's image
   holds for it (mode, uid, gid, xattrs; mtime, symlink target, device number): then every other inode
   is as the parent has it and the layout (nids, inode forms, blocks) stays the same provided each
   changed file keeps its chunk count and inode form (compact or extended), and the most common mtime
   (the superblock's build_time, layout.py) stays the most common one. The lstat calls are the cost of
   a rebuild that changed little: they run at C speed (a map over the recorded paths, relative to the
   root's descriptor) and keep nothing for a name: the caller's Python runs only for each suspect, as
   the calls reach it (``_differing``, ``SourceScan``).
   Each suspect is looked up again through directories alone (``_lstat_below``): the build info is not
   covered by the manifest, so its paths must not lead the patch path to read anything outside the
   source (a ".." component, a symlink where a directory was).
2. the build reads the regular files ``Rescan.files`` lists with the chunker (uploading new chunks),
   each as soon as the scan has compared it (``scan_changes``'s ``on_file``): its sha256 and zstd run
   on the other core while the lstat calls go on;
3. ``Rescan.patch``: checks the blob map (read in place: only the changed files' entries are looked up,
   dsec_fs.blobmap.EncodedBlobMap) and, if it can be kept in place, patches copies of the parent's
   meta.erofs and blob map.

The blob map: a full build lists each distinct chunk once, in tree order, then file order. A chunk
position k of a changed file, whose old chunk o and new chunk n differ, keeps the blob map's layout when
both are data (a hole is no entry), both fill the same number of blocks, o is named by no other chunk
index of the parent (the build info's shared list) and n by no other of the new layer (it is not in the
parent's blob map, nor twice among the changes): a full build then puts n exactly where o was, and every
chunk index keeps its block address. Anything else (a hole filled or made, a chunk that grows by a block,
content equal to a chunk used elsewhere) takes the full path. A patched layer therefore never lists a
chunk nothing uses.

What is patched: each changed inode's i_size and (extended inodes) i_mtime, i_mtime_nsec; the blob map
entries of the replaced chunks (in a copy of the parent's encoded map: the rest stays as it is); the
device slot's tag (the new blob id); then the uuid and the superblock checksum (writer.seal_image). The
manifest lists the parent's packs plus those holding the new chunks: a full build lists the packs the
index names for each chunk, which may leave out a pack that held only a replaced chunk. Listing it keeps
it live for gc, never breaks a read or fsck.

The parent's chunks: the parent is published, so gc keeps the packs its manifest lists (or rewrites that
list when it repacks), and this build's lease keeps them until the new manifest is published;
the build checks that they exist (``dsec_fs.chunks.missing_packs``, in build.py), which is all a layer copied without its packs (another store)
lacks.

Threads: everything here runs in the build's calling thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import operator
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from dsec_fs.aligned_search import field_matches
from dsec_fs.blobmap import BLOCK_SIZE
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import CorruptError, NotFoundError, UnsupportedError

from .incremental import (MTIME_FIELD, BuildInfo, Identity, ParentLayer, record_at, record_column, records_of,
                          rescanned_records)
from .layout import NS_PER_S
from .ondisk import INODE_SLOT_SIZE, inode
from .ondisk.chunk_index import BLOB_DEVICE_ID, CHUNK_INDEX
from .ondisk.device_slot import SLOT_SIZE, DeviceSlot
from .tree import Node
from .walk_dir import node_of, stat_identity
from .writer import seal_image

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_DOTS = (b".", b"..")
# How many chunk indexes of the parent's image name a replaced chunk is read off the image itself: the
# build info's list of shared entries is not covered by the manifest (review13), meta.erofs is (its
# digest is the layer's). A chunk index as this builder writes it (advise 0, device 1, the blkaddr)
# stands at a multiple of its size (the kernel aligns an inode's array to it); the same bytes elsewhere,
# a directory entry's file type and nid say, are not counted. Counting every match of device and blkaddr
# did: Debian's rebuild of a libc edit went down the full path (0.045 -> 0.34 s, bench_rebuild.py).
_BELOW_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a directory, never through a symlink


@dataclass(slots=True)
class _Change:
    """A regular file whose content, size or mtime may have changed: its new node and its parent's inode."""

    node: Node  # from the source: read by the chunker, which fills node.chunks
    nid: int
    old: inode.Inode  # as the parent's image holds it


@dataclass(frozen=True)
class Patched:
    """A patched layer's meta.erofs and blob map."""

    meta: bytearray
    blob_map_bytes: bytearray  # the parent's, with the replaced chunks' entries patched: the same layout
    data_grew: int  # bytes the replaced chunks add up to beyond the chunks they replace (may be negative)
    new_chunks: list[bytes]  # the chunks that replaced others: the only ones not in the parent's blob map


@dataclass
class Rescan:
    """What a scan found against the parent: the names' identities now, and the regular files to read."""

    parent: ParentLayer
    scanned_at_ns: int  # wall clock when the scan started
    records: bytearray  # every name's identity, encoded in the order of the parent's build info
    changes: list[_Change]  # each regular file among them (each inode once): to read

    @property
    def files(self) -> list[Node]:
        """The regular files the build must read (each once)."""
        return [change.node for change in self.changes]

    def patch(self, chunk_size: int) -> Patched | None:
        """The new meta.erofs and blob map once every file of ``files`` is chunked; None if the blob map
        cannot be kept in place (see the module docstring)."""
        parent = self.parent
        superblock = parent.image.superblock
        slot_at = superblock.devt_slotoff * SLOT_SIZE
        slot = DeviceSlot.unpack(parent.meta, slot_at, source=parent.image.source)
        if slot.tag != parent.manifest.blobmap_sha256.encode("ascii"):  # the map read in place is the image's own
            return _full("the parent's meta.erofs names another blob map than its manifest")
        blob_map = parent.blob_map
        shared = set(parent.info.shared)
        chunk_lists = parent.few_chunk_lists()
        replaced: dict[bytes, tuple[bytes, int]] = {}  # old chunk -> (new chunk, its length)
        added: set[bytes] = set()  # the new chunks
        data_grew = 0
        for change in self.changes:
            old = change.old
            old_chunks = (chunk_lists.of(change.nid, old.size, parent.image.stat(change.nid).mtime_ns)
                          if old.size else [])
            if old_chunks is None:
                return _full(f"the parent's chunk list of {_named(change)} is not as the builder makes it")
            size = change.node.size
            for number, (o, n) in enumerate(zip(old_chunks, change.node.chunks)):
                if o == n:
                    continue
                if o is None or n is None:
                    return _full(f"{_named(change)} has a hole where it had data, or data in a hole")
                if n in blob_map or n in added or o in replaced:
                    return _full(f"{_named(change)} now holds a chunk the layer holds elsewhere too")
                index = blob_map.index_of(o)  # found by its blkaddr (chunk_lists), so there
                if blob_map.index_of(o, index + 1) is not None:  # which entry the file's is, its digest cannot tell
                    return _full(f"the parent's blob map names chunk {to_hex(o)} of {_named(change)} twice")
                old_length = blob_map.entry(index)[2]
                length = min(chunk_size, size - number * chunk_size)
                if index in shared:
                    return _full(f"{_named(change)} had a chunk the layer holds elsewhere too")
                if -(-length // BLOCK_SIZE) != -(-old_length // BLOCK_SIZE):
                    return _full(f"the last chunk of {_named(change)} changed its number of blocks")
                if _chunk_indexes_naming(parent.meta, blob_map.entry(index)[0]) != 1:
                    # the build info's shared list is not covered by the manifest: the image tells
                    return _full(f"{_named(change)} had a chunk another chunk index of the image names too")
                replaced[o] = (n, length)
                added.add(n)
                data_grew += length - old_length
        new_map_bytes = blob_map.replaced(replaced)

        image = bytearray(parent.meta)
        for change in self.changes:
            node = change.node
            new = dataclasses.replace(change.old, size=node.size)  # the reader's cached inode stays as it is
            if new.extended:  # a compact inode's mtime is build_time, which stays (_build_time_stays)
                seconds, new.mtime_nsec = divmod(node.mtime_ns, NS_PER_S)
                new.mtime = seconds & _U64
            offset = superblock.meta_blkaddr * superblock.block_size + change.nid * INODE_SLOT_SIZE
            image[offset:offset + new.header_size] = new.pack()
        slot.tag = to_hex(sha256(new_map_bytes)).encode("ascii")  # the blob id
        image[slot_at:slot_at + SLOT_SIZE] = slot.pack()
        seal_image(image)
        return Patched(meta=image, blob_map_bytes=new_map_bytes, data_grew=data_grew,
                       new_chunks=list(added))


class SourceScan:
    """Step 1's lstat pass over the source ``root`` against the parent's build info ``info``
    (``_differing``), which can start before the parent's image is at hand: ``start`` runs it up to the
    first name to look at (ParentLayer.load calls it while meta.erofs and the blob map are still being
    read), ``scan_changes`` goes on from there. The scan's start on the wall clock (the racy rule,
    incremental.py) is when this is made. Close it when done (its root descriptor): a context manager."""

    def __init__(self, root: str | bytes | os.PathLike, info: BuildInfo):
        self.root = os.fsencode(root)
        self.info = info
        self.scanned_at_ns = time.time_ns()
        self._numbers = _differing(self.root, info)
        self._first: int | OSError | None = None  # what ``start`` found: a name's number, or the OSError
        self._started = False

    def start(self) -> None:
        """Run the lstat calls up to the first name whose identity differs (or is not trusted)."""
        try:
            self._first = next(self._numbers, None)
        except OSError as exc:
            self._first = exc
        self._started = True

    def numbers(self) -> Iterator[int]:
        """The numbers of the names whose identity differs or is not trusted, in order (``_differing``:
        OSError if a name is gone)."""
        if self._started:
            if isinstance(self._first, OSError):
                raise self._first
            if self._first is None:
                return
            yield self._first
        yield from self._numbers

    def close(self) -> None:
        self._numbers.close()

    def __enter__(self) -> "SourceScan":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scan_changes(scan: SourceScan, parent: ParentLayer, on_file: Callable[[Node], None] | None = None) -> Rescan | None:
    """Step 1 (see the module docstring): the changes since ``parent`` that ``scan`` (of the parent's
    build info) finds, if the patch path can take them, else None. Reads the metadata of the names whose
    identity is not trusted and equal, never contents. ``on_file(node)`` is called for each regular file
    to read (``Rescan.files``) as soon as the scan has compared it, while the rest of the names are
    still to be looked at: the build reads, hashes and compresses it on the other core meanwhile (step
    2), and drops that work if the scan ends in None."""
    info = parent.info
    if info is None:
        return _full("the parent has no usable build info")
    root = scan.root
    paths = info.paths
    changed: dict[int, Identity] = {}  # name number -> its identity now, where it differs
    changes: dict[tuple[int, int], _Change] = {}  # (st_dev, st_ino) -> change: a hard link's names share it
    with contextlib.closing(scan.numbers()) as differing:
        while True:
            try:
                number = next(differing, None)
            except OSError as exc:  # a name is gone (or unreadable): the full path lists the tree and says which
                return _full(f"cannot stat {os.fsdecode(exc.filename or root)}: {os.strerror(exc.errno or 0)}")
            if number is None:
                break
            path = paths[number]
            source = root + b"/" + path if number else root
            st = _lstat_below(root, path) if number else os.stat(root)  # the root may be a symlink
            if st is None:
                return _full(f"/{_printable(path)} is no name of the source's own")
            identity = changed[number] = stat_identity(st)
            if identity[:2] != record_at(info.records, number)[:2]:  # another inode: links may differ
                return _full(f"/{_printable(path)} is another inode now")
            try:
                change = _compare(path, source, st, parent, changes)
            except (CorruptError, UnsupportedError, NotFoundError) as exc:
                log.warning("cannot compare the source with the parent layer's image, rebuilding in full: %s", exc)
                return None
            if change is False:
                return None
            if change is not True:
                changes[st.st_dev, st.st_ino] = change
                if on_file is not None:
                    on_file(change.node)
    found = list(changes.values())
    records = rescanned_records(info, changed)
    if not _build_time_stays(found, records, parent):
        return _full("the image's most common mtime (its build time) would change")
    return Rescan(parent=parent, scanned_at_ns=scan.scanned_at_ns, records=records, changes=found)


def _differing(root: bytes, info: BuildInfo) -> Iterator[int]:
    """The indexes of the names of the parent's build info ``info`` (the root first) whose identity in the
    source now differs from the recorded one, or whose recorded one is not trusted, in order. One lstat
    per name, relative to the root's descriptor (the root is opened through a symlink, as
    walk_dir.scan_directory stats it), no directory listed (see the module docstring), at C speed: each
    identity is compared as it is made and not kept (docs/benchmarks.md, issue 17, session 11), and the
    caller's code runs only for the names this yields, each as soon as the lstat calls reach it. OSError
    if a name is gone. A name that changes after its lstat is either a suspect already or as any change
    after the scan (the racy rule, incremental.py); each suspect's identity is taken again before it is
    compared."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        lstat = functools.partial(os.lstat, dir_fd=fd)
        stats = itertools.chain([os.fstat(fd)], map(lstat, itertools.islice(info.paths, 1, None)))
        yield from itertools.compress(itertools.count(), map(
            operator.or_, map(operator.ne, map(stat_identity, stats), records_of(info.records)), info.racy))
    finally:
        os.close(fd)


def _lstat_below(root: bytes, path: bytes) -> os.stat_result | None:
    """lstat of the name ``path`` below the directory ``root`` through directories alone: None if a
    component is "." or "..", or not a directory (a symlink: the scan's lstat follows one there), or the
    name is gone. The patch path reads what this finds, so a build info that is not the builder's own
    cannot make it read anything outside the source."""
    *directories, name = path.split(b"/")
    if b"." in directories or b".." in directories or name in _DOTS:
        return None
    fd = -1
    try:
        fd = os.open(root, _BELOW_FLAGS & ~os.O_NOFOLLOW)  # the root itself may be given through a symlink
        for directory in directories:
            fd, parent_fd = os.open(directory, _BELOW_FLAGS, dir_fd=fd), fd
            os.close(parent_fd)
        return os.lstat(name, dir_fd=fd)
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def _compare(path: bytes, source: bytes, st: os.stat_result, parent: ParentLayer,
             changes: dict[tuple[int, int], _Change]) -> _Change | bool:
    """Compare the suspect ``path`` (at ``source``, whose lstat is ``st``) with the parent's image: a
    _Change if it is a regular file to read, True if there is nothing to read (a hard link of a file in
    ``changes``, the files found so far, or another entry that is as the parent has it), False if it
    differs in a way the patch cannot express (the full path; logged)."""
    image = parent.image
    nid = image.resolve(path)
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in changes:
        if changes[st.st_dev, st.st_ino].nid != nid:
            return _refused(f"/{_printable(path)} is another inode now")
        return True
    node = node_of(source, st, {})
    was = image.stat(nid)
    if ((was.mode, was.uid, was.gid) != (node.mode, node.uid, node.gid)
            or image.xattrs(nid) != dict(node.xattrs)):
        return _refused(f"/{_printable(path)} has another mode, owner or xattrs")
    if not node.is_reg:
        if (was.mtime_ns != node.mtime_ns
                or node.is_symlink and image.readlink(nid) != node.target
                or was.rdev != (os.major(node.rdev), os.minor(node.rdev))):
            return _refused(f"/{_printable(path)} changed (not a regular file)")
        # Its mtime was put back (its ctime moved), or its identity was not trusted: its names tell.
        if node.is_dir and _names(source) != [name for name, _nid, _ftype in image.readdir(nid)
                                              if name not in _DOTS]:
            return _refused(f"/{_printable(path)} holds other names than the parent's image")
        return True
    old = image.inode(nid)
    superblock = image.superblock
    chunk_size = parent.manifest.chunk_size  # the blob map's too (ParentLayer.load)
    seconds, nsec = divmod(node.mtime_ns, NS_PER_S)
    if (-(-node.size // chunk_size) != -(-old.size // chunk_size)
            or old.extended != inode.needs_extended(node.size, node.uid, node.gid, was.nlink, seconds, nsec,
                                                    superblock.build_time, superblock.build_time_nsec)):
        return _refused(f"/{_printable(path)} changed its chunk count or inode form")
    return _Change(node=node, nid=nid, old=old)


def _names(directory: bytes) -> list[bytes] | None:
    """The names in ``directory``, in byte order; None if it cannot be listed (gone or unreadable since
    its lstat: the full path then reports it)."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return None


def _build_time_stays(changes: list[_Change], records: bytearray, parent: ParentLayer) -> bool:
    """Whether the most common mtime of the new tree (whose identities are ``records``) is still the
    parent's build_time, so that no inode changes form: no changed file had or gets that mtime, and each
    new mtime has fewer inodes than it, or as many when the root has the build time (layout.py breaks a
    tie for the mtime met first, and the root is the first inode). Inodes are counted as layout.py counts
    them: a directory per name, any other inode once however many names it has (walk_dir merges those by
    st_dev, st_ino)."""
    image = parent.image
    build_time_ns = image.superblock.build_time * NS_PER_S + image.superblock.build_time_nsec
    moved = {change.node.mtime_ns for change in changes if change.node.mtime_ns != image.stat(change.nid).mtime_ns}
    if not moved:
        return True
    if build_time_ns in moved or any(image.stat(change.nid).mtime_ns == build_time_ns
                                     for change in changes if change.node.mtime_ns in moved):
        return False
    mtimes = record_column(records, MTIME_FIELD)

    def having(selected: Iterable[bool]) -> Iterator[Identity]:  # the identities of the names selected
        return (record_at(records, number) for number in itertools.compress(itertools.count(), selected))

    moved_inodes = _count_inodes(having(map(moved.__contains__, mtimes)))
    # The build time must keep more inodes than any moved mtime has (as many if the root has it):
    # counted only as far as that needs (it is the most common mtime, often thousands of inodes).
    counts = [moved_inodes[mtime] for mtime in moved if mtime >= 0]
    if not counts:
        return True
    needed = max(counts) + (mtimes[0] != build_time_ns)  # mtimes[0]: the root's
    return _count_inodes(having(map(build_time_ns.__eq__, mtimes)), stop_at=needed)[build_time_ns] >= needed


def _count_inodes(identities: Iterable[Identity], stop_at: int | None = None) -> Counter[int]:
    """mtime -> the number of inodes of ``identities`` with it, counted as layout.py counts them (see
    _build_time_stays); with ``stop_at``, only until one mtime reaches that count."""
    directories: Counter[int] = Counter()
    others: dict[int, set[tuple[int, int]]] = {}
    for dev, ino, _size, mtime_ns, _ctime_ns, mode in identities:
        if stat.S_ISDIR(mode):
            directories[mtime_ns] += 1
        else:
            others.setdefault(mtime_ns, set()).add((dev, ino))
        if stop_at is not None and directories[mtime_ns] + len(others.get(mtime_ns, ())) >= stop_at:
            break
    directories.update({mtime: len(inodes) for mtime, inodes in others.items()})
    return directories


def _full(reason: str) -> None:
    """Why the build takes the full path (logged at INFO); None, for the caller to return."""
    log.info("rebuilding in full: %s", reason)
    return None


def _refused(reason: str) -> bool:
    """``_full`` for ``_compare``: False."""
    _full(reason)
    return False


def _printable(path: bytes) -> str:
    return path.decode(errors="backslashreplace")


def _named(change: _Change) -> str:
    return change.node.source


def _chunk_indexes_naming(image: bytes, blkaddr: int, enough: int = 2) -> int:
    """How many chunk indexes of ``image`` (this builder's: advise 0) name blob block ``blkaddr``, counting
    up to ``enough``. A chance match at a chunk index's place only sends a rebuild to the full path."""
    matches = field_matches(image, CHUNK_INDEX.pack(0, BLOB_DEVICE_ID, blkaddr), origin=0, stride=CHUNK_INDEX.size,
                            phase=0)
    return sum(1 for _at in itertools.islice(matches, enough))
