"""The layers and traces of the trace-analysis tests (test_analysis.py, test_prefetch_list.py,
test_report.py); the ``layers`` fixture that builds them is in conftest.py.

- ``BASE_FILES``/``WORKSPACE_FILES``: the trees of two layers (``CHUNK`` = 64 KiB chunks); ``Layers``
  holds them built (``build_layers``), read back with the reader so tests can name chunks by file.
- ``write_trace``: a trace written with TraceWriter from a simulated workload (``Read``s of known files at
  known offsets), in fuse mode by file and in kernel mode by blob range the way the kernel asks for it.
- ``WORKLOAD`` and the bytes it reads in each mode, worked out by hand from the file sizes.

Import it as ``tests.lazy_fetch.analysis_support`` (not through conftest: pytest loads every directory's
conftest under the one name "conftest").
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from dsec_fs.blobmap import BLOCK_SIZE, EncodedBlobMap
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.ondisk.chunk_index import HOLE
from erofs_builder.reader import ErofsImage
from lazy_fetch.trace import FLAG_BLOB, FLAG_MISS, NO_CHUNK, TraceHeader, TraceWriter

CHUNK = 64 << 10
PAGE = 4096


def _random(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


LIBBIG = _random(2, 1_100_000)
CONF = _random(3, 100)
BASE_FILES = {
    "bin/tool": _random(1, 200_000),
    "lib/libbig.so": LIBBIG,
    "etc/conf": CONF,
    "etc/conf.copy": CONF,  # the same chunk as etc/conf: the blob holds it once, two files hold it
    "data/sparse": _random(4, CHUNK) + bytes(CHUNK) + _random(5, CHUNK),  # the middle chunk is a hole
    "data/empty": b"",
    "usr/share/doc/readme": _random(6, 5000),
    "usr/share/doc/unread": _random(7, 7000),
}
BASE_BYTES = 200_000 + 1_100_000 + 100 + 100 + 3 * CHUNK + 5000 + 7000
WORKSPACE_FILES = {
    "work/main.py": _random(8, 3000),
    "work/vendor/libbig.so": LIBBIG,  # every chunk also in the base layer
    "work/data.bin": _random(9, 500_000),
}


@dataclass
class Layer:
    digest: str
    image: ErofsImage
    blob_map: EncodedBlobMap
    files: dict[str, bytes]

    def nid(self, path: str) -> int:
        return self.image.resolve(path.encode())

    def entry(self, path: str, k: int) -> int | None:
        """Blob-map entry of chunk ``k`` of ``path`` (worked out with the reader, not with analysis)."""
        _device, blkaddr = self.image.chunk_map(self.nid(path))[k]
        return None if blkaddr == HOLE else self.blob_map.locate(blkaddr)


@dataclass
class Layers:
    store: FilesystemStore
    base: Layer
    workspace: Layer


def _build(tmp_path, store, name: str, files: dict[str, bytes], ref: str, symlinks: dict[str, str]) -> Layer:
    root = tmp_path / name
    for path, data in files.items():
        os.makedirs(root / os.path.dirname(path), exist_ok=True)
        (root / path).write_bytes(data)
    for path, target in symlinks.items():
        os.symlink(target, root / path)
    digest = build_layer(str(root), store, name=ref, chunk_size=CHUNK).digest
    layer = open_layer(store, digest)
    return Layer(digest, ErofsImage(layer.meta), EncodedBlobMap(layer.blobmap, source="blobmap"), files)


def build_layers(tmp) -> Layers:
    """Both layers built into one FilesystemStore under ``tmp``."""
    store = FilesystemStore(str(tmp / "store"), fsync=False)
    return Layers(store, _build(tmp, store, "base", BASE_FILES, "base/test:1", {"bin/sh": "tool"}),
                  _build(tmp, store, "workspace", WORKSPACE_FILES, "ws/repo:1", {}))


@dataclass
class Read:
    path: str
    offset: int
    length: int
    at_us: int  # when the read was answered
    latency_us: int = 20
    miss: bool = False
    flags: int = 0  # extra flags: FLAG_PREFETCH, FLAG_ERROR


def write_trace(path, layer: Layer, reads: list[Read], *, mode: str = "fuse", role: str = "base",
                combination: str = "", ref: str = "", started_ns: int = 0) -> str:
    """A trace of ``reads``: in fuse mode one record per read, by file; in kernel mode the blob reads the
    kernel would make for it (whole pages, one per chunk, none for holes)."""
    header = TraceHeader(layer=layer.digest, ref=ref, role=role, combination=combination, mode=mode,
                         chunk_size=CHUNK, started_ns=started_ns)
    writer = TraceWriter(str(path), header)
    for read in reads:
        flags = read.flags | (FLAG_MISS if read.miss else 0)
        nid = layer.nid(read.path)
        if mode == "fuse":
            first = layer.entry(read.path, read.offset // CHUNK) if read.offset < len(layer.files[read.path]) else None
            writer.record(nid=nid, offset=read.offset, length=read.length, chunk=NO_CHUNK if first is None else first,
                          latency_us=read.latency_us, flags=flags, time_ns=read.at_us * 1000)
            continue
        size = len(layer.files[read.path])
        start, end = read.offset // PAGE * PAGE, -(-min(read.offset + read.length, size) // PAGE) * PAGE
        while start < end:
            k = start // CHUNK
            stop = min(end, (k + 1) * CHUNK)
            entry = layer.entry(read.path, k)
            if entry is not None:
                blob_offset = layer.blob_map.entries[entry][0] * BLOCK_SIZE + start - k * CHUNK
                writer.record(nid=0, offset=blob_offset, length=stop - start, chunk=entry,
                              latency_us=read.latency_us, flags=flags | FLAG_BLOB, time_ns=read.at_us * 1000)
            start = stop
    writer.close()
    return str(path)


# The workload: a program, part of a big library, a config file, a sparse file, part of a document.
WORKLOAD = [
    Read("bin/tool", 0, 131072, 1000, latency_us=400, miss=True),
    Read("bin/tool", 131072, 131072, 2000),
    Read("lib/libbig.so", 0, 131072, 3000, latency_us=900, miss=True),
    Read("lib/libbig.so", 524288, 131072, 4000, latency_us=300, miss=True),
    Read("etc/conf", 0, 4096, 5000, latency_us=100, miss=True),
    Read("data/sparse", 0, 3 * CHUNK, 6000),
    Read("usr/share/doc/readme", 1000, 2000, 7000),
]
FUSE_BYTES = 200_000 + 262_144 + 100 + 3 * CHUNK + 2000  # the hole chunk of data/sparse is read too
KERNEL_BYTES = 200_000 + 262_144 + 100 + 2 * CHUNK + PAGE  # no read of the hole; readme by whole pages
CHUNK_BYTES = 200_000 + 4 * CHUNK + 100 + 2 * CHUNK + 5000  # the chunks either mode fetched
