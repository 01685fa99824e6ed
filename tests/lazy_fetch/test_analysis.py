"""analysis.py on real layers built in tmp and traces written with TraceWriter from a simulated workload
(known files read at known offsets, in fuse mode by file and in kernel mode by blob range the way the
kernel asks for it): every figure is checked against numbers worked out by hand from the file sizes.

The layers, the workload and the trace writer are in analysis_support.py (shared with
test_prefetch_list.py and test_report.py), the ``layers`` fixture in conftest.py.
"""

from __future__ import annotations

import pytest

from dsec_fs.errors import FormatError, NotFoundError
from lazy_fetch.analysis import CHUNK_SIZES, analyze
from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.trace import FLAG_ERROR, FLAG_PREFETCH, TraceHeader, TraceWriter
from tests.lazy_fetch.analysis_support import (
    BASE_BYTES, BASE_FILES, CHUNK, CHUNK_BYTES, FUSE_BYTES, KERNEL_BYTES, PAGE, WORKLOAD, WORKSPACE_FILES, Read,
    write_trace,
)

# Bytes (and fetches) the same fuse-mode reads need at each chunk size, worked out by hand: tool is read
# whole; libbig at [0, 128K) and [512K, 640K); conf whole; sparse whole (the middle 64K is a hole);
# readme inside its only chunk.
FUSE_AT_CHUNK_SIZE = {
    64 << 10: (200_000 + 4 * CHUNK + 100 + 2 * CHUNK + 5000, 4 + 4 + 1 + 2 + 1),
    128 << 10: (200_000 + 2 * 131072 + 100 + 3 * CHUNK + 5000, 2 + 2 + 1 + 2 + 1),
    256 << 10: (200_000 + 2 * 262144 + 100 + 3 * CHUNK + 5000, 1 + 2 + 1 + 1 + 1),
    512 << 10: (200_000 + 2 * 524288 + 100 + 3 * CHUNK + 5000, 1 + 2 + 1 + 1 + 1),
    1 << 20: (200_000 + 1048576 + 100 + 3 * CHUNK + 5000, 1 + 1 + 1 + 1 + 1),
    2 << 20: (200_000 + 1_100_000 + 100 + 3 * CHUNK + 5000, 5),
    4 << 20: (200_000 + 1_100_000 + 100 + 3 * CHUNK + 5000, 5),
}


def test_layer_index_maps_every_chunk_back_to_its_file(layers):
    base = layers.base
    index = LayerIndex.open(layers.store, base.digest)
    assert index.layer_bytes == BASE_BYTES and index.layer_files == len(BASE_FILES)
    for path, data in BASE_FILES.items():
        file = index.files[base.nid(path)]
        assert file.path == "/" + path and file.size == len(data)
        assert list(file.chunks) == [base.entry(path, k) for k in range(-(-len(data) // CHUNK))]
    conf = base.entry("etc/conf", 0)
    assert base.entry("etc/conf.copy", 0) == conf and index.holders[conf] == 2
    assert index.owner[conf] == (base.nid("etc/conf"), 0)  # the first holder in path order
    assert index.files[base.nid("data/sparse")].chunks[1] is None
    assert index.dir_totals["/usr/share/doc"] == [2, 12_000]
    assert index.dir_totals["/etc"] == [2, 200]


@pytest.mark.parametrize("mode", ["fuse", "kernel"])
def test_one_trace_figures_match_what_was_read(layers, tmp_path, mode):
    base = layers.base
    path = write_trace(tmp_path / "t.dtr", base, WORKLOAD, mode=mode, ref="base/test:1")
    report = analyze([path], layers.store)
    s, = report.traces
    expected = FUSE_BYTES if mode == "fuse" else KERNEL_BYTES
    assert s.bytes_read == expected
    assert s.byte_fraction == expected / BASE_BYTES
    assert s.files_read == 5 and s.file_fraction == 5 / len(BASE_FILES)
    assert s.chunks_read == 12 and s.chunk_bytes == CHUNK_BYTES
    # Kernel mode records one read per chunk: tool's first read covers two chunks, both waited.
    assert s.misses == (4 if mode == "fuse" else 2 + 2 + 2 + 1)
    waits_ms = [0.4, 0.9, 0.3, 0.1] if mode == "fuse" else [0.4] * 2 + [0.9] * 2 + [0.3] * 2 + [0.1]
    assert s.wait_ms == pytest.approx(sum(waits_ms))
    assert s.stalled_ms == pytest.approx(0.4 + 0.9 + 0.3 + 0.1)  # a read's pieces overlap in time
    assert s.last_wait_ms == 5.0 and s.duration_ms == 7.0
    assert s.ambiguous_bytes == (100 if mode == "kernel" else 0)

    layer, = report.layers
    assert layer.name == "base/test:1" and layer.layer_bytes == BASE_BYTES and layer.traces == 1
    assert layer.union_bytes_read == expected and layer.union_files_read == 5
    hot = {f.path: f for f in layer.hot_files}
    assert set(hot) == {"/bin/tool", "/lib/libbig.so", "/etc/conf", "/data/sparse", "/usr/share/doc/readme"}
    assert hot["/lib/libbig.so"].mean_bytes_read == 262_144 and hot["/lib/libbig.so"].first_read_ms == 3.0
    assert hot["/etc/conf"].mean_bytes_read == 100 and hot["/etc/conf"].read_fraction == 1.0
    assert hot["/lib/libbig.so"].wait_ms == pytest.approx(1.2 if mode == "fuse" else 2.4)
    assert [f.path for f in layer.wait_files][:2] == ["/lib/libbig.so", "/bin/tool"]
    dirs = {d.path: d for d in layer.hot_dirs}
    assert dirs["/usr/share/doc"].mean_bytes_read == (2000 if mode == "fuse" else PAGE)
    assert dirs["/usr/share/doc"].bytes == 12_000 and dirs["/usr/share/doc"].files == 2
    assert dirs["/usr"].mean_bytes_read == dirs["/usr/share/doc"].mean_bytes_read
    rows = [(row.path, row.first_read_ms) for row in layer.timeline.rows]
    assert rows == [("/bin/tool", 1.0), ("/lib/libbig.so", 3.0), ("/etc/conf", 5.0), ("/data/sparse", 6.0),
                    ("/usr/share/doc/readme", 7.0)]
    assert layer.timeline.rows[2].waits == [(4.9, 5.0)]


def test_read_sizes_and_cold_start_band(layers, tmp_path):
    path = write_trace(tmp_path / "t.dtr", layers.base, WORKLOAD)
    layer, = analyze([path], layers.store).layers
    # 128 KiB reads x4, 192 KiB x1 (both in the 128 KiB class), 4 KiB x1, 2000 bytes x1 (the 1 KiB class).
    assert layer.read_sizes == [(1024, 1), (4096, 1), (131072, 5)]
    band = layer.cold_start
    assert band.t_ms[0] == 0 and band.t_ms[-1] == 7.0
    assert band.median[-1] == CHUNK_BYTES and band.median[0] == 0
    assert band.p10 == band.median == band.p90  # one trace


def test_chunk_size_estimates(layers, tmp_path):
    path = write_trace(tmp_path / "t.dtr", layers.base, WORKLOAD)
    layer, = analyze([path], layers.store).layers
    assert [e.chunk_size for e in layer.chunk_sizes] == list(CHUNK_SIZES)
    got = {e.chunk_size: (e.mean_bytes, e.mean_chunks) for e in layer.chunk_sizes}
    assert got == FUSE_AT_CHUNK_SIZE
    assert [e.current for e in layer.chunk_sizes] == [c == CHUNK for c in CHUNK_SIZES]
    at_1m = next(e for e in layer.chunk_sizes if e.chunk_size == 1 << 20)
    assert at_1m.amplification == FUSE_AT_CHUNK_SIZE[1 << 20][0] / FUSE_BYTES
    assert at_1m.union_bytes == at_1m.mean_bytes  # one trace


def test_many_traces_combinations_sharing_and_prefetch(layers, tmp_path):
    base, ws = layers.base, layers.workspace
    paths = []
    # Four sandboxes of one combination; each also reads the workspace. Sandbox 3 reads the unread doc.
    for i in range(4):
        extra = [Read("usr/share/doc/unread", 0, 8192, 8000, latency_us=1000, miss=True)] if i == 3 else []
        paths.append(write_trace(tmp_path / f"b{i}.dtr", base, WORKLOAD + extra, combination="c1",
                                 ref="base/test:1", started_ns=i))
        paths.append(write_trace(tmp_path / f"w{i}.dtr", ws, [
            Read("work/main.py", 0, 4096, 500, latency_us=250, miss=True),
            Read("work/vendor/libbig.so", 0, 65536, 600, latency_us=250, miss=True),
        ], role="workspace", combination="c1", ref="ws/repo:1", started_ns=i))
    report = analyze(paths, layers.store)
    assert [layer.name for layer in report.layers] == ["base/test:1", "ws/repo:1"]
    base_report, ws_report = report.layers
    assert base_report.traces == 4 and ws_report.traces == 4
    assert base_report.byte_fraction.min == FUSE_BYTES / BASE_BYTES
    assert base_report.byte_fraction.max == (FUSE_BYTES + 7000) / BASE_BYTES
    assert base_report.union_bytes_read == FUSE_BYTES + 7000 and base_report.union_files_read == 6
    hot = {f.path: f for f in base_report.hot_files}
    assert hot["/bin/tool"].traces == 4 and hot["/bin/tool"].trace_fraction == 1.0
    assert hot["/usr/share/doc/unread"].traces == 1 and hot["/usr/share/doc/unread"].trace_fraction == 0.25
    assert base_report.hot_files[-1].path == "/usr/share/doc/unread"
    assert base_report.core_chunk_bytes == CHUNK_BYTES and base_report.union_chunk_bytes == CHUNK_BYTES + 7000
    assert [(r.traces, r.chunks, r.bytes) for r in base_report.chunk_readers] == [(1, 1, 7000), (4, 12, CHUNK_BYTES)]

    combo, = report.combinations
    assert combo.combination == "c1" and [m.role for m in combo.members] == ["base", "workspace"]
    ws_bytes = 3000 + 65536
    ws_total = sum(len(d) for d in WORKSPACE_FILES.values())
    assert combo.members[1].mean_bytes_read == ws_bytes
    assert combo.byte_fraction == pytest.approx((FUSE_BYTES + 7000 / 4 + ws_bytes) / (BASE_BYTES + ws_total))
    assert combo.in_band is False

    # libbig.so's chunks are in both layers: the four base ones read, and chunk 0 read in both.
    shared = report.cross_layer
    assert shared.shared_chunks == 4 and shared.shared_bytes == 4 * CHUNK
    first = next(s for s in shared.top if s.read_in == ["base/test:1", "ws/repo:1"])
    assert first.traces == 8 and first.held_by == ["base/test:1", "ws/repo:1"]
    assert shared.read_bytes_per_layer - shared.read_bytes_distinct == CHUNK

    # Learned from the first three base traces, scored on the fourth (which also reads the unread doc).
    quality = {p.min_fraction: p for p in base_report.prefetch if p.scope == "all"}
    q = quality[0.5]
    assert (q.train_traces, q.test_traces, q.list_chunks, q.list_bytes) == (3, 1, 12, CHUNK_BYTES)
    assert q.needed_bytes == CHUNK_BYTES + 7000 and q.hit_bytes == CHUNK_BYTES and q.wasted_bytes == 0
    assert q.coverage == CHUNK_BYTES / (CHUNK_BYTES + 7000) and q.precision == 1.0
    assert (q.waits, q.saved_waits, q.wait_ms, q.saved_wait_ms) == (5, 4, 2.7, 1.7)


def test_prefetch_and_error_records_do_not_count_as_reads(layers, tmp_path):
    base = layers.base
    path = write_trace(tmp_path / "t.dtr", base, [
        Read("usr/share/doc/unread", 0, 7000, 100, flags=FLAG_PREFETCH),
        Read("bin/tool", 0, 65536, 200, flags=FLAG_PREFETCH),
        Read("bin/tool", 0, 4096, 300),
        Read("etc/conf", 0, 100, 400, flags=FLAG_ERROR),
    ])
    s, = analyze([path], layers.store).traces
    assert (s.reads, s.errors, s.records) == (1, 1, 4)
    assert s.bytes_read == 4096 and s.files_read == 1 and s.bytes_requested == 4096
    assert s.prefetched_bytes == 7000 + CHUNK and s.prefetch_used_bytes == CHUNK


def test_a_record_that_does_not_fit_the_layer_names_file_and_record(layers, tmp_path):
    header = TraceHeader(layer=layers.base.digest, mode="fuse", chunk_size=CHUNK)
    path = str(tmp_path / "bad.dtr")
    writer = TraceWriter(path, header)
    writer.record(nid=layers.base.nid("bin/tool"), offset=0, length=10, chunk=0, latency_us=1, flags=0)
    writer.record(nid=layers.base.nid("etc"), offset=0, length=10, chunk=0, latency_us=1, flags=0)  # a directory
    writer.close()
    with pytest.raises(FormatError, match=r"bad\.dtr: trace record 1: nid \d+ is not a regular file"):
        analyze([path], layers.store)


def test_a_layer_missing_from_the_store_names_the_trace(layers, tmp_path):
    path = str(tmp_path / "orphan.dtr")
    TraceWriter(path, TraceHeader(layer="ab" * 32)).close()
    with pytest.raises(NotFoundError, match="orphan.dtr"):
        analyze([path], layers.store)


def test_report_to_dict_is_json(layers, tmp_path):
    import json

    path = write_trace(tmp_path / "t.dtr", layers.base, WORKLOAD, mode="kernel")
    data = json.loads(json.dumps(analyze([path], layers.store).to_dict()))
    assert data["traces"][0]["bytes_read"] == KERNEL_BYTES
    assert data["layers"][0]["chunk_sizes"][0]["chunk_size"] == 64 << 10
    assert data["notes"] and "attributed to the first" in data["notes"][0]


def test_traces_that_read_nothing(layers, tmp_path):
    paths = [write_trace(tmp_path / "empty.dtr", layers.base, []),
             write_trace(tmp_path / "eof.dtr", layers.base, [Read("data/empty", 0, 4096, 10),
                                                             Read("bin/tool", 1 << 40, 10, 20)])]
    report = analyze(paths, layers.store)
    assert [(s.reads, s.bytes_read, s.files_read, s.chunks_read) for s in report.traces] == [(0, 0, 0, 0),
                                                                                            (2, 0, 0, 0)]
    layer, = report.layers
    assert layer.hot_files == [] and layer.timeline.rows == [] and set(layer.cold_start.median) == {0}
    assert all(e.mean_bytes == 0 for e in layer.chunk_sizes)
