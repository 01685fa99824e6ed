"""Helpers of the overlay tests (test_stack.py, test_sandbox.py); the fixtures (``store``, ``layers``,
``nothing_left_mounted``) are in conftest.py.

Import it as ``tests.overlay.support`` (not through conftest: pytest loads every directory's conftest
under the one name "conftest").
"""

from __future__ import annotations

import os

import pytest
from treecmp import write_files

from erofs_builder.build import build_layer


def build(store, tmp_path, ref: str, files: dict[str, bytes]) -> str:
    """Publish ``files`` as a layer named ``ref``; returns its digest."""
    source = write_files(tmp_path / "src" / ref.replace("/", "_").replace(":", "_"), files)
    return build_layer(source, store, name=ref).digest


def build_programs(store, tmp_path, debian_rootfs: str, ref: str, programs: dict[str, str],
                   files: dict[str, bytes]) -> str:
    """Publish a layer named ``ref`` of ``programs`` (in-image path -> path in the Debian rootfs, made
    0755) and ``files``; returns the ref. Skips the test if the rootfs lacks one (not x86_64?)."""
    content = dict(files)
    for image_path, source in programs.items():
        path = os.path.join(debian_rootfs, source)
        if not os.path.isfile(path):
            pytest.skip(f"no {source} in the Debian rootfs (not x86_64?)")
        with open(path, "rb") as f:
            content[image_path] = f.read()
    root = write_files(tmp_path / "src" / ref.replace("/", "_").replace(":", "_"), content)
    for image_path in programs:
        os.chmod(os.path.join(root, image_path), 0o755)
    build_layer(root, store, name=ref)
    return ref
