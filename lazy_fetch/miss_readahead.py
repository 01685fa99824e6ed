"""What an on-demand read brings along when it misses: the rest of its file, and, while a reader walks
files stored one after another, a window of the files after it that grows as the walk goes on.

Why. With a store 20 ms away, a first start is its misses one after another: the kernel asks for a big
file a window at a time (or, for a library mapped into memory, a page fault at a time, all over the
file), and a reader importing a package opens its files one by one. Each is a round trip. Two patterns
cover most of them:

- **The rest of the file.** A read names the chunks of its file after it as readahead (at most
  FILE_BYTES): the file comes in the GETs its first miss makes anyway (its chunks lie side by side in its
  pack), and the reader's next reads of it hit the cache.
- **A walk in blob order.** The build lays a directory's files out one after another in the blob. When a
  read starts a new file right where the previous file read ended (within WALK_GAP entries), the reader
  is walking: the window of chunks named after the file doubles with each new file, from WINDOW_START up
  to the daemon's ``--miss-readahead`` (default 4 MiB), as the kernel's readahead grows on a sequential
  file, and holds while the reader stays in the file; a read of a file elsewhere sets it back to nothing.
  A reader of one file never walks, so reading one file fetches that file's chunks only.

The fetcher fetches readahead only when a wanted chunk missed and only within the runs it reads for
the miss (fetcher.py): it costs link bytes, never a round trip. A walk whose reads hit (the window came
with an earlier miss) has the rest of its window fetched in the background at prefetch priority
(``window_to_warm``), so the walk does not stop at the window's end. The map of which chunks belong to which
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
        self._window = 0
        self._window_entries: list[int] = []  # the window the latest read named
        self._warmed_to = -1  # the last entry a walk's window was warmed up to
        self._last_file = -1
        self._last_end = -1  # the last blob entry of the latest read

    def ready(self, files: FileChunks) -> None:
        self.files = files

    def plan(self, chunks: list[BlobChunk]) -> list[tuple[bytes, ChunkLocation]]:
        """Named on every read (the fetcher looks at it only if the read misses): the file's chunks after
        this read, and while walking, the window after the file."""
        files = self.files
        if files is None or not chunks:
            return []
        first, last = chunks[0].entry, chunks[-1].entry
        number = files.owner[first]
        if number != self._last_file:  # a new file: the next one in the blob, or a jump
            adjacent = number >= 0 and self._last_file >= 0 and 0 < first - self._last_end <= WALK_GAP
            self._window = min(max(2 * self._window, WINDOW_START), self.max_window) if adjacent else 0
            if not adjacent:
                self._warmed_to = -1
        self._last_file, self._last_end = number, last
        ahead: dict[int, None] = {}
        if number >= 0:
            own = files.files[number]
            self._take(ahead, own[own.index(last) + 1:] if last in own else own, FILE_BYTES)
        window: dict[int, None] = {}
        if number >= 0 and self._window:
            self._take(window, range(max(last, files.files[number][-1]) + 1, len(self.blob.blob_map.entries)),
                       self._window)
        self._window_entries = list(window)
        ahead.update(window)
        wanted = {chunk.entry for chunk in chunks}
        entries = self.blob.blob_map.entries
        return [(entries[entry][1], self.blob.location(entry, entries[entry][1])) for entry in ahead
                if entry not in wanted]

    def window_to_warm(self) -> list[tuple[bytes, ChunkLocation]]:
        """After a read that hit while walking: the part of its window no earlier call gave, to fetch in
        the background (the fetcher brings readahead only with a miss, and a walk whose window arrived
        reads hit after hit until it runs past it: as the kernel's async readahead, the next window is
        asked for before the reader gets there)."""
        entries = self.blob.blob_map.entries
        fresh = [entry for entry in self._window_entries if entry > self._warmed_to]
        if fresh:
            self._warmed_to = fresh[-1]
        return [(entries[entry][1], self.blob.location(entry, entries[entry][1])) for entry in fresh]

    def _take(self, ahead: dict[int, None], candidates, budget: int) -> None:
        entries = self.blob.blob_map.entries
        for entry in candidates:
            budget -= entries[entry][2]
            if budget < 0:
                return
            ahead[entry] = None
