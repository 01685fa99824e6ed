"""Who a layer's served blob reads for, over time: the holders of its mounts, and the label of its trace.

Every mount of a layer in one mode reads through one served blob (served_layers.Served), and a sandbox
layer is mounted once per node and shared by every sandbox that uses it (overlay/node_service.py). So a
read cannot be told apart by sandbox: the daemon sees a read of the blob (in kernel mode, often the
kernel's readahead, in no reader's context), and a file one sandbox read is in the page cache when the
next one reads it, which the daemon never sees at all. What it can know is who holds the blob, and when.

A ``Holder`` is what a user of a mount stands for: a sandbox's (role, ref, combination), or a bare mount's
ref. ``Holders`` counts them per mountpoint. While every holder has one label the trace is theirs:
its header names the role, the ref and the combination, and a combination profile may be learned from it.
When the set of labels changes, the daemon ends the trace (a *segment*) and starts another under the new
label (trace_segments.py; none while no one holds it); while holders of two or more labels share the blob, the segment is ``shared`` (its header says how
many: ``holders``), its reads count for the layer only. So a read is attributed to a combination only when
it can only be that combination's; the cost is one more trace file per change of the set of labels.

The combination of a sandbox is the ordered layer digests of its stack, top first; ``combination_id``
names it (the sha256 of those digests, one per line): the key of its profiles (profile.py) and what its
traces' headers carry.

Threads: plain values and a table of the daemon's trio thread.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

ROLES = ("base", "workspace", "toolkit")


@dataclass(frozen=True)
class Holder:
    role: str = ""  # base | workspace | toolkit; "" for a bare mount
    ref: str = ""  # NAME:TAG the layer was asked for as, if any
    combination: str = ""  # combination_id of the sandbox's stack; "" for a bare mount


def combination_id(digests: Sequence[str]) -> str:
    """The id of a stack of layers (digests top first)."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


@dataclass(frozen=True)
class Label:
    """What one trace segment is for: one Holder, or ``holders`` (> 1) of them sharing the blob."""
    holder: Holder
    holders: int = 1
    since_ns: int = field(default_factory=time.monotonic_ns)  # when this label's holder came (sole), or now

    def same(self, other: Label | None) -> bool:
        """The same label (whenever it started)."""
        return other is not None and (self.holder, self.holders) == (other.holder, other.holders)

    @property
    def combination(self) -> str:
        """The combination the segment's reads belong to, "" if none or shared."""
        return self.holder.combination if self.holders == 1 else ""


class Holders:
    """The holders of one served blob, by mountpoint: what each mount was asked for as, and by whom."""

    def __init__(self) -> None:
        self._by_mount: dict[str, Counter[Holder]] = {}
        self._since: dict[Holder, int] = {}  # label -> monotonic ns of its first holder now present

    def add(self, mountpoint: str, holder: Holder) -> None:
        """One more ``holder`` of the mount. A sandbox's replaces the bare holder the mount had (a mount a
        daemon adopted after a restart, before its sandboxes hold it again)."""
        held = self._by_mount.setdefault(mountpoint, Counter())
        if holder.role:
            for bare in [h for h in held if not h.role]:
                del held[bare]
        held[holder] += 1
        self._forget_gone()
        self._since.setdefault(holder, time.monotonic_ns())

    def remove(self, mountpoint: str, holder: Holder | None = None) -> None:
        """One ``holder`` of the mount fewer; None: every holder of the mount (it is unmounted)."""
        held = self._by_mount.get(mountpoint)
        if held is None:
            return
        if holder is None:
            held.clear()
        elif held[holder] > 0:
            held[holder] -= 1
            held += Counter()  # drop counts of zero
        if not held:
            del self._by_mount[mountpoint]
        self._forget_gone()

    def _forget_gone(self) -> None:
        present = self._present()
        for gone in [h for h in self._since if h not in present]:
            del self._since[gone]

    def _present(self) -> set[Holder]:
        return {h for held in self._by_mount.values() for h in held}

    def label(self) -> Label | None:
        """The label the blob's trace should have now; None when no one holds it."""
        present = self._present()
        if not present:
            return None
        if len(present) == 1:
            (holder,) = present
            return Label(holder, 1, self._since[holder])
        roles = {h.role for h in present}
        refs = {h.ref for h in present}
        shared = Holder(role=roles.pop() if len(roles) == 1 else "", ref=refs.pop() if len(refs) == 1 else "")
        return Label(shared, len(present))
