"""Acceptance of every algorithm on the tiny test pairs (greedy, the test prompts, 24 new tokens).

    EDGE_SD_TEST_CACHE=/tmp/tiny pytest -q tests/test_export.py   # builds the tiny pairs once
    python benchmarks/tiny_pairs.py /tmp/tiny                      # then this table

Writes benchmarks/results/tiny_pairs.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from edge_sd import GenerationConfig, Pipeline  # noqa: E402

from conftest import CROSS_PAIRS  # noqa: E402
from test_lossless import NEW_TOKENS, PROMPTS  # noqa: E402


def main(root: Path) -> None:
    rows = ["| pair | algorithm | k | acceptance rate | tokens per target forward |", "|---|---|---|---|---|"]
    for pair in (*CROSS_PAIRS, "llama_same"):
        pipe = Pipeline.from_folder(root / "pairs" / pair, provider="cpu", threads=2)
        algos = ("standard",) if pair == "llama_same" else ("slem", "tli", "slrs")
        for algo in algos:
            for k in (1, 3, 5):
                prop = acc = new = fwd = 0
                for prompt in PROMPTS:
                    s = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo,
                                                               lookahead=k)).stats
                    prop, acc, new, fwd = prop + s.proposed, acc + s.accepted, new + s.new_tokens, \
                        fwd + s.target_forwards
                rows.append(f"| {pair} | {algo} | {k} | {acc / max(prop, 1):.2f} | {new / fwd:.2f} |")
    text = "\n".join(rows) + "\n"
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "tiny_pairs.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
