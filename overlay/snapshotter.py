"""containerd's snapshot model over dsecfs layers: what ``dsecfs snapshotter`` serves (snapshotter_grpc.py).

Snapshots live under ROOT: their metadata in ROOT/metadata.db (sqlite3, so it survives restarts of the
snapshotter and of containerd), their files in ROOT/snapshots/<id>/:

- ``fs/``: an active snapshot's upper directory, which becomes the committed snapshot's tree (the
  ordinary way: containerd's differ unpacks a layer tar into the upper of an overlay mount we answered);
- ``work/``: OverlayFS's work directory for that upper;
- ``layer/``: a dsecfs layer mounted by the node daemon (kernel mode), for a *remote* snapshot.

Remote snapshots: Prepare with the label ``containerd.io/snapshot.ref`` (the chain ID containerd wants)
and ``containerd.io/snapshot/dsecfs.layer`` (set from a converted image's layer annotations, see
erofs_builder/convert.py) mounts that layer through the node daemon and records a committed snapshot
carrying the labels, then answers ConflictError (gRPC ALREADY_EXISTS): containerd finds the committed
snapshot by its snapshot.ref label and parent, downloads no layer blob and unpacks nothing. The layer's
store (``containerd.io/snapshot/dsecfs.store``) must be one the snapshotter was told to allow: an image
must not make a node read from a store of its choosing. A prefetch list for the layer in ``prefetch_dir``
(``<layer digest>.json``, as ``dsecfs prefetch build`` writes one from the node's traces) goes with the
mount, so a cold start fetches the chunks containers of that layer read first ahead of them.

Mounts: a snapshot without parents is a bind mount of its fs/; an active snapshot over parents is an
overlay (upperdir fs/, lowerdir the parents' fs/ or layer/ dirs, top first); a view of one parent is a
read-only bind of it, of several a read-only overlay. These are the forms containerd's own overlayfs
snapshotter answers, so its differ applies layer tars straight into the upper dir.

Errors, as containerd's snapshotters report them: NotFoundError (no such snapshot or parent),
ConflictError (the key exists; or, for a remote Prepare, "it exists now"), InputError (a parent that
is not committed, a snapshot that still has children, a store that is not allowed).

Threads: the gRPC server calls in from a pool of threads; ``_lock`` guards the database and the snapshot
directories, and is held across a whole call (mounting a remote layer included: a Prepare is rare and a
pull prepares its layers one after the other).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from dsec_fs.client import Node
from dsec_fs.errors import ConflictError, InputError, NotFoundError
from dsec_fs.trees import remove_tree_or_log, walk_directories
from dsec_fs.mounts import umount_or_detach

log = logging.getLogger(__name__)

VIEW, ACTIVE, COMMITTED = 1, 2, 3  # containerd's snapshot kinds (snapshots.proto Kind)
TARGET_LABEL = "containerd.io/snapshot.ref"
LAYER_LABEL = "containerd.io/snapshot/dsecfs.layer"
STORE_LABEL = "containerd.io/snapshot/dsecfs.store"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Mount:
    type: str
    source: str
    options: list[str] = field(default_factory=list)


@dataclass
class SnapshotInfo:
    name: str
    parent: str
    kind: int
    labels: dict[str, str]
    created: float  # seconds since the epoch
    updated: float


@dataclass
class _Row:
    id: int
    info: SnapshotInfo
    layer: str | None  # the dsecfs layer digest of a remote snapshot


class Snapshots:
    """The snapshots under ``root``; remote layers are mounted by the node daemon ``node``, from the stores
    in ``allowed_stores`` only, with their prefetch lists in ``prefetch_dir`` if there are any."""

    def __init__(self, root: str, node: Node | None = None, allowed_stores: tuple[str, ...] = (),
                 prefetch_dir: str | None = None):
        self.root = os.path.abspath(root)
        self.node = node
        self.allowed_stores = set(allowed_stores)
        self.prefetch_dir = prefetch_dir
        os.makedirs(os.path.join(self.root, "snapshots"), mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.path.join(self.root, "metadata.db"), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS snapshots (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "name TEXT UNIQUE NOT NULL, parent TEXT NOT NULL, kind INTEGER NOT NULL, "
                         "labels TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, layer TEXT)")

    def close(self) -> None:
        self._db.close()

    # -- the ten calls ------------------------------------------------------------------------------

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        with self._lock:
            if labels.get(TARGET_LABEL) and labels.get(LAYER_LABEL):
                self._prepare_remote(key, parent, labels)  # always raises ConflictError when it succeeds
            return self._mounts(self._create(key, parent, ACTIVE, labels))

    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        with self._lock:
            return self._mounts(self._create(key, parent, VIEW, labels))

    def mounts(self, key: str) -> list[Mount]:
        with self._lock:
            row = self._get(key)
            if row.info.kind == COMMITTED:
                raise InputError(f"snapshot {key!r} is committed: it has no mounts", where=self.root)
            return self._mounts(row)

    def commit(self, name: str, key: str, labels: dict[str, str]) -> None:
        with self._lock:
            row = self._get(key)
            if row.info.kind != ACTIVE:
                raise InputError(f"snapshot {key!r} is not active", where=self.root)
            if self._find(name) is not None:
                raise ConflictError(f"snapshot {name!r} exists", where=self.root)
            merged = {**row.info.labels, **labels}
            self._db.execute("UPDATE snapshots SET name = ?, kind = ?, labels = ?, updated = ? WHERE id = ?",
                             (name, COMMITTED, json.dumps(merged), time.time(), row.id))

    def remove(self, key: str) -> None:
        with self._lock:
            row = self._get(key)
            children = self._db.execute("SELECT name FROM snapshots WHERE parent = ? LIMIT 1", (key,)).fetchone()
            if children:
                raise InputError(f"snapshot {key!r} has a child {children[0]!r}: remove that first",
                                 where=self.root)
            directory = self._dir(row.id)
            layer_dir = os.path.join(directory, "layer")
            if row.layer is not None and os.path.ismount(layer_dir):
                self._umount_layer(layer_dir)
            self._db.execute("DELETE FROM snapshots WHERE id = ?", (row.id,))
            remove_tree_or_log(directory, "the snapshot directory")  # a container's tree: any depth

    def stat(self, key: str) -> SnapshotInfo:
        with self._lock:
            return self._get(key).info

    def update(self, name: str, labels: dict[str, str], fields: list[str]) -> SnapshotInfo:
        """Set the labels (all of them, or those named ``labels.KEY`` in ``fields``)."""
        with self._lock:
            row = self._get(name)
            if not fields or "labels" in fields:
                new = dict(labels)
            else:
                new = dict(row.info.labels)
                for path in fields:
                    if not path.startswith("labels."):
                        raise InputError(f"cannot update field {path!r} of a snapshot", where=self.root)
                    label = path[len("labels."):]
                    if label in labels:
                        new[label] = labels[label]
                    else:
                        new.pop(label, None)
            self._db.execute("UPDATE snapshots SET labels = ?, updated = ? WHERE id = ?",
                             (json.dumps(new), time.time(), row.id))
            return self._get(name).info

    def list(self) -> list[SnapshotInfo]:
        with self._lock:
            return [row.info for row in self._rows("SELECT * FROM snapshots ORDER BY id", ())]

    def usage(self, key: str) -> tuple[int, int]:
        """(bytes, inodes) of the snapshot's own tree (a remote layer's as it shows, fetching nothing)."""
        with self._lock:
            row = self._get(key)
            top = os.path.join(self._dir(row.id), "layer" if row.layer else "fs")
        counted = [0, 0]  # bytes, inodes

        def count(fd: int) -> list[str]:  # a container's tree: nested any depth (dsec_fs.trees)
            directories = []
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        st = entry.stat(follow_symlinks=False)
                        counted[0] += st.st_blocks * 512
                        counted[1] += 1
                        if stat.S_ISDIR(st.st_mode):
                            directories.append(entry.name)
            except OSError as exc:  # changed meanwhile, or a layer read that failed: counted as far as read
                log.debug("usage of %s: %s", top, exc)
            return directories

        try:
            walk_directories(top, count)
        except OSError as exc:
            log.warning("usage of snapshot %s: counted as far as the walk went: %s", key, exc)
        return counted[0], counted[1]

    def cleanup(self) -> None:
        """Remove snapshot directories no snapshot names (left by a crash between the two)."""
        with self._lock:
            known = {str(row.id) for row in self._rows("SELECT * FROM snapshots", ())}
            base = os.path.join(self.root, "snapshots")
            for entry in os.listdir(base):
                if entry not in known:
                    layer_dir = os.path.join(base, entry, "layer")
                    if os.path.ismount(layer_dir):
                        self._umount_layer(layer_dir)
                    remove_tree_or_log(os.path.join(base, entry), "the stray snapshot directory")

    # -- restarts -----------------------------------------------------------------------------------------

    def remount_layers(self) -> int:
        """Mount again the remote layers whose mounts are gone (a node reboot); how many were."""
        with self._lock:
            count = 0
            for row in self._rows("SELECT * FROM snapshots WHERE layer IS NOT NULL", ()):
                layer_dir = os.path.join(self._dir(row.id), "layer")
                if not os.path.ismount(layer_dir):
                    self._mount_layer(row.layer, row.info.labels[STORE_LABEL], layer_dir)
                    count += 1
            return count

    # -- inside the lock ----------------------------------------------------------------------------------

    def _prepare_remote(self, key: str, parent: str, labels: dict[str, str]) -> None:
        target, layer, store = labels[TARGET_LABEL], labels[LAYER_LABEL], labels.get(STORE_LABEL, "")
        where = f"layer {layer[:64]} for {target[:80]}"
        for row in self._rows("SELECT * FROM snapshots WHERE kind = ? AND parent = ?", (COMMITTED, parent)):
            if row.info.labels.get(TARGET_LABEL) == target:
                raise ConflictError(f"target snapshot {target!r} exists", where=self.root)
        if not _HEX64.fullmatch(layer):
            raise InputError(f"label {LAYER_LABEL} is not a layer digest", where=where)
        if store not in self.allowed_stores:
            raise InputError(f"store {store!r} is not one this snapshotter may read (--allow-store)", where=where)
        snapshot_id = self._insert(key, parent, COMMITTED, labels, layer)
        layer_dir = os.path.join(self._dir(snapshot_id), "layer")
        try:
            os.makedirs(layer_dir)
            self._mount_layer(layer, store, layer_dir)
        except BaseException:
            self._db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
            remove_tree_or_log(self._dir(snapshot_id), "the snapshot directory")
            raise
        log.info("remote snapshot %s: layer %s mounted at %s", key, layer, layer_dir)
        raise ConflictError(f"target snapshot {target!r} exists", where=self.root)

    def _mount_layer(self, layer: str, store: str, layer_dir: str) -> None:
        if self.node is None:
            raise InputError("remote layers need a node daemon (--daemon-socket)", where=self.root)
        prefetch = os.path.join(self.prefetch_dir, f"{layer}.json") if self.prefetch_dir else None
        self.node.mount(layer, layer_dir, mode="kernel", store=store,
                        prefetch_list=prefetch if prefetch and os.path.isfile(prefetch) else None)

    def _umount_layer(self, layer_dir: str) -> None:
        if self.node is not None:
            try:
                self.node.umount(layer_dir, lazy=True)
                return
            except NotFoundError:
                pass  # not the daemon's (any more): unmount it ourselves
        umount_or_detach(layer_dir)

    def _create(self, key: str, parent: str, kind: int, labels: dict[str, str]) -> _Row:
        directory = self._dir(self._insert(key, parent, kind, labels, None))
        for sub in ("fs", "work"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        return self._get(key)

    def _insert(self, key: str, parent: str, kind: int, labels: dict[str, str], layer: str | None) -> int:
        """Record a new snapshot (a new key over a committed parent, or none); its id."""
        if not key:
            raise InputError("a snapshot needs a key", where=self.root)
        if self._find(key) is not None:
            raise ConflictError(f"snapshot {key!r} exists", where=self.root)
        if parent:
            self._committed_parent(parent)
        now = time.time()
        cursor = self._db.execute(
            "INSERT INTO snapshots (name, parent, kind, labels, created, updated, layer) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key, parent, kind, json.dumps(labels), now, now, layer))
        return cursor.lastrowid

    def _committed_parent(self, parent: str) -> _Row:
        row = self._find(parent)
        if row is None:
            raise NotFoundError(f"parent snapshot {parent!r} does not exist", where=self.root)
        if row.info.kind != COMMITTED:
            raise InputError(f"parent snapshot {parent!r} is not committed", where=self.root)
        return row

    def _mounts(self, row: _Row) -> list[Mount]:
        lowers = [self._tree_dir(ancestor) for ancestor in self._ancestors(row.info.parent)]
        directory = self._dir(row.id)
        if row.info.kind == VIEW:
            if not lowers:
                return [Mount("bind", os.path.join(directory, "fs"), ["ro", "rbind"])]
            if len(lowers) == 1:
                return [Mount("bind", lowers[0], ["ro", "rbind"])]
            return [Mount("overlay", "overlay", ["lowerdir=" + ":".join(lowers)])]
        if not lowers:
            return [Mount("bind", os.path.join(directory, "fs"), ["rw", "rbind"])]
        return [Mount("overlay", "overlay", [f"workdir={os.path.join(directory, 'work')}",
                                             f"upperdir={os.path.join(directory, 'fs')}",
                                             "lowerdir=" + ":".join(lowers), "index=off"])]

    def _ancestors(self, parent: str) -> Iterator[_Row]:
        seen = set()
        while parent:
            row = self._find(parent)
            if row is None or row.id in seen:
                raise NotFoundError(f"parent snapshot {parent!r} is missing", where=self.root)
            seen.add(row.id)
            yield row
            parent = row.info.parent

    def _tree_dir(self, row: _Row) -> str:
        return os.path.join(self._dir(row.id), "layer" if row.layer else "fs")

    def _dir(self, snapshot_id: int) -> str:
        return os.path.join(self.root, "snapshots", str(snapshot_id))

    def _get(self, key: str) -> _Row:
        row = self._find(key)
        if row is None:
            raise NotFoundError(f"snapshot {key!r} does not exist", where=self.root)
        return row

    def _find(self, key: str) -> _Row | None:
        rows = self._rows("SELECT * FROM snapshots WHERE name = ?", (key,))
        return rows[0] if rows else None

    def _rows(self, query: str, args: tuple) -> list[_Row]:
        return [_Row(id_, SnapshotInfo(name, parent, kind, json.loads(labels), created, updated), layer)
                for id_, name, parent, kind, labels, created, updated, layer in self._db.execute(query, args)]
