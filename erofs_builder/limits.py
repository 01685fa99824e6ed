"""How big an input a build takes: bounds on a layer and on a tar stream, and the check of a layer's size.

A layer's cost is not its input's size: a 353 KiB tar of 64 sparse members of 1 TiB each is 64 Mi chunk
entries, half a GiB of meta.erofs and more in memory. ``LayerLimits`` bounds what the layer itself will
be, whatever the input: its logical size (every regular file's size, holes included, a hard-linked inode
once) and an estimate of its metadata (inodes, names, xattrs, symlink targets and 8 bytes of chunk index
per chunk: the bulk of meta.erofs and of the Tree in memory). ``LayerBudget`` adds entries up as a walk
places them and raises InputError, naming the entry and the limit, as soon as one is exceeded: before
that entry's content is read, so a bomb costs the time of its headers. Stream builds (tar, OCI) check
each member as it arrives; a directory's walk (walk_dir.py) each name as it is placed, and a directory's
listing as it is read (``check_listing``): a source of millions of names, a sandbox's upper dir at its
commit, is refused once past the bound, not held whole in memory first (the Tree of a walk keeps a few
hundred bytes a name). ``check_tree`` checks a finished tree, before any file is read.

``TarLimits`` bounds the parsing of one tar stream (walk_tar.py). Its decompression-bomb ratio counts
only the data a build stores: a piece of a file that is all zeros (a chunk the build stores as a hole)
is not counted, so a preallocated disk image of zeros passes, and the time it costs is bounded by
``LayerLimits.max_size``.

Every limit can be raised: ``dsecfs build --max-size``, ``--max-meta-size`` and ``--tar-limit
NAME=VALUE``. Plain data and one object per walk: one thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsec_fs.errors import InputError
from dsec_fs.units import human_size, parse_size

from .tree import Node, Tree

CHUNK_INDEX_ENTRY = 8  # bytes of an EROFS chunk index entry (struct erofs_inode_chunk_index)
INODE_BYTES = 64  # an extended inode; compact ones are 32
DIRENT_BYTES = 12  # struct erofs_dirent, without the name


@dataclass(frozen=True)
class LayerLimits:
    max_size: int = 256 << 30  # logical bytes of all regular files together (holes count)
    max_meta_size: int = 256 << 20  # estimated bytes of metadata (see the module docstring)


@dataclass(frozen=True)
class TarLimits:
    """Bounds that keep a hostile archive from exhausting memory or time; raise them for unusual inputs."""

    max_file_size: int = 1 << 40  # logical size of one regular file (a sparse file's real size)
    max_header_size: int = 1 << 20  # PAX records plus GNU long names of one member
    max_sparse_segments: int = 1 << 16  # data segments in one sparse map
    max_tar_bytes: int = 1 << 42  # uncompressed tar stream in total
    # Decompression bomb: at most max_expansion uncompressed bytes per compressed input byte, once past
    # expansion_allowance; all-zero pieces of files are not counted (see the module docstring). gzip
    # cannot exceed ~1032:1; zstd reaches ~32000:1 on long runs of zeros.
    max_expansion: int = 10_000
    expansion_allowance: int = 256 << 20


DEFAULT_LAYER_LIMITS = LayerLimits()
DEFAULT_LIMITS = TarLimits()


def tar_limits_with(settings: list[str], base: TarLimits = DEFAULT_LIMITS) -> TarLimits:
    """``base`` with NAME=VALUE settings applied (``--tar-limit max_expansion=100000``; sizes as 4G)."""
    names = {field.name for field in dataclasses.fields(TarLimits)}
    changes = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        name = name.strip().replace("-", "_")
        if name not in names or not value:
            raise InputError(f"not a tar limit setting: {setting!r} (NAME=VALUE, NAME one of {', '.join(sorted(names))})",
                             where="--tar-limit")
        changes[name] = parse_size(value)
    return dataclasses.replace(base, **changes)


class LayerBudget:
    """The running size of one layer's entries against ``limits`` (see the module docstring)."""

    def __init__(self, limits: LayerLimits, chunk_size: int):
        self.limits = limits
        self.chunk_size = chunk_size
        self.size = 0  # logical bytes of regular files
        self.meta = 0  # estimated metadata bytes

    def add(self, name: bytes, node: Node, *, new_inode: bool) -> None:
        """Count a name placed in the layer; ``new_inode`` unless it is another name of a counted inode."""
        self.meta += DIRENT_BYTES + len(name)
        if new_inode:
            self.meta += INODE_BYTES + len(node.target)
            if node.xattrs:  # (most entries have none: no generator for them)
                self.meta += sum(len(k) + len(v) + 4 for k, v in node.xattrs.items())
            if node.is_reg:
                self.size += node.size
                self.meta += -(-node.size // self.chunk_size) * CHUNK_INDEX_ENTRY
        if self.size > self.limits.max_size:
            raise InputError(f"the layer's files add up to more than {human_size(self.limits.max_size)} "
                             f"({self.size} bytes so far; raise it with --max-size)", where=node.source or repr(name))
        if self.meta > self.limits.max_meta_size:
            self._too_much_metadata(self.meta, node.source or repr(name))

    def check_listing(self, names: int, name_bytes: int, where: str) -> None:
        """InputError if ``names`` names not added yet (``name_bytes`` bytes of them together: a directory
        being listed, ``where``) would take the metadata past its bound, each counted as an inode of its
        own (a listing holds each name's lstat, several times what its inode costs in the layer: only a
        directory of millions of hard links is counted more than it costs)."""
        pending = self.meta + names * (DIRENT_BYTES + INODE_BYTES) + name_bytes
        if pending > self.limits.max_meta_size:
            self._too_much_metadata(pending, where)

    def _too_much_metadata(self, meta: int, where: str) -> None:
        raise InputError(f"the layer's metadata would exceed {human_size(self.limits.max_meta_size)} "
                         f"(about {meta} bytes so far; raise it with --max-meta-size)", where=where)


def check_tree(tree: Tree, limits: LayerLimits, chunk_size: int) -> None:
    """InputError if the finished ``tree`` exceeds ``limits`` (a hard-linked inode counted once)."""
    budget = LayerBudget(limits, chunk_size)
    budget.add(b"", tree.root, new_inode=True)
    linked: set[int] = set()  # id() of the inodes with several names counted so far
    for directory in tree.nodes():  # in no order: no sorting of names, unlike Tree.walk
        for name, node in (directory.children or {}).items():
            new_inode = True
            if node.nlink > 1 and not node.is_dir:
                new_inode = id(node) not in linked
                linked.add(id(node))
            budget.add(name, node, new_inode=new_inode)
