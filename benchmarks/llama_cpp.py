"""edge-sd against llama.cpp on the same GGUF file, side by side, interleaved per prompt.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    LLAMA_BIN=$(bash benchmarks/llama_cpp.sh)      # once: llama.cpp's tools (about 10 minutes)
    .venv/bin/python benchmarks/llama_cpp.py --llama-bin "$LLAMA_BIN" [--per-set 6] [-n 64]

For every prompt, one after the other: edge-sd plain decoding and auto (greedy, then sampled at T=1
with the prompt's seed) on the pair folder, then llama.cpp's plain decoding (`llama-completion`,
greedy and sampled) and its drafter-free n-gram speculation (`llama-speculative-simple --spec-type
ngram-simple`, greedy) on the GGUF file the pair's target was exported from; then the chat setting
(T=0.8, top-k 40, top-p 0.95, min-p 0.05, the same seed) for edge-sd's plain decoding and auto and
llama.cpp's plain decoding and n-gram speculation, llama.cpp with edge-sd's sampler order
(`--samplers "penalties;temperature;top_k;top_p;min_p"`; `--no-chat` leaves these rows out). A slow spell of the
machine then hits every row alike. The rate compared is the decode rate: new tokens over the time
after the prompt's prefill, choosing the tokens included (for llama-completion, its `eval time` plus
its sampler's `sampling time`; for its speculation, the time it reports for decoding), with both
tools on the same number of threads. llama.cpp's rate by its `eval time` alone is reported beside.

Prompt sets: code (HumanEval) and summaries (Lee news articles), from the 5th prompt of each on (the
first 4 calibrate DISCO in scripts/real_pair.sh), and prose (story and essay openings written for this
benchmark, below). `--sets long-code,long-summarisation` runs the prompts of 1k to 4.6k tokens instead
(whole code files to continue, news digests to summarise; edge_sd/tools/prompt_sets.py), from the
first on, into benchmarks/results/llama_cpp_long.*; `--modes greedy` leaves out the sampled rows.
`--perplexity` adds perplexity on the first news articles, computed the way
`llama-perplexity` computes it (chunks of --ctx tokens, each scored on its second half), for the pair's
target and llama.cpp on the same text.

Writes benchmarks/results/llama_cpp.{md,json,png}; `--report` writes the table and plot again from
the JSON, without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.llama_cpp import LlamaCpp, Timing
from edge_sd.bench.llama_cpp import version as llama_version
from edge_sd.bench.run import CHAT, machine, write_results
from edge_sd.manifest import load_engine_manifest, load_pair_manifest
from edge_sd.pipeline import GenerationConfig, Pipeline
from edge_sd.sampling import SamplingConfig
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CACHE = cache_dir()
# Openings of stories and essays, for continuation (no article or code to copy from).
PROSE = [
    "The lighthouse keeper had not seen a ship in eleven days when",
    "There are three reasons why cities should plant more trees. The first",
    "On the morning of the storm, Maria packed her bag and",
    "The history of the bicycle begins in the early nineteenth century, when",
    "My grandfather kept a small notebook in which he wrote",
    "Learning a second language as an adult is hard, but",
    "The train slowed as it entered the valley, and the passengers",
    "Good software documentation starts with a clear description of",
]
ROWS = {  # label -> (tool, mode)
    "edge-sd plain": ("edge-sd", "greedy"),
    "edge-sd auto": ("edge-sd", "greedy"),
    "llama.cpp plain": ("llama.cpp", "greedy"),
    "llama.cpp n-gram": ("llama.cpp", "greedy"),
    "edge-sd plain, T=1": ("edge-sd", "sample"),
    "edge-sd auto, T=1": ("edge-sd", "sample"),
    "llama.cpp plain, T=1": ("llama.cpp", "sample"),
    "edge-sd plain, chat": ("edge-sd", "chat"),
    "edge-sd auto, chat": ("edge-sd", "chat"),
    "llama.cpp plain, chat": ("llama.cpp", "chat"),
    "llama.cpp n-gram, chat": ("llama.cpp", "chat"),
}
SAMPLING = {"greedy": SamplingConfig(), "sample": SamplingConfig(1.0), "chat": CHAT}
# With --fp32: plain decoding of the same file exported dequantized, first.
ALL_ROWS = {"edge-sd plain, fp32": ("edge-sd", "greedy"), **ROWS}


LABELS = {"code": "code", "summarisation": "summaries", "long-code": "code files",
          "long-summarisation": "news digests"}
SHORT_SETS = ("code", "summarisation", "prose")
MODES = ("greedy", "sample", "chat")
# The real pair is calibrated on each set's first 4 prompts (`edge-sd calibrate --per-set 4`): held out from here on.
SKIP = 4


def prompt_list(sets: list[str], per_set: int, skip: int) -> list[tuple[str, str]]:
    """(set label, prompt) for each set's prompts, one set after the other; long sets from the first."""
    out = []
    for name in sets:
        if name == "prose":
            out += [("prose", t) for t in PROSE[:per_set]]
            continue
        first = 0 if name in prompt_sets.LONG_SETS else skip
        out += [(LABELS[name], p.text) for p in prompt_sets.load(name, CACHE, first + per_set)[first:]]
    return out


def _edge(pipe: Pipeline, prompt: str, n: int, algorithm: str, mode: str, seed: int) -> dict:
    r = pipe.generate(prompt, GenerationConfig(max_new_tokens=n, algorithm=algorithm, seed=seed,
                                               **dataclasses.asdict(SAMPLING[mode])))
    # After the prefill, whose last row gave the first token: llama.cpp's `eval` runs likewise leave
    # out the token its prompt's forward gave.
    s = r.stats
    return {"tokens": s.decoded_tokens, "decode_s": s.decode_s, "rate": s.decoded_tokens / s.decode_s,
            "ids": r.token_ids, "schedule": r.stats.schedule.get("rounds", {})}


def _llama(timing: Timing) -> dict:
    return {"tokens": timing.tokens, "decode_s": timing.decode_s, "rate": timing.rate, "accept": timing.accept,
            "eval_s": timing.eval_s}


def second_half(logits: np.ndarray, ctx: int) -> np.ndarray:
    """The rows of a chunk's logits [ctx, V] that predict its second half, as float64 log-probabilities."""
    rows = logits[ctx // 2 - 1 : ctx - 1].astype(np.float64)
    rows -= rows.max(-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(-1, keepdims=True))


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """`ids` cut into chunks of ctx tokens as llama-perplexity cuts them, each starting with BOS."""
    return [([bos] + ids[s + 1 : s + ctx]) if bos is not None else ids[s : s + ctx]
            for s in range(0, len(ids) - ctx + 1, ctx)]


def chunk_perplexity(side, text: str, ctx: int) -> tuple[float, int]:
    """Perplexity of an engine the llama-perplexity way: the text cut into chunks of ctx tokens (BOS
    first), each scored on its second half. Returns (perplexity, positions scored)."""
    engine = side.engine
    nll, count = 0.0, 0
    for chunk in chunks(side.vocab.encode_text(text), ctx, side.manifest.bos_token_id):
        engine.reset()
        engine.reserve(ctx)
        logp = second_half(engine.forward(np.asarray(chunk)), ctx)
        nll -= float(logp[np.arange(len(logp)), chunk[ctx // 2 :]].sum())
        count += len(logp)
    engine.reset()
    return float(np.exp(nll / count)), count


def perplexity(pipe: Pipeline, fp32: Pipeline | None, binary: Path, gguf: Path, articles: int, ctx: int,
               threads: int) -> dict:
    """Perplexity of the pair's target, of an fp32 export of the same file, and of llama.cpp, on the
    same text, all the llama-perplexity way."""
    text = "\n".join(prompt_sets.articles(CACHE, articles))
    ours, count = chunk_perplexity(pipe.target, text, ctx)
    reference = chunk_perplexity(fp32.target, text, ctx)[0] if fp32 is not None else None
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-t", str(threads),
                           "-b", str(ctx)], capture_output=True, text=True, timeout=1800)
    Path(f.name).unlink()
    m = re.search(r"Final estimate: PPL = ([\d.]+)", proc.stderr + proc.stdout)
    return {"ctx": ctx, "articles": articles, "edge_sd": ours, "edge_sd_positions": count,
            "edge_sd_fp32": reference, "llama_cpp": float(m.group(1)) if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file [the pair target's source]")
    ap.add_argument("--llama-bin", type=Path, help="folder of llama.cpp's binaries (llama_cpp.sh)")
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("--per-set", type=int, default=6)
    ap.add_argument("--skip", type=int, default=SKIP)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--perplexity", type=int, default=0, help="also perplexity on this many news articles")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity chunk length")
    ap.add_argument("--fp32", type=Path, default=None, help="an fp32 export of the same GGUF (a single engine): "
                    "a plain-decoding row and its perplexity beside the pair's target")
    ap.add_argument("--no-chat", action="store_true", help="without the chat-setting rows (--modes greedy,sample)")
    ap.add_argument("--modes", default=",".join(MODES), help="which of greedy, sample (T=1) and chat to run")
    ap.add_argument("--sets", default=",".join(SHORT_SETS),
                    help=f"prompt sets, of {', '.join(SHORT_SETS + prompt_sets.LONG_SETS)}")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    sets = args.sets.split(",")
    unknown = [x for x in sets if x not in SHORT_SETS + prompt_sets.LONG_SETS]
    modes = [m for m in args.modes.split(",") if not (args.no_chat and m == "chat")]
    if unknown or not set(modes) <= set(MODES) or "greedy" not in modes:
        sys.exit(f"--sets takes {', '.join(SHORT_SETS + prompt_sets.LONG_SETS)}; --modes takes "
                 f"{', '.join(MODES)}, greedy among them")
    # Long prompts have results of their own beside the short ones.
    name = "llama_cpp_long" if any(x in prompt_sets.LONG_SETS for x in sets) else "llama_cpp"
    if args.report:
        write_results(args.out, name, report, plot)
        return
    if args.llama_bin is None:
        sys.exit("--llama-bin: the folder of llama.cpp's binaries (bash benchmarks/llama_cpp.sh prints it)")

    pm = load_pair_manifest(args.pair)
    target = load_engine_manifest(args.pair / pm.target)
    gguf = args.gguf or Path(target.source)
    if not gguf.is_file():
        sys.exit(f"GGUF file {gguf} not found (--gguf)")
    pipe = Pipeline.from_folder(args.pair, threads=args.threads)
    fp32 = Pipeline.from_folder(args.fp32, threads=args.threads) if args.fp32 else None
    rows = {k: v for k, v in (ROWS if fp32 is None else ALL_ROWS).items() if v[1] in modes}
    prompts = prompt_list(sets, args.per_set, args.skip)
    n = args.max_new_tokens
    # llama.cpp's cache holds the longest prompt and its new tokens (edge-sd's holds what it was
    # exported for, and says so where a prompt does not fit).
    longest = max(len(pipe.target.vocab.encode_text(text)) for _, text in prompts)
    llama = LlamaCpp(args.llama_bin, gguf, args.threads, ctx=max(2048, longest + n + 16))
    # Warm-up: load-time calibration of auto, and the first forwards of each shape.
    for p in (pipe, fp32):
        if p is not None:
            p.generate(prompts[0][1], GenerationConfig(max_new_tokens=8))
    records = []
    for i, (group, text) in enumerate(prompts):
        seed = 1000 + i
        rec = {"set": group, "prompt": i, "runs": {}}
        runs = rec["runs"]
        if fp32 is not None:
            runs["edge-sd plain, fp32"] = _edge(fp32, text, n, "plain", "greedy", seed)
        runs["edge-sd plain"] = _edge(pipe, text, n, "plain", "greedy", seed)
        runs["edge-sd auto"] = _edge(pipe, text, n, "auto", "greedy", seed)
        runs["edge-sd auto"]["equal_to_plain"] = runs["edge-sd auto"]["ids"] == runs["edge-sd plain"]["ids"]
        runs["llama.cpp plain"] = _llama(llama.plain(text, n, SAMPLING["greedy"], seed))
        runs["llama.cpp n-gram"] = _llama(llama.ngram(text, n, SAMPLING["greedy"], seed))
        if "sample" in modes:
            runs["edge-sd plain, T=1"] = _edge(pipe, text, n, "plain", "sample", seed)
            runs["edge-sd auto, T=1"] = _edge(pipe, text, n, "auto", "sample", seed)
            runs["llama.cpp plain, T=1"] = _llama(llama.plain(text, n, SAMPLING["sample"], seed))
        if "chat" in modes:
            runs["edge-sd plain, chat"] = _edge(pipe, text, n, "plain", "chat", seed)
            runs["edge-sd auto, chat"] = _edge(pipe, text, n, "auto", "chat", seed)
            runs["llama.cpp plain, chat"] = _llama(llama.plain(text, n, SAMPLING["chat"], seed))
            runs["llama.cpp n-gram, chat"] = _llama(llama.ngram(text, n, SAMPLING["chat"], seed))
        for r in runs.values():
            r.pop("ids", None)
        records.append(rec)
        print(f"[{i + 1}/{len(prompts)}] {group}: " + ", ".join(f"{k} {v['rate']:.1f}" for k, v in runs.items()),
              file=sys.stderr, flush=True)
        time.sleep(0.1)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "gguf": gguf.name, "target_precision": target.precision,
              "drafter_precision": load_engine_manifest(args.pair / pm.drafter).precision,
              "llama_cpp": llama_version(args.llama_bin), "options": {k: str(v) for k, v in vars(args).items()},
              "rows": list(rows), "records": records}
    if args.perplexity:
        result["perplexity"] = perplexity(pipe, fp32, args.llama_bin / "llama-perplexity", gguf, args.perplexity,
                                          args.ctx, args.threads)
    print(write_results(args.out, name, report, plot, result))


def medians(result: dict) -> dict[str, dict[str, float]]:
    """label -> set -> median decode rate (tok/s), with 'all' over every prompt."""
    out: dict[str, dict[str, float]] = {}
    sets = sorted({r["set"] for r in result["records"]}) + ["all"]
    for label in result.get("rows", ROWS):
        out[label] = {s: statistics.median(r["runs"][label]["rate"] for r in result["records"]
                                           if s in ("all", r["set"])) for s in sets}
    return out


def ratios(result: dict, label: str, against: list[str]) -> dict[str, float]:
    """set -> median over prompts of label's rate / the best of `against` on the same prompt."""
    sets = sorted({r["set"] for r in result["records"]}) + ["all"]
    return {s: statistics.median(r["runs"][label]["rate"] / max(r["runs"][a]["rate"] for a in against)
                                 for r in result["records"] if s in ("all", r["set"])) for s in sets}


def round_kinds(result: dict, label: str) -> dict[str, int]:
    """What a row's rounds were, over every prompt (from auto's schedule statistics)."""
    kinds = {"plain steps": 0, "lookup drafts": 0, "drafter drafts": 0, "lookup drafts extended by the drafter": 0}
    for r in result["records"]:
        for key, n in r["runs"][label].get("schedule", {}).items():
            algo = key.split(":")[0]
            kind = ("plain steps" if algo == "plain" else "lookup drafts" if algo == "lookup"
                    else "lookup drafts extended by the drafter" if algo.startswith("lookup+") else "drafter drafts")
            kinds[kind] += n
    return kinds


def report(result: dict) -> str:
    med = medians(result)
    sets = list(next(iter(med.values())))
    m = result["machine"]
    lines = [
        f"# edge-sd against llama.cpp on {result['gguf']}",
        "",
        f"{result['date']}; {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}; llama.cpp "
        f"{result['llama_cpp']}; {result['options']['threads']} threads each; "
        f"{result['options']['max_new_tokens']} new tokens; target {result['target_precision']}, drafter "
        f"{result['drafter_precision']}. Decode rate (new tokens "
        "over the time after the prompt's prefill), median over prompts; every row ran on every prompt, "
        "interleaved. Command: `python benchmarks/llama_cpp.py --llama-bin \"$(bash benchmarks/llama_cpp.sh)\" "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in result["options"].items()
                   if k in ("per_set", "max_new_tokens", "perplexity") and v not in ("0",))
        + "".join(f" --{k} {v}" for k, v in result["options"].items()
                  if k in ("sets", "modes") and v not in (",".join(SHORT_SETS), ",".join(MODES)))
        + (" --fp32 FOLDER" if result["options"].get("fp32") not in (None, "None") else "") + "`"
        + (" (FOLDER: the same file exported with `edge-sd export --precision fp32`)."
           if result["options"].get("fp32") not in (None, "None") else "."),
        "",
        "| row | " + " | ".join(sets) + " |",
        "|---|" + "---|" * len(sets),
    ]
    for label, by_set in med.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in by_set.values()) + " |")
    lines += ["", "Ratios (median over prompts of the per-prompt ratio):", "",
              "| ratio | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for name, label, against in (
        ("edge-sd plain / llama.cpp plain", "edge-sd plain", ["llama.cpp plain"]),
        ("edge-sd auto / best of llama.cpp plain and n-gram (greedy)", "edge-sd auto",
         ["llama.cpp plain", "llama.cpp n-gram"]),
        ("edge-sd auto, T=1 / llama.cpp plain, T=1", "edge-sd auto, T=1", ["llama.cpp plain, T=1"]),
        ("edge-sd auto / edge-sd plain (greedy)", "edge-sd auto", ["edge-sd plain"]),
        ("edge-sd auto, T=1 / edge-sd plain, T=1", "edge-sd auto, T=1", ["edge-sd plain, T=1"]),
        *([("edge-sd plain, chat / llama.cpp plain, chat", "edge-sd plain, chat", ["llama.cpp plain, chat"]),
           ("edge-sd auto, chat / best of llama.cpp plain and n-gram, chat", "edge-sd auto, chat",
            ["llama.cpp plain, chat", "llama.cpp n-gram, chat"]),
           ("edge-sd auto, chat / edge-sd plain, chat", "edge-sd auto, chat", ["edge-sd plain, chat"])]
          if "edge-sd auto, chat" in med else []),
        *([("edge-sd plain / edge-sd plain, fp32 target", "edge-sd plain", ["edge-sd plain, fp32"])]
          if "edge-sd plain, fp32" in med else []),
    ):
        if label in med and all(a in med for a in against):
            lines.append(f"| {name} | "
                         + " | ".join(f"{v:.2f}x" for v in ratios(result, label, against).values()) + " |")
    lines += _eval_only(result, sets)
    equal = sum(r["runs"]["edge-sd auto"]["equal_to_plain"] for r in result["records"])
    lines += ["", f"edge-sd auto's greedy output equal to its plain decoding: {equal} of {len(result['records'])} "
              "prompts."]
    for label in [x for x in ("edge-sd auto", "edge-sd auto, T=1", "edge-sd auto, chat") if x in med]:
        kinds = round_kinds(result, label)
        lines += ["", f"{label}'s rounds over every prompt: {sum(kinds.values())} ("
                  + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ")."]
    if "perplexity" in result:
        p = result["perplexity"]
        fp32_ppl = f", the fp32 export of the same file {p['edge_sd_fp32']:.3f}" if p.get("edge_sd_fp32") else ""
        lines += ["", f"Perplexity, the first {p['articles']} news articles, chunks of {p['ctx']} tokens scored on "
                  f"their second half (llama-perplexity's method, {p['edge_sd_positions']} positions): edge-sd's "
                  f"{result['target_precision']} target {p['edge_sd']:.3f}{fp32_ppl}, llama.cpp {p['llama_cpp']}."]
    return "\n".join(lines) + "\n"


def _eval_only(result: dict, sets: list[str]) -> list[str]:
    """llama-completion's rows timed by its `eval time` alone, without its sampler (as results before
    commit 7f9469c timed them), and the ratios above against them."""
    labels = ("llama.cpp plain", "llama.cpp plain, T=1")
    if not all(r["runs"].get(label, {}).get("eval_s") for r in result["records"] for label in labels):
        return []
    alone = {"records": [{"set": r["set"], "runs": {**r["runs"], **{
        label: {"rate": r["runs"][label]["tokens"] / r["runs"][label]["eval_s"]} for label in labels}}}
        for r in result["records"]], "rows": list(labels)}
    med = medians(alone)
    lines = ["", "llama.cpp plain decoding timed by its `eval time` alone (its forwards, without choosing the "
             "tokens), and the ratios against it:", "",
             "| row | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for label in labels:
        lines.append(f"| {label}, eval time alone | " + " | ".join(f"{v:.1f}" for v in med[label].values()) + " |")
    for name, label, against in (("edge-sd plain / llama.cpp plain", "edge-sd plain", ["llama.cpp plain"]),
                                 ("edge-sd auto, T=1 / llama.cpp plain, T=1", "edge-sd auto, T=1",
                                  ["llama.cpp plain, T=1"])):
        lines.append(f"| {name}, eval time alone | "
                     + " | ".join(f"{v:.2f}x" for v in ratios(alone, label, against).values()) + " |")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = medians(result)
    sets = [s for s in next(iter(med.values())) if s != "all"]
    labels = list(med)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        xs = np.arange(len(sets)) + (j - len(labels) / 2 + 0.5) * width
        tool, mode = ALL_ROWS[label]
        color = "tab:blue" if tool == "edge-sd" else "tab:orange"
        ax.bar(xs, [med[label][s] for s in sets], width, label=label, color=color,
               alpha=1.0 if "auto" in label or "n-gram" in label else 0.55,
               hatch={"sample": "//", "chat": ".."}.get(mode))
    ax.set_xticks(np.arange(len(sets)), sets)
    ax.set_ylabel("decode rate, tok/s (median)")
    ax.set_title(f"edge-sd and llama.cpp on {result['gguf']} ({result['machine']['cores']} cores, {result['date']})")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
