"""Chunk stores: one interface (base.Store), backends, and policy wrappers. ``open_store(url)`` picks one.

URLs:
    /some/dir, file:///some/dir   the local directory store (the embedded default)
    posix:///mnt/3fs/dsecfs       a shared POSIX mount (3FS, NFS, ...); same atomic-write rules
    s3://bucket/prefix            S3 or any S3-compatible endpoint (boto3; see s3.py)
"""

from __future__ import annotations


from ..errors import InputError
from ..paths import default_dir
from .base import Store
from .filesystem import FilesystemStore

DEFAULT_STORE_ENV = "DSECFS_STORE"


def default_store_url() -> str:
    """$DSECFS_STORE, else a per-user data directory (/var/lib/dsecfs/store for root)."""
    return default_dir(DEFAULT_STORE_ENV, "/var/lib/dsecfs/store", "XDG_DATA_HOME", "~/.local/share", "store")


def open_store(url: str | None = None) -> Store:
    url = url or default_store_url()
    if url.startswith("s3://"):
        from .s3 import S3Store  # boto3 is an optional extra, imported only when asked for

        return S3Store.from_url(url)
    if url.startswith("posix://"):
        return FilesystemStore(url[len("posix://"):], scheme="posix")
    if url.startswith("file://"):
        return FilesystemStore(url[len("file://"):])
    if "://" in url:
        raise InputError(f"unknown store scheme in {url!r} (use a path, file://, posix:// or s3://)")
    return FilesystemStore(url)


__all__ = ["Store", "FilesystemStore", "open_store", "default_store_url"]
