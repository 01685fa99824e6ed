"""What a layer made by someone else may not hand to the host: the privileged parts of a tree.

A sandbox runs as root inside (with CAP_FSETID, CAP_MKNOD and CAP_SETFCAP), so its upper dir can hold a
setuid-root shell, a 0666 character device 1:1 (/dev/mem) or a binary with file capabilities. Inside the
sandbox they give nothing (the stack is nosuid,nodev and commands run with no_new_privs), and neither do
layer mounts (nosuid,nodev); but ``sandbox commit`` publishes them and ``dsecfs extract`` as root
recreates them on the host, where any local user could run them. So by default both drop them:

- the setuid bit of every non-directory, and its setgid bit (setgid on a directory only makes new entries
  inherit its group, and stays);
- character and block devices, except OverlayFS whiteouts (character devices 0:0), which are how a layer
  says "deleted" and stay as they are;
- ``security.capability`` xattrs (file capabilities).

``keep_privileged`` (``--keep-privileged``) restores everything, as tar -p does. ``Dropped`` counts what
was dropped, per kind. Plain functions, no state: any thread.
"""

from __future__ import annotations

import stat
from dataclasses import asdict, dataclass

from .tree import Tree

CAPABILITY_XATTR = b"security.capability"


@dataclass
class Dropped:
    setuid: int = 0  # inodes whose setuid bit was cleared
    setgid: int = 0  # non-directories whose setgid bit was cleared
    devices: int = 0  # device nodes left out
    capabilities: int = 0  # inodes whose security.capability xattr was left out

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def total(self) -> int:
        return self.setuid + self.setgid + self.devices + self.capabilities


def is_whiteout(mode: int, rdev: int) -> bool:
    """An OverlayFS whiteout: a character device 0:0."""
    return stat.S_ISCHR(mode) and rdev == 0


def is_device(mode: int, rdev: int) -> bool:
    """A device node that is not a whiteout."""
    return (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) and not is_whiteout(mode, rdev)


def unprivileged_mode(mode: int, dropped: Dropped) -> int:
    """``mode`` without the setuid bit, and without setgid unless it is a directory's; counts what it clears."""
    if mode & stat.S_ISUID:
        dropped.setuid += 1
        mode &= ~stat.S_ISUID
    if mode & stat.S_ISGID and not stat.S_ISDIR(mode):
        dropped.setgid += 1
        mode &= ~stat.S_ISGID
    return mode


def unprivileged_xattrs(xattrs: dict[bytes, bytes], dropped: Dropped) -> dict[bytes, bytes]:
    if CAPABILITY_XATTR not in xattrs:
        return xattrs
    dropped.capabilities += 1
    return {name: value for name, value in xattrs.items() if name != CAPABILITY_XATTR}


def drop_privileged(tree: Tree) -> Dropped:
    """Take the privileged parts out of ``tree`` in place (see the module docstring); call Tree.finish()
    again afterwards, since device nodes are removed."""
    dropped = Dropped()
    seen: set[int] = set()  # id() of the nodes done: a hard-linked inode counts once
    for directory in list(tree.nodes()):
        if not directory.is_dir:
            continue
        for name, node in list(directory.children.items()):
            if is_device(node.mode, node.rdev):
                del directory.children[name]
                if id(node) not in seen:
                    seen.add(id(node))
                    dropped.devices += 1
    for node in tree.nodes():
        if id(node) not in seen:
            seen.add(id(node))
            node.mode = unprivileged_mode(node.mode, dropped)
            node.xattrs = unprivileged_xattrs(node.xattrs, dropped)
    return dropped
