"""When ONNX Runtime's worker threads should spin, for a target and a drafter that take turns.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    .venv/bin/python benchmarks/spin.py [--pair DIR] [--rounds 20] [--repeats 2]

Each setting of OrtEngine's `spin` (always / run / never) is loaded in a process of its own (threads
that spin in one process would slow the next setting's engines in the same process), the settings
taking turns `--repeats` times. In each: the pair's target and drafter, 150 positions cached, then
`--rounds` rounds of what speculative decoding does (a two-position target forward, two one-position
drafter steps) and as many one-position target steps alone (plain decoding); medians in ms. Writes
benchmarks/results/spin.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
OUT = ROOT / "benchmarks" / "results" / "spin.md"
CONTEXT = 150
COLUMNS = ("target, 2 positions", "drafter step after the target", "drafter step after a drafter step",
           "target alone, 1 position")


def measure(pair: Path, spin: str, rounds: int) -> list[float]:
    """Run in the child process: the four medians (ms) for one setting."""
    import time

    import numpy as np

    from edge_sd.engines.ort import OrtEngine

    target = OrtEngine(pair / "target", threads=2, spin=spin)
    drafter = OrtEngine(pair / "drafter", threads=2, spin=spin, min_step_positions=1)
    ids = np.arange(CONTEXT + 2) % 1000 + 3
    for e in (target, drafter):
        e.reset()
        e.reserve(CONTEXT + 8)
        e.forward(ids[:CONTEXT])

    def timed(engine: OrtEngine, n: int) -> float:
        start = time.perf_counter()
        engine.forward(ids[CONTEXT:CONTEXT + n])
        engine.truncate(CONTEXT)
        return 1e3 * (time.perf_counter() - start)

    cols: list[list[float]] = [[], [], [], []]
    for _ in range(rounds):
        cols[0].append(timed(target, 2))
        cols[1].append(timed(drafter, 1))
        cols[2].append(timed(drafter, 1))
    for _ in range(rounds):
        cols[3].append(timed(target, 1))
    return [statistics.median(c) for c in cols]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.pair, args.child, args.rounds)))
        return

    from edge_sd.engines.ort import SPIN

    runs: dict[str, list[list[float]]] = {s: [] for s in SPIN}
    for r in range(args.repeats):
        for spin in SPIN:
            out = subprocess.run([sys.executable, __file__, "--pair", str(args.pair), "--rounds", str(args.rounds),
                                  "--child", spin], check=True, capture_output=True, text=True).stdout
            runs[spin].append(json.loads(out.strip().splitlines()[-1]))
            print(f"[{r + 1}/{args.repeats}] {spin}: " + ", ".join(f"{v:.1f}" for v in runs[spin][-1]), file=sys.stderr)
    lines = [
        f"Command: `python benchmarks/spin.py --rounds {args.rounds} --repeats {args.repeats}` "
        f"({datetime.date.today()}); pair `{args.pair.name}`, 2 threads per engine, {CONTEXT} positions cached. "
        "Each cell: the median over the rounds of one process, one per repeat (ms).",
        "",
        "| spin | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for spin, values in runs.items():
        cells = [" / ".join(f"{v[i]:.1f}" for v in values) for i in range(len(COLUMNS))]
        lines.append(f"| {spin} | " + " | ".join(cells) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
