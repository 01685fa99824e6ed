"""Fixtures of the erofs_builder tests; their helpers are in reader_support.py.

``rich`` (per module) is reader_support.make_source's tree, with device nodes, foreign owners and trusted
xattrs (so it needs root), built as a layer and exported.
"""

from __future__ import annotations

import os

import pytest

from tests.erofs_builder.reader_support import BuiltLayer, build, make_source


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> BuiltLayer:
    if os.geteuid() != 0:
        pytest.skip("the rich tree needs root (device nodes, chown, trusted xattrs)")
    tmp = tmp_path_factory.mktemp("rich")
    return build(tmp, make_source(tmp / "src"))
