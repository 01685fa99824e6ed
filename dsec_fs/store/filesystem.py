"""A store in a directory: the embedded default (a bare path or file://) and shared POSIX mounts such as
3FS (posix://). Both schemes are this one class: a local directory and a 3FS mount need the same care.

Writes are atomic and durable: the object is written to a temporary file beside its final name, fsynced,
renamed into place, and the directory fsynced, so a crash leaves either the old state or the new object,
never a torn one. ``put_all`` fsyncs each directory once for all its objects, and has the last object
written and fsynced while the others are, renamed into place once they are durable; ``put_many`` renames
each object into place once it is durable and fsyncs each directory once after; ``put_ephemeral``
skips the fsyncs on a local (file://) store. Temporary names start with ``.tmp-`` and are invisible to
``list``; ``gc`` removes old ones. Key components map to directories, so the fan-out in the key layout
keeps directories small. Directories are made 0700 and objects 0600 (DIR_MODE, FILE_MODE): another local
user reads nothing.

Every key is resolved beneath the store's root without following a symlink (``open_beneath``): a shared
mount may have writers who are not this node's, and what one leaves at a key or at a directory of its
path (a symlink out of the store or to /dev/zero, a FIFO nobody writes, a directory swapped for a
symlink while a path is walked) must not make a reader block or read outside, a writer write outside,
or gc and list walk or unlink outside. Such a thing at a key is a CorruptError "not an object" naming
the key; ``list`` does not descend into it. The root itself is the operator's and may be a symlink.

Threads: any thread may call any method; the only shared state is the root path. ``put_all`` writes in
threads of its own and waits for them before it returns.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ..beneath import open_beneath
from ..errors import CorruptError, InputError, NotFoundError, UnavailableError
from ..files import write_and_close
from .base import PUT_ALL_THREADS, Store, check_key, check_range, too_large

TMP_PREFIX = ".tmp-"
# Packs hold every byte of every image, files the image keeps 0600 included: the store's owner's alone.
# (Created so; a store made by an older version keeps its modes: a shared posix:// mount is its
# operator's to set.)
DIR_MODE = 0o700
FILE_MODE = 0o600
# ELOOP: a symlink on the path; ENXIO: a socket; EXDEV: out of the root.
_NOT_AN_OBJECT = (errno.ELOOP, errno.ENXIO, errno.EXDEV)
# What a walk below a directory passes by: gone, a symlink or not a directory (any more), too deep a path.
_NOT_WALKED = (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, *_NOT_AN_OBJECT)
_TRANSIENT = (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR)


def _unavailable(exc: OSError, key: str) -> UnavailableError:
    # ENOSPC, EACCES, EROFS and friends will not go away by retrying; EIO, ESTALE and timeouts might.
    return UnavailableError(f"{os.strerror(exc.errno or 0)} ({exc.__class__.__name__})", where=key,
                            transient=exc.errno in _TRANSIENT)


def _remove(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _store_error(exc: OSError, where: str) -> Exception:
    """The store error for an OSError met resolving or reading a key."""
    if isinstance(exc, FileNotFoundError):
        return NotFoundError("no such object", where=where)
    if exc.errno in _NOT_AN_OBJECT:
        return CorruptError("not an object: a symlink on its path, or a socket", where=where)
    return _unavailable(exc, where)


class FilesystemStore(Store):
    def __init__(self, root: str, *, scheme: str = "file", create: bool = True, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.scheme = scheme
        self.url = f"{scheme}://{self.root}"
        self.round_trips = scheme != "file"  # a posix:// mount may be served by another host
        self.fsync = fsync
        if create:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)  # the store's parents are not its own
            if not os.path.isdir(self.root):
                try:
                    os.mkdir(self.root, DIR_MODE)
                except FileExistsError:  # another process made it meanwhile
                    pass
        elif not os.path.isdir(self.root):
            raise NotFoundError(f"no such store (create one with `dsecfs store init {self.url}`)", where=self.url)

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _parts(self, key: str) -> list[str]:
        check_key(key, self.url)
        parts = key.split("/")
        if any(p.startswith(TMP_PREFIX) for p in parts):
            raise InputError(f"store keys may not start with {TMP_PREFIX!r}: {key!r}", where=self.url)
        return parts

    def _open(self, relpath: str, flags: int, where: str) -> int:
        """``relpath`` (a key, or a directory of one; "" is the root) opened beneath the root; OSError, or
        UnavailableError naming ``where`` if the root itself cannot be opened (a removed or unmounted
        store: not an empty one, nor a missing object)."""
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UnavailableError(f"the store's root {self.root}: {os.strerror(exc.errno or 0)}", where=where,
                                   transient=exc.errno in _TRANSIENT) from None
        if not relpath:
            return root_fd
        try:
            return open_beneath(root_fd, os.fsencode(relpath), flags)
        finally:
            os.close(root_fd)

    def _open_object(self, key: str) -> tuple[int, int]:
        """A blocking fd of the regular file at ``key``, and its size; store errors. Opened without
        blocking, so a FIFO at the key is refused instead of waited on."""
        where = self._where(key)
        self._parts(key)
        try:
            fd = self._open(key, os.O_RDONLY | os.O_NONBLOCK, where)
        except OSError as exc:
            raise _store_error(exc, where) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptError(f"not an object: not a regular file (mode {st.st_mode:o})", where=where)
            os.set_blocking(fd, True)  # read blocking, as a network file system may honour O_NONBLOCK
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise _unavailable(exc, where) from None
            raise
        return fd, st.st_size

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(key, offset, length)
        where = self._where(key)
        fd, size = self._open_object(key)
        try:
            # An empty read past the end is a range past the end too (the same answer as S3's 416).
            if not length and offset > size:
                raise CorruptError(f"offset {offset} is past the end", where=where)
            # Refused before reading: the range may come from a corrupt pack index, and pread would
            # allocate all of ``length`` (or overflow on an offset past 2**63) first.
            if length and offset + length > size:
                raise CorruptError(f"range [{offset}, {offset + length}) runs past the end ({size})", where=where)
            if length is None:
                length = size - offset
            data = os.pread(fd, length, offset) if length else b""
        except OSError as exc:
            raise _unavailable(exc, where) from None
        finally:
            os.close(fd)
        if len(data) != length:
            raise CorruptError(f"range [{offset}, {offset + length}) runs past the end ({offset + len(data)})",
                               where=where)
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        where = self._where(key)
        fd, size = self._open_object(key)
        try:
            if size > limit:
                raise too_large(where, size, limit)
            # pread allocates all it is asked for first: no more than the file holds (and a byte to tell
            # that it grew), as ``limit`` may be a size a manifest gave, gigabytes for a small object.
            data = os.pread(fd, min(limit, size) + 1, 0) if limit else b""
        except OSError as exc:
            raise _unavailable(exc, where) from None
        finally:
            os.close(fd)
        if len(data) > limit:  # grew since the fstat: writes replace objects whole, but a writer may not
            raise too_large(where, f"more than {limit}", limit)
        return data

    def _directory(self, parts: list[str], where: str) -> int:
        """An fd of the directory of parts[:-1] beneath the root, made (DIR_MODE) where missing."""
        relpath = "/".join(parts[:-1])
        try:
            return self._open(relpath, os.O_RDONLY | os.O_DIRECTORY, where)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _store_error(exc, where) from None
        fd = self._open("", os.O_RDONLY | os.O_DIRECTORY, where)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, DIR_MODE, dir_fd=fd)
                except FileExistsError:  # there already, or another writer made it meanwhile
                    pass
                below = open_beneath(fd, os.fsencode(part), os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
                fd = below
        except OSError as exc:
            os.close(fd)
            raise _store_error(exc, where) from None
        return fd

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._put(key, data, sync=self.fsync, sync_directory=self.fsync)

    def put_ephemeral(self, key: str, data: bytes | memoryview) -> None:
        """``put`` without fsyncs on a file:// store, whose disk and writer share a crash; on posix:// (a
        mount another host may serve) as ``put``. A crash may leave such an object torn or empty."""
        if self.scheme != "file":
            return self.put(key, data)
        self._put(key, data, sync=False, sync_directory=False)

    def put_all(self, objects: Iterable[tuple[str, bytes | memoryview]], last: tuple[str, bytes | memoryview]) -> None:
        """Store.put_all with fewer fsyncs on the path to ``last``: each object is written to a temporary
        file, fsynced and renamed into place in a thread; meanwhile ``last`` is written to a temporary file
        and fsynced in the calling thread. Once all are in place each of their directories is fsynced
        once, then ``last`` is renamed into place and its directory fsynced: a crash leaves ``last``
        without its objects at no point. If anything fails, ``last``'s temporary file is removed."""
        last_key, last_data = last
        last_parts = self._parts(last_key)
        directories: dict[str, list[str]] = {}  # each objects' directory: the parts of a key in it
        last_fd = self._directory(last_parts, self._where(last_key))
        last_tmp = None
        try:
            with ThreadPoolExecutor(max_workers=PUT_ALL_THREADS, thread_name_prefix="put-all") as pool:
                puts = []
                for key, data in objects:
                    parts = self._parts(key)
                    directories.setdefault("/".join(parts[:-1]), parts)
                    # Their directories are fsynced below, once each.
                    puts.append(pool.submit(self._put, key, data, sync=self.fsync, sync_directory=False))
                last_tmp = self._write_temp(last_fd, last_data, last_key, sync=self.fsync)
                for put in puts:
                    put.result()
            if self.fsync:
                self._sync_directories(directories)
            self._rename(last_fd, last_tmp, last_parts[-1], last_key)
            last_tmp = None
            if self.fsync:
                self._sync_directory(last_fd, "/".join(last_parts[:-1]))
        finally:
            if last_tmp is not None:
                _remove(last_fd, last_tmp)
            os.close(last_fd)

    def put_many(self, objects: list[tuple[str, bytes | memoryview]]) -> None:
        """Store.put_many with one flush round fewer than ``put_all``: each object is written to a
        temporary file, fsynced and renamed into place side by side (the first in the calling thread, the
        others in threads), then each of their directories is fsynced once. Nothing orders one object
        after another, so no object waits for a directory's fsync before its rename."""
        if not objects:
            return
        directories: dict[str, list[str]] = {}
        for key, _data in objects:
            parts = self._parts(key)
            directories.setdefault("/".join(parts[:-1]), parts)
        with ThreadPoolExecutor(max_workers=PUT_ALL_THREADS, thread_name_prefix="put-all") as pool:
            puts = [pool.submit(self._put, key, data, sync=self.fsync, sync_directory=False)
                    for key, data in objects[1:]]
            try:
                self._put(*objects[0], sync=self.fsync, sync_directory=False)
            finally:
                for put in puts:
                    put.exception()  # waits: each is done before any error is raised
            for put in puts:
                put.result()
        if self.fsync:
            self._sync_directories(directories)

    def _sync_directories(self, directories: dict[str, list[str]]) -> None:
        """fsync each directory (its path beneath the root: the parts of a key in it) once."""
        for directory, parts in sorted(directories.items()):
            dir_fd = self._directory(parts, f"{self.url}/{directory}")
            try:
                self._sync_directory(dir_fd, directory)
            finally:
                os.close(dir_fd)

    def _put(self, key: str, data: bytes | memoryview, *, sync: bool, sync_directory: bool) -> None:
        """Write ``key`` (the file fsynced if ``sync``, then its directory if ``sync_directory``)."""
        parts = self._parts(key)
        dir_fd = self._directory(parts, self._where(key))
        try:
            self._put_in(dir_fd, parts[-1], data, key, sync=sync)
            if sync_directory:
                self._sync_directory(dir_fd, "/".join(parts[:-1]))
        finally:
            os.close(dir_fd)

    def _put_in(self, dir_fd: int, name: str, data: bytes | memoryview, key: str, *, sync: bool) -> None:
        """Write ``data`` to a temporary file in the directory ``dir_fd`` and rename it to ``name``."""
        self._rename(dir_fd, self._write_temp(dir_fd, data, key, sync=sync), name, key)

    def _write_temp(self, dir_fd: int, data: bytes | memoryview, key: str, *, sync: bool) -> str:
        """A new temporary file in the directory ``dir_fd`` holding ``data``, fsynced if ``sync``; its name.
        Nothing is left behind on failure (UnavailableError naming ``key``). Every object is written here,
        whichever put wrote it: a test's fault or count goes here."""
        tmp = f"{TMP_PREFIX}{os.urandom(8).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
            write_and_close(fd, data, sync=sync)
        except OSError as exc:
            _remove(dir_fd, tmp)
            raise _unavailable(exc, self._where(key)) from None
        return tmp

    def _rename(self, dir_fd: int, tmp: str, name: str, key: str) -> None:
        """Move the temporary file ``tmp`` to ``name`` in ``dir_fd``: the object appears whole (``tmp`` is
        removed on failure). Replaces whatever is at the name, a symlink or a FIFO a hostile writer left
        included."""
        try:
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            _remove(dir_fd, tmp)
            if exc.errno == errno.EISDIR:  # a directory at the key
                raise CorruptError("not an object: a directory", where=self._where(key)) from None
            raise _unavailable(exc, self._where(key)) from None

    def _sync_directory(self, dir_fd: int, directory: str) -> None:
        """fsync the directory ``dir_fd`` (``directory`` beneath the root): the names renamed into it
        survive a crash."""
        try:
            os.fsync(dir_fd)
        except OSError as exc:
            raise _unavailable(exc, f"{self.url}/{directory}") from None

    def exists(self, key: str) -> bool:
        try:
            self._stat(key)
        except (NotFoundError, CorruptError):
            return False
        return True

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float:
        return self._stat(key).st_mtime

    def _stat(self, key: str) -> os.stat_result:
        where = self._where(key)
        self._parts(key)
        try:
            fd = self._open(key, os.O_PATH, where)
        except OSError as exc:
            raise _store_error(exc, where) from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise NotFoundError("no such object (a directory)", where=where)
            raise CorruptError(f"not an object: not a regular file (mode {st.st_mode:o})", where=where)
        return st

    def list(self, prefix: str) -> Iterator[str]:
        # Walk only the directory that can hold the prefix, then filter by the full prefix.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        for directory, entry in self._walk(base_dir, self._where(prefix)):
            if not entry.name.startswith(TMP_PREFIX):
                key = directory + entry.name
                if key.startswith(prefix):
                    yield key

    def _walk(self, top: str, where: str) -> Iterator[tuple[str, os.DirEntry]]:
        """(its directory as "" or "a/b/", entry) of every regular file in directory ``top`` ("": the root)
        and those below it, but in no ``.tmp-`` directory. Nothing that is not a directory is walked
        into, a symlink to one included; a directory replaced by one meanwhile is passed by. Each
        directory is opened beneath the root by its path, one at a time: a tree nested any depth costs
        neither an fd nor a stack frame a level (os.fwalk's recursion raised RecursionError on one a
        hostile writer made 1000 deep). OSError but those of _NOT_WALKED: UnavailableError."""
        pending = [top]
        while pending:
            directory = pending.pop()
            try:
                fd = self._open(directory, os.O_RDONLY | os.O_DIRECTORY, where)
            except OSError as exc:
                if exc.errno in _NOT_WALKED:
                    continue
                raise _unavailable(exc, f"{self.url}/{directory}") from None
            prefix = directory + "/" if directory else ""
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            if not entry.name.startswith(TMP_PREFIX):
                                pending.append(prefix + entry.name)
                        elif entry.is_file(follow_symlinks=False):
                            yield prefix, entry
            except OSError as exc:
                raise _unavailable(exc, f"{self.url}/{directory}") from None
            finally:
                os.close(fd)

    def delete(self, key: str) -> None:
        parts = self._parts(key)
        where = self._where(key)
        try:
            self._unlink("/".join(parts[:-1]), parts[-1], where)  # a symlink at the key goes, never followed
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            raise _store_error(exc, where) from None

    def _unlink(self, directory: str, name: str, where: str) -> None:
        """Unlink ``name`` in ``directory``, opened beneath the root (OSError if it cannot be: the callers
        say what that means); gone already is done; an error unlinking is an UnavailableError."""
        dir_fd = self._open(directory, os.O_RDONLY | os.O_DIRECTORY, where)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _unavailable(exc, where) from None
        finally:
            os.close(dir_fd)

    def temp_files(self) -> Iterator[tuple[str, float]]:
        """(path below the root, mtime) of temporary files left by interrupted writes, for gc to remove
        with ``remove_temp_file``."""
        for directory, entry in self._walk("", self.url):
            if entry.name.startswith(TMP_PREFIX):
                try:
                    yield directory + entry.name, entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue

    def remove_temp_file(self, path: str) -> None:
        """Unlink ``path`` (from ``temp_files``) beneath the root, by its directory opened there: a
        directory of its path swapped for a symlink since the walk met it makes nothing outside go."""
        directory, _, name = path.rpartition("/")
        if not name.startswith(TMP_PREFIX):
            raise InputError(f"not a temporary file: {path!r}", where=self.url)
        where = f"{self.url}/{path}"
        try:
            self._unlink(directory, name, where)
        except OSError as exc:
            if exc.errno not in _NOT_WALKED:
                raise _unavailable(exc, where) from None
