"""Cut every regular file of a Tree into fixed-size chunks, name them, and upload the new ones.

For each regular-file Node (once, however many names it has) the chunker reads the file's pieces through
``Node.reader`` and fills ``node.chunks``: the sha256 of each piece, or None for a hole (a piece the
reader already knows is a hole, or one that is all zeros). Every distinct non-zero chunk gets its place
in the layer's BlobMap in build order (tree order, then file order), so the same tree always gives the
same blob. A chunk is compressed and handed to the ChunkUploader only the first time this build meets it
and only if the store's ChunkIndex does not already hold it.

Pipeline and threads:
- The calling (main) thread reads pieces, one file after another: sequential reads in chunk-size buffers.
- A ThreadPoolExecutor hashes, zero-checks, compresses and uploads; hashlib and zstandard release the GIL,
  so on two cores both stay busy.
- The main thread consumes results in submission order and alone touches the BlobMap, the nodes'
  chunk lists and the statistics, so those need no lock.
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


def chunk_tree(
    tree: Tree,
    uploader: ChunkUploader,
    index: ChunkIndex,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int | None = None,
    progress: Progress | None = None,
) -> tuple[BlobMap, ChunkStats]:
    """Fill ``node.chunks`` of every regular file, upload new chunks, and return the blob map and statistics.

    The caller flushes the uploader afterwards. Errors of readers (InputError naming the file) and of the
    uploader propagate; chunks already queued are then simply never referenced.
    """
    check_chunk_size(chunk_size)
    workers = max(1, workers or os.cpu_count() or 1)
    inflight = max(2, min(2 * workers, INFLIGHT_BYTES // chunk_size))
    files = _regular_files(tree)
    total = sum(node.size for node in files)

    blob_map = BlobMap(chunk_size)
    stats = ChunkStats(files=len(files), bytes=total)
    claims = _Claims()
    zeros = bytes(chunk_size)
    done = 0

    def process(piece: bytes) -> _Piece:
        if piece == (zeros if len(piece) == chunk_size else bytes(len(piece))):
            return _Piece(None, len(piece), None)
        digest = sha256(piece)
        if digest in index or not claims.first(digest):
            return _Piece(digest, len(piece), None)
        frame = compress.compress(piece)
        return _Piece(digest, len(piece), len(frame) if uploader.add(digest, len(piece), frame) else None)

    def consume(chunks: list[bytes | None], result: _Piece) -> None:
        nonlocal done
        chunks.append(result.digest)
        stats.chunks += 1
        if result.digest is None:
            stats.hole_chunks += 1
        else:
            blob_map.add(result.digest, result.length)
            if result.stored is None:
                stats.dedup_bytes += result.length
            else:
                stats.new_chunks += 1
                stats.new_bytes += result.length
                stats.stored_bytes += result.stored
        done += result.length
        if progress is not None:
            progress(done, total)

    # In submission order: the chunk list a piece belongs to, and its result (a Future while a worker has it).
    pending: collections.deque[tuple[list[bytes | None], Future[_Piece] | _Piece]] = collections.deque()

    def consume_oldest() -> None:
        chunks, result = pending.popleft()
        consume(chunks, result.result() if isinstance(result, Future) else result)

    with ThreadPoolExecutor(max_workers=min(workers, inflight), thread_name_prefix="chunker") as pool:
        try:
            for node in files:
                node.chunks = []
                with contextlib.closing(_pieces(node, chunk_size)) as pieces:
                    for length, piece in pieces:
                        if piece is None:  # a hole the reader found without reading: nothing to hash
                            pending.append((node.chunks, _Piece(None, length, None)))
                        else:
                            pending.append((node.chunks, pool.submit(process, piece)))
                        while len(pending) >= inflight:
                            consume_oldest()
            while pending:
                consume_oldest()
        finally:
            for _chunks, result in pending:
                if isinstance(result, Future):
                    result.cancel()

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
