"""zstd compression of single chunks (and of a layer's metadata, each one frame too).

Each chunk is its own zstd frame with the content size recorded in the frame header, so any chunk can be
decompressed alone (a ranged GET of one frame is enough) and a decompression bomb is caught before any
memory is spent: we refuse a frame whose declared size differs from the size the index promised.

zstandard's compressor and decompressor objects are not thread-safe; each thread gets its own through
``threading.local``. Both release the GIL, so a pool of worker threads keeps every core busy;
``compress_many`` compresses a list of small chunks in one call that holds no GIL throughout, so a worker
thread compresses a batch of small files beside the thread that reads them (one GIL hand-over a batch,
not one a file).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import zstandard

from .errors import CorruptError

DEFAULT_LEVEL = 3
# The most a zstd frame can expand: its densest block is an RLE block, 4 bytes (3 of header, 1 of content)
# standing for at most 128 KiB. A frame declaring more than this many bytes per byte of its own is lying.
# zstandard allocates the declared size before decompressing, so this is checked first.
MAX_EXPANSION = (128 << 10) // 4

def frame_bound(size: int) -> int:
    """The longest frame zstd makes of ``size`` bytes (ZSTD_COMPRESSBOUND, headers included): an index
    that gives a chunk a longer frame is lying, and would have a reader fetch that many bytes for it."""
    return size + (size >> 8) + ((((128 << 10) - size) >> 11) if size < 128 << 10 else 0)


# Bytes a frame may leave allocated beyond its length rather than be copied (see compress).
PIN_SLACK = 1024

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    try:  # called once a chunk: the common case first
        return _local.compressors[level]
    except AttributeError:
        _local.compressors = {}
    except KeyError:
        pass
    comp = _local.compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                                write_checksum=False)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def compress(data: bytes | memoryview, level: int = DEFAULT_LEVEL) -> bytes:
    frame = _compressor(level).compress(data)
    # zstandard shrinks the result's length but not its allocation (ZSTD_compressBound of the input):
    # a 100-byte frame of a 1 MiB chunk would pin 1 MiB while it waits in a pack. Copy it to its size when
    # that frees something worth a copy: not for the frame of a small file that did not shrink, nor for a
    # frame about its input's size (a layer's blob map, of digests: a copy of its ~40 MB frame at 1,000,000
    # chunks only doubled it for a while).
    if len(data) - len(frame) > max(PIN_SLACK, len(frame) >> 3):
        return bytes(memoryview(frame))
    return frame


def compress_many(chunks: list[bytes], level: int = DEFAULT_LEVEL) -> Sequence[bytes]:
    """``compress`` of each of ``chunks`` (at least one), in one call into zstd (zstandard's
    multi_compress_to_buffer: the loop is C, the GIL released for all of it), for many small chunks.

    Returns a sequence of the frames as bytes-like objects, the same bytes as ``compress`` gives: the
    caller copies each to ``bytes`` in the thread that keeps them (``frames_of``). The frames share one
    buffer, allocated in the calling thread's C heap: a worker thread that made each frame its own bytes
    would leave those of a whole pack in flight in its own glibc arena, on top of the main one."""
    try:
        return _compressor(level).multi_compress_to_buffer(chunks, threads=0)
    except NotImplementedError:  # zstandard's CFFI backend lacks it
        return [compress(chunk, level) for chunk in chunks]


def frames_of(compressed: Sequence[bytes]) -> list[bytes]:
    """The frames of a ``compress_many`` result, each its own bytes."""
    return [bytes(compressed[number]) for number in range(len(compressed))]


def compress_pieces(pieces: Iterable[bytes | memoryview], size: int, level: int = DEFAULT_LEVEL) -> bytearray:
    """One frame of the ``size`` bytes that ``pieces`` yields in turn, its content size in the header, as
    ``compress`` writes it, for data that is never whole in memory (dsec_fs.spill). It decompresses to
    the same bytes; the frame itself may differ from ``compress``'s by a few bytes (zstd's streaming
    and one-shot paths match differently: a 1.2 MB frame of a 100,000-inode meta.erofs, 580 bytes)."""
    stream = _compressor(level).compressobj(size=size)
    frame = bytearray()
    for piece in pieces:
        frame += stream.compress(piece)
    frame += stream.flush()
    return frame  # not copied to bytes: at 1,000,000 inodes meta.erofs's frame is tens of MB


def decompress(frame: bytes | memoryview, expected_size: int, *, what: str) -> bytes:
    """Decompress one frame that must hold exactly ``expected_size`` bytes; ``what`` names it in errors."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"not a zstd frame: {exc}", where=what) from None
    if params.content_size != expected_size:
        raise CorruptError(
            f"zstd frame declares {params.content_size} bytes, index says {expected_size}", where=what
        )
    if expected_size > MAX_EXPANSION * len(frame):
        raise CorruptError(f"a zstd frame of {len(frame)} bytes cannot hold {expected_size} bytes", where=what)
    try:
        out = _decompressor().decompress(frame, max_output_size=expected_size)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"zstd frame does not decompress: {exc}", where=what) from None
    if len(out) != expected_size:
        raise CorruptError(f"zstd frame gave {len(out)} bytes, expected {expected_size}", where=what)
    return out
