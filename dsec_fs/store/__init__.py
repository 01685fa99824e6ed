"""Chunk stores: one interface (base.Store), backends, and policy wrappers. ``open_store(url)`` picks one.

URLs (parsed strictly: anything else is an InputError naming the URL):
    /some/dir, ./dir, file:///some/dir   the local directory store (the embedded default)
    posix:///mnt/3fs/dsecfs              a shared POSIX mount (3FS, NFS, ...); same atomic-write rules
    s3://bucket/prefix                   S3 or any S3-compatible endpoint (boto3; see s3.py)

Opening a store never creates it: a directory store that does not exist is a NotFoundError naming the
URL, so a mistyped --store cannot leave an empty store behind. ``init_store`` creates one (the directory,
or the bucket), which is what ``dsecfs store init`` and a build into a new store do.
"""

from __future__ import annotations

import os
import re

from ..errors import InputError
from ..paths import default_dir
from .base import Store
from .filesystem import FilesystemStore

DEFAULT_STORE_ENV = "DSECFS_STORE"
SCHEMES = ("file", "posix", "s3")
# S3's bucket naming rules: 3 to 63 lowercase letters, digits, dots and hyphens, a letter or digit at each end.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


def default_store_url() -> str:
    """$DSECFS_STORE, else a per-user data directory (/var/lib/dsecfs/store for root)."""
    return default_dir(DEFAULT_STORE_ENV, "/var/lib/dsecfs/store", "XDG_DATA_HOME", "~/.local/share", "store")


def parse_store_url(url: str) -> tuple[str, str]:
    """(scheme, location): ("file", an absolute path), ("posix", an absolute path) or ("s3", "bucket/prefix")."""
    where = f"store URL {url!r}"
    if not url or any(ord(c) < 0x20 for c in url):
        raise InputError("empty, or contains a control character", where=where)
    match = _SCHEME.fullmatch(url)
    if match is None:
        return "file", os.path.abspath(url)
    scheme, rest = match.group(1), match.group(2)
    if scheme not in SCHEMES:
        raise InputError(f"unknown scheme {scheme}:// (use a path, file://, posix:// or s3://)", where=where)
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise InputError(f"bad bucket name {bucket!r}: 3 to 63 lowercase letters, digits, '.' and '-'",
                             where=where)
        return scheme, rest
    if not rest.startswith("/"):
        raise InputError(f"{scheme}:// takes an absolute path, with three slashes: {scheme}:///{rest}",
                         where=where)
    return scheme, os.path.normpath(rest)


def open_store(url: str | None = None, *, create: bool = False) -> Store:
    """The store at ``url`` (default: default_store_url()). A directory store must exist unless ``create``
    (NotFoundError naming the URL); an S3 bucket is checked by its first request."""
    scheme, location = parse_store_url(url or default_store_url())
    if scheme == "s3":
        from .s3 import S3Store  # boto3 is an optional extra, imported only when asked for

        return S3Store.from_url(f"s3://{location}")
    return FilesystemStore(location, scheme=scheme, create=create)


def init_store(url: str | None = None) -> tuple[Store, bool]:
    """Create the store at ``url`` if it does not exist: (the store, whether it was created)."""
    scheme, location = parse_store_url(url or default_store_url())
    if scheme == "s3":
        store = open_store(url)
        return store, store.create_bucket_if_missing()
    existed = os.path.isdir(location)
    return FilesystemStore(location, scheme=scheme, create=True), not existed


__all__ = ["Store", "FilesystemStore", "open_store", "init_store", "parse_store_url", "default_store_url"]
