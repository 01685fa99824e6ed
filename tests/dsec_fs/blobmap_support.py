"""The blob map as every reader held it before blobmap13 (a decoding into tuples, walked in Python): the
oracle the read form (dsec_fs.blobmap.EncodedBlobMap) is checked against, in tests/dsec_fs/test_blobmap.py
and tests/lazy_fetch/test_blob_reader.py."""

from __future__ import annotations

import bisect

from dsec_fs.blobmap import BLOCK_SIZE, ENTRY, HEADER


class TupleDecoding:
    """A blob map decoded as the readers held it before blobmap13: a list of (blkaddr, digest, length)
    and a list of blkaddrs, walked in Python; ValueError for what that decode refused (but a chunk twice)."""

    def __init__(self, data: bytes):
        magic, version, bits, chunkbits, reserved, count, self.blocks = HEADER.unpack_from(data, 0)
        if (magic, version, bits, reserved) != (b"DSECBMAP", 1, 12, 0) or not 12 <= chunkbits <= 24:
            raise ValueError("header")
        self.entries = [(b, d, n) for b, n, d in ENTRY.iter_unpack(data[HEADER.size:])]
        end = 0
        for blkaddr, _digest, length in self.entries:
            if blkaddr != end or not 1 <= length <= 1 << chunkbits:
                raise ValueError("not contiguous, or a length out of range")
            end += -(-length // BLOCK_SIZE)
        if end != self.blocks or count != len(self.entries):
            raise ValueError("header")
        self.starts = [blkaddr for blkaddr, _digest, _length in self.entries]

    def locate(self, blkaddr: int) -> int:
        return bisect.bisect_right(self.starts, blkaddr) - 1

    def entries_in(self, offset: int, end: int) -> list[int]:
        return [i for i, (blkaddr, _digest, length) in enumerate(self.entries)
                if offset < end and blkaddr * BLOCK_SIZE < end and offset < blkaddr * BLOCK_SIZE + length]
