"""Unpack a tar into a directory with GNU tar, for tests and benchmarks that need a source tree.

Python's ``tarfile`` extraction filters (``filter="data"``) arrived in 3.11.4; Debian 12's python3 is
3.11.2, where ``extractall`` has no such argument and would trust every member. GNU tar refuses members
naming ``..``, strips leading slashes and holds back symlinks until the end, so a member cannot write
outside ``dest`` through them; ``--no-same-owner`` keeps the files the caller's, as the data filter does.
"""

from __future__ import annotations

import os
import subprocess


def extract_tar(archive: str | bytes, dest: str) -> None:
    """Unpack ``archive`` (a path, or the tar's bytes; compressed ones too) into ``dest`` (made if absent)."""
    os.makedirs(dest, exist_ok=True)
    source = ["-f", archive] if isinstance(archive, str) else ["-f", "-"]
    subprocess.run(["tar", "-x", "--no-same-owner", "-C", dest, *source],
                   input=archive if isinstance(archive, bytes) else None, check=True, capture_output=True)
