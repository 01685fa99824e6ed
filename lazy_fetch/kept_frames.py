"""Checking the chunks a fill kept as fetched (cache.Frame: their packs' zstd frames, neither decompressed
nor checked against their digest; cache.py, "Frames") once someone wants their bytes: the fetcher calls
these from its flights (fetcher.py, "A fill's chunks as fetched").

- ``check_kept``: a Frame the cache (or a fill's flight that ended) holds: its chunk, or None after the
  frame is dropped from the cache and a warning names the chunk and the pack (the caller then reads the
  chunk from the store, as a miss).
- ``check_fetched``: the Frames a fill's store read brought that a reader joined while it was in the air:
  each its chunk, or the error that says it is not (delivered to the waiters as a store read's is;
  whatever decompressing raises, MemoryError for the size a forged pack index claims included, is that
  chunk's CorruptError: it escaped the flight and stopped the fetcher).

Both decompress a frame to exactly a size never more than a location gives, and check its sha256
(dsec_fs.chunks.decode_chunk): ``check_kept`` the reader's (the blob map's: a frame kept of another size
is refused unread), ``check_fetched`` the fill's read's, which a forged pack index may have made large
(its allocation fails, at worst, as the fill's own decompression did before it kept frames).

Threads: plain functions for worker threads (they decompress and hash, and ``check_kept`` writes the
cache's index); nothing here is shared.
"""

from __future__ import annotations

import logging

from dsec_fs.chunks import ChunkLocation, decode_chunk
from dsec_fs.digest import to_hex
from dsec_fs.errors import CorruptError, DsecError
from dsec_fs.store import keys

from .cache import ChunkCache, Frame

log = logging.getLogger(__name__)


def check_kept(cache: ChunkCache, digest: bytes, location: ChunkLocation, frame: Frame) -> bytes | None:
    """The chunk a fill kept as ``frame``, decompressed within ``location.ulen`` and checked against
    ``digest``; None when it is not that chunk (a store writer that lied to the fill, or bytes changed
    before they were kept), once its entry is dropped and a warning logged."""
    key = keys.pack(frame.pack_id)
    try:
        if frame.plain_size != location.ulen:
            raise CorruptError(f"kept as a frame of {frame.plain_size} bytes, the blob map says {location.ulen}",
                               where=f"chunk {to_hex(digest)} in {key}")
        return decode_chunk(frame.frame, digest, location.ulen, key)
    except Exception as exc:  # whatever the frame makes zstd or the check raise: that frame is not the chunk
        log.warning("chunk cache: the frame a fill kept of chunk %s from %s is not that chunk (%s); dropped, "
                    "reading the store", to_hex(digest), key, exc)
    try:
        cache.drop_frame(digest)
    except (DsecError, OSError) as exc:
        log.warning("chunk cache: dropping the frame of chunk %s failed: %s", to_hex(digest), exc)
    return None


def check_fetched(wanted: list[tuple[bytes, ChunkLocation]], frames: dict[bytes, Frame]) -> dict[bytes, bytes | CorruptError]:
    """Each of ``wanted`` (digest, the location the fill read it from) whose Frame is in ``frames``: its
    chunk, or the CorruptError (IntegrityError) saying the frame is not it."""
    checked: dict[bytes, bytes | CorruptError] = {}
    for digest, location in wanted:
        key = keys.pack(location.pack_id)
        try:
            checked[digest] = decode_chunk(frames[digest].frame, digest, location.ulen, key)
        except CorruptError as exc:
            checked[digest] = exc
        except Exception as exc:  # whatever else zstd raises (MemoryError for a forged claim): not the chunk
            checked[digest] = CorruptError(f"the frame kept of the chunk cannot be checked: {exc!r}",
                                           where=f"chunk {to_hex(digest)} in {key}")
    return checked
