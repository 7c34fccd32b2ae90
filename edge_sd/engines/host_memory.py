"""Where large host blocks come from (glibc's malloc).

glibc serves a block of 128 KiB or more from a mapping of its own and returns it to the system when it
is freed, until a freed mapped block raises that threshold to its size (up to 32 MiB). From then on
the blocks an ONNX Runtime forward allocates and frees (logits of up to 17 rows of a 262k vocabulary,
attention scratch growing with the context) come from the heap, where they interleave with small
blocks that live on, and the holes they leave are never given back: resident memory climbs through a
long generation. Fixing the threshold keeps the largest of them mapped.

It is fixed at 8 MiB, not at glibc's starting 128 KiB: a mapped block costs a page fault a page each
time a forward writes it, and a forward's blocks between the two (an LM head part's logits, 256 KiB a
row, export/logits.py) made the target's verification forwards markedly slower when mapped, while
taking them from the heap left resident memory as flat over a 2048-token generation
(benchmarks/results/startup.md). A forward's whole-vocabulary logits stay mapped, so the decoding loop
writes them into a buffer the engine reuses (engines/engine.py, `forward(scratch=True)`). A process that
sets MALLOC_MMAP_THRESHOLD_ keeps its own.

A fixed mmap threshold also fixes glibc's trim threshold, at 128 KiB: every freed heap block of more
than that at the top of the heap was given back to the system, and the next one page-faulted its
pages in again. Choosing a token allocates such blocks (a 262k-entry row of float32 is 1 MiB: the
penalized logits, the weights), and trimming made it several times slower
(benchmarks/results/sampler.md). The trim threshold is fixed at 32 MiB: the heap keeps at most that
much free at its top. MALLOC_TRIM_THRESHOLD_ in the environment keeps its own.

Neither threshold returns free pages inside the heap. A long prompt's forwards allocate and free
blocks under the mmap threshold (attention over hundreds of rows), which land in the heap's free
space wherever it lies and leave its pages resident: without a trim, a Gemma-3-270M target's heap
held several times what it had in use after a long prefill (benchmarks/results/context_depth.md).
`give_back` (glibc's malloc_trim) returns them; an engine calls it after a forward of many
positions, where it costs well under 1% of the forward.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
THRESHOLD = 8 << 20
TRIM_THRESHOLD = 32 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def give_back() -> None:
    """Return the heap's free pages to the system (glibc only; elsewhere nothing)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.cache
def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold, once per process; whether it was set (False off glibc, or where the
    environment sets it)."""
    libc = _libc()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or libc is None:
        return False
    try:
        if not os.environ.get("MALLOC_TRIM_THRESHOLD_"):
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except AttributeError:
        return False
