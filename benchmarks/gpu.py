"""The GPU run: edge-sd's engines and its draft / verify loop on an NVIDIA GPU, in one process.

    edge-sd export -t google/gemma-3-270m -d HuggingFaceTB/SmolLM2-135M-Instruct \\
        --precision int4 --device cuda -o engines/gpu-pair        # on any machine (not validated there)
    edge-sd calibrate engines/gpu-pair --per-set 4 --draft-max 6 -n 48       # on the GPU (optional: DISCO's stops)
    python benchmarks/gpu.py engines/gpu-pair -o benchmarks/results/gpu

Needs onnxruntime-gpu (and onnxruntime-genai-cuda for the per-token reference). Measures:
1. each engine (target; drafter re-feeding nothing): ms per forward of 1 and of k+1 positions after 64
   cached, the cut-back, and plain greedy decoding through edge-sd's loop against onnxruntime-genai's
   generator on the same graph and token ids (the builder's genai_config.json is in each engine folder);
2. the loop on held-out prompts of the benchmark's sets (edge_sd.bench.run): plain decoding, auto and
   SLEM / TLI / SLRS at each k, greedy and sampling, with the same-tokens-as-plain check;
3. what auto chose on one prompt: rounds per draft length, plain steps, its cost estimates.
Writes gpu.md and gpu.json into the output folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from edge_sd import GenerationConfig, Pipeline
from edge_sd.bench import engine_timing as engine_bench
from edge_sd.bench import report
from edge_sd.bench.run import BenchOptions
from edge_sd.bench.run import run as run_loop
from edge_sd.manifest import PAIR_FILE, load_engine_manifest, load_pair_manifest
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown GPU"


def engine_rows(pair: Path, prompts: list[str], opts: argparse.Namespace) -> list[dict]:
    pm = load_pair_manifest(pair)
    t, d = pair / pm.target, pair / pm.drafter
    cases = [engine_bench.EngineCase(f"target {load_engine_manifest(t).name}", t),
             engine_bench.EngineCase(f"drafter {load_engine_manifest(d).name}", d, min_step=1)]
    eo = engine_bench.EngineOptions(cases, prompts, k=3, repeats=opts.repeats, new_tokens=opts.max_new_tokens,
                                    threads=opts.threads, provider=opts.provider, transformers=False)
    return engine_bench.run(eo, progress=lambda s: print(s, file=sys.stderr, flush=True))["cases"]


def engine_table(rows: list[dict]) -> str:
    lines = ["| engine | precision | ms forward, 1 position | 4 positions | cut back | edge-sd plain tok/s "
             "| onnxruntime-genai tok/s | edge-sd / genai (median) | same tokens |", "|---" * 9 + "|"]
    for r in rows:
        genai = f"{r['genai_tok_s']:.1f}" if "genai_tok_s" in r else "-"
        ratio = f"{r['vs_genai_median']:.2f}x" if "vs_genai_median" in r else "-"
        same = f"{r['genai_same_tokens']}/{r['prompts']}" if "genai_same_tokens" in r else "-"
        lines.append(f"| {r['label']} | {r['precision']} | {r['ms_forward_1']:.2f} | {r['ms_forward_4']:.2f} "
                     f"| {r['ms_cut_back']:.3f} | {r['decode_tok_s']:.1f} | {genai} | {ratio} | {same} |")
    return "\n".join(lines)


def auto_trace(pair: Path, prompt: str, opts: argparse.Namespace) -> dict:
    """One greedy generation with auto, after a warm-up one: what it chose and why; and the target's
    consistency figures where they were measured at load (engines/consistency.py)."""
    pipe = Pipeline.from_folder(pair, provider=opts.provider, threads=opts.threads)
    cfg = GenerationConfig(max_new_tokens=opts.max_new_tokens)
    pipe.generate(prompt, cfg)
    r = pipe.generate(prompt, cfg)
    return {"providers": pipe.target.engine.providers, "stats": r.stats.to_dict(),
            "target_consistency": pipe.target.engine.consistency}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path, help="pair folder exported for the GPU")
    ap.add_argument("-o", "--out", type=Path, default=Path("benchmarks/results/gpu"))
    ap.add_argument("--provider", default="cuda", help="cuda or tensorrt")
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("--skip", type=int, default=4, help="held out from `edge-sd calibrate` (its --per-set)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=48)
    ap.add_argument("-k", default="1,2,3", help="draft lengths of the fixed rows")
    ap.add_argument("--algorithms", default="slem,tli,slrs")
    ap.add_argument("--modes", default="greedy,sample")
    ap.add_argument("--passes", type=int, default=2, help="runs of the whole loop table (GPU timings are noisy)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=cache_dir())
    opts = ap.parse_args()
    if not (opts.pair / PAIR_FILE).is_file():
        ap.error(f"{opts.pair} is not a pair folder (no {PAIR_FILE})")
    if opts.passes < 1:
        ap.error("--passes must be at least 1")
    opts.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.strftime("%Y-%m-%d")
    plist = [p for s in prompt_sets.SETS
             for p in prompt_sets.load(s, opts.cache, opts.skip + opts.per_set)[opts.skip:]]
    results: dict = {"command": command, "date": started, "gpu": gpu_name()}

    def save() -> None:  # after each part, so that a run cut short keeps what it measured
        (opts.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    print("1/3 engines", file=sys.stderr, flush=True)
    rows = engine_rows(opts.pair, [p.text for p in plist], opts)
    results["engines"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    save()
    print("2/3 the loop", file=sys.stderr, flush=True)
    bo = BenchOptions(pair=opts.pair, cache=opts.cache, per_set=opts.per_set, skip=opts.skip,
                      max_new_tokens=opts.max_new_tokens, ks=tuple(int(k) for k in opts.k.split(",")),
                      algorithms=tuple(opts.algorithms.split(",")), modes=tuple(opts.modes.split(",")),
                      threads=opts.threads, provider=opts.provider, transformers=False)
    results["loop"] = []
    for _ in range(opts.passes):
        loop = run_loop(bo, on_run=lambda c, r: print(f"  {c.label} {r.prompt}: {r.new_tokens / r.wall_s:.1f} tok/s",
                                                      file=sys.stderr, flush=True))
        results["machine"] = loop["machine"]
        results["loop"].append(report.summarise(loop))
        save()
    print("3/3 auto's choices", file=sys.stderr, flush=True)
    results["auto"] = auto_trace(opts.pair, plist[0].text, opts)
    save()
    m = results["machine"]
    parts = [
        f"Command: `{command}` ({started}).",
        f"Machine: {results['gpu']}; {m['cpu']}, {m['cores']} cores; ONNX Runtime {m['onnxruntime']} "
        f"({', '.join(results['auto']['providers'])}), Python {m['python']}.",
        "**Engines** (medians; the drafter re-feeds nothing; onnxruntime-genai decodes the same graph from the "
        "same token ids; ratio: edge-sd's decode rate over genai's, median over prompts):",
        engine_table(rows),
        f"**The loop** ({opts.per_set} prompts of each set after the first {opts.skip}, {opts.max_new_tokens} "
        "new tokens; speedup: median over prompts of tok/s against plain decoding of the same engine):",
    ]
    for i, summary in enumerate(results["loop"]):
        for mode in bo.modes:
            parts += [f"*{mode}, pass {i + 1}*", report.table(summary, mode)]
    st = results["auto"]["stats"]
    parts += [f"**The target's forwards on this provider** (engines/consistency.py; relative to the logits' scale): "
              f"{json.dumps(results['auto']['target_consistency'])}"]
    parts += ["**auto on the first prompt** (greedy): rounds by draft length "
              f"{st['rounds_by_drafts']}; schedule {json.dumps(st['schedule'])}"]
    (opts.out / "gpu.md").write_text("\n\n".join(parts) + "\n")
    print((opts.out / "gpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
