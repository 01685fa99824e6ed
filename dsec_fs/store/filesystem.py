"""A store in a directory: the embedded default (a bare path or file://) and shared POSIX mounts such as
3FS (posix://). Both schemes are this one class: a local directory and a 3FS mount need the same care.

Writes are atomic and durable: the object is written to a temporary file beside its final name, fsynced,
renamed into place, and the directory fsynced, so a crash leaves either the old state or the new object,
never a torn one. ``put_all`` fsyncs each directory once for all its objects, and has the last object
written and fsynced while the others are, renamed into place once they are durable; ``put_ephemeral``
skips the fsyncs on a local (file://) store. Temporary names start with ``.tmp-`` and are invisible to
``list``; ``gc`` removes old ones. Key components map to directories, so the fan-out in the key layout
keeps directories small. Directories are made 0700 and objects 0600 (DIR_MODE, FILE_MODE): another local
user reads nothing.

Threads: any thread may call any method; the only shared state is the root path. ``put_all`` writes in
threads of its own and waits for them before it returns.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ..beneath import open_beneath
from ..errors import CorruptError, InputError, NotFoundError, UnavailableError
from .base import PUT_ALL_THREADS, Store, check_key, check_range, too_large

TMP_PREFIX = ".tmp-"
# Packs hold every byte of every image, files the image keeps 0600 included: the store's owner's alone.
# (Created so; a store made by an older version keeps its modes: a shared posix:// mount is its
# operator's to set.)
DIR_MODE = 0o700
FILE_MODE = 0o600


def _unavailable(exc: OSError, key: str) -> UnavailableError:
    # ENOSPC, EACCES, EROFS and friends will not go away by retrying; EIO, ESTALE and timeouts might.
    transient = exc.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR)
    return UnavailableError(f"{os.strerror(exc.errno or 0)} ({exc.__class__.__name__})", where=key, transient=transient)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _make_dirs(directory: str) -> None:
    """os.makedirs with every directory it makes DIR_MODE (makedirs gives that to the last one only)."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # another writer made it meanwhile
            pass


class FilesystemStore(Store):
    def __init__(self, root: str, *, scheme: str = "file", create: bool = True, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.scheme = scheme
        self.url = f"{scheme}://{self.root}"
        self.round_trips = scheme != "file"  # a posix:// mount may be served by another host
        self.fsync = fsync
        if create:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)  # the store's parents are not its own
            _make_dirs(self.root)
        elif not os.path.isdir(self.root):
            raise NotFoundError(f"no such store (create one with `dsecfs store init {self.url}`)", where=self.url)

    def _path(self, key: str) -> str:
        check_key(key, self.url)
        parts = key.split("/")
        if any(p.startswith(TMP_PREFIX) for p in parts):
            raise InputError(f"store keys may not start with {TMP_PREFIX!r}: {key!r}", where=self.url)
        return os.path.join(self.root, *parts)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(key, offset, length)
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                # An empty read past the end is a range past the end too (the same answer as S3's 416).
                if not length and offset > size:
                    raise CorruptError(f"offset {offset} is past the end", where=f"{self.url}/{key}")
                # Refused before reading: the range may come from a corrupt pack index, and pread would
                # allocate all of ``length`` (or overflow on an offset past 2**63) first.
                if length and offset + length > size:
                    raise CorruptError(f"range [{offset}, {offset + length}) runs past the end ({size})",
                                       where=f"{self.url}/{key}")
                if length is None:
                    f.seek(offset)
                    return f.read()
                data = os.pread(f.fileno(), length, offset)
        except FileNotFoundError:
            raise NotFoundError("no such object", where=f"{self.url}/{key}") from None
        except OSError as exc:
            raise _unavailable(exc, f"{self.url}/{key}") from None
        if len(data) != length:
            raise CorruptError(
                f"range [{offset}, {offset + length}) runs past the end ({offset + len(data)})",
                where=f"{self.url}/{key}",
            )
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        where = f"{self.url}/{key}"
        self._path(key)  # the key's checks
        try:
            # Neither followed nor waited on: what a hostile writer leaves at the key, or at a directory of
            # its path, instead of an object (a symlink to /dev/zero or out of the store, a FIFO nobody
            # writes) is refused at once. The store's root is the operator's, and may be a symlink.
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = open_beneath(root_fd, os.fsencode(key), os.O_RDONLY | os.O_NONBLOCK)
            finally:
                os.close(root_fd)
        except FileNotFoundError:
            raise NotFoundError("no such object", where=where) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EXDEV):  # a symlink; a socket; out of the root
                raise CorruptError("not an object: a symlink on its path, or a socket", where=where) from None
            raise _unavailable(exc, where) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptError(f"not an object: not a regular file (mode {st.st_mode:o})", where=where)
            if st.st_size > limit:
                raise too_large(where, st.st_size, limit)
            os.set_blocking(fd, True)  # a regular file: read blocking, as ``get`` reads (a network file system may
            # honour O_NONBLOCK on reads)
            data = os.pread(fd, limit + 1, 0) if limit else b""
        except OSError as exc:
            raise _unavailable(exc, where) from None
        finally:
            os.close(fd)
        if len(data) > limit:  # grew since the fstat: writes replace objects whole, but a writer may not
            raise too_large(where, f"more than {limit}", limit)
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        self._rename(self._write_temp(path, data, key, sync=self.fsync), path, key)
        if self.fsync:
            self._sync_directory(os.path.dirname(path))

    def put_ephemeral(self, key: str, data: bytes | memoryview) -> None:
        """``put`` without fsyncs on a file:// store, whose disk and writer share a crash; on posix:// (a
        mount another host may serve) as ``put``. A crash may leave such an object torn or empty."""
        if self.scheme != "file":
            return self.put(key, data)
        path = self._path(key)
        self._rename(self._write_temp(path, data, key, sync=False), path, key)

    def put_all(self, objects: Iterable[tuple[str, bytes | memoryview]], last: tuple[str, bytes | memoryview]) -> None:
        """Store.put_all with fewer fsyncs on the path to ``last``: each object is written to a temporary
        file, fsynced and renamed into place in a thread; meanwhile ``last`` is written to a temporary file
        and fsynced in the calling thread. Once all are in place each of their directories is fsynced
        once, then ``last`` is renamed into place and its directory fsynced: a crash leaves ``last``
        without its objects at no point. If anything fails, ``last``'s temporary file is removed."""
        last_key, last_data = last
        last_path = self._path(last_key)
        last_tmp = None
        directories = set()
        try:
            with ThreadPoolExecutor(max_workers=PUT_ALL_THREADS, thread_name_prefix="put-all") as pool:
                puts = []
                for key, data in objects:
                    path = self._path(key)
                    directories.add(os.path.dirname(path))
                    puts.append(pool.submit(self._put_unsynced_directory, key, path, data))
                last_tmp = self._write_temp(last_path, last_data, last_key, sync=self.fsync)
                for put in puts:
                    put.result()
            if self.fsync:
                for directory in sorted(directories):
                    self._sync_directory(directory)
            self._rename(last_tmp, last_path, last_key)
            last_tmp = None
        finally:
            if last_tmp is not None:
                _remove(last_tmp)
        if self.fsync:
            self._sync_directory(os.path.dirname(last_path))

    def _put_unsynced_directory(self, key: str, path: str, data: bytes | memoryview) -> None:
        """``put``, but for the fsync of the directory (put_all makes one for all its objects)."""
        self._rename(self._write_temp(path, data, key, sync=self.fsync), path, key)

    def _write_temp(self, path: str, data: bytes | memoryview, key: str, *, sync: bool) -> str:
        """A new temporary file beside ``path`` (directories made as needed) holding ``data``, fsynced if
        ``sync``; its path. Nothing is left behind on failure (UnavailableError naming ``key``). Every
        object is written here, whichever put wrote it: a test's fault or count goes here."""
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(8)}")
        try:
            _make_dirs(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _remove(tmp)
            raise _unavailable(exc, f"{self.url}/{key}") from None
        return tmp

    def _rename(self, tmp: str, path: str, key: str) -> None:
        """Move the temporary file ``tmp`` to ``path``: the object appears whole (removed on failure)."""
        try:
            os.rename(tmp, path)
        except OSError as exc:
            _remove(tmp)
            raise _unavailable(exc, f"{self.url}/{key}") from None

    def _sync_directory(self, directory: str) -> None:
        """fsync ``directory``: the names renamed into it survive a crash."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise _unavailable(exc, directory) from None

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float:
        return self._stat(key).st_mtime

    def _stat(self, key: str) -> os.stat_result:
        try:
            return os.stat(self._path(key))
        except FileNotFoundError:
            raise NotFoundError("no such object", where=f"{self.url}/{key}") from None
        except OSError as exc:
            raise _unavailable(exc, f"{self.url}/{key}") from None

    def list(self, prefix: str) -> Iterator[str]:
        # Walk only the directory that can hold the prefix, then filter by the full prefix.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base_dir.split("/")) if base_dir else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                key = rel + name
                if key.startswith(prefix):
                    yield key

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _unavailable(exc, f"{self.url}/{key}") from None

    def temp_files(self) -> Iterator[tuple[str, float]]:
        """(path, mtime) of temporary files left by interrupted writes, for gc to remove."""
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    path = os.path.join(dirpath, name)
                    try:
                        yield path, os.stat(path).st_mtime
                    except FileNotFoundError:
                        continue
