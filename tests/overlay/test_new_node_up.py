"""``sandbox up`` on a node that has never seen the layers (issue 13, "another node"): what it waits for is
the store round trips it makes one after another, so the lookups that need nothing but the refs run side
by side. A real ``dsecfs daemon`` over a posix store with emulated round trips of 300 ms (--latency, no
bandwidth limit); its LatencyStore counts the round trips waited for in a row
(``dsecfs_store_serial_round_trips`` on /metrics). The floor for layers and profiles:

1. the refs (side by side);
2. each layer's manifest, and its access profiles listed (combination, layer, ref name), side by side;
3. meta.erofs, the blob map, the pack indexes and the packs' presence, and the profile objects, side by side.

Then the profile's chunks are prefetched (one more). Each test also checks what the sandbox reads.
"""

from __future__ import annotations

import pytest

from dsec_fs.sandbox_client import Sandbox
from tests.lazy_fetch import daemon_support
from tests.overlay.test_repeat_up import BASE, BASE_FILES, TOOL_FILES, TOOLKIT, read_tree, store_url  # noqa: F401
from tests.overlay.test_node_sandboxes import mounts_below

pytestmark = [pytest.mark.root, pytest.mark.fuse]

ROUND_TRIP_MS = 300  # long beside the lag, on a loaded machine, between requests made side by side


@pytest.fixture
def nodes(tmp_path):
    made = [daemon_support.Daemons(tmp_path / "a"), daemon_support.Daemons(tmp_path / "b")]
    try:
        yield made
    finally:
        for daemons in made:
            daemons.stop_all()
        assert mounts_below(tmp_path) == []


def serial_round_trips(node) -> int:
    return int(daemon_support.metrics(node)[("dsecfs_store_serial_round_trips", frozenset())])


def start(daemons, store_url):  # noqa: F811
    return daemons.start(store_url, profiles=True, latency_ms=ROUND_TRIP_MS).node


def test_a_first_up_on_a_new_node_waits_for_three_round_trips(nodes, store_url):  # noqa: F811
    node = start(nodes[0], store_url)
    info = node.sandbox_up(BASE, toolkit=TOOLKIT)
    assert serial_round_trips(node) <= 3  # no profile anywhere: refs, manifests and listings, the rest
    assert read_tree(info.rootfs, TOOL_FILES) == TOOL_FILES and read_tree(info.rootfs, BASE_FILES) == BASE_FILES
    Sandbox(node, info.id).down()


def test_another_node_gets_the_layers_and_their_profiles_in_three_round_trips(nodes, store_url):  # noqa: F811
    first = nodes[0].start(store_url, profiles=True).node  # its round trips are not counted: no latency
    info = first.sandbox_up(BASE, toolkit=TOOLKIT)
    assert read_tree(info.rootfs, TOOL_FILES) == TOOL_FILES and read_tree(info.rootfs, BASE_FILES) == BASE_FILES
    Sandbox(first, info.id).down()
    nodes[0].stop_all()  # publishes the profiles learned

    other = start(nodes[1], store_url)
    info = other.sandbox_up(BASE, toolkit=TOOLKIT)
    prefetched = daemon_support.wait_for(
        lambda: (jobs := other.prefetches()) and all(job.state == "done" for job in jobs) and jobs, "the prefetches")
    assert {job.list for job in prefetched} == {"profile:combination"}  # learned by the first node, for this stack
    assert serial_round_trips(other) <= 4  # the three of the layers and profiles, then the profile's chunks
    assert read_tree(info.rootfs, TOOL_FILES) == TOOL_FILES and read_tree(info.rootfs, BASE_FILES) == BASE_FILES
    Sandbox(other, info.id).down()
