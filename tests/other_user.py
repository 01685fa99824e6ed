"""What another local user (uid and gid 65534, no groups: setpriv) can read, for privacy tests.

    readable_by_nobody(paths)   # the paths among ``paths`` that user can list (directories) or read

Each path is tried as that user in a fresh /usr/bin/python3 (the test's virtualenv may be out of its
reach): a directory counts as readable when it can be listed, anything else when one byte can be read
(opened O_NONBLOCK, so a FIFO does not hang the probe). A path is tried as given; for a real question
pass every path below a directory, as ``all_paths`` lists them.
"""

from __future__ import annotations

import json
import os
import subprocess

NOBODY = 65534
_PROBE = r"""
import json, os, stat, sys
readable = []
for path in json.load(sys.stdin):
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.listdir(path)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                os.read(fd, 1)
            finally:
                os.close(fd)
        readable.append(path)
    except OSError:
        pass
print(json.dumps(readable))
"""


def readable_by_nobody(paths: list[str]) -> list[str]:
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "/usr/bin/python3", "-I", "-S", "-c", _PROBE],
                          input=json.dumps(paths), capture_output=True, text=True, check=True, cwd="/")
    return json.loads(done.stdout)


def all_paths(root: str) -> list[str]:
    """``root`` and every path below it (not following symlinks)."""
    found = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        found += [os.path.join(dirpath, name) for name in dirnames + filenames]
    return found
