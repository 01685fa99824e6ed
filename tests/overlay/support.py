"""Helpers of the overlay tests (test_stack.py, test_sandbox.py); the fixtures (``store``, ``layers``,
``nothing_left_mounted``) are in conftest.py.

Import it as ``tests.overlay.support`` (not through conftest: pytest loads every directory's conftest
under the one name "conftest").
"""

from __future__ import annotations

from treecmp import write_files

from erofs_builder.build import build_layer


def build(store, tmp_path, ref: str, files: dict[str, bytes]) -> str:
    """Publish ``files`` as a layer named ``ref``; returns its digest."""
    source = write_files(tmp_path / "src" / ref.replace("/", "_").replace(":", "_"), files)
    return build_layer(source, store, name=ref).digest
