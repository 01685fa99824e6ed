"""The miss readahead's file map as the daemon made it before it read meta.erofs's records itself: from the
layer's LayerIndex (the reader's walk of the whole image). Tests hold ``FileChunks.of_image`` to it, on
real layers and on mutated images the reader accepts."""

from __future__ import annotations

import re
from array import array

from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.miss_readahead import SMALL_FILE_BYTES, FileChunks

_SHARED_OBJECT = re.compile(r"\.so(\.[0-9]+)*$")


def file_chunks_of_index(index: LayerIndex) -> FileChunks:
    lengths = index.blob_map.lengths
    owner = array("i", [-1]) * len(lengths)
    files: list[tuple[int, ...]] = []
    directory = array("i")
    directories: dict[str, int] = {}
    small: list[list[int]] = []
    libraries = set()
    for file in index.files.values():
        entries = tuple(dict.fromkeys(entry for entry in file.chunks if entry is not None))
        if not entries:
            continue
        number = len(files)
        files.append(entries)
        parent = directories.setdefault(file.path.rpartition("/")[0], len(directories))
        if parent == len(small):
            small.append([])
        directory.append(parent)
        if _SHARED_OBJECT.search(file.path):
            libraries.add(number)
        if sum(lengths[entry] for entry in entries) <= SMALL_FILE_BYTES:
            small[parent].append(number)
        for entry in entries:
            if owner[entry] < 0:
                owner[entry] = number
    for members in small:
        members.sort(key=lambda number: files[number][0])
    return FileChunks(owner, files, directory, small, frozenset(libraries))


def as_values(files: FileChunks) -> tuple:
    """Everything a FileChunks holds, comparable with ==."""
    return (list(files.owner), files.files, list(files.directory), files.small, files.libraries)
