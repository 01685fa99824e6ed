"""A store object that never answers, made for real: a FUSE file system (what 3FS is) mounted over a pack
of a directory (POSIX) store, whose reads wait until told to answer, as reads of a hung 3FS or NFS file
wait in the kernel. (A FIFO no longer does: the store refuses one at once as no object.)

    hung = HungPack(store_dir, pack_id)   # reads of the pack block from now on
    ...
    hung.answer()                         # the reads stuck in it return the pack's bytes; it is unmounted

The FUSE server runs in a process of its own (``python -m tests.lazy_fetch.hung_store PACK``, fusepy),
so its signal handlers and threads stay out of the test's; it answers once its stdin is closed. Import
it as ``tests.lazy_fetch.hung_store``.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

from dsec_fs.mounts import mount_device, umount_or_detach
from dsec_fs.store import keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HungPack:
    def __init__(self, store_dir: str, pack_id: str):
        self.key = keys.pack(pack_id)
        self.path = os.path.join(store_dir, self.key)
        self._server = subprocess.Popen([sys.executable, "-m", "tests.lazy_fetch.hung_store", self.path],
                                        stdin=subprocess.PIPE, cwd=ROOT)
        deadline = time.monotonic() + 20
        while mount_device(self.path) is None:
            if self._server.poll() is not None or time.monotonic() > deadline:
                self.answer()
                raise RuntimeError(f"the hung pack's FUSE server did not mount over {self.path}")
            time.sleep(0.02)

    def answer(self) -> None:
        """Let the stuck reads return the pack's bytes, then unmount (the pack beneath is the store's
        again). Safe to call again."""
        if self._server.stdin and not self._server.stdin.closed:
            self._server.stdin.close()
        if mount_device(self.path) is not None:
            umount_or_detach(self.path)
        try:
            self._server.wait(10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()


def _serve(path: str) -> None:
    import fuse  # fusepy: the test's FUSE server only

    fd = os.open(path, os.O_RDONLY)  # the pack beneath the mount, opened before it is hidden
    size = os.fstat(fd).st_size
    answered = threading.Event()
    
    def wait_for_eof() -> None:
        while os.read(0, 4096):
            pass
        answered.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()

    class OnePack(fuse.Operations):
        def getattr(self, name, fh=None):
            if name != "/":
                raise fuse.FuseOSError(errno.ENOENT)
            now = time.time()
            return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": size,
                    "st_atime": now, "st_mtime": now, "st_ctime": now}

        def read(self, name, length, offset, fh):
            answered.wait()
            return os.pread(fd, length, offset)

    fuse.FUSE(OnePack(), path, foreground=True, ro=True, fsname="hung-pack",
              nonempty=True)  # libfuse 2 calls a mountpoint file of any size "not empty"


if __name__ == "__main__":
    _serve(sys.argv[1])
