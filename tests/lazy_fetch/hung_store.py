"""A store object that never answers, made for real: a pack of a directory (POSIX) store replaced by a
FIFO nobody writes to, so that open(2) of it blocks in the kernel, as a read of a hung NFS or 3FS file does.

    hung = HungPack(store_dir, pack_id)   # reads of the pack block from now on
    ...
    hung.answer()                         # the pack is back; the reads stuck in the FIFO return

Import it as ``tests.lazy_fetch.hung_store``.
"""

from __future__ import annotations

import errno
import os

from dsec_fs.store import keys


class HungPack:
    def __init__(self, store_dir: str, pack_id: str):
        self.key = keys.pack(pack_id)
        self.path = os.path.join(store_dir, self.key)
        self._saved = self.path + ".saved"
        self._fifo = self.path + ".fifo"  # a second name, so the FIFO can be opened after the pack is back
        os.rename(self.path, self._saved)
        os.mkfifo(self._fifo)
        os.link(self._fifo, self.path)

    def answer(self) -> None:
        """Put the pack back, then open the FIFO for writing and close it, so the reads stuck in open(2)
        return (they see an empty object). Safe to call again."""
        if os.path.exists(self._saved):
            os.rename(self._saved, self.path)
        try:
            os.close(os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:  # ENXIO: no reader is stuck in it (any more)
            if exc.errno != errno.ENXIO:
                raise
