"""A layer's virtual blob (EROFS device 1), read by byte range and made from chunks fetched by digest.

The blob is the layer's distinct chunks in blob-map order, each starting on a block boundary; the bytes
between a chunk's end and the next block boundary are zeros. Nothing stores the blob: ``read`` finds the
chunks a range covers in the blob map, fetches them all with one ``fetch_many`` (so neighbours in a pack
travel in one ranged GET), and cuts the range out, zero padding included. This is what the kernel-mode
FUSE blob file and the fuse-mode file reads call.

Readahead. An on-demand read may name ``readahead``: chunks it expects to be read next, which the
fetcher brings along only if the read misses and only within the GETs it makes for the miss (fetcher.py).
What to name is the caller's choice (miss_readahead.py: the rest of the file, a growing window while a
reader walks files in blob order). Prefetch reads name none.

Locations. The chunk index may be shared by every layer of a store (the daemon's), and in a shared store
one writer's index object may claim chunks of other layers in its own pack. A chunk is therefore read
from the packs this layer's manifest names first, and if a read fails verification (or its pack is
missing) from each other location the index knows, before the read fails: a forged index costs a
failed GET, never a read error of an intact layer, and never a wrong byte (every chunk is verified).
A location that failed where another worked is put last in the index (``ChunkIndex.demote``), so the
index's first answer, which prefetches use, is one that works.

Sizes. Only the blob map's length of a chunk (the layer's, verified through its manifest) is trusted:
anyone who writes the store can put a pack index that claims the chunk is a GiB, with a zstd frame that
declares as much, and zstd allocates what a frame declares before decompressing it (dsec_fs.compress).
So a location that claims another size than the blob map's is never read: ``location`` passes over it,
and ``_fetch_anywhere`` counts it as a failed location (a CorruptError naming its pack index and the
chunk) and tries the next. open_layer_blob refuses a layer whose own packs' first location for a chunk
claims another size.

Threads: a LayerBlob is used from the trio thread (its fetcher lives there). The blob map and the chunk
index it reads are safe to share.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from dsec_fs.chunks import ChunkIndex, ChunkLocation, location_of_size, size_claim_error
from dsec_fs.digest import to_hex
from dsec_fs.errors import CorruptError, DsecError, FormatError, InputError, NotFoundError
from dsec_fs.layer import LayerFiles
from dsec_fs.store import keys
from dsec_fs.blobmap import EncodedBlobMap

from .fetcher import ONDEMAND, ChunkFetcher, Priority


class BlobChunk(NamedTuple):
    """A chunk whose bytes a blob range covers."""

    entry: int  # its number in the blob map
    digest: bytes
    start: int  # byte offset of its first byte in the blob (its blkaddr times the block size)
    length: int  # bytes of chunk data; zeros follow up to the next block boundary


class LayerBlob:
    """The virtual blob of one layer; ``chunk_index`` must locate every chunk of ``blob_map``."""

    def __init__(self, blob_map: EncodedBlobMap, chunk_index: ChunkIndex, fetcher: ChunkFetcher, *, label: str = "",
                 packs: Iterable[str] = ()):
        self.blob_map = blob_map
        self.chunk_index = chunk_index
        self.packs = frozenset(packs)  # the layer's own packs (its manifest's): their locations go first
        self.fetcher = fetcher
        self.label = label
        self.size = blob_map.blocks * blob_map.block_size

    def chunks_for_range(self, offset: int, length: int) -> list[BlobChunk]:
        """The chunks whose data overlaps [offset, offset + length), in blob order. A range that falls
        only in padding or past the end of the blob needs none."""
        _check_range(offset, length)
        entry, block_size = self.blob_map.entry, self.blob_map.block_size
        chunks = []
        for number in self.blob_map.entries_in(offset, offset + length):
            blkaddr, digest, chunk_length = entry(number)
            chunks.append(BlobChunk(number, digest, blkaddr * block_size, chunk_length))
        return chunks

    async def read(self, offset: int, length: int, *, priority: Priority = ONDEMAND,
                   readahead: list[tuple[bytes, ChunkLocation]] = ()) -> bytes:
        """Bytes [offset, offset + length) of the blob, shorter when the range runs past its end (empty at
        or beyond the end), as read(2) answers; ``readahead``: see the module docstring."""
        chunks = self.chunks_for_range(offset, length)
        end = min(offset + length, self.size)
        if offset >= end:
            return b""
        try:
            fetched = await self.fetcher.fetch_many(
                [(chunk.digest, self.location(chunk.entry, chunk.digest)) for chunk in chunks], priority=priority,
                label=self.label, readahead=readahead if priority == ONDEMAND else ())
        except (CorruptError, NotFoundError):
            fetched = {chunk.digest: await self._fetch_anywhere(chunk, priority) for chunk in chunks}
        for chunk in chunks:
            got = len(fetched[chunk.digest])
            if got != chunk.length:
                raise CorruptError(f"{got} bytes, the blob map says {chunk.length}",
                                   where=f"chunk {to_hex(chunk.digest)}")
        if len(chunks) == 1 and chunks[0].start <= offset and end <= chunks[0].start + chunks[0].length:
            return fetched[chunks[0].digest][offset - chunks[0].start:end - chunks[0].start]  # most reads
        out = bytearray(end - offset)  # what no chunk covers is padding: zeros
        for chunk in chunks:
            low, high = max(offset, chunk.start), min(end, chunk.start + chunk.length)
            out[low - offset:high - offset] = fetched[chunk.digest][low - chunk.start:high - chunk.start]
        return bytes(out)

    def following(self, last: int, budget: int) -> list[tuple[bytes, ChunkLocation]]:
        """The chunks after blob-map entry ``last``, while their data fits in ``budget`` bytes."""
        ahead = []
        blob_map = self.blob_map
        for number, length, digest in zip(itertools.count(last + 1), blob_map.lengths[last + 1:],
                                          blob_map.digests(last + 1)):
            budget -= length
            if budget < 0:
                break
            ahead.append((digest, self.location(number, digest)))
        return ahead

    def location(self, entry: int, digest: bytes) -> ChunkLocation:
        """The location to read first: in one of the layer's own packs if any, and one that claims the
        chunk's size as the blob map gives it (see Sizes above)."""
        locations = self.chunk_index.locations(digest, self.packs)
        if not locations:
            raise NotFoundError("the chunk index does not locate this chunk of the blob",
                                where=f"chunk {to_hex(digest)} (blob entry {entry})")
        return location_of_size(locations, digest, self.blob_map.lengths[entry])

    async def _fetch_anywhere(self, chunk: BlobChunk, priority: Priority) -> bytes:
        """The chunk from the first of its locations whose read verifies (see Locations above); the last
        error if none does. One that was read already comes from the cache; one that claims another size
        than the blob map's is not read (see Sizes above)."""
        error: DsecError | None = None
        failed: list[ChunkLocation] = []
        for location in self.chunk_index.locations(chunk.digest, self.packs):
            if location.ulen != chunk.length:
                error = size_claim_error(location, chunk.digest, chunk.length)
                failed.append(location)
                continue
            try:
                data = (await self.fetcher.fetch_many([(chunk.digest, location)], priority=priority,
                                                      label=self.label))[chunk.digest]
            except (CorruptError, NotFoundError) as exc:
                error = exc
                failed.append(location)
                continue
            for bad in failed:  # so that the index's first answer (prefetches, other layers) is one that works
                self.chunk_index.demote(chunk.digest, bad)
            return data
        assert error is not None  # read() located every chunk it asks for (location)
        raise error


async def open_layer_blob(layer: LayerFiles, fetcher: ChunkFetcher, *, chunk_index: ChunkIndex | None = None,
                          label: str | None = None) -> LayerBlob:
    """The blob of an opened layer (dsec_fs.layer.open_layer). Reads the index objects of the layer's packs
    into ``chunk_index`` (a new one by default; pass the daemon's shared one) unless it already locates
    every chunk, and checks that each chunk is located with the length the blob map gives it.
    ``label`` (the FetchStats label) defaults to the layer digest."""
    source = keys.layer_blobmap(layer.digest)
    blob_map = EncodedBlobMap(layer.blobmap, source=source)
    manifest = layer.manifest
    if (blob_map.blocks, blob_map.block_size) != (manifest.blob_blocks, manifest.block_size):
        raise FormatError("blob map header", None,
                          f"{blob_map.blocks} blocks of {blob_map.block_size} bytes, the manifest says "
                          f"{manifest.blob_blocks} of {manifest.block_size}", source=source)
    chunk_index = ChunkIndex() if chunk_index is None else chunk_index
    if not chunk_index.has_packs(manifest.packs):
        await fetcher.call_store(f"pack indexes of layer {layer.digest}", chunk_index.load_packs, fetcher.store,
                                 manifest.packs)
    packs = frozenset(manifest.packs)
    for number, (_blkaddr, digest, length) in enumerate(blob_map.entries):
        locations = chunk_index.locations(digest, packs)
        if not locations:
            raise NotFoundError("no pack of the layer holds this chunk",
                                where=f"chunk {to_hex(digest)} (blob entry {number} of layer {layer.digest})")
        location = locations[0]
        if location.ulen != length:
            raise FormatError(f"blob map entry {number}", None,
                              f"chunk {to_hex(digest)} is {length} bytes here, {location.ulen} in its pack",
                              source=source)
    return LayerBlob(blob_map, chunk_index, fetcher, label=layer.digest if label is None else label, packs=packs)


def _check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise InputError(f"negative range offset={offset} length={length}", where="blob read")
