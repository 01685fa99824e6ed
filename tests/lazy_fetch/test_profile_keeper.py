"""profile_keeper.py on a real layer and traces written with TraceWriter as a long run writes them: what
its publishes read, and what they publish."""

from __future__ import annotations

import trio

from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore, keys
from lazy_fetch import profile
from lazy_fetch.layer_index import LayerIndex
from lazy_fetch.profile_keeper import ProfileKeeper, PublishedRun
from lazy_fetch.trace import NO_CHUNK, TraceHeader, TraceWriter, join_segments, read_trace
from tests.lazy_fetch.analysis_support import CHUNK, WORKLOAD


def _record(writer: TraceWriter, layer, read) -> None:
    first = layer.entry(read.path, read.offset // CHUNK)
    writer.record(nid=layer.nid(read.path), offset=read.offset, length=read.length,
                  chunk=NO_CHUNK if first is None else first, latency_us=20, flags=0, time_ns=read.at_us * 1000)


def test_a_long_runs_publishes_read_only_what_its_trace_gained_and_publish_all_of_it(layers, tmp_path, monkeypatch):
    """A run publishes every --profile-every for as long as it lives: re-reading its whole trace (every
    segment of every relabel) each time made a publish's time and memory grow with the run's age. Each
    reads only the records written since the one before, and publishes what the whole trace says."""
    base = layers.base
    index = LayerIndex.open(layers.store, base.digest)
    accessed = []
    access = LayerIndex.access
    monkeypatch.setattr(LayerIndex, "access", lambda self, trace: accessed.append(len(trace.records)) or
                        access(self, trace))
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    keeper = ProfileKeeper(str(tmp_path / "state"))
    files = open_layer(layers.store, base.digest)
    run = PublishedRun()

    def publish(paths):
        keeper.publish_soon(None, store, files, lambda: index, paths, None, run=run)
        trio.run(keeper.flush)

    first, second = str(tmp_path / "1.dtr"), str(tmp_path / "2.dtr")
    writer = TraceWriter(first, TraceHeader(layer=base.digest, mode="fuse", chunk_size=CHUNK, started_ns=10**18))
    for read in WORKLOAD[:3]:
        _record(writer, base, read)
    writer.flush()
    publish([first])
    for read in WORKLOAD[3:5]:
        _record(writer, base, read)
    writer.close()
    publish([first])
    # A relabel: the next segment, started 1 ms into the run, its record times its own.
    writer = TraceWriter(second, TraceHeader(layer=base.digest, mode="fuse", chunk_size=CHUNK,
                                             started_ns=10**18 + 10**6))
    for read in WORKLOAD[5:]:
        _record(writer, base, read)
    writer.close()
    publish([first, second])

    assert accessed[:3] == [3, 2, 2] and keeper.published == 3
    published = profile.fetch(store, keys.layer_profiles(base.digest))
    joined = join_segments([read_trace(first), read_trace(second)])
    whole = profile.learned_from(index, index.access(joined).use.first_read)
    assert published.traces == 1
    assert [(e.digest, e.first_read_us, e.path) for e in published.entries] == \
        [(e.digest, e.first_read_us, e.path) for e in whole.entries]
    assert {e.path for e in published.entries} == {"/" + read.path for read in WORKLOAD}
