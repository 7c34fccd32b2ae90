"""Where large host blocks come from (glibc's malloc).

glibc serves a block of 128 KiB or more from a mapping of its own and returns it to the system when it
is freed, until a freed mapped block raises that threshold to its size (up to 32 MiB). From then on
the blocks an ONNX Runtime forward allocates and frees (logits of up to 17 rows of a 262k vocabulary,
attention scratch growing with the context) come from the heap, where they interleave with small
blocks that live on, and the holes they leave are never given back: resident memory climbs through a
long generation. Fixing the threshold where glibc starts it keeps those blocks mapped. A mapped block
costs a page fault a page the first time it is written, so the decoding loop's forwards write their
logits into a buffer the engine reuses (engines/ort.py, `forward(scratch=True)`). A process that sets
MALLOC_MMAP_THRESHOLD_ keeps its own.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD = 128 * 1024  # glibc's own starting value


@functools.cache
def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold, once per process; whether it was set (False off glibc, or where the
    environment sets it)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False
