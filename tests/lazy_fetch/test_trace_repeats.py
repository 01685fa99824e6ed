"""A reader that reads the same bytes again and again against a real node daemon (O_DIRECT, so that every
read reaches the daemon: a fuse-mode mount; EROFS refuses O_DIRECT): its mount's trace stays bounded,
keeping every chunk's first reads in order, and the reads it leaves out are counted. The bound itself
(TraceBound) is checked on its own too, past TRACE_MAX_RECORDS.

Before: every read appended a 40-byte record to the mount's open trace, and a publish or a report read
every one of them back into memory (a TraceRecord each): 20,000 re-reads of one 4 KiB block made a trace
of 20,100 records (804 KB), growing for as long as the reader went on.
"""

from __future__ import annotations

import mmap
import os

import pytest

from lazy_fetch.blob_reader import BlobChunk
from lazy_fetch.trace import read_trace
from lazy_fetch.traced_blob import TRACE_MAX_RECORDS, TRACE_RECENT_READS, TraceBound
from tests.lazy_fetch.daemon_support import layer_metric, layer_store, mount_dirs

CHUNK = 64 * 1024
FILES = {"hot.bin": os.urandom(4 * CHUNK), "cold.bin": os.urandom(3 * CHUNK)}
REREADS = 20_000


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> str:
    return layer_store(tmp_path_factory.mktemp("repeats"), FILES, "t/repeats:1", CHUNK)


def _read_direct(path: str, offsets: list[int]) -> list[bytes]:
    """One O_DIRECT read of 4 KiB at each of ``offsets`` (each a FUSE read the daemon answers)."""
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return [bytes(block[:os.preadv(fd, [block], offset)]) for offset in offsets]
    finally:
        os.close(fd)


@pytest.mark.fuse
@pytest.mark.root
def test_o_direct_rereads_keep_the_trace_bounded_and_first_reads_in_order(store_dir, daemons, tmp_path):
    daemon = daemons.start(store_dir)
    node = daemon.node
    mnt, = mount_dirs(tmp_path, "mnt")
    info = node.mount("t/repeats:1", mnt, mode="fuse")
    try:
        hot, cold = os.path.join(mnt, "hot.bin"), os.path.join(mnt, "cold.bin")
        assert _read_direct(hot, [0] * REREADS) == [FILES["hot.bin"][:4096]] * REREADS
        # Then the first reads of other chunks, which the trace must still record, in order.
        offsets = [2 * CHUNK, 0, CHUNK]
        assert _read_direct(cold, offsets) == [FILES["cold.bin"][o:o + 4096] for o in offsets]
        untraced = layer_metric(node, "dsecfs_layer_untraced_reads_total", info.layer)
    finally:
        node.umount(mnt)
    records = read_trace(info.trace).records
    assert len(records) < 50, f"{len(records)} records for {REREADS} reads of one block"
    assert untraced >= REREADS - 10
    cold_nid = {r.nid for r in records} - {records[0].nid}
    assert [r.offset for r in records if r.nid in cold_nid] == offsets


def _chunks(*entries: int) -> list[BlobChunk]:
    return [BlobChunk(entry, bytes(32), entry * CHUNK, CHUNK) for entry in entries]


def test_the_bound_keeps_new_chunks_past_its_records_and_forgets_old_repeats():
    bound = TraceBound(chunks=4)
    assert bound.admits((5, 0, 4096, 0), _chunks(0))
    assert not bound.admits((5, 0, 4096, 0), _chunks(0))  # a repeat
    assert bound.admits((5, 0, 4096, 1), _chunks(0))  # answered otherwise (a miss): not a repeat
    for offset in range(1, TRACE_MAX_RECORDS - 1):  # distinct reads of chunk 1, up to the bound
        assert bound.admits((5, offset, 1, 0), _chunks(1))
    assert bound.records == TRACE_MAX_RECORDS
    assert not bound.admits((6, 0, 1, 0), _chunks(1))  # distinct, but of a chunk recorded: past the bound
    assert bound.admits((6, 0, 1, 0), _chunks(1, 2))  # a chunk it never recorded
    assert not bound.admits((7, 0, 1, 0), _chunks(2))
    assert TRACE_RECENT_READS < TRACE_MAX_RECORDS
