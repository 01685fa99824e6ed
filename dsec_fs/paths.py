"""Where dsecfs keeps its files by default: one rule for every per-node directory.

An environment variable names the directory outright; otherwise root (a node daemon, image CI) uses a
system path under /var, and any other user the XDG base directory of the same kind, so that a user's
builds and tests neither need root nor write into the node's state. ``private_dir`` makes one that only
its owner may enter.
"""

from __future__ import annotations

import os
import stat

from .errors import InputError


def default_dir(env: str, system_path: str, xdg_env: str, xdg_fallback: str, name: str) -> str:
    """$env, else ``system_path`` for root, else ``$xdg_env`` (default ``~/xdg_fallback``)/dsecfs/``name``."""
    chosen = os.environ.get(env)
    if chosen:
        return chosen
    if os.geteuid() == 0:
        return system_path
    base = os.environ.get(xdg_env) or os.path.expanduser(xdg_fallback)
    return os.path.join(base, "dsecfs", name)


def private_dir(path: str) -> None:
    """Make ``path`` (and missing parents) a directory only its owner may enter: created 0700, and a
    directory found wider (group or other bits) narrowed to its owner's bits. Follows a symlink at
    ``path``: the operator named it. InputError if something else than a directory is there."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError("not a directory", where=path)
    if st.st_mode & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
