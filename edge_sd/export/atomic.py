"""Build an artifact folder beside its destination and move it into place only when complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edge_sd.errors import UsageError
from edge_sd.scratch import scratch_folder


@contextmanager
def atomic_folder(dest: Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces `dest`, on any failure it is removed.

    The temporary folder sits in `dest`'s parent so that the final rename stays on one filesystem.
    KeyboardInterrupt is a BaseException and takes the same clean-up path.
    """
    dest = Path(dest).absolute()
    if dest.exists() and not force:
        raise UsageError(f"{dest} already exists; pass --force to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_folder(dest.parent, f".{dest.name}.partial-")
    # mkdtemp makes its folder its owner's alone; the artifact folder is made as any other folder
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        if dest.exists():
            old = scratch_folder(dest.parent, f".{dest.name}.old-")
            os.replace(dest, old / dest.name)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
