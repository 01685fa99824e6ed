"""The blob map of a fresh build, laid out once from the chunked files and held packed.

A build needs three things of its blob map (dsec_fs.blobmap has the format): its encoding (published,
and hashed into the blob id), each chunk index's block on the blob (for meta.erofs), and which entries
more than one chunk index names (the build info's shared chunks, incremental.py). ``lay_out_blob``
makes all three in one pass over the files in blob order, and nothing per chunk outlives it but the
encoding (40 bytes an entry) and the files' block addresses: each file's chunk list of digests is
replaced by the tuple of its chunks' blkaddrs (None for a hole), which is what the writer asks for
(``BlobLayout.blkaddrs``); a walked small file keeps its one blkaddr in its directory's column instead
of a tuple and an int (walk_dir.WalkedFile.chunks: 80 bytes a file at the writer's peak). A ``BlobMap`` per build held a tuple, an int, a dict entry and two list slots
per chunk besides the digests, all alive while meta.erofs was written: the peak of a build of many small
files (~200 bytes a chunk at 1,000,000 files; the digests, ~80 bytes each, are freed here too).

The layout is the one ``BlobMap.add`` gives in the same order (chunker.blob_map_of), byte for byte.

Threads: one thread (the build's) calls everything here.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from dsec_fs.blobmap import ENTRY, HEADER, check_chunk_size, chunk_end, header
from dsec_fs.errors import InputError

from .tree import Node


class BlobLayout:
    """What a fresh build keeps of its blob map once ``lay_out_blob`` has placed every chunk."""

    def __init__(self, encoded: bytearray, count: int, blocks: int, shared: list[int]):
        self.encoded = encoded  # the blob map as published (dsec_fs.blobmap's format)
        self.count = count  # entries: the layer's distinct non-hole chunks
        self.blocks = blocks  # the blob's size in blocks
        self.shared = shared  # indexes of the entries named by more than one chunk index, ascending

    def __len__(self) -> int:
        return self.count

    @staticmethod
    def blkaddrs(chunks: tuple[int | None, ...]) -> tuple[int | None, ...]:
        """The blob blocks of a file's chunks: its chunk list as ``lay_out_blob`` left it (the writer asks
        a BlobMap the same thing with the file's digests)."""
        return chunks


def lay_out_blob(files: list[Node], chunk_size: int) -> BlobLayout:
    """The blob map of chunked regular files (chunker.regular_files of a tree, each file once, in that
    order); replaces each file's ``chunks`` (digests) with its chunks' blkaddrs."""
    chunk_bits = check_chunk_size(chunk_size)
    encoded = bytearray(HEADER.size)
    pack_entry = ENTRY.pack
    # digest -> its entry's blkaddr: the int object the chunk lists hold anyway, where an entry number
    # would be an object more per chunk (32 MB at 1,000,000); an entry's number, needed for the few
    # chunks named twice, is found from its blkaddr, as entries start in ascending blocks
    blkaddr_of: dict[bytes, int] = {}
    starts = array("I")  # blkaddr of each entry (chunk_end keeps them within 32 bits)
    shared = set()
    blocks = 0

    def place(digest: bytes, length: int) -> int:
        """The blkaddr of a chunk: where it already is, or a new entry at the end of the blob."""
        nonlocal blocks
        blkaddr = blkaddr_of.get(digest)
        if blkaddr is not None:
            shared.add(bisect_left(starts, blkaddr))
            return blkaddr
        blkaddr = blocks
        blocks = chunk_end(blkaddr, digest, length, chunk_size)
        blkaddr_of[digest] = blkaddr
        starts.append(blkaddr)
        encoded.extend(pack_entry(blkaddr, length, digest))
        return blkaddr

    for node in files:
        digests = node.chunks
        if digests is None:
            raise InputError("regular file was never chunked", where=node.source)
        if len(digests) == 1 and digests[0] is not None:  # the usual small file: no loop
            node.chunks = (place(digests[0], node.size),)
        else:
            size = node.size
            node.chunks = tuple(None if digest is None else place(digest, min(chunk_size, size - number * chunk_size))
                                for number, digest in enumerate(digests))
    encoded[:HEADER.size] = header(chunk_bits, len(starts), blocks)
    return BlobLayout(encoded, len(starts), blocks, sorted(shared))

