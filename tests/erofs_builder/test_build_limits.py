"""Inputs sized to exhaust memory or time, and the legitimate ones that look alike (issue 14): a sparse
bomb refused fast in little memory, a tar.zst of one 4 GiB file of zeros built into holes, the layer
limits on directory trees, and every limit settable from ``dsecfs build``.

The CLI runs as a real process (the entry point of the venv) so its time and peak RSS are its own.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile

import pytest
import zstandard

from dsec_fs.errors import InputError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder import build_layer
from erofs_builder.limits import LayerLimits, TarLimits, tar_limits_with
from erofs_builder.ondisk.chunk_index import HOLE
from erofs_builder.reader import ErofsImage

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
TIB = 1 << 40


def sparse_member(name: str, size: int) -> tuple[tarfile.TarInfo, bytes]:
    """A PAX 0.1 sparse member of ``size`` bytes holding 512 bytes of data at its start."""
    data = b"x" * 512
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.pax_headers = {"GNU.sparse.map": f"0,{len(data)}", "GNU.sparse.size": str(size),
                      "GNU.sparse.numblocks": "1"}
    return ti, data


def write_tar(path, members) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for ti, data in members:
            archive.addfile(ti, io.BytesIO(data))


def run_measured(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float, int]:
    """(result, seconds, peak RSS in bytes) of ``dsecfs args`` run alone in a fresh process."""
    probe = ("import resource, subprocess, sys, time\n"
             "t = time.monotonic()\n"
             "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
             "sys.stdout.buffer.write(b'%d %f %d\\n' % (r.returncode, time.monotonic() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
             "sys.stdout.buffer.write(r.stderr)\n")
    result = subprocess.run([sys.executable, "-c", probe, DSECFS, *args], capture_output=True, timeout=timeout)
    first, _, rest = result.stdout.partition(b"\n")
    code, seconds, rss_kib = first.split()
    return subprocess.CompletedProcess(args, int(code), b"", rest), float(seconds), int(rss_kib) * 1024


def test_a_sparse_bomb_is_refused_fast_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.tar"
    write_tar(bomb, [sparse_member(f"sparse{i:02d}", TIB) for i in range(64)])
    assert os.path.getsize(bomb) < 512 << 10
    store = tmp_path / "store"
    result, seconds, rss = run_measured(["build", str(bomb), "--store", f"file://{store}", "--name", "bomb:1"],
                                        timeout=60)
    assert result.returncode == 2, result.stderr  # an input error
    assert b"--max-size" in result.stderr and b"sparse00" in result.stderr
    assert seconds < 5 and rss < 200 << 20, (seconds, rss)
    print(f"sparse bomb refused in {seconds:.2f} s, peak RSS {rss >> 20} MiB")
    assert not os.path.exists(store / "refs")  # nothing published


def test_layer_limits_bound_the_logical_size_and_the_metadata(tmp_path):
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    small = tmp_path / "small.tar"
    write_tar(small, [sparse_member("a", 1 << 30), sparse_member("b", 1 << 30)])
    with pytest.raises(InputError, match="more than 1.5 GiB") as caught:
        build_layer(small, store, limits=LayerLimits(max_size=3 << 29))
    assert caught.value.where == "b"  # the member that went over, before its content was read
    with pytest.raises(InputError, match="metadata"):  # 2 GiB in 4 KiB chunks: 4 MiB of chunk index
        build_layer(small, store, chunk_size=4096, limits=LayerLimits(max_meta_size=1 << 20))
    assert build_layer(small, store, limits=LayerLimits(max_size=2 << 30)).manifest.stats["bytes"] == 2 << 30
    # A directory tree is checked before any file is read; a hard-linked inode counts once.
    source = tmp_path / "dir"
    source.mkdir()
    with open(source / "sparse", "wb") as f:
        f.truncate(1 << 30)
    os.link(source / "sparse", source / "again")
    assert build_layer(source, store, limits=LayerLimits(max_size=1 << 30)).manifest.stats["files"] == 1
    with pytest.raises(InputError, match="--max-size"):
        build_layer(source, store, limits=LayerLimits(max_size=(1 << 30) - 1))


def test_tar_limits_from_settings():
    limits = tar_limits_with(["max_expansion=100000", "max-file-size=2T"])
    assert limits == TarLimits(max_expansion=100_000, max_file_size=2 * TIB)
    with pytest.raises(InputError, match="max_expansion"):
        tar_limits_with(["max_expanse=1"])


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, read in pieces: a 4 GiB file without 4 GiB anywhere."""

    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


@pytest.mark.slow
def test_a_tar_zst_of_one_4_gib_file_of_zeros_builds_into_holes(tmp_path):
    size = 4 << 30
    path = tmp_path / "disk.tar.zst"
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as compressed:
        with tarfile.open(fileobj=compressed, mode="w|", format=tarfile.PAX_FORMAT) as archive:
            ti = tarfile.TarInfo("var/lib/disk.img")
            ti.size = size
            archive.addfile(ti, io.BufferedReader(_Zeros(size), 1 << 20))
    assert os.path.getsize(path) < size // 10_000  # beyond the 10000:1 bomb ratio
    store_dir = tmp_path / "store"
    result, seconds, rss = run_measured(["build", str(path), "--store", f"file://{store_dir}", "--name", "disk:1",
                                         "--json"], timeout=600)
    assert result.returncode == 0, result.stderr
    layer = open_layer(FilesystemStore(str(store_dir)), "disk:1")
    image = ErofsImage(layer.meta)
    nid = image.resolve(b"var/lib/disk.img")
    assert image.stat(nid).size == size
    assert set(blkaddr for _device, blkaddr in image.chunk_map(nid)) == {HOLE}  # one hole, all of it
    assert rss < 300 << 20, rss
    print(f"4 GiB of zeros: {seconds:.1f} s, peak RSS {rss >> 20} MiB")
