"""Tables, a plot and the README section of the engine benchmark (bench/engine_timing.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from edge_sd.bench.report import save_figure, update_readme

README_START = "<!-- engines-bench:start -->"
README_END = "<!-- engines-bench:end -->"
PLOT = "engines.png"


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def speed_table(cases: list[dict], k: int) -> str:
    lines = [
        f"| engine | path | precision | ms / forward, 1 position | {k + 1} positions | cut-back, ms "
        "| plain decoding, tok/s | time outside the engine | onnxruntime-genai, tok/s | edge-sd / genai "
        "(median) | transformers, tok/s | edge-sd / transformers (median) |",
        "|" + "---|" * 12,
    ]
    for c in cases:
        lines.append(
            f"| {c['label']} | {c['export_path']} | {c['precision']} | {c['ms_forward_1']:.1f} "
            f"| {c[f'ms_forward_{k + 1}']:.1f} | {c['ms_cut_back']:.3f} | {c['decode_tok_s']:.1f} "
            f"| {c['other_share']:.1%} | {_f(c.get('genai_tok_s'), '.1f')} "
            f"| {_f(c.get('vs_genai_median'), '.2f')}{'x' if 'vs_genai_median' in c else ''} "
            f"| {_f(c.get('hf_tok_s'), '.1f')} "
            f"| {_f(c.get('vs_hf_median'), '.2f')}{'x' if 'vs_hf_median' in c else ''} |")
    return "\n".join(lines)


def quality_table(cases: list[dict]) -> str:
    rows = [c for c in cases if "quality" in c or "memory" in c]
    lines = ["| engine | perplexity (news articles) | top-1 agreement with fp32 | greedy outputs equal to fp32 "
             "| resident memory after 2048 tokens / (weights + KV) | after load, MB | after 2048 tokens, MB |",
             "|" + "---|" * 7]
    for c in rows:
        q, mem = c.get("quality", {}), c.get("memory", {})
        same = c.get("same_as_reference")
        lines.append(
            f"| {c['label']} | {_f(q.get('perplexity'), '.2f')} | {_f(q.get('top1_agreement'), '.1%')} "
            f"| {'' if same is None else f'{same[0]}/{same[1]}'} "
            f"| {_f(mem.get('ratio_to_weights_and_kv'), '.2f')}{'x' if mem else ''} "
            f"| {_f(mem.get('rss_loaded', 0) / 1e6 if mem else None, '.0f')} "
            f"| {_f(max(mem['rss_at'].values()) / 1e6 if mem else None, '.0f')} |")
    return "\n".join(lines)


def plot(cases: list[dict], k: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    xs = range(len(cases))
    width = 0.28
    ax.bar([x - width for x in xs], [c["ms_forward_1"] for c in cases], width, label="edge-sd, 1 position")
    ax.bar(list(xs), [c[f"ms_forward_{k + 1}"] for c in cases], width, label=f"edge-sd, {k + 1} positions")
    genai = [(x, 1e3 / c["genai_tok_s"]) for x, c in zip(xs, cases, strict=True) if c.get("genai_tok_s")]
    if genai:
        ax.bar([x + width for x, _ in genai], [v for _, v in genai], width,
               label="onnxruntime-genai generator, per token")
    ax.set_xticks(list(xs), [c["label"] for c in cases], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("one forward (2 threads), and onnxruntime-genai's decoding of the same graph")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, out / PLOT)


def markdown(results: dict, command: str, image_dir: str) -> str:
    o, k = results["options"], results["options"]["k"]
    parts = [
        f"Command: `{command}` ({results['date']}).",
        f"Machine: {results['machine']}; {o['threads']} threads per engine.",
        f"Forwards: after {o['context']} cached positions, median of {o['repeats']}; a forward as the loop runs "
        "it (with `min_step_positions` 2 a one-position step feeds two). Plain decoding: greedy, "
        f"{o['new_tokens']} new tokens after each of {o['prompts']} prompts (HumanEval and Lee news), decode "
        "rate without the prompt; onnxruntime-genai and transformers decode the same token ids in the same "
        "process, interleaved prompt by prompt; ratios are per prompt, then the median.",
        speed_table(results["cases"], k),
    ]
    if any("quality" in c or "memory" in c for c in results["cases"]):
        parts += [
            "Quality and memory of each target precision: perplexity over the first 256 tokens of "
            f"{o.get('articles', 0)} Lee news articles, top-1 agreement with the fp32 builder engine at the "
            "same positions, greedy outputs (the plain-decoding runs above) equal to the fp32 engine's; memory "
            "in a fresh process over a 2048-token greedy generation (`python -m edge_sd.bench.engine_timing "
            "--memory`).",
            quality_table(results["cases"]),
        ]
    if "llama_cpp" in results:
        ll = results["llama_cpp"]
        parts.append(
            f"llama.cpp (`llama-bench`, build {ll['build_commit']}, {ll['threads']} threads) decodes the GGUF the "
            f"target was exported from ({ll['model']}, 4-bit weights) at {ll['tok_s']:.1f} tok/s "
            f"(± {ll['stddev_tok_s']:.1f}, {ll['tokens']} tokens, no prompt), on the same machine in the same run.")
    parts.append(f"![forward times]({image_dir}/{PLOT})")
    return "\n\n".join(parts)


def write(results: dict, out: Path, command: str, readme: Path | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(results, indent=1) + "\n")
    image = plot(results["cases"], results["options"]["k"], out)
    (out / "engines.md").write_text(markdown(results, command, ".") + "\n")
    if readme is not None:
        rel = Path(os.path.relpath(out.resolve(), readme.resolve().parent)).as_posix()
        update_readme(readme, markdown(results, command, rel), README_START, README_END)
    return [out / "engines.json", out / "engines.md", image]
