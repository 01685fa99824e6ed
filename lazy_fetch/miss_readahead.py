"""What an on-demand read brings along when it misses: more of its file, a directory's small files, and,
while a reader walks files stored one after another, a window of the files after it. The windows over a
file and over a walk start small and grow only while the reader reads what they named, as the kernel's
readahead does.

Why. With a store 20 ms away, a first start is its misses one after another: the kernel asks for a big
file a window at a time (or, for a library mapped into memory, a page fault at a time, all over the
file), and a reader importing a package opens its files one by one. Each is a round trip. Three patterns
cover most of them:

- **More of the file, read in order.** A file's first read names the next FILE_START of its chunks after
  it as readahead: they come in the GETs its first miss makes anyway (a file's chunks lie side by side in
  its pack). A read that goes on where the file's previous read ended and reads a chunk so named doubles
  the file's window, up to FILE_BYTES, and the grown window is fetched in the background. A read of the
  file elsewhere (a page fault of a library mapped into memory, somewhere in the file) names none of it,
  and from then on the file's window no longer grows; nor does a shared object's (``*.so``, ``*.so.N``),
  whose loader maps it before its first fault. The kernel reads around each page fault, so a mapped
  library is read in order for a while at each fault, which a doubled window took for a reader going
  through the file (numpy's OpenBLAS library: 10.5 MB named and never read; docs/benchmarks.md, issue
  13, "bytes8").
- **A directory's small files.** Once a reader has read two files of one directory (an import of a
  package, a scan), a read names the directory's other files of at most SMALL_FILE_BYTES, nearest in the
  blob first, up to DIRECTORY_BYTES: the build lays them out side by side, so they come in the GETs of one
  miss. A reader of one file never gets them.
- **A walk in blob order.** The build lays a directory's files out one after another in the blob. When a
  read starts a new file right where the previous file read ended (within WALK_GAP entries), the reader
  is walking: the window of chunks named after the file doubles with each new file, from WINDOW_START up
  to the daemon's ``--miss-readahead`` (default 4 MiB) but never beyond twice the bytes the walk has read,
  and holds while the reader stays in the file; a read of a file elsewhere ends the walk. A walk ends
  with its last window unread, so a window that runs ahead of the walk is what a walk of small files
  wastes. A reader of one file never walks. Why 4 MiB, not more: with the window bound to twice the
  walk, no walk of a numpy, boto3 or sympy start got a window past 512 KiB, and 8 and 16 MiB fetched the
  same bytes with the same store requests behind both emulated stores, no faster (docs/benchmarks.md,
  issue 13, "The miss readahead's default").
  The window stays inside the directory of the file being read until the walk itself has gone on from
  one directory into the next (a tree walk: a copy, a scan): a walk inside one directory (an import
  reading a package's ``__pycache__``) then does not name what the build laid out after it, the
  package's sources and the next directories, which such a reader seldom reads. Measured (fill none, no
  profile): 3.0-5.9 MB less on numpy, boto3 and sympy, 8-18% fewer store requests, the round trips
  waited one after another behind a 20 ms store within four of before (docs/benchmarks.md, issue 13,
  "A walk's window stays in its directory").

Why windows that must be earned. Measured on a Debian + python3 base with numpy and pandas (``import
numpy, pandas``, fill none, no profile; docs/benchmarks.md, issue 13), the rest of a file up to 16 MiB on
every read brought 12 MB the command never read, most of it of the 25 MB OpenBLAS library, which the
loader maps and touches in a few places; in order only, 3 MB. A walk's window that doubled with each file
whatever their size ran megabytes ahead of walks of small files. A directory's small files named in
steps that must be read into (256 KiB, doubling) fetched 1.7-3 MB less on numpy, boto3 and sympy but made
15% more store requests on numpy (425 -> 490; the steps are warmed one GET each); riding along with the
misses instead, 2-4 MB less, but 4-17% more requests (boto3, sympy): more of a directory's files missed
one by one. So they come at once.

The fetcher fetches readahead only when a wanted chunk missed and only within the runs it reads for
the miss (fetcher.py): it costs link bytes, never a round trip. What a read names that no miss brought
(a walk's window while its reads hit, a grown file window, a directory's small files) is fetched in the
background at prefetch priority (``to_warm``), so the reader does not stop at the window's end. The map of which
chunks belong to which file is read from the records of the layer's meta.erofs (``FileChunks.of_image``
over erofs_builder/chunked_files.py; no LayerIndex, whose paths and per-chunk objects only profiles
and reports need): 40 ms of CPU for the Debian + python3 base's 8,315 files and 24 ms for numpy's
5,087, where the LayerIndex walk took 156 and 87 ms, so both maps of a numpy start are ready before
`up` returns (docs/benchmarks.md, issue 13, "ramap14"). It is
built in a worker thread once the layer is mounted, or, on a node that holds some of its chunks
already, at its first read that waits for the store (daemon_stores.py ``_map_files_soon``); reads before
it is ready get no readahead, and an image it refuses (a FormatError, logged) gets none at all.

Threads: ``FileChunks.of_image`` blocks (a worker thread); ``MissReadahead`` belongs to the daemon's trio
thread.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable

from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.chunks import ChunkLocation
from dsec_fs.errors import FormatError
from erofs_builder.chunked_files import chunked_files

from .blob_reader import BlobChunk, LayerBlob

FILE_START = 1 << 20  # of a file's own chunks after a read, named at first
FILE_BYTES = 16 << 20  # what a file's window grows to while the reader reads what it named
WINDOW_START = 256 << 10
DEFAULT_WINDOW = 4 << 20
WALK_GAP = 2  # blob entries between one file's last read chunk and the next file's first: still a walk
# A shared object's name (lib.so, libc.so.6, _ssl.cpython-311-x86_64-linux-gnu.so): what a loader maps.
_SHARED_OBJECT = re.compile(rb"\.so(\.[0-9]+)*$")
SMALL_FILE_BYTES = 256 << 10  # a directory's files up to this size come along as its neighbours
DIRECTORY_BYTES = 2 << 20  # at most this much of a directory's small files named at once


class FileChunks:
    """For each blob-map entry, the file it belongs to (its first holder in the image's walk order); each
    file's chunks in file order and its directory; each directory's small files."""

    def __init__(self, owner: array, files: list[tuple[int, ...]], directory: array, small: list[list[int]],
                 libraries: frozenset[int] = frozenset()):
        self.owner = owner  # entry -> file number, -1 for none
        self.files = files  # file number -> its blob entries, in file order, no holes, no repeats
        self.directory = directory  # file number -> directory number
        self.small = small  # directory number -> its files of at most SMALL_FILE_BYTES, in blob order
        self.libraries = libraries  # file numbers of shared objects (by name), which loaders map

    @classmethod
    def of_image(cls, meta: bytes | memoryview, blob_map: EncodedBlobMap, *, source: str) -> FileChunks:
        """The map of a layer's image ``meta`` (its meta.erofs, named ``source`` in errors) over its blob
        map: read from the image's records (erofs_builder/chunked_files.py), no LayerIndex made. A chunk
        index that names no chunk's first block of the blob map is a FormatError."""
        lengths = blob_map.lengths
        entry_at = blob_map.entries_by_start()
        owner = array("i", [-1]) * len(lengths)
        files: list[tuple[int, ...]] = []
        directory = array("i")
        directories: dict[int, int] = {}  # directory nid -> its number
        small: list[list[int]] = []
        libraries = set()
        for file in chunked_files(meta, chunk_bits=blob_map.chunk_bits, source=source):
            found = list(map(entry_at.get, file.blkaddrs))
            if None in found:
                raise FormatError(f"inode nid {file.nid}", None, f"block {file.blkaddrs[found.index(None)]} is not "
                                  "the start of a chunk in the blob map", source=source)
            entries = tuple(found) if len(found) == 1 else tuple(dict.fromkeys(found))  # most files: one chunk
            number = len(files)
            files.append(entries)
            parent = directories.setdefault(file.directory, len(directories))
            if parent == len(small):
                small.append([])
            directory.append(parent)
            if b".so" in file.name and _SHARED_OBJECT.search(file.name):
                libraries.add(number)
            if sum(map(lengths.__getitem__, entries)) <= SMALL_FILE_BYTES:
                small[parent].append(number)
            for entry in entries:
                if owner[entry] < 0:
                    owner[entry] = number
        for members in small:
            members.sort(key=lambda number: files[number][0])
        return cls(owner, files, directory, small, frozenset(libraries))


class MissReadahead:
    """The readahead to name for each on-demand read of one layer's blob (see the module docstring)."""

    def __init__(self, blob: LayerBlob, max_window: int):
        self.blob = blob
        self.max_window = max_window
        self.files: FileChunks | None = None  # set once built
        self.unmapped = False  # the map could not be made (the image is refused): no readahead, for good
        self._walk_bytes = 0  # of the chunks the current walk has read
        self._window = 0
        self._window_entries: list[int] = []  # the window the latest read named
        self._warmed_to = -1  # the last entry a walk's window was warmed up to
        self._last_file = -1
        self._walk_crossed = False  # the current walk went on from one directory into another
        self._last_end = -1  # the last blob entry of the latest read
        self._named: set[int] = set()  # entries named as readahead and not read yet
        self._file_window: dict[int, int] = {}  # file -> its window, once read
        self._file_end: dict[int, int] = {}  # file -> the last entry of its latest read
        self._mapped: set[int] = set()  # files read elsewhere than where their previous read ended
        self._read_files: set[int] = set()  # files read so far
        self._directory_reads: dict[int, int] = {}  # directory -> files of it read so far
        self._warm: list[int] = []  # what the latest read named for the background (to_warm)

    def ready(self, files: FileChunks) -> None:
        self.files = files

    def plan(self, chunks: list[BlobChunk]) -> list[tuple[bytes, ChunkLocation]]:
        """Named on every read (the fetcher looks at it only if the read misses): the file's chunks after
        this read, a directory's small files, and while walking, the window after the file."""
        files = self.files
        if files is None or not chunks:
            return []
        first, last = chunks[0].entry, chunks[-1].entry
        number = files.owner[first]
        foreseen = [chunk.entry for chunk in chunks if chunk.entry in self._named]  # readahead that was read
        self._named.difference_update(foreseen)
        if number != self._last_file:  # a new file: the next one in the blob, or a jump
            adjacent = number >= 0 and self._last_file >= 0 and 0 < first - self._last_end <= WALK_GAP
            if adjacent:
                self._walk_crossed |= files.directory[number] != files.directory[self._last_file]
                self._window = min(max(2 * self._window, WINDOW_START), max(2 * self._walk_bytes, WINDOW_START),
                                   self.max_window)
            else:
                self._window = self._walk_bytes = 0
                self._warmed_to = -1
                self._walk_crossed = False
        if number >= 0 and first > self._last_end:
            self._walk_bytes += sum(chunk.length for chunk in chunks if chunk.entry > self._last_end)
        self._last_file, self._last_end = number, last
        ahead: dict[int, None] = {}
        if number >= 0:
            self._plan_file(ahead, files.files[number], number, first, last, bool(foreseen))
        window_entries: dict[int, None] = {}
        if number >= 0 and self._window:
            after = range(max(last, files.files[number][-1]) + 1, len(self.blob.blob_map))
            if not self._walk_crossed:
                after = _in_directory(files, files.directory[number], after)
            self._name(window_entries, after, self._window)
        self._window_entries = list(window_entries)
        ahead.update(window_entries)
        if number >= 0 and number not in self._read_files:
            self._read_files.add(number)
            parent = files.directory[number]
            self._directory_reads[parent] = self._directory_reads.get(parent, 0) + 1
            if self._directory_reads[parent] == 2:  # a reader of several files of this directory
                self._warm += self._name(ahead, self._near(files, parent, number), DIRECTORY_BYTES)
        wanted = {chunk.entry for chunk in chunks}
        return self._located(entry for entry in ahead if entry not in wanted)

    def to_warm(self) -> list[tuple[bytes, ChunkLocation]]:
        """After a read: what it named that its GETs may not have brought, to fetch in the background (the
        fetcher skips what is cached or in the air). The fetcher brings readahead only with a miss and
        only in the runs of the miss, and a walk whose window arrived reads hit after hit until it runs
        past it: as the kernel's async readahead, the part of the window no earlier call gave is asked
        for before the reader gets there; and what a grown file or directory window named."""
        fresh = [entry for entry in self._window_entries if entry > self._warmed_to]
        if fresh:
            self._warmed_to = fresh[-1]
        fresh += self._warm
        self._warm = []
        return self._located(fresh)

    def _located(self, entries: Iterable[int]) -> list[tuple[bytes, ChunkLocation]]:
        """(digest, location) of each of blob-map ``entries``."""
        digest_of, location = self.blob.blob_map.digest, self.blob.location
        located = []
        for entry in entries:
            digest = digest_of(entry)
            located.append((digest, location(entry, digest)))
        return located

    def _plan_file(self, ahead: dict[int, None], own: tuple[int, ...], number: int, first: int, last: int,
                   foreseen: bool) -> None:
        """Name the file's window after this read: on its first read and on reads that go on where its
        previous read ended; a read of it elsewhere (a page fault of a mapped library) names none of it.
        A read in order of a chunk readahead named (``foreseen``: this file's window, or a walk's that
        reached into the file) doubles the window, and what it grew by is warmed."""
        previous = self._file_end.get(number)
        self._file_end[number] = last
        if previous is not None and not previous <= first <= previous + 1:
            self._mapped.add(number)
            return
        window = self._file_window.get(number, FILE_START)
        grown = (foreseen and window < FILE_BYTES and number not in self._mapped
                 and number not in self.files.libraries)
        if grown:
            window = min(2 * window, FILE_BYTES)
        self._file_window[number] = window
        named = self._name(ahead, own[own.index(last) + 1:] if last in own else own, window)
        if grown:
            self._warm += named  # what the window grew by

    def _near(self, files: FileChunks, parent: int, number: int):
        """The chunks of the directory's small files not read yet, nearest in the blob to ``number`` first."""
        start = files.files[number][0]
        members = sorted((n for n in files.small[parent] if n not in self._read_files),
                         key=lambda n: abs(files.files[n][0] - start))
        for member in members:
            yield from files.files[member]

    def _name(self, ahead: dict[int, None], candidates, budget: int) -> list[int]:
        """Add to ``ahead`` the ``candidates`` that fit in ``budget`` bytes, in order, and note those not
        named yet as named. Returns those."""
        lengths = self.blob.blob_map.lengths
        named = []
        for entry in candidates:
            budget -= lengths[entry]
            if budget < 0:
                break
            ahead[entry] = None
            if entry not in self._named:
                self._named.add(entry)
                named.append(entry)
        return named


def _in_directory(files: FileChunks, parent: int, entries):
    """``entries`` up to the first that belongs to no file of directory ``parent``."""
    for entry in entries:
        owner = files.owner[entry]
        if owner < 0 or files.directory[owner] != parent:
            return
        yield entry
