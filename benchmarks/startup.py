"""Start-up and memory of `edge-sd generate`: time from launch to the first generated text, and the
process's resident memory against the engines' weights plus their KV buffers.

    .venv/bin/python benchmarks/startup.py engines/gemma3-270m_smollm2-135m [OTHER_FOLDER ...] [--runs 4]

Each folder is launched --runs times in a fresh process (`edge-sd generate FOLDER -p ... -n 32`). The
first launch starts without the engines' runtime_cache (it is removed first): it builds ONNX Runtime's
sessions from the engines and saves what later launches reuse (engines/prepared.py). Memory: one
process loads the folder, then generates --memory-tokens tokens (greedy, auto; a reply that ends early
is followed by another turn), reading its resident set after loading, every 256 tokens and at the end,
and its peak; a pair twice, its drafter session deferred to its first draft (as `edge-sd generate`
loads it) and built at load. Writes benchmarks/results/startup.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edge_sd.bench.run import machine
from edge_sd.engines.prepared import CACHE_DIR
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


def weights_and_kv(folder: Path, positions: int, drafter: bool = True) -> tuple[float, float]:
    """MB of weights (the engine files) and of KV buffers for `positions` positions (float32), of both
    engines of a pair or (drafter=False) its target's alone."""
    weights = kv = 0.0
    for e in engines(folder)[: None if drafter else 1]:
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
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--memory-tokens", type=int, default=2048)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    rows = []
    for folder in args.folders:
        for e in engines(folder):
            shutil.rmtree(e / CACHE_DIR, ignore_errors=True)
        runs = [launch(folder, args.n) for _ in range(args.runs)]
        # A pair's drafter session is deferred to its first draft (Model.load): measured so, as
        # `edge-sd generate` runs, and with it built at load.
        for drafter in ("deferred", "at load") if len(engines(folder)) > 1 else ("-",):
            proc = subprocess.run([sys.executable, "-c", _MEMORY, str(folder), str(args.memory_tokens),
                                   str(drafter == "deferred")], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"memory run failed: {proc.stderr[-1000:]}")
            mem = json.loads(proc.stdout.strip().splitlines()[-1])
            weights, kv = weights_and_kv(folder, mem["positions"])
            own = weights_and_kv(folder, mem["positions"], drafter=mem["drafter_built"] is not False)
            rows.append({"folder": str(folder), "drafter": drafter, "first": runs[0],
                         "later": statistics.median(runs[1:]) if len(runs) > 1 else None,
                         "weights_mb": weights, "kv_mb": kv, "built_mb": sum(own), **mem})
            print(rows[-1], file=sys.stderr, flush=True)
    m = machine()
    lines = ["# Start-up and memory of `edge-sd generate`", "",
             f"{datetime.date.today().isoformat()}; {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}; "
             f"`edge-sd generate FOLDER -p \"{PROMPT}\" -n {args.n} --threads 2`, each launch a fresh process, "
             "the first one without the engines' runtime_cache. Command: "
             f"`python benchmarks/startup.py {' '.join(str(f) for f in args.folders)} --runs {args.runs} "
             f"--memory-tokens {args.memory_tokens}`.", "",
             "| folder | first text, first launch (s) | first text, later launches (s, median) | "
             "drafter session | drafter forwards | weights (MB) | KV buffers (MB) | resident after loading (MB) | "
             f"resident after {args.memory_tokens} tokens (MB) | peak (MB) | after {args.memory_tokens} tokens / "
             "(weights + KV) | peak / (weights + KV) | peak / (weights + KV of the sessions built) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        later = f"{r['later']:.2f}" if r["later"] is not None else "-"
        base = r["weights_mb"] + r["kv_mb"]
        built = {None: "-", True: "built", False: "never built"}[r["drafter_built"]]
        lines.append(f"| {Path(r['folder']).name} | {r['first']:.2f} | {later} | {r['drafter']}: {built} | "
                     f"{r['drafter_forwards']} | {r['weights_mb']:.0f} | {r['kv_mb']:.0f} | {r['loaded']:.0f} | "
                     f"{r['end']:.0f} | {r['peak']:.0f} | {r['end'] / base:.2f}x | {r['peak'] / base:.2f}x | "
                     f"{r['peak'] / r['built_mb']:.2f}x |")
    lines += ["", "Resident memory every 256 tokens (MB):", ""]
    lines += [f"- {Path(r['folder']).name}, drafter {r['drafter']}: {', '.join(f'{x:.0f}' for x in r['trace'])}"
              for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# One process: load, then generate, reading its own resident set (VmRSS) and peak (VmHWM) in MB.
_MEMORY = """
import json, sys
from edge_sd import GenerationConfig, Model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1e3 for line in f if line.startswith(key))

model = Model.load(sys.argv[1], threads=2, defer_drafter=sys.argv[3] == "True")
total = int(sys.argv[2])
forwards = 0
loaded = status("VmRSS")
gen = model.generator(GenerationConfig(max_new_tokens=total))
gen.append_text("Write a long story about a lighthouse keeper and the ships she watched for forty years.")
done, trace = 0, []
while done < total:
    if gen.is_done:  # the reply ended early: another turn keeps the sequence growing
        gen.append_text(" Go on.")
        forwards += gen.result().stats.drafter_forwards
    done += len(gen.generate_next_tokens().ids)
    if done // 256 > len(trace):
        trace.append(status("VmRSS"))
end = status("VmRSS")
gen.stop()  # the reply's statistics are complete once it has ended
forwards += gen.result().stats.drafter_forwards
print(json.dumps({"loaded": loaded, "end": end, "peak": status("VmHWM"), "trace": trace,
                  "positions": len(gen.ids), "drafter_forwards": forwards,
                  "drafter_built": None if model.drafter is None else model.drafter.session.loaded}))
"""


if __name__ == "__main__":
    main()
