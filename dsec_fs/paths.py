"""Where dsecfs keeps its files by default, and how it makes them: one rule for every per-node directory.

An environment variable names the directory outright; otherwise root (a node daemon, image CI) uses a
system path under /var, and any other user the XDG base directory of the same kind, so that a user's
builds and tests neither need root nor write into the node's state.

What the node keeps (layer state, blobs, cached chunks, a local store's packs) is its own and not its
users': every byte of every image is in there, files a layer keeps 0600 included. ``private_dir`` makes
such a directory 0700, and narrows one it finds wider (made by an older version, or by hand), so that a
file's own mode inside never matters to another local user.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)


def default_dir(env: str, system_path: str, xdg_env: str, xdg_fallback: str, name: str) -> str:
    """$env, else ``system_path`` for root, else ``$xdg_env`` (default ``~/xdg_fallback``)/dsecfs/``name``."""
    chosen = os.environ.get(env)
    if chosen:
        return chosen
    if os.geteuid() == 0:
        return system_path
    base = os.environ.get(xdg_env) or os.path.expanduser(xdg_fallback)
    return os.path.join(base, "dsecfs", name)


def private_dir(path: str) -> str:
    """Make directory ``path`` (with any missing parents, which get the usual modes) if it is not there,
    and leave it 0700: readable, writable and searchable by its owner only. One found with any group or
    other bits is narrowed to 0700, and that is logged. Returns ``path``."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("%s was mode %04o: narrowed to 0700 (its contents are the node's, not its users')", path, mode)
        os.chmod(path, 0o700)
    return path
