"""Cut every regular file of a Tree into fixed-size chunks, name them, and upload the new ones.

For each regular-file Node (once, however many names it has) the chunker reads the file's pieces through
``Node.reader`` and fills ``node.chunks``: the sha256 of each piece, or None for a hole (a piece the
reader already knows is a hole, or one that is all zeros). Every distinct non-zero chunk gets its place
in the layer's BlobMap in build order (tree order, then file order), so the same tree always gives the
same blob. A chunk is compressed and handed to the ChunkUploader only the first time this build meets it
and only if the store's ChunkIndex does not already hold it.

Pipeline and threads:
- The calling (main) thread reads pieces, one file after another: sequential reads in chunk-size buffers;
  a directory walk hands over every file of the finished tree, a tar or OCI walk each file as its
  content streams past (``Chunker.add_file`` as the walker's ``on_file``).
- Pieces go to a ThreadPoolExecutor in batches of about BATCH_BYTES; a worker hashes, zero-checks,
  compresses and uploads each piece of its batch. hashlib and zstandard release the GIL, so on two cores
  both stay busy. A batch, not a piece, is the unit of work: a Future and a GIL hand-over per small file
  would cost far more than naming it.
- Files under INLINE_BYTES are hashed in the main thread at once: for so few bytes a worker's Python
  code per file would cost more than it saves, as the main thread's reads and that code would take
  turns at the GIL. Their chunks wait in a batch of about CLAIMED_BATCH_BYTES, claimed together
  (``ChunkUploader.claim_many``: one lock a batch, not one a file); the new ones are compressed in a
  worker all the same, in one call that holds no GIL (compress.compress_many), so the main thread reads
  on while the other core compresses; the worker hands the frames back, and the main thread queues
  them for upload (``ChunkUploader.add_claimed_many``) when it settles the batch.
- The main thread alone settles results (fills a node's chunk list at the piece's position, adds up the
  statistics), so those need no lock; the BlobMap is laid out from the final tree afterwards.
- The threads share no state of the chunker: a thread that meets a new chunk claims it from the uploader
  (``ChunkUploader.claim`` or ``claim_many``, under the uploader's lock) before compressing it, so two
  threads that meet the same new chunk do not both compress it, and nothing per chunk outlives the
  chunk's upload.
- At most ``_max_batches`` batches of either kind (about 2 per worker, capped by INFLIGHT_BYTES) are read
  and not yet settled, so memory does not grow with the amount of data (only the Tree grows, with the entries).
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from dsec_fs import compress
from dsec_fs.chunks import ChunkIndex, ChunkUploader
from dsec_fs.digest import sha256
from dsec_fs.errors import InputError

from dsec_fs.blobmap import BlobMap, check_chunk_size
from .tree import Node, Tree

DEFAULT_CHUNK_SIZE = 1 << 20
# A batch goes to a worker once it holds this much; with small chunks a batch holds many pieces.
BATCH_BYTES = 1 << 20
# Files smaller than this are named in the main thread (see the module docstring).
INLINE_BYTES = 16 << 10
# Their new chunks go to a worker in batches of this many bytes. 1 MiB batches grew the build's peak RSS by
# ~80 MB at 100,000 small files, against ~13 MB for these (docs/benchmarks.md, build8), as fast.
CLAIMED_BATCH_BYTES = 128 << 10
# Read-ahead beyond two batches per worker adds memory, not speed (16 MiB in flight instead of 4 was
# within noise for the Debian rootfs, for 8 MB more RSS: docs/benchmarks.md, issue 17, third session);
# with large chunks fewer batches fit.
INFLIGHT_BYTES = 64 << 20
_END = object()  # sentinel for next(): the reader has no more pieces

# Called with (bytes of file content chunked so far, bytes of file content in the tree).
Progress = Callable[[int, int], None]
# Incremental builds (incremental.py): the chunk digests a regular file is known to have (None for a
# hole) without reading it, or None when it must be read.
KnownChunks = Callable[[Node], "list[bytes | None] | None"]
# A piece on its way to a worker: the chunk list it belongs to, its position there, its length and bytes.
_Slot = tuple[list, int, int, bytes]
# What naming a piece found: (digest, or None for all zeros; compressed size if it uploaded a new chunk).
_Named = tuple["bytes | None", "int | None"]
# A small file's chunk, named and waiting to be claimed, then (if new) compressed: (digest, length, bytes).
_SmallChunk = tuple[bytes, int, bytes]


@dataclass(slots=True)
class ChunkStats:
    files: int = 0  # regular-file inodes (a hard-linked file counts once)
    bytes: int = 0  # their total size
    chunks: int = 0  # chunk slots over all files, holes included
    hole_chunks: int = 0  # slots that are holes: all zeros or inside a sparse file's hole
    distinct_chunks: int = 0  # distinct non-zero chunks: the entries of the blob map
    new_chunks: int = 0  # distinct chunks the store did not hold, now uploaded
    new_bytes: int = 0  # their uncompressed size
    dedup_bytes: int = 0  # bytes of non-hole slots that needed no upload (repeats here or already stored)
    stored_bytes: int = 0  # compressed size of the new chunks
    reused_files: int = 0  # files not read: their chunk lists came from a parent layer (``known``)
    reused_bytes: int = 0  # their total size


class Chunker:
    """Chunks regular files one at a time, as a walker hands them over, then lays out the blob map.

    Directory builds feed every file of a finished Tree (``chunk_tree``); streaming inputs (tar, OCI) call
    ``add_file`` from the walker's ``on_file`` while each member's content is readable. ``add_file`` reads
    the file at once in the calling thread; hashing and compression go to the pool.

    Use as a context manager, then ``finish()`` once the walk is done. The blob map is laid out from the
    final tree (``blob_map_for``), not in the order files arrived, so files that a later tar member or an
    OCI whiteout removed take no place in the blob, and the same tree always gives the same blob.
    """

    def __init__(self, uploader: ChunkUploader, index: ChunkIndex, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 workers: int | None = None, progress: Progress | None = None, known: KnownChunks | None = None,
                 total_bytes: int = 0):
        check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.stats = ChunkStats()
        self._uploader = uploader
        self._index = index
        self._known = known
        self._progress = progress
        # Streaming inputs do not know their size up front: the total then grows with the files seen.
        self._total = total_bytes
        self._done = 0
        self._zeros = bytes(chunk_size)
        workers = max(1, workers or os.cpu_count() or 1)
        self._batch_bytes = max(BATCH_BYTES, chunk_size)
        self._max_batches = max(2, min(2 * workers, INFLIGHT_BYTES // self._batch_bytes))
        self._inline_below = min(INLINE_BYTES, chunk_size + 1)  # a file this small is one piece
        self._pool = ThreadPoolExecutor(max_workers=min(workers, self._max_batches), thread_name_prefix="chunker")
        self._batch: list[_Slot] = []  # pieces read, not yet handed to a worker
        self._batch_size = 0  # their bytes
        self._small: list[_SmallChunk] = []  # small files' chunks named, not yet claimed nor handed to a worker
        self._small_size = 0  # their bytes
        # Batches handed to workers, in order: the Future of each one's result, and what settles it.
        self._pending: collections.deque[tuple[Callable[[list], None], Future[list]]] = collections.deque()

    def __enter__(self) -> "Chunker":
        return self

    def __exit__(self, *exc) -> None:
        for _settle, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def add_file(self, node: Node) -> None:
        """Read ``node``'s content now and name or queue its pieces; ``node.chunks`` is complete after
        ``finish``."""
        stats = self.stats
        size = node.size
        stats.files += 1
        stats.bytes += size
        if stats.bytes > self._total:
            self._total = stats.bytes
        if self._known is not None:
            reused = _known_digests(node, self._known, self._index, self.chunk_size)
            if reused is not None:
                stats.reused_files += 1
                stats.reused_bytes += size
                node.chunks = reused
                for number, digest in enumerate(reused):
                    self._settle(_piece_length(size, number, self.chunk_size), digest, None)
                return
        if 0 < size < self._inline_below:
            self._add_small(node, size)
            return
        node.chunks = [None] * -(-size // self.chunk_size) if size else ()
        if size:
            if node.reader is None:
                raise InputError("regular file has no content reader", where=node.source)
            pieces = iter(node.reader(self.chunk_size))
            try:
                self._read(node, pieces)
            finally:
                close = getattr(pieces, "close", None)  # a generator: let it close its file now
                if close is not None:
                    close()

    def _add_small(self, node: Node, size: int) -> None:
        """add_file for a file of one piece under INLINE_BYTES: read, hashed and named here, at once (most
        files of a tree are such files, so this is ``_read`` without its loop and batches); its chunk waits
        in ``_small`` to be claimed and, if new, compressed by a worker with the rest of its batch."""
        reader = node.reader
        if reader is None:
            raise InputError("regular file has no content reader", where=node.source)
        pieces = reader(self.chunk_size)
        if type(pieces) is tuple and len(pieces) == 1 and pieces[0] is not None:  # read whole (ChunkReader)
            piece = pieces[0]
        else:
            piece = _only_piece(node, iter(pieces))
        if piece is None:  # a hole the reader found without reading
            digest = None
        elif len(piece) != size:
            raise InputError(f"chunk 0 is {len(piece)} bytes, expected {size}", where=node.source)
        elif not piece[0] and piece == bytes(size):  # all zeros (see _name)
            digest = None
        else:
            digest = sha256(piece)
        node.chunks = (digest,)  # a tuple: 24 bytes less than a list (most files of a large tree are these)
        if digest is None:
            self._settle(size, None, None)
            return
        self._small.append((digest, size, piece))
        self._small_size += size
        if self._small_size >= CLAIMED_BATCH_BYTES:
            self._submit_small()

    def _read(self, node: Node, pieces: Iterator[bytes | None]) -> None:
        """Take a file's pieces from its reader, checking that they add up to exactly ``node.size`` bytes,
        and add each to the batch for a worker (a piece of a file under INLINE_BYTES is named at once)."""
        chunks, size, chunk_size = node.chunks, node.size, self.chunk_size
        inline = size < INLINE_BYTES
        for number in range(len(chunks)):
            piece = next(pieces, _END)
            length = _piece_length(size, number, chunk_size)
            if piece is None:  # a hole the reader found without reading: nothing to hash
                self._settle(length, None, None)
            elif piece is _END:
                raise InputError(f"content ends after {number} of {len(chunks)} chunks", where=node.source)
            elif len(piece) != length:
                raise InputError(f"chunk {number} is {len(piece)} bytes, expected {length}", where=node.source)
            elif inline:
                digest, stored = self._name(piece, length)
                chunks[number] = digest
                self._settle(length, digest, stored)
            else:
                self._batch.append((chunks, number, length, piece))
                self._batch_size += length
                if self._batch_size >= self._batch_bytes:
                    self._submit()
        if next(pieces, _END) is not _END:
            raise InputError(f"content runs past the file's size {size}", where=node.source)
        if inline:  # complete: a tuple is 24 bytes less than a list (most files of a large tree are small)
            node.chunks = tuple(chunks)

    def send(self) -> None:
        """Hand the pieces read so far to the workers now, without waiting for them (``finish`` waits)."""
        if self._batch:
            self._submit()
        if self._small:
            self._submit_small()

    def finish(self) -> ChunkStats:
        """Wait for every queued piece; the caller then flushes the uploader."""
        self.send()
        while self._pending:
            self._settle_oldest()
        return self.stats

    def _name(self, piece: bytes, length: int) -> _Named:
        """Name one piece of ``length`` bytes, and compress and upload it if nobody has it yet (any thread)."""
        # A piece that starts with a non-zero byte is not all zeros: no zero buffer to compare with.
        if not piece[0] and piece == (self._zeros if length == self.chunk_size else bytes(length)):
            return None, None
        digest = sha256(piece)
        if not self._uploader.claim(digest):  # stored already, or another piece of this build has it
            return digest, None
        frame = compress.compress(piece)
        self._uploader.add_claimed(digest, length, frame)
        return digest, len(frame)

    def _name_batch(self, batch: list[_Slot]) -> list[_Named]:
        """In a worker: name every piece of a batch."""
        name = self._name
        return [name(piece, length) for _chunks, _number, length, piece in batch]

    def _submit(self) -> None:
        batch, self._batch, self._batch_size = self._batch, [], 0
        self._queue(functools.partial(self._settle_named, batch), self._name_batch, batch)

    def _submit_small(self) -> None:
        """Claim the small files' chunks named since the last call, under one lock, count them, and hand the
        new ones to a worker to compress (their compressed sizes are counted when the batch is settled)."""
        small, small_bytes = self._small, self._small_size
        self._small, self._small_size = [], 0
        claimed = list(itertools.compress(small, self._uploader.claim_many([digest for digest, _, _ in small])))
        stats = self.stats
        new_bytes = sum(length for _digest, length, _piece in claimed)
        stats.chunks += len(small)
        stats.new_chunks += len(claimed)
        stats.new_bytes += new_bytes
        stats.dedup_bytes += small_bytes - new_bytes
        if self._progress is not None:
            self._done += small_bytes
            self._progress(self._done, self._total)
        if claimed:
            self._queue(functools.partial(self._settle_compressed, claimed), compress.compress_many,
                        [piece for _digest, _length, piece in claimed])

    def _queue(self, settle: Callable[[list], None], work: Callable[[list], list], batch: list) -> None:
        """Hand ``work(batch)`` to a worker, to be settled in order by ``settle(its result)``."""
        while len(self._pending) >= self._max_batches:
            self._settle_oldest()
        self._pending.append((settle, self._pool.submit(work, batch)))

    def _settle_oldest(self) -> None:
        settle, future = self._pending.popleft()
        settle(future.result())

    def _settle_named(self, batch: list[_Slot], named: list[_Named]) -> None:
        for (chunks, number, length, _piece), (digest, stored) in zip(batch, named):
            chunks[number] = digest
            self._settle(length, digest, stored)

    def _settle_compressed(self, claimed: list[_SmallChunk], frames: Sequence[bytes]) -> None:
        """Queue a batch of small files' new chunks for upload, now compressed; count what they store."""
        frames = compress.frames_of(frames)  # here: see compress_many
        self._uploader.add_claimed_many((digest, length, frame)
                                        for (digest, length, _piece), frame in zip(claimed, frames))
        self.stats.stored_bytes += sum(map(len, frames))

    def _settle(self, length: int, digest: bytes | None, stored: int | None) -> None:
        """Count one named piece in the statistics (its digest is already in its chunk list)."""
        stats = self.stats
        stats.chunks += 1
        if digest is None:
            stats.hole_chunks += 1
        elif stored is None:
            stats.dedup_bytes += length
        else:
            stats.new_chunks += 1
            stats.new_bytes += length
            stats.stored_bytes += stored
        if self._progress is not None:
            self._done += length
            self._progress(self._done, self._total)


def chunk_tree(
    tree: Tree,
    uploader: ChunkUploader,
    index: ChunkIndex,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int | None = None,
    progress: Progress | None = None,
    known: KnownChunks | None = None,
) -> tuple[BlobMap, ChunkStats]:
    """Fill ``node.chunks`` of every regular file of a finished tree, upload new chunks, and return the blob
    map and statistics: ``chunk_files`` on the tree's ``regular_files``, then ``blob_map_of`` them.

    The caller flushes the uploader afterwards. Errors of readers (InputError naming the file) and of the
    uploader propagate; chunks already queued are then simply never referenced.
    """
    files = regular_files(tree)
    stats = chunk_files(files, uploader, index, chunk_size=chunk_size, workers=workers, progress=progress,
                        known=known)
    blob_map = blob_map_of(files, chunk_size)
    stats.distinct_chunks = len(blob_map)
    return blob_map, stats


def chunk_files(
    files: list[Node],
    uploader: ChunkUploader,
    index: ChunkIndex,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int | None = None,
    progress: Progress | None = None,
    known: KnownChunks | None = None,
) -> ChunkStats:
    """Fill ``node.chunks`` of each regular file of ``files`` (distinct nodes) and upload new chunks;
    ``stats.distinct_chunks`` is left to whoever lays out the blob map.

    ``known`` lets a file go unread: its chunk list is used if it has the file's chunk count and ``index``
    holds every chunk of it (else the file is read), and its chunks take their places in the blob map
    exactly as if the file had been read.
    """
    with Chunker(uploader, index, chunk_size=chunk_size, workers=workers, progress=progress, known=known,
                 total_bytes=sum(node.size for node in files)) as chunker:
        for node in files:
            chunker.add_file(node)
        return chunker.finish()


def blob_map_for(tree: Tree, chunk_size: int) -> BlobMap:
    """The virtual blob of a chunked tree: its distinct non-hole chunks, in tree order, then file order."""
    return blob_map_of(regular_files(tree), chunk_size)


def blob_map_of(files: list[Node], chunk_size: int) -> BlobMap:
    """The virtual blob of chunked regular files (``regular_files`` of a tree, in that order)."""
    blob_map = BlobMap(chunk_size)
    add = blob_map.add
    for node in files:
        if node.chunks is None:
            raise InputError("regular file was never chunked", where=node.source)
        for number, digest in enumerate(node.chunks):
            if digest is not None:
                add(digest, _piece_length(node.size, number, chunk_size))
    return blob_map


def regular_files(tree: Tree) -> list[Node]:
    """Regular-file nodes in tree order, each once even when hard-linked."""
    tree.finish()  # counts names: only a node with several can come again, so only those are remembered
    seen: set[int] = set()
    files = []
    for _path, node in tree.walk():
        if node.is_reg and (node.nlink < 2 or id(node) not in seen):
            if node.nlink > 1:
                seen.add(id(node))
            files.append(node)
    return files


def _only_piece(node: Node, pieces: Iterator[bytes | None]) -> bytes | None:
    """The one piece a reader gives for a file of one piece (None: a hole), then closes it; InputError if
    it gives none or more."""
    try:
        piece = next(pieces, _END)
        if piece is _END:
            raise InputError("content ends after 0 of 1 chunks", where=node.source)
        if next(pieces, _END) is not _END:
            raise InputError(f"content runs past the file's size {node.size}", where=node.source)
        return piece
    finally:
        close = getattr(pieces, "close", None)  # a generator: let it close its file now
        if close is not None:
            close()


def _piece_length(size: int, number: int, chunk_size: int) -> int:
    """Bytes in piece ``number`` of a file of ``size`` bytes. The length of a file's only piece is its very
    size object: the lengths the blob map and the packs keep are then no extra objects for small files."""
    return size if number == 0 and size <= chunk_size else min(chunk_size, size - number * chunk_size)


def _known_digests(node: Node, known: KnownChunks | None, index: ChunkIndex,
                   chunk_size: int) -> tuple[bytes | None, ...] | None:
    """The chunk list ``known`` gives for a file, if it fits the file and the store holds every chunk of
    it (a chunk gc removed since means the file is read)."""
    digests = known(node) if known is not None else None
    if digests is None or len(digests) != -(-node.size // chunk_size):
        return None
    if any(digest is not None and digest not in index for digest in digests):
        return None
    return tuple(digests)
