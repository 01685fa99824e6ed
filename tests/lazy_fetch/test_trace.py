import json
import os
import time

import pytest
from click.testing import CliRunner

from cli.main import main
from dsec_fs.errors import FormatError, UnsupportedError
from lazy_fetch.trace import FLAG_MISS, RECORD, TRACE_SUFFIX, TraceHeader, TraceWriter, prune_traces, read_trace


def _write(path, n):
    writer = TraceWriter(str(path), TraceHeader(layer="ab" * 32, role="base", mode="fuse", chunk_size=4096))
    for i in range(n):
        writer.record(nid=40 + i, offset=i * 4096, length=4096, chunk=i, latency_us=i, flags=FLAG_MISS if i % 2 else 0)
    writer.close()


def test_round_trip(tmp_path):
    path = tmp_path / "t.dtr"
    _write(path, 1000)
    trace = read_trace(str(path))
    assert trace.header.role == "base" and trace.header.chunk_size == 4096
    assert [r.nid for r in trace.records] == [40 + i for i in range(1000)]
    assert [r.miss for r in trace.records[:4]] == [False, True, False, True]
    assert all(a.time_ns <= b.time_ns for a, b in zip(trace.records, trace.records[1:]))
    assert not trace.truncated


def test_truncated_last_record_is_dropped_or_named(tmp_path):
    path = tmp_path / "t.dtr"
    _write(path, 10)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    trace = read_trace(str(path))
    assert trace.truncated and len(trace.records) == 9
    with pytest.raises(FormatError, match="trace record 9"):
        read_trace(str(path), strict=True)


@pytest.mark.parametrize("cut", [0, 5, 12, 20])
def test_short_or_garbled_header(tmp_path, cut):
    path = tmp_path / "t.dtr"
    _write(path, 1)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(FormatError) as info:
        read_trace(str(path))
    assert str(path) in str(info.value)


def test_bad_magic_and_version_and_flags(tmp_path):
    path = tmp_path / "t.dtr"
    _write(path, 2)
    data = bytearray(path.read_bytes())
    path.write_bytes(b"X" + data[1:])
    with pytest.raises(FormatError, match="magic"):
        read_trace(str(path))
    path.write_bytes(bytes(data).replace(b'"version": 1', b'"version": 9'))
    with pytest.raises(UnsupportedError):
        read_trace(str(path))
    data[-RECORD.size + 36] = 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="trace record 1.*flags"):
        read_trace(str(path))


DAY = 86400.0


def _aged_traces(directory, ages_in_days: list[float], size: int = 1000) -> list[str]:
    """Trace-named files of ``size`` bytes, last written the given number of days ago; oldest first."""
    now = time.time()
    paths = []
    for index, age in enumerate(ages_in_days):
        path = os.path.join(directory, f"t{index}{TRACE_SUFFIX}")
        with open(path, "wb") as f:
            f.write(b"x" * size)
        os.utime(path, (now - age * DAY, now - age * DAY))
        paths.append(path)
    return paths


def test_prune_by_age_then_by_size_keeping_open_traces(tmp_path):
    old, open_but_old, mid, new = _aged_traces(tmp_path, [10, 9, 2, 0])
    (tmp_path / "notes.txt").write_text("not a trace")
    result = prune_traces(str(tmp_path), max_bytes=None, max_age=7 * DAY, keep=frozenset({open_but_old}))
    assert result.removed == [old] and result.removed_bytes == 1000
    assert (result.kept, result.kept_bytes) == (3, 3000)
    result = prune_traces(str(tmp_path), max_bytes=2000, max_age=None, keep=frozenset({open_but_old}))
    assert result.removed == [mid]  # the oldest that may go; the open one stays even though it is older
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", os.path.basename(open_but_old),
                                                   os.path.basename(new)])


def test_prune_dry_run_removes_nothing(tmp_path):
    paths = _aged_traces(tmp_path, [3, 2, 1])
    result = prune_traces(str(tmp_path), max_bytes=0, max_age=None, dry_run=True)
    assert result.removed == paths and all(os.path.exists(path) for path in paths)


def test_the_prune_command(tmp_path):
    old, new = _aged_traces(tmp_path, [8, 1])
    runner = CliRunner()
    out = runner.invoke(main, ["trace", "prune", str(tmp_path), "--max-age", "7d", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["removed"] == [old] and os.path.exists(new)
    out = runner.invoke(main, ["trace", "prune", str(tmp_path)])
    assert out.exit_code != 0 and "--max-size, --max-age or both" in out.output
    out = runner.invoke(main, ["trace", "prune", str(tmp_path), "--max-age", "soon"])
    assert out.exit_code == 2 and "not a duration" in out.output


@pytest.mark.fuse
@pytest.mark.root
def test_the_daemon_prunes_old_traces_at_start_and_traces_new_mounts(layers, daemons, tmp_path):
    trace_dir = os.path.join(daemons.state_dir, "traces")
    os.makedirs(trace_dir)
    old, young = _aged_traces(trace_dir, [3, 0.5])
    node = daemons.start(layers.store.root, extra_args=["--trace-keep-age", "1d"]).node
    assert not os.path.exists(old) and os.path.exists(young)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    node.mount("base/test:1", str(mountpoint))
    try:
        (mount,) = node.mounts()
        assert os.path.dirname(mount.trace) == trace_dir and os.path.exists(mount.trace)
    finally:
        node.umount(str(mountpoint))
