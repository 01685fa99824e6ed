"""A node daemon's fill keeps a layer's chunks in the cache as fetched, their packs' zstd frames, and the
first read of each decompresses and checks it (lazy_fetch/cache.py: frames), read through the kernel's
EROFS on the daemon's FUSE blob file: a frame the store lied about is never served, one damaged at rest is
caught, and the entries a read checked are plain afterwards.
"""

from __future__ import annotations

import errno
import os
import random

import pytest

from dsec_fs.chunks import ChunkIndex
from dsec_fs.digest import to_hex
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore, keys
from lazy_fetch.cache import read_index
from lazy_fetch.cache_segments import segment_name
from tests.lazy_fetch.daemon_support import drop_caches, file_chunks, layer_store, mount_dirs, wait_for

pytestmark = [pytest.mark.fuse, pytest.mark.root]

CHUNK = 64 << 10
REF = "t/frames:1"
rng = random.Random(17)
FILES = {f"lib/mod{i}.so": rng.randbytes(CHUNK) for i in range(6)}  # a chunk each


def flip_frame_byte(store_dir: str, location) -> None:
    """Change one byte in the middle of a chunk's frame in its pack, on the store's disk: the frame (of
    random bytes, stored as they are) still decompresses, to other bytes than the chunk's."""
    with open(os.path.join(store_dir, keys.pack(location.pack_id)), "r+b") as f:
        f.seek(location.offset + location.clen // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def read(mnt: str, name: str) -> bytes:
    with open(os.path.join(mnt, name), "rb") as f:
        return f.read()


def test_a_fill_keeps_frames_a_first_read_checks_and_a_lie_or_rot_is_never_served(tmp_path, daemons):
    store_dir = layer_store(tmp_path, FILES, REF, CHUNK)
    store = FilesystemStore(store_dir)
    layer = open_layer(store, REF)
    index = ChunkIndex()
    index.load_packs(store, layer.manifest.packs)
    digest_of = {}
    for name in FILES:
        (digest_of[name],) = file_chunks(layer, name)
    lied, lies = digest_of["lib/mod1.so"], digest_of["lib/mod2.so"]
    flip_frame_byte(store_dir, index.get(lied))  # the store lies while the fill reads
    flip_frame_byte(store_dir, index.get(lies))

    # No miss readahead: its window would check the chunks after those read (what a reader reads next),
    # and this test keeps some frames unread.
    first = daemons.start(store_dir, extra_args=["--miss-readahead", "0"])
    node = first.node
    mnt, = mount_dirs(tmp_path, "mnt")
    node.mount(REF, mnt, mode="kernel", fill="layer")
    wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the fill")
    cache = node.cache_stats()
    assert cache.frames == cache.entries == len(FILES), cache  # every chunk kept as fetched, nothing checked
    flip_frame_byte(store_dir, index.get(lied))  # and tells the truth again: mod1 reads right from it

    drop_caches()
    for name in ("lib/mod0.so", "lib/mod1.so", "lib/mod3.so"):
        assert read(mnt, name) == FILES[name]
    with pytest.raises(OSError) as info:
        read(mnt, "lib/mod2.so")  # its frame and the store both lie: no byte of it is served
    assert info.value.errno == errno.EIO
    assert node.ping()
    # mod0, mod1, mod3 checked and plain (once the cache writer has them); mod2's frame dropped (the store
    # gave nothing better); two frames left
    wait_for(lambda: node.cache_stats().frames == 2, "the checked chunks written plain")
    cache = node.cache_stats()
    assert (cache.bad_frames, cache.entries) == (2, 5), cache
    log = daemons.log()
    for digest in (lied, lies):
        assert f"chunk {to_hex(digest)} from {keys.pack(index.get(digest).pack_id)} is not that chunk" in log
    node.umount(mnt)
    assert first.stop() == 0

    entries = read_index(daemons.cache_dir)
    assert [entries[digest_of[f"lib/mod{i}.so"]].is_frame for i in (0, 1, 3, 4, 5)] == [False] * 3 + [True] * 2
    assert lies not in entries
    rotting = entries[digest_of["lib/mod4.so"]]  # a frame whose bytes rot on the cache's disk
    with open(os.path.join(daemons.cache_dir, "segments", segment_name(rotting.segment)), "r+b") as f:
        f.seek(rotting.offset + rotting.size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    node = daemons.start(store_dir, extra_args=["--miss-readahead", "0"]).node
    node.mount(REF, mnt, mode="kernel", fill="none")
    drop_caches()
    assert read(mnt, "lib/mod4.so") == FILES["lib/mod4.so"]  # from the store: its xxh3 caught the rot
    assert read(mnt, "lib/mod5.so") == FILES["lib/mod5.so"]  # a frame kept across the restart, checked now
    wait_for(lambda: node.cache_stats().frames == 0, "mod5 written plain")
    cache = node.cache_stats()
    assert (cache.rotten, cache.bad_frames) == (1, 0), cache
    node.umount(mnt)
