"""The engine benchmark whose results the README shows: each export path and precision of the real
pair's two models, side by side with onnxruntime-genai's generator and transformers.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    bash scripts/prepare_real_pair.sh engines/gemma3-270m_smollm2-135m --hf   # + fp32 HF folders
    .venv/bin/python benchmarks/engines.py [--quick] [--no-memory] [--llama-bench PATH]

Exports the variants it lacks into engines/variants/ (a few minutes each, once), then measures them
in one process (memory in a fresh process per engine) and writes benchmarks/results/engines.{md,json},
engines.png and the README's engine section (not with --quick). --llama-bench names a llama.cpp
`llama-bench` binary you built: it decodes the GGUF the target came from, for one more line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CACHE = cache_dir()
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
VARIANTS = ROOT / "engines" / "variants"
HF = CACHE / "real" / "hf"
TOKENIZERS = {"gemma3-270m": CACHE / "tokenizers" / "gemma3" / "tokenizer.json",
              "smollm2-135m": CACHE / "real" / "smollm2-tokenizer" / "tokenizer.json"}
# label -> (model, exporter, precision, folder); None folder: exported into engines/variants/.
TARGETS = {
    "Gemma-3-270M builder fp32 (pair target)": ("gemma3-270m", "builder", "fp32", PAIR / "target"),
    "Gemma-3-270M optimum fp32 (before)": ("gemma3-270m", "optimum", "fp32", None),
    "Gemma-3-270M builder int8": ("gemma3-270m", "builder", "int8", None),
    "Gemma-3-270M builder int4": ("gemma3-270m", "builder", "int4", None),
}
DRAFTERS = {
    "SmolLM2-135M builder int8 (pair drafter)": ("smollm2-135m", "builder", "int8", PAIR / "drafter"),
    "SmolLM2-135M builder int4": ("smollm2-135m", "builder", "int4", None),
    "SmolLM2-135M optimum int8 (before)": ("smollm2-135m", "optimum", "int8", None),
}
MEMORY = ("Gemma-3-270M builder fp32 (pair target)", "Gemma-3-270M builder int8",
          "SmolLM2-135M builder int8 (pair drafter)")


def folder_of(label: str, spec: tuple) -> Path:
    model, exporter, precision, folder = spec
    if folder is not None:
        return folder
    dest = VARIANTS / f"{model}_{exporter}_{precision}"
    if not (dest / "engine.json").is_file():
        from edge_sd.export.atomic import atomic_folder
        from edge_sd.export.hf import ExportOptions, export_engine

        print(f"exporting {label} into {dest}", file=sys.stderr, flush=True)
        drafter = model == "smollm2-135m"
        with atomic_folder(dest, force=True) as tmp:
            export_engine(str(HF / model), tmp, ExportOptions(precision=precision, exporter=exporter, drafter=drafter),
                          tokenizer=str(TOKENIZERS[model]), name=model)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, 5 repeats; no README")
    ap.add_argument("--no-memory", action="store_true", help="skip the 2048-token memory runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", type=Path, default=None, help="a llama.cpp llama-bench binary")
    args = ap.parse_args()

    from edge_sd.bench import engine_report
    from edge_sd.bench.engine_timing import EngineCase, EngineOptions, run
    from edge_sd.bench.quality import quality
    from edge_sd.bench.run import machine
    from edge_sd.engines.ort import OrtEngine
    from edge_sd.pipeline import Pipeline
    from edge_sd.tools import prompt_sets as prompts

    per_set, tokens, repeats, n_articles = (1, 24, 5, 3) if args.quick else (3, 64, 20, 20)
    texts = [p.text for s in prompts.SETS for p in prompts.load(s, CACHE, per_set)]
    specs = {**TARGETS, **DRAFTERS}
    # Drafters run their forwards at their natural size, as a pair runs them.
    cases = [EngineCase(label, folder_of(label, spec), HF / spec[0] if spec[2] == "fp32" else None,
                        1 if label in DRAFTERS else None) for label, spec in specs.items()]
    opts = EngineOptions(cases=cases, prompts=texts, new_tokens=tokens, repeats=repeats, threads=args.threads)
    results = run(opts, progress=lambda s: print(s, file=sys.stderr, flush=True))
    by_label = {c["label"]: c for c in results["cases"]}

    # Quality of each target precision against the fp32 builder engine.
    reference_label = next(iter(TARGETS))
    ref = OrtEngine(folder_of(reference_label, TARGETS[reference_label]), provider="cpu", threads=args.threads)
    articles = [Pipeline.from_folder(ref.folder).target.prompt_ids(a, False)
                for a in prompts.articles(CACHE, n_articles)]
    ref_outputs = by_label[reference_label]["token_ids"]
    for label, spec in TARGETS.items():
        engine = OrtEngine(folder_of(label, spec), provider="cpu", threads=args.threads)
        print(f"{label}: quality", file=sys.stderr, flush=True)
        by_label[label]["quality"] = quality(engine, ref, articles)
        outs = by_label[label]["token_ids"]
        by_label[label]["same_as_reference"] = (sum(a == b for a, b in zip(outs, ref_outputs, strict=True)),
                                                len(outs))
    if not args.no_memory:
        for label in MEMORY:
            print(f"{label}: memory over 2048 tokens", file=sys.stderr, flush=True)
            folder = folder_of(label, specs[label])
            proc = subprocess.run([sys.executable, "-m", "edge_sd.bench.engine_timing", "--memory", str(folder),
                                   "-n", "2048", "--threads", str(args.threads)],
                                  capture_output=True, text=True, check=True)
            by_label[label]["memory"] = json.loads(proc.stdout.strip().splitlines()[-1])
    for c in results["cases"]:
        c.pop("token_ids", None)
    if args.llama_bench:
        results["llama_cpp"] = llama_cpp(args.llama_bench, CACHE / "real" / "gemma-3-270m-q4_k_m.gguf", tokens,
                                         args.threads)
    m = machine()
    results.update(
        date=datetime.date.today().isoformat(),
        machine=f"{m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}, Python {m['python']}",
        options={"context": opts.context, "k": opts.k, "repeats": repeats, "new_tokens": tokens,
                 "prompts": len(texts), "threads": args.threads, "articles": n_articles},
    )
    command = "python benchmarks/engines.py" + (" --quick" if args.quick else "")
    out = ROOT / "benchmarks" / "results" if not args.quick else ROOT / "bench-results"
    files = engine_report.write(results, out, command, None if args.quick else ROOT / "README.md")
    print(engine_report.speed_table(results["cases"], opts.k))
    print(engine_report.quality_table(results["cases"]))
    print("wrote " + ", ".join(map(str, files)), file=sys.stderr)


def llama_cpp(binary: Path, gguf: Path, tokens: int, threads: int) -> dict:
    """llama.cpp's own benchmark decoding `tokens` tokens of the GGUF (no prompt), 3 repetitions."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "3", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    (row,) = json.loads(proc.stdout)
    return {"model": gguf.name, "tok_s": row["avg_ts"], "stddev_tok_s": row["stddev_ts"],
            "build_commit": row.get("build_commit"), "threads": threads, "tokens": tokens}


if __name__ == "__main__":
    main()
