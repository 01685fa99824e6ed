"""Give the C heap's free memory back to the kernel between the phases of a long build.

Python objects over 512 bytes (file contents read, zstd frames, dict and list tables) come from the C
allocator, not from Python's own arenas. glibc's free() returns memory to the kernel only from the top of
its heap, so after a phase that interleaved many short-lived allocations (the chunks of a million small
files) with a few long-lived ones, the freed memory between them stays resident, and the next phase's
large buffers (meta.erofs, the build info) come on top of it. ``malloc_trim(0)`` hands every free page of
every arena back (madvise), which costs a walk over the free lists: milliseconds, once per phase.

Elsewhere than glibc (musl has no malloc_trim) this does nothing.

Threads: any thread may call it; glibc locks its arenas.
"""

from __future__ import annotations

import ctypes

try:
    # dlopen(NULL): the C library the interpreter runs on (ctypes.util.find_library runs ldconfig, ~4 ms)
    _malloc_trim = ctypes.CDLL(None).malloc_trim
    _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):
    _malloc_trim = None


def release_free_memory() -> None:
    """Return the C heap's free pages to the kernel (glibc), so that they stop counting as resident."""
    if _malloc_trim is not None:
        _malloc_trim(0)
