"""auto against fixed configurations on held-out prompts, several sampling seeds pooled into one table.

One `edge-sd bench` run seeds each prompt once, so a sampled row of 16 prompts rests on 16 draws
whose per-prompt ratios move from run to run on a busy machine. This pools the records of several runs (each
its own seed) into one table, every speedup still against plain decoding of the same prompt and seed:

    P=engines/gemma3-270m_smollm2-135m   # after scripts/real_pair.sh (DISCO calibrated on prompts 1-4)
    edge-sd bench $P --skip 4 --per-set 8 -n 48 --draft-lengths 2 --algorithms slem --modes greedy \\
        --schedules disco --no-transformers -o runs/greedy
    edge-sd bench $P --skip 4 --per-set 8 -n 48 --draft-lengths 1,2 --algorithms tli,slrs --modes sample \\
        --no-transformers -o runs/seed0 --seed 0
    edge-sd bench $P --skip 4 --per-set 8 -n 48 --draft-lengths 1,2 --algorithms tli,slrs --modes sample \\
        --no-transformers -o runs/seed1000 --seed 1000
    python benchmarks/heldout.py runs/greedy runs/seed0 runs/seed1000

Writes benchmarks/results/heldout.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edge_sd.bench.report import summarise, table


def pooled(results: list[dict], mode: str) -> dict:
    """The records of one mode from every run, each prompt id tagged with its run so that plain
    decoding of the same prompt under another seed is not taken for this one's. The saved records
    carry no token ids (greedy output checks need them): pool sampled runs only."""
    return {"records": [{**r, "prompt": f"{r['prompt']}#{i}", "token_ids": None}
                        for i, res in enumerate(results) for r in res["records"] if r["mode"] == mode]}


def main(runs: list[Path]) -> None:
    results = [json.loads((run / "real_pair.json").read_text()) for run in runs]
    # Greedy output is the same under any seed: its rows come from the run's own summary, which
    # checked every output against plain decoding token for token.
    rows = [r for res in results for r in res["summary"] if r["mode"] == "greedy"]
    rows += summarise(pooled(results, "sample"))
    opts, machine = results[0]["options"], results[0]["machine"]
    first, last = opts["skip"] + 1, opts["skip"] + opts["per_set"]
    lines = [
        f"Pooled from {len(runs)} `edge-sd bench` runs ({', '.join(r['date'] for r in results)}), commands in "
        f"`benchmarks/heldout.py`; prompts {first}-{last} of each set (held out from DISCO's calibration on "
        f"1-{opts['skip']}), {opts['max_new_tokens']} new tokens. Speedup: median over (prompt, seed) of tok/s "
        "against plain decoding of the same prompt and seed in the same run.",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, ONNX Runtime {machine['onnxruntime']}.",
    ]
    for mode, title in (("greedy", "Greedy (temperature 0)"), ("sample", "Sampling (temperature 1)")):
        mode_rows = [r for r in rows if r["mode"] == mode]
        if mode_rows:
            lines += ["", f"**{title}**, {mode_rows[0]['prompts']} generations a row", "", table(mode_rows, mode)]
    text = "\n".join(lines) + "\n"
    (Path(__file__).parent / "results" / "heldout.md").write_text(text)  # the folder is in the repository
    print(text)


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
