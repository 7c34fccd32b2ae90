"""Keeping a runtime cache's weights in large pages of the page cache (Linux).

A session loaded from the runtime cache maps its prepacked weights from the cache's data file, and
every forward reads all of them. Where the page cache holds that file in 2 MiB folios (as it does
after the file was written, or read from start to end), the kernel maps them with one page-table
entry each; where it holds 4 KiB pages (read back by the mapping's own faults, after the file had
been evicted: a reboot, memory pressure), the same forward walks 512 times as many entries and
misses the TLB on the way, and decodes markedly slower (benchmarks/results/large_pages.md).

`too_small` measures how much of the file's resident mapping is in 2 MiB entries
(/proc/self/smaps, FilePmdMapped) right after the session is built; where too little is, the caller
drops the session, `reread` drops the file from the page cache (posix_fadvise) and reads it through,
which the kernel's readahead stores in large folios, then drops again what the load had not made
resident, and the caller builds the session again. What was dropped again (the embedding table, of
which a forward reads a row a token) faults in small pages as before, where in 2 MiB folios each row
read would map 2 MiB. Where that does not help (a kernel or file system without large folios for
files), a marker beside the file says so for that kernel and later loads skip it. EDGE_SD_LARGE_PAGES=0
skips it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "EDGE_SD_LARGE_PAGES"
MARKER = "large_pages.json"  # beside the data file: the kernel whose page cache gave no large pages
# Mappings smaller than this gain too little to be worth a re-read; shares below SMALL are re-read.
MIN_RESIDENT = 64 << 20
SMALL = 0.5
CHUNK = 8 << 20
LARGE = 2 << 20  # a PMD-mapped folio's size on x86-64 and arm64 with 4 KiB pages


@dataclass(frozen=True)
class Residency:
    """What this process holds of a file's mappings: resident bytes and those mapped in 2 MiB entries."""

    resident: int
    large: int
    # (offset, length) in the file of each mapping at least half resident: what the load itself read
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def share(self) -> float:
        return self.large / self.resident if self.resident else 1.0


def residency(path: Path, smaps: str | None = None) -> Residency | None:
    """Residency of this process's mappings of `path` (smaps: that file's text, for tests); None where
    the kernel does not say (no /proc/self/smaps, or no FilePmdMapped field in it)."""
    if smaps is None:
        try:
            smaps = Path("/proc/self/smaps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    target = str(Path(path).resolve())
    resident = large = 0
    seen = False
    mapping: list[int] | None = None  # offset, length, resident bytes of the mapping being read
    mappings = []
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode, path
            mapping = None
            if len(fields) == 6 and fields[5].strip() == target:
                start, _, end = fields[0].partition("-")
                mapping = [int(fields[2], 16), int(end, 16) - int(start, 16), 0]
                mappings.append(mapping)
        elif mapping is not None and fields[0] == "Rss:":
            mapping[2] = int(fields[1]) << 10
            resident += mapping[2]
        elif mapping is not None and fields[0] == "FilePmdMapped:":
            large += int(fields[1]) << 10
            seen = True
    spans = tuple(sorted((offset, length) for offset, length, held in mappings if 2 * held >= length))
    return Residency(resident, large, spans) if seen else None


def wanted(data: Path) -> bool:
    """Whether a small share of large pages should be re-read: on, on Linux, and not marked as of no
    use on this kernel."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    if not hasattr(os, "posix_fadvise") or platform.system() != "Linux":
        return False
    try:
        marked = json.loads((data.parent / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return not (isinstance(marked, dict) and marked.get("kernel") == platform.release())


def too_small(data: Path) -> Residency | None:
    """This process's residency of `data` where it is large and mostly in small pages and re-reading
    is `wanted`, else None."""
    if not wanted(data):
        return None
    held = residency(data)
    if held is None or held.resident < MIN_RESIDENT or held.share >= SMALL:
        return None
    return held


def reread(data: Path, spans: tuple[tuple[int, int], ...]) -> float:
    """Drop `data` from the page cache, read it from start to end (readahead takes a file read in order
    into large folios; read stretch by stretch, it did not) and drop again the whole 2 MiB stretches
    outside `spans` (offset, length; none: all of it is kept); seconds taken. Pages some other process
    maps stay as they are."""
    start = time.perf_counter()
    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, CHUNK):
            pass
        size = os.fstat(fd).st_size
        kept = 0
        for offset, length in [*(spans or ((0, size),)), (size, 0)]:
            gap_start, gap_end = -(-kept // LARGE) * LARGE, offset // LARGE * LARGE
            if gap_end > gap_start:
                os.posix_fadvise(fd, gap_start, gap_end - gap_start, os.POSIX_FADV_DONTNEED)
            kept = max(kept, offset + length)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def mark_of_no_use(data: Path, before: Residency, after: Residency | None) -> None:
    """Remember that re-reading gave no large pages on this kernel (best effort: a read-only folder
    re-reads at every load)."""
    record = {"kernel": platform.release(), "share_before": round(before.share, 3),
              "share_after": None if after is None else round(after.share, 3)}
    try:
        (data.parent / MARKER).write_text(json.dumps(record) + "\n", encoding="utf-8")
    except OSError:
        pass


MADV_DONTNEED = 4  # Linux


def release(path: Path, smaps: str | None = None) -> int:
    """Unmap this process's resident pages of its mappings of `path` that hold no page of their own
    (madvise MADV_DONTNEED): what a later access reads faults back in from the page cache, and what nothing
    reads again stops counting against the process. A session loaded from the runtime cache has read
    every prepacked weight once; where the runtime computes the LM head itself (engines/lm_head.py),
    the graph's copy of the head would otherwise stay resident unread. Returns the bytes unmapped (0
    where the kernel or libc does not offer it)."""
    if platform.system() != "Linux":
        return 0
    if smaps is None:
        try:
            smaps = Path("/proc/self/smaps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return 0
    target = str(Path(path).resolve())
    ranges: list[list[int]] = []  # address, length, bytes of its own (copied on write)
    mapping: list[int] | None = None
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a header: address range, permissions, offset, device, inode, path
            mapping = None
            if len(fields) == 6 and fields[5].strip() == target:
                start, _, end = fields[0].partition("-")
                mapping = [int(start, 16), int(end, 16) - int(start, 16), -1]
                ranges.append(mapping)
        elif mapping is not None and fields[0] == "Anonymous:":
            mapping[2] = int(fields[1]) << 10
    # A mapping holding pages of its own (written to, copied on write) would lose them: left alone,
    # as is one whose smaps does not say.
    ranges = [r for r in ranges if r[2] == 0]
    if not ranges:
        return 0
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return sum(length for start, length, _ in ranges if madvise(start, length, MADV_DONTNEED) == 0)
