"""Start-up and memory of `edge-sd generate`: time from launch to the first generated text, and the
process's peak resident memory against the engines' weights plus their KV buffers.

    .venv/bin/python benchmarks/startup.py engines/gemma3-270m_smollm2-135m [OTHER_FOLDER ...] [--runs 3]

Each folder is launched --runs times in a fresh process (`edge-sd generate FOLDER -p ... -n 32`); the
first launch after a folder was written pays the operating system's file cache filling, later ones
do not. Writes benchmarks/results/startup.md.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edge_sd.bench.run import machine
from edge_sd.manifest import ENGINE_FILE, PAIR_FILE, load_engine_manifest, load_pair_manifest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The three primary colors are"


def engines(folder: Path) -> list[Path]:
    if (folder / PAIR_FILE).is_file():
        pm = load_pair_manifest(folder)
        return [folder / pm.target, folder / pm.drafter]
    if (folder / ENGINE_FILE).is_file():
        return [folder]
    raise SystemExit(f"{folder}: not an edge-sd folder")


def weights_and_kv(folder: Path, positions: int) -> tuple[float, float]:
    """MB of weights (the engine files) and of KV buffers for `positions` positions (float32)."""
    weights = kv = 0.0
    for e in engines(folder):
        m = load_engine_manifest(e)
        weights += sum(f.bytes for f in m.files if f.path.startswith("model.onnx")) / 1e6
        kv += 2 * m.num_layers * m.num_kv_heads * m.head_dim * positions * 4 / 1e6
    return weights, kv


def launch(folder: Path, new_tokens: int) -> float:
    """One `edge-sd generate` in a fresh process: seconds from launch to its first text."""
    exe = shutil.which("edge-sd") or str(Path(sys.executable).with_name("edge-sd"))
    cmd = [exe, "generate", str(folder), "-p", PROMPT, "-n", str(new_tokens), "--threads", "2"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read().decode()
    proc.wait()
    if proc.returncode != 0 or not first:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-1000:]}")
    return first_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    rows = []
    for folder in args.folders:
        runs = [launch(folder, args.n) for _ in range(args.runs)]
        # Peak memory: one generation in a process of its own, which reports its own maximum.
        proc = subprocess.run([sys.executable, "-c", _PEAK, str(folder), str(args.n)], capture_output=True, text=True)
        peak_mb = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else float("nan")
        weights, kv = weights_and_kv(folder, 64 + args.n)
        rows.append({"folder": str(folder), "first": runs[0],
                     "later": statistics.median(runs[1:]) if len(runs) > 1 else None,
                     "peak_mb": peak_mb, "weights_mb": weights, "kv_mb": kv})
        print(rows[-1], file=sys.stderr, flush=True)
    m = machine()
    lines = ["# Start-up and memory of `edge-sd generate`", "",
             f"{datetime.date.today().isoformat()}; {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}; "
             f"`edge-sd generate FOLDER -p \"{PROMPT}\" -n {args.n} --threads 2`, each launch a fresh process. "
             f"Command: `python benchmarks/startup.py {' '.join(str(f) for f in args.folders)} --runs {args.runs}`.",
             "", "| folder | first text, first launch (s) | first text, later launches (s, median) | peak RSS (MB) | "
             "weights (MB) | KV buffers (MB) | RSS / (weights + KV) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        later = f"{r['later']:.2f}" if r["later"] is not None else "-"
        ratio = r["peak_mb"] / (r["weights_mb"] + r["kv_mb"])
        lines.append(f"| {Path(r['folder']).name} | {r['first']:.2f} | {later} | {r['peak_mb']:.0f} | "
                     f"{r['weights_mb']:.0f} | {r['kv_mb']:.0f} | {ratio:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# The peak resident memory of one generation in a process of its own (ru_maxrss of that process).
_PEAK = """
import resource, sys
from edge_sd import GenerationConfig, Pipeline
pipe = Pipeline.from_folder(sys.argv[1], threads=2)
pipe.generate("The three primary colors are", GenerationConfig(max_new_tokens=int(sys.argv[2])))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3)
"""


if __name__ == "__main__":
    main()
