"""Bytes a build makes too big to keep in its memory: written once into an unnamed temporary file, then
read back in pieces (hashed, compressed) without ever being whole in memory.

A layer's meta.erofs of 1,000,000 inodes is ~96 MB: held as a bytearray, it was the largest single
part of the build's peak, and publishing it (hash, compress) needed nothing but a pass over it. A
``SpillFile`` is that image in the page cache instead, where the kernel may write it out or keep it,
without it counting as the process's memory. The writer fills it through ``mapped()`` (an mmap, as
writable as the bytearray was) and hands back the pages it is done with (``release``): dirty pages of a
shared file mapping stay in the page cache when dropped from the process. Reading goes through
``pread`` into one buffer, never through the mapping, which would map every page back.

The file is made with ``tempfile.TemporaryFile`` (O_TMPFILE where the filesystem has it, else created
and unlinked at once): it has no name to leave behind, whatever happens, and its space is freed when
``close`` (or the end of a ``with``) closes it, or when the process dies. Its space is allocated when it
is made (posix_fallocate): a store through a mapping into a sparse file the filesystem has no room for
is a SIGBUS that kills the process, where a full $TMPDIR must be an error naming it.

Threads: one thread at a time per SpillFile.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Iterator

from . import compress
from .errors import UnavailableError

PIECE = 4 << 20  # bytes read back at a time


class SpillFile:
    """``size`` bytes (zeros until written) in an unnamed temporary file; a bytes-like to
    dsec_fs.layer.publish_layer, which hashes and compresses it a piece at a time."""

    def __init__(self, size: int, *, prefix: str = "dsecfs-spill-"):
        self.size = size
        self._file = tempfile.TemporaryFile(prefix=prefix)
        try:
            # Allocated, not only sized (see the module docstring: a full file system is ENOSPC here).
            if size:
                os.posix_fallocate(self._file.fileno(), 0, size)
        except OSError as exc:
            self._file.close()
            raise UnavailableError(f"no room for a temporary file of {size} bytes: {os.strerror(exc.errno or 0)}",
                                   where=tempfile.gettempdir(), transient=False) from None
        except BaseException:
            self._file.close()
            raise

    def __len__(self) -> int:
        return self.size

    def mapped(self) -> mmap.mmap:
        """A writable shared mapping of the whole file, for the caller to close."""
        return mmap.mmap(self._file.fileno(), self.size)

    @staticmethod
    def release(mapping: mmap.mmap, end: int) -> None:
        """Drop the mapping's pages before ``end`` (rounded down to a page) from the process's memory;
        what was written there stays in the file."""
        end -= end % mmap.PAGESIZE
        if end > 0:
            mapping.madvise(mmap.MADV_DONTNEED, 0, end)

    def pieces(self) -> Iterator[memoryview]:
        """The file's bytes in order, PIECE at a time: each view is valid until the next is asked for."""
        buffer = bytearray(min(PIECE, self.size))
        view = memoryview(buffer)
        offset = 0
        while offset < self.size:
            length = os.preadv(self._file.fileno(), [view[:min(PIECE, self.size - offset)]], offset)
            if length <= 0:
                raise OSError(f"temporary file ended at {offset} of {self.size} bytes")
            yield view[:length]
            offset += length

    def sha256(self) -> bytes:
        digest = hashlib.sha256()
        for piece in self.pieces():
            digest.update(piece)
        return digest.digest()

    def compress(self, level: int) -> bytearray:
        """One zstd frame of the whole file, its size in the header (see compress.compress_pieces)."""
        return compress.compress_pieces(self.pieces(), self.size, level)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "SpillFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
