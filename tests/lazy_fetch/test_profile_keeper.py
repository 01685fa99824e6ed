"""profile_keeper.py on a real layer and traces written with TraceWriter as a long run writes them: what
its publishes read, and what they publish."""

from __future__ import annotations

import threading

import trio

from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore, keys
from dsec_fs.store.wrappers import StoreWrapper
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


class HungPuts(StoreWrapper):
    """A real directory store whose puts wait until ``answer`` is set, as a hung 3FS or NFS mount's writes
    wait in the kernel (tests/lazy_fetch/hung_store.py makes hung reads of a pack, not writes); ``waiting``
    counts the threads stuck in one."""

    def __init__(self, inner):
        super().__init__(inner)
        self.answer = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()

    def put(self, key, data):
        with self._lock:
            self.waiting += 1
        try:
            self.answer.wait(30)
        finally:
            with self._lock:
                self.waiting -= 1
        self.inner.put(key, data)


def test_periodic_publishes_of_a_run_wait_for_its_unfinished_one_not_pile_up_in_worker_threads(layers, tmp_path):
    """Each period queued another publish of the run whatever became of the last: behind a store that does
    not answer, each took a worker thread (trio's 40, which every store call and read of the daemon
    shares) waiting on the run's lock. A periodic publish is skipped while one is unfinished; the run's
    last publish (at its end) is still queued, and publishes all of the trace once the store answers."""
    base = layers.base
    index = LayerIndex.open(layers.store, base.digest)
    store = HungPuts(FilesystemStore(str(tmp_path / "store"), fsync=False))
    keeper = ProfileKeeper(str(tmp_path / "state"))
    files = open_layer(layers.store, base.digest)
    run = PublishedRun()
    path = str(tmp_path / "1.dtr")
    writer = TraceWriter(path, TraceHeader(layer=base.digest, mode="fuse", chunk_size=CHUNK, started_ns=10**18))
    for read in WORKLOAD:
        _record(writer, base, read)
    writer.close()
    queued = []

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(5):  # five periods behind the hung store
                keeper.publish_soon(nursery, store, files, lambda: index, [path], None, run=run, if_idle=True)
                await trio.sleep(0.2)
            queued.append(len(keeper._queued))
            keeper.publish_soon(nursery, store, files, lambda: index, [path], None, run=run)  # the run ends
            await trio.sleep(0.2)
            store.answer.set()

    trio.run(main)
    assert queued == [1]
    assert keeper.published == 2 and store.waiting == 0
    published = profile.Profile.decode(store.get(keys.layer_profiles(base.digest) + keeper.node_id), source="k")
    assert published.traces == 1
