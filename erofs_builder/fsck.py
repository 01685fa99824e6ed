"""fsck for layers and images: find every problem we can and say where each one is.

``fsck_layer`` checks a published layer on a store, outside in:
1. the manifest, meta.erofs and the blob map against their digests (dsec_fs.layer.open_layer), and the
   blob map's own structure and its agreement with the manifest;
2. meta.erofs with the userspace reader (reader.py), which validates every structure it reads: every
   inode reached from the root, its xattrs, its symlink target, its directory blocks, its chunk indexes;
3. the image against the blob map: the device slot's tag is the blob id and its size the blob's; every
   chunk index points at device 1 and at the start of a blob-map chunk whose length is the length that
   chunk of the file must have; nlink counts the names found;
4. with ``check_chunks``: every chunk of the blob map is in a pack the manifest lists, and fetching it
   gives bytes with the right sha256 (fetched in batches of neighbouring ranges, like a reader would).

``fsck_image`` runs steps 2-3 on an image alone (and, given a blob, reads every file's data through it;
given a blob map too, hashes every chunk of that blob).

A problem that makes the rest of a step meaningless (an image whose superblock does not parse, a
directory block that does) ends that step; anything local to one inode or one chunk is recorded and the
check goes on. Nothing here raises for corrupt input; it raises NotFoundError when the layer does not
exist and UnavailableError when the store (or a blob file) cannot be read at all.

Threads: plain blocking functions, safe from any thread; the store calls are the caller's store's.
"""

from __future__ import annotations

import stat
from dataclasses import asdict, dataclass, field

from dsec_fs import layer as layers
from dsec_fs.chunks import ChunkIndex, read_chunk, read_chunks
from dsec_fs.digest import sha256, to_hex
from dsec_fs.errors import CorruptError, DsecError, InputError, IntegrityError, NotFoundError, UnsupportedError
from dsec_fs.store import keys
from dsec_fs.store.base import Store

from .blob import BATCH_BYTES, Blob, chunk_batches
from dsec_fs.blobmap import EncodedBlobMap
from .ondisk.chunk_index import BLOB_DEVICE_ID, HOLE
from .ondisk.inode import LAYOUT_CHUNK_BASED
from .reader import ErofsImage

# Errors that are findings about the layer. UnavailableError is not one: when the store cannot answer,
# fsck cannot conclude anything, so it raises (retry later).
FINDINGS = (CorruptError, UnsupportedError, NotFoundError, InputError)
# Data read per call when fsck_image reads files through a blob.
READ_BYTES = 8 << 20


@dataclass(frozen=True)
class Problem:
    where: str  # the layer object, inode (nid and path), chunk (digest and blob block) or image offset
    message: str
    kind: str = "corrupt"  # the DsecError kind behind it: corrupt, unsupported, not-found, input

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class FsckReport:
    """What fsck found; ``ok`` when there are no problems (warnings do not count)."""

    layer: str | None = None  # the layer digest (fsck_layer only)
    entries: int = 0  # names walked, the root included
    inodes: int = 0  # distinct inodes among them
    chunks: int = 0  # entries of the blob map
    chunks_verified: int = 0  # chunks fetched (or read from the blob) whose sha256 matched
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # not wrong, but worth knowing

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}

    def summary(self) -> str:
        """Text for a terminal: one line of counts, then every problem and warning on its own line."""
        verdict = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        lines = [f"{self.layer or 'image'}: {verdict}; {self.entries:,} entries, {self.inodes:,} inodes, "
                 f"{self.chunks:,} chunks, {self.chunks_verified:,} verified"]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def add(self, where: str, error: DsecError | str) -> None:
        if isinstance(error, DsecError):
            self.problems.append(Problem(where, str(error), error.kind))
        else:
            self.problems.append(Problem(where, error))


def fsck_layer(store: Store, ref_or_digest: str, *, check_chunks: bool = True) -> FsckReport:
    """Check the layer ``ref_or_digest``; NotFoundError if there is no such ref or published layer."""
    digest = layers.resolve(store, ref_or_digest)
    if not store.exists(keys.layer_manifest(digest)):
        raise NotFoundError("layer is not published (no manifest)", where=f"layer {digest}")
    report = FsckReport(layer=digest)
    try:
        files = layers.open_layer(store, digest)
    except FINDINGS as exc:
        report.add(f"layer {digest}", exc)
        return report
    blobmap_key = keys.layer_blobmap(digest)
    try:
        blobmap = EncodedBlobMap(files.blobmap, source=blobmap_key)
    except FINDINGS as exc:
        report.add(blobmap_key, exc)
        return report
    _check_manifest(report, files.manifest, blobmap, keys.layer_manifest(digest))
    _check_distinct(report, blobmap, blobmap_key)
    _ImageCheck(report, files.meta, keys.layer_meta(digest), blob=None, blobmap=blobmap).run()
    if check_chunks:
        _check_store_chunks(report, store, files.manifest, blobmap)
    return report


def fsck_image(meta: bytes, blob: Blob | None = None, *, blobmap: EncodedBlobMap | None = None,
               source: str = "meta.erofs") -> FsckReport:
    """Check an image alone; with ``blob`` (device 1, e.g. a FileBlob) read all file data through it;
    with ``blobmap`` check the image against it, and with both, hash every chunk of the blob."""
    report = FsckReport()
    check = _ImageCheck(report, meta, source, blob=blob, blobmap=blobmap)
    check.run()
    if blob is not None and blobmap is not None and check.image is not None:
        _check_blob_chunks(report, blob, blobmap)
    return report


def _check_manifest(report: FsckReport, manifest: layers.Manifest, blobmap: EncodedBlobMap, source: str) -> None:
    expected = {
        "blob_id": blobmap.blob_id,
        "blob_blocks": blobmap.blocks,
        "chunk_size": blobmap.chunk_size,
        "block_size": blobmap.block_size,
    }
    for name, value in expected.items():
        if getattr(manifest, name) != value:
            report.add(f"{source} field {name!r}", f"is {getattr(manifest, name)!r}, the blob map says {value!r}")


def _check_distinct(report: FsckReport, blobmap: EncodedBlobMap, source: str) -> None:
    """A finding for each entry whose chunk an earlier entry holds already: the builder places a chunk
    once, and a mount does not look (dsec_fs/blobmap.py)."""
    first: dict[bytes, int] = {}
    for index, digest in enumerate(blobmap.digests()):
        earlier = first.setdefault(digest, index)
        if earlier != index:
            report.add(f"{source} entry {index}", f"chunk {to_hex(digest)} is already at entry {earlier}")


class _ImageCheck:
    """Walk one image and check every inode; with a blob map, check the image against it."""

    def __init__(self, report: FsckReport, meta: bytes, source: str, *, blob: Blob | None, blobmap: EncodedBlobMap | None):
        self.report = report
        self.meta = meta
        self.source = source
        self.blob = blob
        self.blobmap = blobmap
        self.image: ErofsImage | None = None
        self.used: set[int] = set()  # blob-map entries some chunk index points at

    def run(self) -> None:
        try:
            self.image = ErofsImage(self.meta, blob=self.blob, source=self.source)
        except FINDINGS as exc:
            self.report.add(self.source, exc)
            return
        if self.blobmap is not None:
            self._check_device_slot()
        links: dict[int, int] = {}  # nid -> the nlink the tree implies: names, or 2 + subdirectories
        dir_nids: dict[bytes, int] = {}  # path -> nid of each directory
        paths: dict[int, bytes] = {}  # nid -> first path
        try:
            for path, nid in self.image.walk():
                self.report.entries += 1
                if stat.S_ISDIR(self.image.stat(nid).mode):
                    links[nid] = 2
                    dir_nids[path] = nid
                    if path:
                        links[dir_nids[path.rpartition(b"/")[0]]] += 1
                else:
                    links[nid] = links.get(nid, 0) + 1
                if nid not in paths:
                    paths[nid] = path
                    self._check_inode(nid, path)
        except FINDINGS as exc:
            self.report.add(f"{self.source} (walking the tree)", exc)
            links.clear()  # counts of a partial walk mean nothing
        self.report.inodes = len(paths)
        for nid, count in links.items():
            nlink = self.image.stat(nid).nlink
            if nlink != count:
                self.report.add(self._where(nid, paths[nid]), f"nlink is {nlink}, the tree has {count}")
        if self.blobmap is not None:
            self.report.chunks = len(self.blobmap)
            unused = len(self.blobmap) - len(self.used)
            if unused:
                self.report.warnings.append(Problem(self.source, f"{unused} chunks of the blob map are used by "
                                                                 "no file"))

    def _where(self, nid: int, path: bytes) -> str:
        return f"{self.source}: inode nid {nid} (/{path.decode(errors='backslashreplace')})"

    def _check_device_slot(self) -> None:
        if self.image.block_size != self.blobmap.block_size:
            self.report.add(f"{self.source}: superblock", f"block size {self.image.block_size}, the blob map's is "
                            f"{self.blobmap.block_size}")
        devices = self.image.devices
        if len(devices) != 1:
            self.report.add(f"{self.source}: device table", f"{len(devices)} extra devices, a layer has 1 (its blob)")
            return
        slot = devices[0]
        where = f"{self.source}: device slot 1"
        if slot.tag != self.blobmap.blob_id.encode():
            self.report.add(where, f"tag {slot.tag[:64]!r} is not the blob id {self.blobmap.blob_id}")
        if slot.blocks != self.blobmap.blocks:
            self.report.add(where, f"{slot.blocks} blocks, the blob map has {self.blobmap.blocks}")

    def _check_inode(self, nid: int, path: bytes) -> None:
        """Everything of one inode the walk itself did not read; problems are recorded, not raised."""
        where = self._where(nid, path)
        image = self.image
        try:
            mode = image.stat(nid).mode
            image.xattrs(nid)
            if stat.S_ISLNK(mode):
                image.readlink(nid)
            elif stat.S_ISREG(mode):
                if image.inode(nid).layout == LAYOUT_CHUNK_BASED:
                    self._check_chunks_of(nid, where)
                if self.blob is not None:
                    self._read_all(nid)
        except FINDINGS as exc:
            self.report.add(where, exc)

    def _check_chunks_of(self, nid: int, where: str) -> None:
        chunk_map = self.image.chunk_map(nid)  # validates every index against its device
        if self.blobmap is None:
            return
        chunk_size = self.image.chunk_size(nid)
        if chunk_size != self.blobmap.chunk_size:
            self.report.add(where, f"chunk size {chunk_size}, the layer's is {self.blobmap.chunk_size}")
            return
        size = self.image.stat(nid).size
        for k, (device, blkaddr) in enumerate(chunk_map):
            if blkaddr == HOLE:
                continue
            if device != BLOB_DEVICE_ID:
                self.report.add(f"{where} chunk {k}", f"is on device {device}, not the blob (device 1)")
                continue
            if blkaddr >= self.blobmap.blocks:
                self.report.add(f"{where} chunk {k}",
                                f"blob block {blkaddr} is past the blob ({self.blobmap.blocks} blocks)")
                continue
            index = self.blobmap.locate(blkaddr)
            start, digest, length = self.blobmap.entries[index]
            expected = min(chunk_size, size - k * chunk_size)
            if start != blkaddr:
                self.report.add(f"{where} chunk {k}", f"blob block {blkaddr} is inside chunk {to_hex(digest)}, "
                                f"which starts at block {start}")
            elif length != expected:
                self.report.add(f"{where} chunk {k}", f"chunk {to_hex(digest)} at blob block {blkaddr} is {length} "
                                f"bytes, this chunk of the file is {expected}")
            else:
                self.used.add(index)

    def _read_all(self, nid: int) -> None:
        size = self.image.stat(nid).size
        for offset in range(0, size, READ_BYTES):
            self.image.read(nid, offset, READ_BYTES)


def _chunk_where(blkaddr: int, digest: bytes) -> str:
    return f"chunk {to_hex(digest)} (blob block {blkaddr})"


def _check_store_chunks(report: FsckReport, store: Store, manifest: layers.Manifest, blobmap: EncodedBlobMap) -> None:
    index = ChunkIndex()
    try:
        index.load_packs(store, manifest.packs)
    except FINDINGS:
        # Load them one by one to name every pack index that is missing or corrupt.
        for pack_id in manifest.packs:
            try:
                index.load_packs(store, [pack_id])
            except FINDINGS as exc:
                report.add(keys.index(pack_id), exc)
    present = []
    for blkaddr, digest, length in blobmap.entries:
        location = index.get(digest)
        if location is None:
            report.add(_chunk_where(blkaddr, digest), "is in no pack the manifest lists")
        elif location.ulen != length:
            report.add(_chunk_where(blkaddr, digest),
                       f"the pack index says {location.ulen} bytes, the blob map {length}")
        else:
            present.append((blkaddr, digest, length))
    for batch in chunk_batches(present, BATCH_BYTES):
        wanted = [(digest, index.get(digest)) for _blkaddr, digest, _length in batch]
        try:
            read_chunks(store, wanted)
            report.chunks_verified += len(batch)
        except FINDINGS:
            # Fetch the batch's chunks one by one to name each bad one.
            for (blkaddr, digest, _length), (_digest, location) in zip(batch, wanted):
                try:
                    read_chunk(store, digest, location)
                    report.chunks_verified += 1
                except FINDINGS as exc:
                    report.add(_chunk_where(blkaddr, digest), exc)


def _check_blob_chunks(report: FsckReport, blob: Blob, blobmap: EncodedBlobMap) -> None:
    """Hash each chunk as the blob holds it, and check the padding up to its block boundary is zero."""
    block_size = blobmap.block_size
    for batch in chunk_batches(blobmap.entries, BATCH_BYTES):
        first, last = batch[0], batch[-1]
        start = first[0] * block_size
        end = (last[0] + -(-last[2] // block_size)) * block_size
        try:
            data = memoryview(blob.read(start, end - start))
        except FINDINGS as exc:
            report.add(f"blob bytes [{start}, {end})", exc)
            continue
        for blkaddr, digest, length in batch:
            at = blkaddr * block_size - start
            padded = -(-length // block_size) * block_size
            if sha256(data[at:at + length]) != digest:
                report.add(_chunk_where(blkaddr, digest), IntegrityError("the blob's bytes do not hash to the digest",
                                                                         where=f"blob offset {at + start}"))
            elif any(data[at + length:at + padded]):
                report.add(_chunk_where(blkaddr, digest), "the padding after the chunk is not zero")
            else:
                report.chunks_verified += 1
