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
- A ThreadPoolExecutor hashes, zero-checks, compresses and uploads; hashlib and zstandard release the GIL,
  so on two cores both stay busy.
- The main thread consumes results in submission order and alone touches the nodes' chunk lists and the
  statistics, so those need no lock; the BlobMap is laid out from the final tree afterwards.
- ``_Claims`` is the only state the workers share: ``_lock`` guards the set of digests some worker has
  already taken on, so two workers that meet the same new chunk do not both compress it.
- At most ``inflight`` pieces (about 2 per worker, capped by INFLIGHT_BYTES) are read and not yet
  consumed, so memory does not grow with the amount of data (only the Tree grows, with the entries).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from dsec_fs import compress
from dsec_fs.chunks import ChunkIndex, ChunkUploader
from dsec_fs.digest import sha256
from dsec_fs.errors import InputError

from .blobmap import BlobMap, check_chunk_size
from .tree import Node, Tree

DEFAULT_CHUNK_SIZE = 1 << 20
# Read-ahead beyond two pieces per worker adds memory, not speed; with large chunks fewer pieces fit.
INFLIGHT_BYTES = 64 << 20
_END = object()  # sentinel for next(): the reader has no more pieces

# Called with (bytes of file content chunked so far, bytes of file content in the tree).
Progress = Callable[[int, int], None]
# Incremental builds (incremental.py): the chunk digests a regular file is known to have (None for a
# hole) without reading it, or None when it must be read.
KnownChunks = Callable[[Node], "list[bytes | None] | None"]


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


@dataclass(slots=True)
class _Piece:
    """What a worker found out about one piece."""

    digest: bytes | None  # None: all zeros
    length: int
    stored: int | None  # compressed size when this piece uploaded a new chunk, else None


class _Claims:
    """Digests of new chunks that some worker of this build has taken on (to compress and upload)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()

    def first(self, digest: bytes) -> bool:
        """True exactly once per digest: the caller is the one to handle it."""
        with self._lock:
            if digest in self._seen:
                return False
            self._seen.add(digest)
            return True


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
        self._claims = _Claims()
        self._zeros = bytes(chunk_size)
        workers = max(1, workers or os.cpu_count() or 1)
        self._inflight = max(2, min(2 * workers, INFLIGHT_BYTES // chunk_size))
        self._pool = ThreadPoolExecutor(max_workers=min(workers, self._inflight), thread_name_prefix="chunker")
        # In submission order: the chunk list a piece belongs to, and its result (a Future while a worker has it).
        self._pending: collections.deque[tuple[list[bytes | None], Future[_Piece] | _Piece]] = collections.deque()

    def __enter__(self) -> "Chunker":
        return self

    def __exit__(self, *exc) -> None:
        for _chunks, result in self._pending:
            if isinstance(result, Future):
                result.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def add_file(self, node: Node) -> None:
        """Read ``node``'s content now and queue its pieces; ``node.chunks`` is complete after ``finish``."""
        self.stats.files += 1
        self.stats.bytes += node.size
        self._total = max(self._total, self.stats.bytes)
        node.chunks = []
        reused = _known_pieces(node, self._known, self._index, self.chunk_size)
        if reused is not None:
            self.stats.reused_files += 1
            self.stats.reused_bytes += node.size
            for piece in reused:
                self._queue(node.chunks, piece)
            return
        with contextlib.closing(_pieces(node, self.chunk_size)) as pieces:
            for length, piece in pieces:
                if piece is None:  # a hole the reader found without reading: nothing to hash
                    self._queue(node.chunks, _Piece(None, length, None))
                else:
                    self._queue(node.chunks, self._pool.submit(self._process, piece))

    def finish(self) -> ChunkStats:
        """Wait for every queued piece; the caller then flushes the uploader."""
        while self._pending:
            self._consume_oldest()
        return self.stats

    def _process(self, piece: bytes) -> _Piece:
        """In a worker: name the piece, and compress and upload it if nobody has it yet."""
        if piece == (self._zeros if len(piece) == self.chunk_size else bytes(len(piece))):
            return _Piece(None, len(piece), None)
        digest = sha256(piece)
        if digest in self._index or not self._claims.first(digest):
            return _Piece(digest, len(piece), None)
        frame = compress.compress(piece)
        return _Piece(digest, len(piece), len(frame) if self._uploader.add(digest, len(piece), frame) else None)

    def _queue(self, chunks: list[bytes | None], result: Future[_Piece] | _Piece) -> None:
        self._pending.append((chunks, result))
        while len(self._pending) >= self._inflight:
            self._consume_oldest()

    def _consume_oldest(self) -> None:
        chunks, result = self._pending.popleft()
        piece = result.result() if isinstance(result, Future) else result
        stats = self.stats
        chunks.append(piece.digest)
        stats.chunks += 1
        if piece.digest is None:
            stats.hole_chunks += 1
        elif piece.stored is None:
            stats.dedup_bytes += piece.length
        else:
            stats.new_chunks += 1
            stats.new_bytes += piece.length
            stats.stored_bytes += piece.stored
        self._done += piece.length
        if self._progress is not None:
            self._progress(self._done, self._total)


def blob_map_for(tree: Tree, chunk_size: int) -> BlobMap:
    """The virtual blob of a chunked tree: its distinct non-hole chunks, in tree order, then file order."""
    blob_map = BlobMap(chunk_size)
    for node in _regular_files(tree):
        if node.chunks is None:
            raise InputError("regular file was never chunked", where=node.source)
        for number, digest in enumerate(node.chunks):
            if digest is not None:
                blob_map.add(digest, min(chunk_size, node.size - number * chunk_size))
    return blob_map


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
    map and statistics.

    The caller flushes the uploader afterwards. Errors of readers (InputError naming the file) and of the
    uploader propagate; chunks already queued are then simply never referenced.

    ``known`` lets a file go unread: its chunk list is used if it has the file's chunk count and ``index``
    holds every chunk of it (else the file is read), and its chunks take their places in the blob map
    exactly as if the file had been read.
    """
    files = _regular_files(tree)
    with Chunker(uploader, index, chunk_size=chunk_size, workers=workers, progress=progress, known=known,
                 total_bytes=sum(node.size for node in files)) as chunker:
        for node in files:
            chunker.add_file(node)
        stats = chunker.finish()
    blob_map = blob_map_for(tree, chunk_size)
    stats.distinct_chunks = len(blob_map)
    return blob_map, stats


def _regular_files(tree: Tree) -> list[Node]:
    """Regular-file nodes in tree order, each once even when hard-linked."""
    seen: set[int] = set()
    files = []
    for _path, node in tree.walk():
        if node.is_reg and id(node) not in seen:
            seen.add(id(node))
            files.append(node)
    return files


def _known_pieces(node: Node, known: KnownChunks | None, index: ChunkIndex, chunk_size: int) -> list[_Piece] | None:
    """The pieces of a file whose chunk list ``known`` gives, if that list fits the file and the store
    holds every chunk of it (a chunk gc removed since means the file is read)."""
    digests = known(node) if known is not None else None
    if digests is None or len(digests) != -(-node.size // chunk_size):
        return None
    if any(digest is not None and digest not in index for digest in digests):
        return None
    return [_Piece(digest, min(chunk_size, node.size - k * chunk_size), None) for k, digest in enumerate(digests)]


def _pieces(node: Node, chunk_size: int) -> Iterator[tuple[int, bytes | None]]:
    """(length, piece) for each chunk of the node, checking that the reader gives exactly ``node.size`` bytes."""
    if node.size == 0:
        return
    if node.reader is None:
        raise InputError("regular file has no content reader", where=node.source)
    count = -(-node.size // chunk_size)
    pieces = node.reader(chunk_size)
    for number in range(count):
        piece = next(pieces, _END)
        if piece is _END:
            raise InputError(f"content ends after {number} of {count} chunks", where=node.source)
        length = min(chunk_size, node.size - number * chunk_size)
        if piece is not None and len(piece) != length:
            raise InputError(f"chunk {number} is {len(piece)} bytes, expected {length}", where=node.source)
        yield length, piece
    if next(pieces, _END) is not _END:
        raise InputError(f"content runs past the file's size {node.size}", where=node.source)
