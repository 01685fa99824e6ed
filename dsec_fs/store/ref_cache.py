"""A Store wrapper that answers reads of refs (``refs/<name>:<tag>``) from memory for a short time.

    store = RefCacheStore(inner, ttl=15.0)

Why a TTL is safe: a ref is the one thing in a store that moves (``dsecfs ref set``, a new build of the
same name), and it names a layer by digest, which never changes meaning: meta.erofs is the digest's own
bytes. A reader that sees a ref up to ``ttl`` seconds old mounts the layer the ref named that long ago,
exactly as if it had asked then; it never mixes two layers. A ref set or deleted through this wrapper is
forgotten at once, and ``forget`` does the same for one set through another Store (the node daemon's
sandbox commit), so a node sees its own changes; another node's change is seen within ``ttl``. A missing
ref is not remembered (a ref about to be made must be found as soon as it is). ``ttl`` 0 turns caching off.

Nor is a ref that names no published layer: a body that holds no layer digest (cut short or damaged on
the way) is not kept, and a kept ref is forgotten once a read of the manifest of the layer it names finds
none (a damaged body can still read as a digest: a wrong one). Either would otherwise fail every open of
the ref for the TTL, and no retry would make the store request that mends it (one cut-short ref read made
a sandbox of the reliability soak fail all of its 21 tries to start again).

Only whole reads of a ref key are cached (``get`` of all of it, and ``get_at_most``, which is how
dsec_fs.layer reads a ref: anyone who can write the store can grow one); every other call goes to
``inner`` unchanged (of a manifest read, only its NotFoundError is looked at).

Threads: any thread; ``_lock`` guards ``_refs`` and is never held while the inner store is called.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..errors import NotFoundError
from . import keys
from .base import Store, too_large
from .keys import REFS
from .wrappers import StoreWrapper


class RefCacheStore(StoreWrapper):
    def __init__(self, inner: Store, ttl: float):
        super().__init__(inner)
        self.ttl = ttl
        self.hits = 0
        self._lock = threading.Lock()
        # key -> (monotonic time it was read, its bytes, the manifest key of the layer they name)
        self._refs: dict[str, tuple[float, bytes, str]] = {}

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if not self.ttl:
            return self.inner.get(key, offset, length)
        if not key.startswith(REFS) or offset or length is not None:
            return self._other(key, lambda: self.inner.get(key, offset, length))
        return self._whole(key, lambda: self.inner.get(key))

    def get_at_most(self, key: str, limit: int) -> bytes:
        if not self.ttl:
            return self.inner.get_at_most(key, limit)
        if not key.startswith(REFS):
            return self._other(key, lambda: self.inner.get_at_most(key, limit))
        data = self._whole(key, lambda: self.inner.get_at_most(key, limit))
        if len(data) > limit:  # cached by a get of all of it
            raise too_large(key, len(data), limit)
        return data

    def _whole(self, key: str, read: Callable[[], bytes]) -> bytes:
        """The ref at ``key`` from memory if read within ``ttl``, else ``read()`` and remembered."""
        now = time.monotonic()
        with self._lock:
            cached = self._refs.get(key)
            if cached is not None and now - cached[0] < self.ttl:
                self.hits += 1
                return cached[1]
        data = read()
        target = keys.ref_target(data)
        with self._lock:
            if target is not None:
                self._refs[key] = (now, data, keys.layer_manifest(target))
            for stale in [k for k, (read_at, _, _) in self._refs.items() if now - read_at >= self.ttl]:
                del self._refs[stale]
        return data

    def _other(self, key: str, read: Callable[[], bytes]) -> bytes:
        """``read()`` of a key that is no ref; a manifest found missing makes the refs naming its layer
        forgotten (see the module docstring)."""
        try:
            return read()
        except NotFoundError:
            with self._lock:
                for naming in [k for k, (_, _, manifest) in self._refs.items() if manifest == key]:
                    del self._refs[naming]
            raise

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._forget(key)
        try:
            self.inner.put(key, data)
        finally:
            self._forget(key)  # a read that raced the put may have cached the old value

    def delete(self, key: str) -> None:
        self._forget(key)
        try:
            self.inner.delete(key)
        finally:
            self._forget(key)

    def forget(self, key: str) -> None:
        """The ref at ``key`` was set elsewhere by this node (through another Store): read it again."""
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._refs.pop(key, None)
