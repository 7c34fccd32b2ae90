"""The real-pair benchmark: `edge-sd bench` with the settings of benchmarks/results/real_pair.md.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    bash scripts/prepare_real_pair.sh engines/gemma3-270m_smollm2-135m --hf   # + fp32 HF folders
    .venv/bin/python benchmarks/real_pair.py [--quick] [other `edge-sd bench` options]

Writes benchmarks/results/real_pair.{md,json} and two PNG plots.
Extra arguments go to `edge-sd bench` after the defaults below (so they override them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from edge_sd.tools.cli import app

ROOT = Path(__file__).resolve().parents[1]
# The results' settings: 2 threads (the machines measured have 2 cores), transformers' assisted
# generation beside edge-sd, every k up to 8.
DEFAULTS = [
    "bench", str(ROOT / "engines" / "gemma3-270m_smollm2-135m"), "--threads", "2", "--transformers",
    "--per-set", "8", "-n", "64", "--draft-lengths", "1-8",
    "--out", str(ROOT / "benchmarks" / "results"),
]

if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    args = DEFAULTS[:2] + sys.argv[1:] if quick else DEFAULTS + sys.argv[1:]  # a smoke run writes no results
    os.environ["EDGE_SD_BENCH_COMMAND"] = " ".join(["python benchmarks/real_pair.py", *sys.argv[1:]])
    sys.argv = ["edge-sd", *args]
    app()
