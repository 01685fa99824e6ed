"""The chunk store interface: one small set of blocking object operations every backend implements.

A store holds immutable objects under slash-separated keys (see ``keys.py`` for the layout). Backends
know nothing of packs, layers or refs; everything above talks to a ``Store`` and stays backend-agnostic,
and policies (retry, limits, verification, latency, faults) are wrappers that are themselves Stores.

Threads: every method blocks and may be called from any thread at the same time; a backend guards its
own shared state. Async code (trio) calls stores through ``trio.to_thread.run_sync``.

Errors a backend raises, and nothing else:
- ``NotFoundError``: the key does not exist (permanent);
- ``UnavailableError(transient=True)``: try again later (timeouts, 5xx, connection reset);
- ``UnavailableError(transient=False)``: retrying is pointless (no bucket, access denied, read-only);
- ``CorruptError``: the backend returned fewer bytes than the object holds for a range inside it.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..errors import FormatError, InputError, UnsupportedError

# Objects ``put_all`` writes side by side (a layer's meta.erofs, blob map and build info).
PUT_ALL_THREADS = 3

T = TypeVar("T")
R = TypeVar("R")


class Store(abc.ABC):
    """A flat namespace of immutable objects. Writes are atomic: a reader sees all of an object or none."""

    url: str
    # Whether a request waits on a round trip worth overlapping with others (a network store, a shared
    # mount, a wrapper); False where requests are local system calls of microseconds (file://): callers
    # then make them one after another (``side_by_side``) rather than start threads for them.
    round_trips: bool = True

    @abc.abstractmethod
    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of ``key`` (to its end when length is None).

        A range that runs past the end of the object is an error (CorruptError), never a short answer:
        callers ask for ranges an index promised them.
        """

    def get_at_most(self, key: str, limit: int) -> bytes:
        """All of ``key`` if it holds at most ``limit`` bytes, else UnsupportedError; never more than
        ``limit`` bytes in memory. For small objects anyone may write (access profiles): a backend answers
        in one request (one ranged read that also tells the size); this default asks for the size first."""
        size = self.size(key)
        if size > limit:
            raise too_large(key, size, limit)
        return self.get(key, 0, size)

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous object."""

    def put_all(self, objects: Iterable[tuple[str, bytes | memoryview]], last: tuple[str, bytes | memoryview]) -> None:
        """Store each (key, data) of ``objects`` as ``put`` does, then ``last``, an object that names them (a
        layer's manifest): ``last`` is written only once every one of ``objects`` is stored, and not at all
        if one of them fails or ``objects`` raises (the error is raised here). ``objects`` is consumed in
        the calling thread as it yields, while what it yielded is written side by side in other threads.
        This default puts each object in a thread (round trips overlap) through ``put``, so a wrapper's
        policies apply to each; a backend may make them durable together (a directory store syncs each
        directory once, not once an object)."""
        with ThreadPoolExecutor(max_workers=PUT_ALL_THREADS, thread_name_prefix="put-all") as pool:
            puts = [pool.submit(self.put, key, data) for key, data in objects]
            for put in puts:
                put.result()
        self.put(*last)

    def put_many(self, objects: list[tuple[str, bytes | memoryview]]) -> None:
        """Store each (key, data) of ``objects`` as ``put`` does, side by side and in no order among them:
        for objects that nothing names yet (a layer's meta.erofs, blob map and build info, whose manifest
        is written later). Returns once every one is stored; if one fails, the error is raised here and
        the others may be stored or not. This default puts each in a thread through ``put`` (so a
        wrapper's policies apply to each); a backend may make them durable together."""
        with ThreadPoolExecutor(max_workers=PUT_ALL_THREADS, thread_name_prefix="put-all") as pool:
            puts = [pool.submit(self.put, key, data) for key, data in objects]
            for put in puts:
                put.result()

    def put_ephemeral(self, key: str, data: bytes | memoryview) -> None:
        """``put`` for an object that means something only while its writer runs (a lease): as atomic for
        readers, but a backend need not make it survive a crash of the writer's host, which ends the
        writer too. This default is ``put``."""
        self.put(key, data)

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Length of the object in bytes (NotFoundError when absent)."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Every key that starts with ``prefix``, in no particular order."""

    def list_at_most(self, prefix: str, limit: int) -> list[str]:
        """At most ``limit`` of the keys ``list`` gives, the first it gives; the listing stops there. For
        prefixes anyone may write to (access profiles): a writer may put millions of keys there, or, in a
        directory store, a symlink to a huge tree in place of the prefix's directory."""
        return list(itertools.islice(self.list(prefix), limit))

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error (deletes are retried after crashes)."""

    def mtime(self, key: str) -> float:
        """Seconds since the epoch at which ``key`` was last written (used by gc's grace period)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections and file handles."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def side_by_side(store: Store, request: Callable[[T], R], items: Iterable[T], *, threads: int, name: str) -> list[R]:
    """``[request(item) for item in items]``: in up to ``threads`` threads (named ``name``) when the store's
    requests are round trips and there is more than one, else in the calling thread (a thread costs
    more to start than a local request takes)."""
    items = list(items)
    if not store.round_trips or len(items) < 2:
        return [request(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix=name) as pool:
        return list(pool.map(request, items))


def too_large(where: str, size: int | str, limit: int) -> UnsupportedError:
    return UnsupportedError(f"{size} bytes, over the limit of {limit} for this object", where=where)


def get_small(store: Store, key: str, limit: int, structure: str) -> bytes:
    """Object ``key`` (a ``structure``: a manifest, a ref, a pack index...), read only if it holds at most
    ``limit`` bytes; a larger one is a FormatError naming the key (no writer of ours makes one, so a
    store writer grew it), and no more than ``limit`` of its bytes is ever in memory."""
    try:
        return store.get_at_most(key, limit)
    except UnsupportedError as exc:
        raise FormatError(structure, None, exc.message, source=key) from None


def check_range(key: str, offset: int, length: int | None) -> None:
    """Reject negative ranges before they reach a backend (each would treat them differently)."""
    if offset < 0 or (length is not None and length < 0):
        raise InputError(f"negative range offset={offset} length={length}", where=key)


def check_key(key: str, where: str) -> None:
    """Keys are relative slash paths without empty, '.' or '..' parts, so any store copies to any other."""
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        raise InputError(f"invalid store key {key!r}", where=where)
