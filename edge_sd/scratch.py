"""Temporary folders named for the process that made them, so that those a killed process left behind
(an export or a first load ended by SIGKILL, or the machine going down) are removed by the next
process that makes one in the same place: nothing else ever would, and they can hold gigabytes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def scratch_folder(parent: Path, prefix: str) -> Path:
    """A new temporary folder in `parent` named for this process (prefix, pid, random part), made
    after removing those of ended processes (`remove_orphans`)."""
    remove_orphans(parent, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def remove_orphans(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders in `parent` that `scratch_folder` made for processes that no longer run (a
    killed export or first load: nothing else would ever remove them); returns them. A process on
    this machine is asked for by its pid; a folder of a running one is left alone."""
    removed: list[Path] = []
    try:
        found = list(Path(parent).glob(f"{prefix}*"))
    except OSError:
        return removed
    for path in found:
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's: running
        return True
    return True
