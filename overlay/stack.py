"""OverlayFS stacks: layer mountpoints merged under one target, and an upper dir turned back into a layer.

A sandbox's root is ``lowerdir=toolkit...:workspace:base`` (top first) with a private upper and work dir.
``mount_stack`` assembles it with mount(2); ``unmount_stack`` takes it apart; ``upper_to_tree`` reads an
upper dir as an erofs_builder Tree, so a changed workspace can be published as a new layer that OverlayFS
applies on top of the layers it was made over (whiteouts and opaque directories kept as OverlayFS wrote
them: a lower layer's whiteouts and opaque directories hide what is below it exactly as an upper's do).

Mount options (Linux 6.18), fixed because commit depends on them:

- ``metacopy=off``: with metacopy, a chmod/chown of a lower file copies up metadata only, and the upper
  entry's data lives in the lower (trusted.overlay.metacopy); published alone it would be an empty file.
- ``redirect_dir=off``: with redirect_dir, renaming a lower directory records the old path in
  trusted.overlay.redirect instead of copying it; that entry means nothing without the exact lowers it was
  made over. With it off, rename(2) of a merged directory fails with EXDEV and tools (mv, git, pip) fall
  back to copy and delete, which the upper records as a new (opaque) directory and a whiteout.
- ``index=off``: the inode index (hard links kept across copy-up, NFS export) ties an upper to one exact
  set of lowers by file handle; sandboxes need neither, and a stack of new layer mounts would be refused.
- ``xino=auto``: every layer is its own filesystem (one EROFS mount each); xino puts the layer number in
  the high bits of st_ino, so that every file shows the overlay's st_dev and still a unique st_ino (EROFS
  inode numbers are small, so the bits are free). The kernel uses it only if every lower filesystem has
  a distinct, non-null UUID; EROFS images whose superblock UUID is zero make it fall back to xino=off
  (dmesg: "null uuid detected in lower fs"). Then a non-directory shows its layer's own st_dev, which
  keeps (st_dev, st_ino) unique too, but differs from the st_dev of the overlay's directories.
- not ``userxattr``: we run as root, so OverlayFS keeps its bookkeeping in trusted.overlay.* (which is
  what ``upper_to_tree`` expects).
- ``volatile`` is optional (StackOptions): it skips every sync of the upper dir, which makes sandbox exits
  cheaper; after a crash the upper dir may have lost writes, and OverlayFS refuses to mount the same work
  dir again (the sandbox is thrown away anyway).

Mount flags ``nosuid,nodev``: a sandbox's root honours no setuid bit and no device node of an image (or
of its upper dir). Commands run with no_new_privs anyway, and the runtime mounts its own /dev over the
root; without nodev an image's device node opens wherever no devices cgroup stops it (the namespaces
runtime). OverlayFS checks the flags of its own mount, not those of the layers under it.

Paths: mount(2) data is split at ',' and lowerdir at ':'; OverlayFS accepts both (and '\\') escaped with
a backslash, so any path works. The data must fit one page (4096 bytes with the terminating NUL); a stack
that does not fit is refused with InputError (keep layer mountpoints short).

A read-only stack (no upper) of a single layer is a read-only bind mount of it: OverlayFS needs two
lowers when there is no upper.

Needs CAP_SYS_ADMIN (and trusted.* xattrs in upper_to_tree). Functions keep no state; any thread may call
them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from dsec_fs import mounts
from dsec_fs.errors import InputError, NotFoundError, UnsupportedError
from erofs_builder.limits import LayerBudget
from erofs_builder.tree import Tree
from erofs_builder.walk_dir import walk_directory

STACK_FLAGS = mounts.MS_NOSUID | mounts.MS_NODEV  # see the module docstring
MAX_LOWERS = 500  # the kernel's OVL_MAX_STACK
MOUNT_DATA_MAX = os.sysconf("SC_PAGE_SIZE") - 1  # mount(2) copies one page, NUL included

OVERLAY_XATTR_PREFIX = b"trusted.overlay."
OPAQUE_XATTR = b"trusted.overlay.opaque"  # "y": the directory hides the same directory in the layers below
# Upper entries whose meaning lives in a lower layer: a stack mounted with our options never writes them,
# and stripping them would publish something else than the sandbox saw.
LOWER_DEPENDENT_XATTRS = (b"trusted.overlay.redirect", b"trusted.overlay.metacopy")


@dataclass(frozen=True)
class StackOptions:
    xino: str = "auto"  # "auto" | "on" | "off"
    volatile: bool = False  # never sync the upper dir (see the module docstring)

    def mount_options(self) -> list[str]:
        if self.xino not in ("auto", "on", "off"):
            raise InputError(f"xino must be auto, on or off, not {self.xino!r}", where="stack options")
        options = ["index=off", "metacopy=off", "redirect_dir=off", f"xino={self.xino}"]
        if self.volatile:
            options.append("volatile")
        return options


def escape_path(path: str) -> str:
    """A path as OverlayFS reads it from mount data: '\\', ':' and ',' escaped with a backslash."""
    return path.replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def stack_mount_data(lowers: Sequence[str], upper_dir: str | None, work_dir: str | None,
                     options: StackOptions = StackOptions()) -> str:
    """The mount(2) data of a stack: "lowerdir=a:b:c,upperdir=..,workdir=..,<options>" (paths as given)."""
    parts = ["lowerdir=" + ":".join(escape_path(lower) for lower in lowers)]
    if upper_dir is not None:
        parts += [f"upperdir={escape_path(upper_dir)}", f"workdir={escape_path(work_dir)}"]
    data = ",".join(parts + options.mount_options())
    if len(os.fsencode(data)) > MOUNT_DATA_MAX:
        raise InputError(f"the mount options are {len(os.fsencode(data))} bytes, mount(2) takes at most "
                         f"{MOUNT_DATA_MAX}: use shorter layer mountpoints or fewer layers",
                         where=f"overlay stack of {len(lowers)} layers")
    return data


def mount_stack(lowers: Sequence[str | os.PathLike], upper_dir: str | os.PathLike | None,
                work_dir: str | os.PathLike | None, target: str | os.PathLike, *,
                options: StackOptions = StackOptions()) -> None:
    """Mount ``lowers`` (top first: toolkit..., workspace, base; any role may be missing) merged at ``target``.

    With ``upper_dir`` and ``work_dir`` (same filesystem, work dir empty) the stack is writable and every
    change lands in ``upper_dir``; with both None it is read-only.
    """
    lowers = [_existing_dir(lower, "layer") for lower in lowers]
    if not lowers:
        raise InputError("a stack needs at least one lower layer", where=os.fsdecode(target))
    if len(lowers) > MAX_LOWERS:
        raise InputError(f"{len(lowers)} layers, OverlayFS stacks at most {MAX_LOWERS}", where=os.fsdecode(target))
    if len(set(lowers)) != len(lowers):
        raise InputError("a layer appears twice in the stack", where=", ".join(lowers))
    if (upper_dir is None) != (work_dir is None):
        raise InputError("upper_dir and work_dir go together (both, or neither for a read-only stack)",
                         where=os.fsdecode(target))
    target = _existing_dir(target, "stack target")
    if upper_dir is None:
        if len(lowers) == 1:
            mounts.mount(lowers[0], target, "", mounts.MS_BIND)
            try:
                mounts.mount("none", target, "", mounts.MS_BIND | mounts.MS_REMOUNT | mounts.MS_RDONLY | STACK_FLAGS)
            except BaseException:
                mounts.umount(target, lazy=True)
                raise
            return
        mounts.mount("overlay", target, "overlay", mounts.MS_RDONLY | STACK_FLAGS,
                     stack_mount_data(lowers, None, None, options))
        return
    upper, work = _existing_dir(upper_dir, "upper dir"), _existing_dir(work_dir, "work dir")
    if os.stat(upper).st_dev != os.stat(work).st_dev:
        raise InputError("the upper and work dirs must be on one filesystem", where=f"{upper}, {work}")
    mounts.mount("overlay", target, "overlay", STACK_FLAGS, stack_mount_data(lowers, upper, work, options))


def unmount_stack(target: str | os.PathLike) -> None:
    """Unmount the stack at ``target``; if something still holds it (EBUSY), detach it lazily.

    NotFoundError if nothing is mounted there.
    """
    if not mounts.is_mountpoint(target):
        raise NotFoundError("nothing is mounted here", where=os.fsdecode(target))
    mounts.umount_or_detach(target)


def upper_to_tree(upper_dir: str | os.PathLike, budget: LayerBudget | None = None) -> Tree:
    """The upper dir as a Tree to build a layer from, with OverlayFS's markers kept and its bookkeeping gone.

    Kept as they are: whiteouts (character devices 0:0) and opaque directories (trusted.overlay.opaque).
    Dropped: every other trusted.overlay.* xattr. OverlayFS writes them for its own use on copy-up and they
    describe this mount, not the content: ``origin`` (a file handle of the lower inode, meaningless on
    another mount), ``impure`` (a directory holds copied-up entries whose inode numbers come from below),
    ``nlink``, ``uuid``, ``upper``, ``protattr``. Refused with UnsupportedError: ``redirect`` and
    ``metacopy``, which only a stack mounted with other options writes, and whose entries are not
    self-contained.

    Read the upper of a stack no process is writing to (walk_directory raises InputError for a file that
    changes while the layer is built). ``budget`` bounds the walk (walk_directory): a sandbox may have
    made millions of names, which the Tree would hold before any later check.
    """
    tree = walk_directory(upper_dir, budget)
    for path, node in tree.walk():
        for name in LOWER_DEPENDENT_XATTRS:
            if name in node.xattrs:
                raise UnsupportedError(f"{name.decode()} makes this entry depend on the layers below it "
                                       "(a stack mounted with redirect_dir or metacopy)", where=node.source)
        node.xattrs = {name: value for name, value in node.xattrs.items()
                       if not name.startswith(OVERLAY_XATTR_PREFIX) or name == OPAQUE_XATTR}
    return tree


def _existing_dir(path: str | os.PathLike, what: str) -> str:
    path = os.path.abspath(os.fsdecode(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NotFoundError(f"{what} does not exist", where=path) from None
    except OSError as exc:
        raise InputError(f"{what}: {os.strerror(exc.errno or 0)}", where=path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} is not a directory", where=path)
    return path
