"""What an on-demand read brings along when it misses: the rest of its file, and, while a reader walks
files stored one after another, a window of the files after it that grows as the walk goes on.

Why. With a store 20 ms away, a first start is its misses one after another: the kernel asks for a big
file a window at a time (or, for a library mapped into memory, a page fault at a time, all over the
file), and a reader importing a package opens its files one by one. Each is a round trip. Two patterns
cover most of them:

- **The rest of the file.** The first read of a file names every other chunk of it as readahead (at most
  FILE_BYTES): the whole file comes in the GETs the miss makes anyway (its chunks lie side by side in its
  pack), and the reader's next reads of it, in order or not, hit the cache.
- **A walk in blob order.** The build lays a directory's files out one after another in the blob. When a
  read starts a new file right where the previous file read ended (within WALK_GAP entries), the reader
  is walking: the window of chunks named after the new file doubles, from WINDOW_START up to the
  daemon's ``--miss-readahead`` (default 4 MiB), as the kernel's readahead grows on a sequential file;
  any read elsewhere sets it back to nothing. A reader of one file never triggers it, so reading one file
  fetches that file's chunks only.

The fetcher fetches readahead only when a wanted chunk missed and only within the runs it reads for
the miss (fetcher.py): it costs link bytes, never a round trip. The map of which chunks belong to which
file comes from the layer's image (``FileChunks.of``, about 0.3 s for 8,000 files, so it is built in a
worker thread once the layer is mounted; reads before it is ready get no readahead).

Threads: ``FileChunks.of`` blocks (a worker thread); ``MissReadahead`` belongs to the daemon's trio thread.
"""

from __future__ import annotations

from array import array

from dsec_fs.chunks import ChunkLocation

from .analysis import LayerIndex
from .blob_reader import BlobChunk, LayerBlob

FILE_BYTES = 16 << 20  # readahead of a file's own chunks on its first read
WINDOW_START = 256 << 10
DEFAULT_WINDOW = 4 << 20
WALK_GAP = 2  # blob entries between one file's last read chunk and the next file's first: still a walk


class FileChunks:
    """For each blob-map entry, the file it belongs to (its first holder in the image's walk order), and
    each file's chunks in file order."""

    def __init__(self, owner: array, files: list[tuple[int, ...]]):
        self.owner = owner  # entry -> file number, -1 for none
        self.files = files  # file number -> its blob entries, in file order, no holes, no repeats

    @classmethod
    def of(cls, index: LayerIndex) -> FileChunks:
        owner = array("i", [-1]) * len(index.blob_map.entries)
        files: list[tuple[int, ...]] = []
        for file in index.files.values():
            entries = tuple(dict.fromkeys(entry for entry in file.chunks if entry is not None))
            if not entries:
                continue
            number = len(files)
            files.append(entries)
            for entry in entries:
                if owner[entry] < 0:
                    owner[entry] = number
        return cls(owner, files)


class MissReadahead:
    """The readahead to name for each on-demand read of one layer's blob (see the module docstring)."""

    def __init__(self, blob: LayerBlob, max_window: int):
        self.blob = blob
        self.max_window = max_window
        self.files: FileChunks | None = None  # set once built
        self._read_files = bytearray()
        self._window = 0
        self._last_file = -1
        self._last_end = -1  # the last blob entry of the latest read

    def ready(self, files: FileChunks) -> None:
        self.files = files
        self._read_files = bytearray(len(files.files))

    def plan(self, chunks: list[BlobChunk]) -> list[tuple[bytes, ChunkLocation]]:
        files = self.files
        if files is None or not chunks:
            return []
        first, last = chunks[0].entry, chunks[-1].entry
        number = files.owner[first]
        ahead: dict[int, None] = {}
        if number >= 0 and not self._read_files[number]:
            self._read_files[number] = 1
            self._take(ahead, files.files[number], FILE_BYTES)
        walking = (number >= 0 and self._last_file >= 0 and number != self._last_file
                   and 0 < first - self._last_end <= WALK_GAP)
        if walking:
            self._window = min(max(2 * self._window, WINDOW_START), self.max_window)
            end = max(last, files.files[number][-1])
            self._take(ahead, range(end + 1, len(self.blob.blob_map.entries)), self._window)
        elif number != self._last_file:
            self._window = 0
        self._last_file, self._last_end = number, last
        wanted = {chunk.entry for chunk in chunks}
        entries = self.blob.blob_map.entries
        return [(entries[entry][1], self.blob.location(entry, entries[entry][1])) for entry in ahead
                if entry not in wanted]

    def _take(self, ahead: dict[int, None], candidates, budget: int) -> None:
        entries = self.blob.blob_map.entries
        for entry in candidates:
            budget -= entries[entry][2]
            if budget < 0:
                return
            ahead[entry] = None
