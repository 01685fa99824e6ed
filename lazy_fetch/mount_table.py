"""The node daemon's mounts: the live table and its persisted copy, ``state_dir/mounts.json``.

The file lists the live mounts, rewritten (atomically) after each mount and unmount, and before each
mount with the mounts being made (``begin``; several at once, as the daemon mounts a stack's layers side
by side), so a daemon killed between mount(2) and the update still leaves the mountpoint listed and the
next daemon detaches it. Not synced: the file describes mounts, and
none outlives the machine's crash or power loss that an fsync guards against, while against the death of
the daemon (SIGKILL, a crash of its own), which is what the table is for, a rename is atomic without one
(the page cache outlives the process). A table left torn by a machine crash is read as empty, with a
warning (``read_left``), which is right then: nothing it listed is mounted any more. The next daemon reads it to adopt
the mounts a dead daemon left alive (raw binding) and to detach the others (``is_ours`` says whether
what is mounted at a listed mountpoint is still ours, read from /proc/self/mountinfo alone: nothing here
stats a mountpoint, which would wait forever on a FUSE session nobody serves yet).

Threads: the daemon's trio thread; ``save`` writes the small file in it (no fsync: a write to the page
cache and a rename, well under a millisecond), as the table must be written before mount(2) goes on.
Nothing here awaits, so each call sees and writes the table whole between the daemon's awaits.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from dsec_fs.errors import UnavailableError
from dsec_fs.files import write_state_file
from dsec_fs.mounts import MountEntry

log = logging.getLogger(__name__)

MOUNT_TABLE = "mounts.json"
MAX_TABLE_BYTES = 64 << 20  # a mount table bigger than this was not written by a daemon


@dataclass
class Mount:
    mountpoint: str
    mode: str
    layer: str  # digest
    ref: str  # as the mount request named the layer (a ref or the digest)
    store: str  # store URL
    blob_id: str
    trace: str  # trace file ("" when tracing is off)
    prefetch: str  # prefetch list path, "profile:combination|layer|name" (profile_keeper.py), or ""
    created: str
    chunks: int
    data_bytes: int
    prefetch_chunks: int = 0  # chunks the prefetch was to fetch
    profile_key: str = ""  # the store prefix of the profile it prefetched by

    def to_json(self) -> dict:
        return asdict(self)


class MountTable:
    """The live mounts by mountpoint, and their file in ``state_dir``."""

    def __init__(self, state_dir: str):
        self.path = os.path.join(state_dir, MOUNT_TABLE)
        self.mounts: dict[str, Mount] = {}
        self.mounting: dict[str, tuple[str, str]] = {}  # mountpoint -> (mode, layer digest): mounts being made

    def begin(self, mountpoint: str, mode: str, layer: str) -> None:
        """List the mount about to be made at ``mountpoint`` (until ``end``), and write the table. Raises
        as ``save`` does, and then lists nothing more."""
        self.mounting[mountpoint] = (mode, layer)
        try:
            self.save()
        except BaseException:
            del self.mounting[mountpoint]
            raise

    def end(self, mountpoint: str) -> None:
        """The mount ``begin`` listed (if it could) is made (and in ``mounts``) or failed: write the table
        without it (``save_after_change``)."""
        self.mounting.pop(mountpoint, None)
        self.save_after_change()

    def save(self) -> None:
        """Write the live mounts, and those being made (``mounting``). UnavailableError (transient) if the
        file cannot be written: a full disk (the sandboxes' upper dirs share the state directory's), so a
        mount that must be listed before it is made is refused."""
        entries = [m.to_json() for m in self.mounts.values()]
        entries += [{"mountpoint": mountpoint, "mode": mode, "layer": layer, "mounting": True}
                    for mountpoint, (mode, layer) in self.mounting.items() if mountpoint not in self.mounts]
        write_state_file(self.path, json.dumps({"pid": os.getpid(), "mounts": entries}, indent=1).encode(),
                         what="the mount table")

    def save_after_change(self) -> None:
        """``save`` once a mount or unmount is made: a failure is logged, not raised, as the change stands.
        The file then still lists what was mounted before (and the mounts being made, if any were), which
        the next daemon checks against what is really mounted (``is_ours``) before it acts on an entry."""
        try:
            self.save()
        except UnavailableError as exc:
            log.error("%s; it lists what was mounted before this change", exc)

    def read_left(self) -> list[dict]:
        """The entries a daemon before us left (each with string mountpoint, mode and layer); an unreadable
        table is logged and taken as empty."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_TABLE_BYTES + 1)
            if len(data) > MAX_TABLE_BYTES:
                raise ValueError(f"over {MAX_TABLE_BYTES} bytes")
            entries = json.loads(data)["mounts"]
            if not all(isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in
                                                       ("mountpoint", "mode", "layer")) for entry in entries):
                raise ValueError("an entry lacks its mountpoint, mode or layer")
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError, RecursionError, OSError) as exc:
            log.warning("ignoring the unreadable mount table %s: %s", self.path, exc)
            return []
        return entries


def is_ours(entry: MountEntry, mode: str, meta_path: str, layer: str) -> bool:
    """A kernel-mode mount is EROFS from our meta image; a fuse-mode one a bind mount of our session's
    layers/<digest>/ directory."""
    if mode == "kernel":
        return entry.fstype == "erofs" and entry.source == meta_path
    return entry.fstype.startswith("fuse") and entry.source == "dsecfs" and entry.root == f"/layers/{layer}"
