"""edge-sd's own C kernels, compiled on first use by the system's C compiler for this CPU.

Each kernel's source lives in the module that uses it (engines/lm_head.py, engines/attention.py). It
is compiled by $CC (or cc) with -O3 -march=native and kept in the cache folder ($EDGE_SD_CACHE, by
default ~/.cache/edge-sd), under a name made from the source, the flags, the compiler's version and
the CPU: a later load finds it there, and a change to any of them builds it again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from edge_sd.layout import cache_dir


@functools.cache
def cpu_flags() -> str:
    """This CPU's instruction-set flags (/proc/cpuinfo), read once a process."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiled(source: str, name: str, what: str, defines: tuple[str, ...] = ()) -> Path:
    """The shared library built from `source` (lib<name>.so in the cache folder), built now if it is
    not there. Raises RuntimeError naming `what` where there is no compiler or it fails."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc}) to build {what}")
    flags = ["-O3", "-march=native", "-shared", "-fPIC", *(f"-D{d}" for d in defines)]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([source, cc, *flags, version, platform.machine(), cpu_flags()]).encode())
    path = cache_dir() / "kernels" / key.hexdigest()[:16] / f"lib{name}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / path.name
            src.write_text(source)
            done = subprocess.run([cc, *flags, "-o", str(out), str(src), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} could not build {what}: {done.stderr.strip()[-300:]}")
            out.replace(path)  # whole or not at all: another process finds a finished library or none
    return path
