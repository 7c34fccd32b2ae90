"""Temporary folders named for the process that made them, so that those a killed process left behind
(an export or a first load ended by SIGKILL, or the machine going down) are removed by the next
process that makes one in the same place: nothing else ever would, and they can hold gigabytes."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("edge_sd")

# Folders named before they carried a pid (`PREFIX<random>`) cannot be traced to a process; one left
# untouched this long belongs to no export or first load still running (those take minutes).
UNNAMED_AGE_S = 24 * 3600


def scratch_folder(parent: Path, prefix: str) -> Path:
    """A new temporary folder in `parent` named for this process (prefix, pid, random part), made
    after removing those of ended processes (`remove_orphans`)."""
    remove_orphans(parent, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def remove_orphans(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders in `parent` that `scratch_folder` made for processes that no longer run (a
    killed export or first load: nothing else would ever remove them), each named in a log line
    (the command line prints it as a note); returns them. A process on this machine is asked for by
    its pid; a folder of a running one is left alone."""
    removed: list[Path] = []
    try:
        found = list(Path(parent).glob(f"{prefix}*"))
    except OSError:
        return removed
    for path in found:
        why = _orphaned(path, path.name[len(prefix):])
        if why and path.is_dir():
            size = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                log.info("removed %s (%.1f MB), left by %s", path, size / 1e6, why)
    return removed


def _orphaned(path: Path, rest: str) -> str:
    """Why `path` is an orphan ("" when it is not, or may not be)."""
    pid, dash, _ = rest.partition("-")
    if dash and pid.isdigit():
        if int(pid) != os.getpid() and not _running(int(pid)):
            return f"process {pid}, which no longer runs"
        return ""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return ""
    return f"a process that ended over {UNNAMED_AGE_S // 3600} hours ago" if age > UNNAMED_AGE_S else ""


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's: running
        return True
    return True
