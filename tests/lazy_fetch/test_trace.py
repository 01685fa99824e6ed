import pytest

from dsec_fs.errors import FormatError, UnsupportedError
from lazy_fetch.trace import FLAG_MISS, RECORD, TraceHeader, TraceWriter, read_trace


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
