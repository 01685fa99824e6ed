"""The miss readahead's file map as the daemon made it before it read meta.erofs's records itself, from the
layer's LayerIndex (the reader's walk of the whole image), written out as its definition: tests hold
``FileChunks.of_image`` to it, on real layers and on mutated images the reader accepts."""

from __future__ import annotations

import re
from array import array

from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.miss_readahead import SMALL_FILE_BYTES, FileChunks

_SHARED_OBJECT = re.compile(r"\.so(\.[0-9]+)*$")


def file_chunks_of_index(index: LayerIndex) -> FileChunks:
    # Files: those holding a chunk, by their first path, in walk order; each its distinct chunks in order.
    held = [(file.path, tuple(dict.fromkeys(e for e in file.chunks if e is not None))) for file in index.files.values()]
    held = [(path, entries) for path, entries in held if entries]
    files = [entries for _path, entries in held]
    # Directories: numbered in the order their first file comes.
    parents = [path.rpartition("/")[0] for path, _entries in held]
    numbers = {parent: n for n, parent in reversed(list(enumerate(dict.fromkeys(parents))))}
    directory = array("i", [numbers[parent] for parent in parents])
    lengths = index.blob_map.lengths
    members: dict[int, list[int]] = {d: [] for d in range(len(numbers))}
    for n, entries in enumerate(files):
        if sum(lengths[e] for e in entries) <= SMALL_FILE_BYTES:
            members[directory[n]].append(n)
    small = [sorted(members[d], key=lambda n: files[n][0]) for d in range(len(numbers))]
    owner = array("i", [-1]) * len(lengths)  # entry -> the first file holding it: the last one written
    for number in reversed(range(len(files))):
        for entry in files[number]:
            owner[entry] = number
    libraries = frozenset(n for n, (path, _entries) in enumerate(held) if _SHARED_OBJECT.search(path))
    return FileChunks(owner, files, directory, small, libraries)


def as_values(files: FileChunks) -> tuple:
    """Everything a FileChunks holds, comparable with ==."""
    return (list(files.owner), files.files, list(files.directory), files.small, files.libraries)
