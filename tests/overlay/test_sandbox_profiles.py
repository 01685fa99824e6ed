"""Access profiles on the sandbox path (lazy_fetch/profile_keeper.py, trace_holders.py, overlay/node_service.py):
traces of sandbox layers carry role, ref and combination, also while sandboxes of several combinations
share a layer's mount; a combination's profile, learned by one daemon, is what another daemon prefetches
by at ``sandbox up``, before the layer's own; damaged objects are ignored; two nodes lose neither's.

Layers are mounted in fuse mode (and kernel mode in the first test), so each read names its file (a kernel-mode blob read can bring a
neighbouring file's chunks along, which would blur which sandbox read what)."""

from __future__ import annotations

import os
import random
import subprocess
import threading

import pytest
from treecmp import write_files

from dsec_fs.client import Node
from dsec_fs.layer import resolve
from dsec_fs.sandbox_client import Sandbox
from dsec_fs.store import FilesystemStore, keys
from erofs_builder.build import build_layer
from lazy_fetch import profile
from lazy_fetch.analysis import analyze
from lazy_fetch.trace import FLAG_MISS, FLAG_PREFETCH, TRACE_SUFFIX, read_trace
from lazy_fetch.trace_holders import combination_id
from tests.lazy_fetch import daemon_support

pytestmark = [pytest.mark.root, pytest.mark.fuse]

CHUNK = 64 * 1024
rng = random.Random(1313)
BASE, TK_A, TK_B = "base/os:1", "tk/a:1", "tk/b:1"
FILES = {
    BASE: {f"usr/lib/mod{i}.py": rng.randbytes(2 * CHUNK + i) for i in range(6)},
    TK_A: {f"opt/a/a{i}.py": rng.randbytes(CHUNK + i) for i in range(3)},
    TK_B: {f"opt/b/b{i}.py": rng.randbytes(CHUNK + i) for i in range(3)},
}


@pytest.fixture
def store_dir(tmp_path) -> str:
    store = FilesystemStore(str(tmp_path / "store"), fsync=False)
    for ref, files in FILES.items():
        build_layer(write_files(tmp_path / "src" / ref.replace("/", "_"), files), store, name=ref, chunk_size=CHUNK)
    return str(tmp_path / "store")


class Daemons(daemon_support.Daemons):
    """With access profiles on, sandbox layers mounted in ``layer_mode``."""

    def __init__(self, tmp_path, layer_mode: str = "fuse"):
        super().__init__(tmp_path)
        self.layer_mode = layer_mode

    def start(self, store: str, **options):
        options["extra_args"] = ["--sandbox-layer-mode", self.layer_mode, *options.get("extra_args", ())]
        return super().start(store, profiles=True, **options)


@pytest.fixture
def layer_mode() -> str:
    return "fuse"


@pytest.fixture
def nodes(tmp_path, nothing_left_mounted, layer_mode):
    made = [Daemons(tmp_path / "a", layer_mode), Daemons(tmp_path / "b", layer_mode)]
    try:
        yield made
    finally:
        for daemons in made:
            daemons.stop_all()


def _digests(store_dir: str) -> dict[str, str]:
    store = FilesystemStore(store_dir)
    return {ref: resolve(store, ref) for ref in FILES}


def _down(node: Node, name: str) -> None:
    Sandbox(node, name).down()


def _read(rootfs: str, ref: str, name: str) -> None:
    with open(os.path.join(rootfs, name), "rb") as f:
        assert f.read() == FILES[ref][name]


def _objects(store_dir: str, prefix: str) -> list[str]:
    return list(FilesystemStore(store_dir).list(prefix))


def _combination(*refs: str, digests: dict[str, str]) -> str:
    return combination_id([digests[ref] for ref in refs])  # top first


def _paths(p: profile.Profile) -> set[str]:
    return {e.path for e in p.entries}


def _chunks(base_file: str) -> int:
    return -(-len(FILES[BASE][base_file]) // CHUNK)


def _mount_of(node: Node, digest: str):
    (mount,) = [m for m in node.mounts() if m.layer == digest]
    return mount


def _learn_a_then_b(node: Node) -> None:
    """Two sandboxes, one after the other: (toolkit A over base) reads mod0 and a0; (toolkit B over base)
    reads mod3. The base's layer profile then holds mod0 and mod3, its profile in (A, base) only mod0."""
    up = node.sandbox_up(BASE, toolkit=TK_A, name="first")
    _read(up.rootfs, BASE, "usr/lib/mod0.py")
    _read(up.rootfs, TK_A, "opt/a/a0.py")
    _down(node, "first")
    up = node.sandbox_up(BASE, toolkit=TK_B, name="second")
    _read(up.rootfs, BASE, "usr/lib/mod3.py")
    _down(node, "second")


@pytest.mark.parametrize("layer_mode", ["fuse", "kernel"])
def test_a_combination_profile_learned_on_one_node_is_used_by_another_at_up(store_dir, nodes, layer_mode):
    """In kernel mode the kernel's readahead of the blob may bring neighbouring files' chunks along, so
    the profiles' exact chunks are checked in fuse mode only."""
    a, b = nodes
    digests = _digests(store_dir)
    combo_a = _combination(TK_A, BASE, digests=digests)
    a.start(store_dir)
    _learn_a_then_b(Node(a.socket))
    a.stop_all()
    base_in_a = keys.combination_profiles(combo_a, digests[BASE])
    assert len(_objects(store_dir, base_in_a)) == 1
    layer_paths = _paths(profile.fetch(FilesystemStore(store_dir), keys.layer_profiles(digests[BASE])))
    assert {"/usr/lib/mod0.py", "/usr/lib/mod3.py"} <= layer_paths
    exact = layer_mode == "fuse"
    if exact:
        assert layer_paths == {"/usr/lib/mod0.py", "/usr/lib/mod3.py"}

    assert (a.state_dir, a.cache_dir) != (b.state_dir, b.cache_dir)
    b.start(store_dir)
    node = Node(b.socket)
    up = node.sandbox_up(BASE, toolkit=TK_A, name="again")
    assert up.combination == combo_a
    base_mount, tk_mount = _mount_of(node, digests[BASE]), _mount_of(node, digests[TK_A])
    # preferred over the layer's profile, which would fetch mod3 too
    assert (base_mount.prefetch, base_mount.profile_key) == ("profile:combination", base_in_a)
    if exact:
        assert base_mount.prefetch_chunks == _chunks("usr/lib/mod0.py")  # mod0's only
    assert tk_mount.prefetch == "profile:combination"
    daemon_support.wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the prefetch")
    _read(up.rootfs, BASE, "usr/lib/mod0.py")
    _read(up.rootfs, TK_A, "opt/a/a0.py")
    for mount in (base_mount, tk_mount):
        trace = read_trace(mount.trace)
        assert [r for r in trace.records if r.flags & FLAG_MISS and not r.flags & FLAG_PREFETCH] == []
        assert (trace.header.combination, trace.header.prefetch) == (combo_a, "profile:combination")
    base_status = next(layer for layer in node.status().layers if layer.layer == digests[BASE])
    assert base_status.prefetched_read_bytes == base_status.prefetched_bytes > 0
    assert base_status.read_not_prefetched_bytes == 0
    samples = daemon_support.metrics(node)
    assert samples[("dsecfs_layer_profile", frozenset({"layer": digests[BASE], "source": "combination",
                                                       "key": base_in_a}.items()))] == 1
    assert samples[("dsecfs_layer_prefetch_bytes", frozenset({"layer": digests[BASE],
                                                              "outcome": "read"}.items()))] > 0
    shown = subprocess.run([daemon_support.DSECFS, "status", "--socket", b.socket], capture_output=True,
                           text=True, check=True).stdout
    assert f"profile:combination {base_in_a}" in shown and f"predicted {digests[BASE][:12]}" in shown
    _down(node, "again")

    # ``trace report`` says, per combination, what each layer prefetched by and how well it predicted.
    report = analyze([os.path.join(b.state_dir, "traces", name) for name in os.listdir(os.path.join(b.state_dir,
                                                                                                   "traces"))],
                     FilesystemStore(store_dir))
    (combo,) = report.combinations
    base_member = next(m for m in combo.members if m.role == "base")
    assert combo.combination == combo_a and base_member.profiles == [f"profile:combination {base_in_a}"]
    assert base_member.prefetched_read_bytes == base_member.prefetched_bytes > 0
    assert base_member.prefetched_unread_bytes == base_member.read_not_prefetched_bytes == 0
    text = subprocess.run([daemon_support.DSECFS, "trace", "report", os.path.join(b.state_dir, "traces"), "-o",
                           str(b.tmp_path / "report"), "--store", store_dir], capture_output=True, text=True,
                          check=True).stdout
    assert f"by profile:combination {base_in_a}" in text

    # The base alone is a new combination: it starts from the base's layer profile.
    up = node.sandbox_up(BASE, name="alone")
    base_mount = _mount_of(node, digests[BASE])
    assert (base_mount.prefetch, base_mount.profile_key) == ("profile:layer", keys.layer_profiles(digests[BASE]))
    layer_profile = profile.fetch(FilesystemStore(store_dir), keys.layer_profiles(digests[BASE]))
    assert layer_profile.traces == 3  # A's two sandboxes, and "again" (mod3: read by 1 of 3, not prefetched)
    if exact:
        assert base_mount.prefetch_chunks == _chunks("usr/lib/mod0.py")
    _down(node, "alone")


def test_traces_carry_role_and_combination_also_while_combinations_share_a_layer(store_dir, nodes, tmp_path):
    """(A over base) and (B over base) share the base's one mount for a while: what the base reads then
    is the layer's only; before, it is A's; after A goes, B's."""
    a, _b = nodes
    digests = _digests(store_dir)
    combo_a, combo_b = _combination(TK_A, BASE, digests=digests), _combination(TK_B, BASE, digests=digests)
    a.start(store_dir)
    node = Node(a.socket)
    first = node.sandbox_up(BASE, toolkit=TK_A, name="first")
    _read(first.rootfs, BASE, "usr/lib/mod0.py")
    _read(first.rootfs, TK_A, "opt/a/a0.py")
    second = node.sandbox_up(BASE, toolkit=TK_B, name="second")
    _read(second.rootfs, BASE, "usr/lib/mod1.py")  # while both hold the base
    _down(node, "first")
    _read(second.rootfs, BASE, "usr/lib/mod2.py")
    _read(second.rootfs, TK_B, "opt/b/b0.py")
    _down(node, "second")
    a.stop_all()

    store = FilesystemStore(store_dir)
    in_combination = {
        (combo, ref): _paths(profile.fetch(store, keys.combination_profiles(combo, digests[ref]),
                                           combination=combo, layer=digests[ref]))
        for combo, ref in ((combo_a, BASE), (combo_a, TK_A), (combo_b, BASE), (combo_b, TK_B))}
    assert in_combination == {(combo_a, BASE): {"/usr/lib/mod0.py"}, (combo_a, TK_A): {"/opt/a/a0.py"},
                              (combo_b, BASE): {"/usr/lib/mod2.py"}, (combo_b, TK_B): {"/opt/b/b0.py"}}
    layer = profile.fetch(store, keys.layer_profiles(digests[BASE]))
    assert layer.traces == 1 and _paths(layer) == {"/usr/lib/mod0.py", "/usr/lib/mod1.py", "/usr/lib/mod2.py"}

    trace_dir = os.path.join(a.state_dir, "traces")
    traces = sorted((read_trace(os.path.join(trace_dir, name)) for name in os.listdir(trace_dir)
                     if name.endswith(TRACE_SUFFIX)), key=lambda t: t.header.started_ns)
    labels = {(t.header.ref, t.header.role, t.header.combination, t.header.holders) for t in traces}
    assert labels == {(BASE, "base", combo_a, 1), (TK_A, "toolkit", combo_a, 1), (BASE, "base", "", 2),
                      (BASE, "base", combo_b, 1), (TK_B, "toolkit", combo_b, 1)}

    report = analyze([t.path for t in traces], store)
    assert all("" not in layer.roles for layer in report.layers)  # no "(bare)"
    members = {c.combination: {(m.role, m.name) for m in c.members} for c in report.combinations}
    assert members == {combo_a: {("base", BASE), ("toolkit", TK_A)}, combo_b: {("base", BASE), ("toolkit", TK_B)},
                       "(shared)": {("base", BASE)}}


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "oversized", "misplaced"])
def test_a_damaged_combination_profile_is_ignored_and_up_works(store_dir, nodes, damage):
    """Every combination object damaged: up falls back to the layer's profile, and reads are right.
    "misplaced": a sound object of another combination, copied under this one's key."""
    a, b = nodes
    digests = _digests(store_dir)
    combo_a, combo_b = _combination(TK_A, BASE, digests=digests), _combination(TK_B, BASE, digests=digests)
    a.start(store_dir)
    _learn_a_then_b(Node(a.socket))
    a.stop_all()
    store = FilesystemStore(store_dir)
    for key in _objects(store_dir, f"{keys.PROFILES}combinations/{combo_a}/"):
        data = store.get(key)
        if damage == "misplaced":
            data = store.get(_objects(store_dir, keys.combination_profiles(combo_b, digests[BASE]))[0])
        store.put(key, {"corrupt": data.replace(b"mod0", b"mod5").replace(b"a0.py", b"a5.py"), "truncated": data[:-40],
                        "oversized": data + b" " * profile.MAX_PROFILE_BYTES, "misplaced": data}[damage])
    b.start(store_dir)
    node = Node(b.socket)
    up = node.sandbox_up(BASE, toolkit=TK_A, name="after")
    assert _mount_of(node, digests[BASE]).prefetch == "profile:layer"
    assert _mount_of(node, digests[TK_A]).prefetch == "profile:layer"
    for name in FILES[BASE]:
        _read(up.rootfs, BASE, name)
    _read(up.rootfs, TK_A, "opt/a/a1.py")
    _down(node, "after")
    assert "ignoring the profile profiles/combinations/" in b.log()


def test_two_nodes_publishing_a_combination_profile_at_once_lose_neither(store_dir, nodes):
    a, b = nodes
    digests = _digests(store_dir)
    combo_a = _combination(TK_A, BASE, digests=digests)
    for daemons, name in ((a, "usr/lib/mod1.py"), (b, "usr/lib/mod4.py")):
        daemons.start(store_dir)
        up = Node(daemons.socket).sandbox_up(BASE, toolkit=TK_A, name="same")
        _read(up.rootfs, BASE, name)
    threads = [threading.Thread(target=_down, args=(Node(d.socket), "same")) for d in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    prefix = keys.combination_profiles(combo_a, digests[BASE])
    daemon_support.wait_for(lambda: len(_objects(store_dir, prefix)) == 2, "both nodes' objects")
    merged = profile.fetch(FilesystemStore(store_dir), prefix, combination=combo_a, layer=digests[BASE])
    assert merged.traces == 2 and _paths(merged) == {"/usr/lib/mod1.py", "/usr/lib/mod4.py"}


def test_a_combination_that_joins_a_layer_mounted_for_another_prefetches_its_own_part(store_dir, nodes):
    a, b = nodes
    digests = _digests(store_dir)
    combo_b = _combination(TK_B, BASE, digests=digests)
    a.start(store_dir)
    _learn_a_then_b(Node(a.socket))  # (B over base) read mod3
    a.stop_all()
    b.start(store_dir)
    node = Node(b.socket)
    node.sandbox_up(BASE, toolkit=TK_A, name="first")  # the base's prefetch: mod0 only
    daemon_support.wait_for(lambda: all(p.state == "done" for p in node.prefetches()), "the first prefetches")
    second = node.sandbox_up(BASE, toolkit=TK_B, name="second")
    key = keys.combination_profiles(combo_b, digests[BASE])
    job = daemon_support.wait_for(lambda: next((p for p in node.prefetches() if p.layer == digests[BASE]
                                                and p.state == "done" and p.list == "profile:combination"
                                                and p.chunks == _chunks("usr/lib/mod3.py")), None),
                                  f"the base's prefetch by {key}")
    assert job.failed_chunks == 0
    _read(second.rootfs, BASE, "usr/lib/mod3.py")
    _down(node, "second")  # the shared segment ends (and is written out)
    _down(node, "first")
    trace_dir = os.path.join(b.state_dir, "traces")
    traces = [read_trace(os.path.join(trace_dir, name)) for name in os.listdir(trace_dir)]
    (segment,) = [t for t in traces if t.header.layer == digests[BASE] and t.header.holders == 2]
    assert any(not r.flags & FLAG_PREFETCH for r in segment.records)  # mod3 was read in it...
    assert [r for r in segment.records if r.flags & FLAG_MISS and not r.flags & FLAG_PREFETCH] == []  # cached
