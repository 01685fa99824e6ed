"""erofs_builder: turn a directory, tar or OCI layout into a layer (an EROFS metadata image plus chunks).

The public entry points are re-exported here and imported on first use (PEP 562), so importing one
submodule (e.g. ``erofs_builder.tree``) does not pull in the whole builder.

    build_layer(source, store, *, name=None, chunk_size=1 << 20, progress=None, workers=None) -> BuildResult
    build_tree(tree, store, *, name=None, chunk_size=1 << 20, progress=None, workers=None, source="")
    walk_directory(root) -> Tree
    chunk_tree(tree, uploader, index, *, chunk_size=1 << 20, workers=None, progress=None) -> (BlobMap, ChunkStats)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_layer": ".build",
    "build_tree": ".build",
    "BuildResult": ".build",
    "walk_directory": ".walk_dir",
    "chunk_tree": ".chunker",
    "ChunkStats": ".chunker",
    "Node": ".tree",
    "Tree": ".tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
