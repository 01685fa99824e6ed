"""Tree.adder (the add a streamed input uses, which remembers the last parent directory) against Tree.add:
the same trees and the same errors for random streams of entries that replace, imply and nest."""

from __future__ import annotations

import random
import stat

import pytest

from dsec_fs.errors import InputError
from erofs_builder.tree import Node, Tree, make_dir

NAMES = [b"a", b"b", b"c"]


def random_stream(rng: random.Random, length: int) -> list[tuple[bytes, str]]:
    stream = []
    for _ in range(length):
        depth = rng.randint(1, 3)
        path = b"/".join(rng.choice(NAMES) for _ in range(depth))
        path = rng.choice([b"", b"/", b"./"]) + path + rng.choice([b"", b"", b"/"])
        stream.append((path, rng.choice(["dir", "file", "file"])))
    return stream


def node_of(kind: str, number: int) -> Node:
    if kind == "dir":
        return make_dir(mtime_ns=number)
    return Node(mode=stat.S_IFREG | 0o644, mtime_ns=number, source=str(number))


def apply(stream: list[tuple[bytes, str]], use_adder: bool) -> tuple[list, list]:
    tree = Tree()
    add = tree.adder() if use_adder else tree.add
    errors = []
    for number, (path, kind) in enumerate(stream):
        try:
            add(path, node_of(kind, number))
        except InputError as exc:
            errors.append((number, exc.message))
    return [(path, node.mode, node.mtime_ns) for path, node in tree.walk()], errors


@pytest.mark.parametrize("seed", range(200))
def test_adder_builds_what_add_builds(seed):
    stream = random_stream(random.Random(seed), 30)
    assert apply(stream, use_adder=True) == apply(stream, use_adder=False)


def test_adder_after_a_directory_became_a_file():
    tree = Tree()
    add = tree.adder()
    add(b"d/x", node_of("file", 1))
    add(b"d", node_of("file", 2))  # replaces the implied directory d, and forgets it as a parent
    with pytest.raises(InputError, match="not a directory"):
        add(b"d/y", node_of("file", 3))
    assert tree.lookup(b"d").mtime_ns == 2
