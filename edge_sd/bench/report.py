"""Summaries of a benchmark run: one row per configuration, a markdown table, PNG plots, README section."""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

# The chat mode's settings, as its plot titles them (bench/run.py's CHAT).
MODE_LABEL = "T=0.8, top-k 40, top-p 0.95, min-p 0.05"

README_START = "<!-- real-pair-bench:start -->"
README_END = "<!-- real-pair-bench:end -->"
SPEEDUP_PNG = "real_pair_speedup.png"
SPLIT_PNG = "real_pair_time_split.png"
KEEP_PNG = "real_pair_pruned_acceptance.png"


def prompt_set(prompt_id: str) -> str:
    """The prompt set of a record's prompt id (prompts.py names them HumanEval/N and lee/N)."""
    return "code" if prompt_id.startswith("HumanEval") else "summarisation"


def summarise(results: dict) -> list[dict]:
    """One row per (mode, engine, algorithm, k, schedule, kept vocabulary), in the order they ran."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results["records"]:
        key = (r["mode"], r["engine"], r["algorithm"], r["k"], r.get("schedule", "static"), r.get("keep", 1.0))
        groups[key].append(r)
    plain = {(r["mode"], r["engine"], r["prompt"]): r for r in results["records"] if r["algorithm"] == "ar"}
    rows = []
    for (mode, engine, algo, k, schedule, keep), recs in groups.items():
        tokens = sum(r["new_tokens"] for r in recs)
        wall = sum(r["wall_s"] for r in recs)
        target = sum(r["target_s"] for r in recs)
        drafter = sum(r["drafter_s"] for r in recs)
        ratios, identical = [], 0
        by_set: dict[str, list[float]] = defaultdict(list)
        for r in recs:
            base = plain[(mode, "edge-sd", r["prompt"])]  # every speedup is over edge-sd's plain decoding
            if r["new_tokens"] and base["new_tokens"]:
                ratios.append((r["new_tokens"] / r["wall_s"]) / (base["new_tokens"] / base["wall_s"]))
                by_set[prompt_set(r["prompt"])].append(ratios[-1])
            own = plain[(mode, engine, r["prompt"])]
            identical += r["token_ids"] == own["token_ids"]
        proposed = sum(r["proposed"] for r in recs)
        forwards = sum(r["target_forwards"] for r in recs)
        rows.append({
            "mode": mode, "engine": engine, "algorithm": algo, "k": k, "schedule": schedule, "keep": keep,
            "prompts": len(recs),
            "speedup_median_by_set": {name: statistics.median(v) for name, v in sorted(by_set.items())},
            "new_tokens": tokens,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "speedup_median": statistics.median(ratios) if ratios else 0.0,
            "acceptance": sum(r["accepted"] for r in recs) / proposed if proposed else None,
            # None where the forwards are not known (llama.cpp's speculation does not report them)
            "tokens_per_target_forward": tokens / forwards if forwards else None,
            "ms_per_token_target": 1000 * target / max(1, tokens),
            "ms_per_token_drafter": 1000 * drafter / max(1, tokens),
            "ms_per_token_other": 1000 * max(0.0, wall - target - drafter) / max(1, tokens),
            # llama.cpp's ids are not read: its rows are compared on speed only
            "identical_to_plain": identical if mode == "greedy" and engine != "llama.cpp" else None,
        })
    return rows


def table(rows: list[dict], mode: str) -> str:
    head = ("| engine | algorithm | k | tok/s | speedup (median) | code | news | acceptance | tok / target fwd "
            "| ms/token: target | drafter | other |" + (" same tokens as plain |" if mode == "greedy" else ""))
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        if r["mode"] != mode:
            continue
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        per_fwd = "" if r["tokens_per_target_forward"] is None else f"{r['tokens_per_target_forward']:.2f}"
        sets = r.get("speedup_median_by_set", {})
        per_set = " | ".join(f"{sets[s]:.2f}x" if s in sets else "" for s in ("code", "summarisation"))
        name = _algo_name(r["algorithm"]) + ("" if r.get("schedule", "static") in ("static", "cost")
                                             else f" ({r['schedule']})")
        if r.get("keep", 1.0) < 1.0:
            name += f", drafter vocab {r['keep']:.0%}"
        line = (f"| {r['engine']} | {name} | {r['k'] or ''} | {r['tokens_per_s']:.1f} "
                f"| {r['speedup_median']:.2f}x | {per_set} | {acc} | {per_fwd} "
                f"| {r['ms_per_token_target']:.1f} | {r['ms_per_token_drafter']:.1f} | {r['ms_per_token_other']:.1f} |")
        if mode == "greedy":
            same = r["identical_to_plain"]
            line += f" {same}/{r['prompts']} |" if same is not None else " |"
        lines.append(line)
    return "\n".join(lines)


def _algo_name(a: str) -> str:
    names = {"ar": "plain", "auto": "auto (cost-aware)", "uag": "assisted (UAG)", "usd": "assisted (USD, as shipped)",
             "usd-unpruned": "assisted (USD, LM head not pruned)", "ngram": "n-gram speculation"}
    return names.get(a, a.upper())


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from edge_sd.errors import UsageError

        raise UsageError("the plots need matplotlib: pip install '.[bench]' in a clone of edge-sd") from None
    modes = [m for m in ("greedy", "sample", "chat") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        mrows = [r for r in rows if r["mode"] == mode]
        auto = [r for r in mrows if r["algorithm"] == "auto"]
        if auto:  # auto chooses its own k each round: a level, not a curve
            ax.axhline(auto[0]["speedup_median"], color="green", ls="--", lw=1.5, label="edge-sd auto (cost-aware)")
        for algo in ("slem", "tli", "slrs", "uag", "usd", "usd-unpruned"):
            pts = sorted((r["k"], r["speedup_median"]) for r in mrows if r["algorithm"] == algo
                         and r.get("schedule", "static") == "static" and r.get("keep", 1.0) == 1.0)
            if pts:
                hf = algo in ("uag", "usd", "usd-unpruned")
                style = "--s" if hf else "-o"
                label = ("transformers " if hf else "edge-sd ") + _algo_name(algo)
                ax.plot(*zip(*pts, strict=True), style, label=label)
        ax.axhline(1.0, color="grey", lw=1)
        hf_plain = [r for r in mrows if r["engine"] == "transformers" and r["algorithm"] == "ar"]
        if hf_plain:
            ax.axhline(hf_plain[0]["speedup_median"], color="grey", ls=":", lw=1, label="transformers plain")
        for r in mrows:  # llama.cpp: no draft length to plot against, levels like auto's
            if r["engine"] == "llama.cpp":
                ax.axhline(r["speedup_median"], color="tab:orange", ls="-." if r["algorithm"] == "ngram" else ":",
                           lw=1.5, label=f"llama.cpp {_algo_name(r['algorithm'])}")
        ax.set_title({"greedy": "greedy (T=0)", "sample": "sample (T=1)"}.get(mode, f"{mode} ({MODE_LABEL})"))
        ax.set_xlabel("k (drafted tokens per round)")
        ax.set_ylabel("speedup over edge-sd plain decoding (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    speed = save_figure(plt, fig, out / SPEEDUP_PNG)

    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.6 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        mrows = [r for r in rows if r["mode"] == mode]
        prefix = {"transformers": "HF ", "llama.cpp": "llama.cpp "}
        labels = [prefix.get(r["engine"], "") + _algo_name(r["algorithm"]) + (f" {r['k']}" if r["k"] else "")
                  for r in mrows]
        bottom = [0.0] * len(mrows)
        for key, color in (("target", "#4c72b0"), ("drafter", "#dd8452"), ("other", "#8c8c8c")):
            vals = [r[f"ms_per_token_{key}"] for r in mrows]
            ax.bar(range(len(mrows)), vals, bottom=bottom, color=color, label=key)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(mrows)), labels, rotation=70, fontsize=7)
        ax.set_ylabel("ms per generated token")
        ax.set_title(f"where the time goes, {mode}")
        ax.legend(fontsize=8)
    split = save_figure(plt, fig, out / SPLIT_PNG)
    return [speed, split] + ([keep_plot(rows, out, plt)] if _keep_rows(rows) else [])


def _keep_rows(rows: list[dict]) -> list[dict]:
    """TLI and RDK rows of the pruned-drafter runs, with the full drafter's TLI row at their k."""
    pruned = [r for r in rows if r["engine"] == "edge-sd" and (r.get("keep", 1.0) < 1.0 or r["algorithm"] == "rdk")]
    ks = {r["k"] for r in pruned}
    full = [r for r in rows if r["engine"] == "edge-sd" and r["algorithm"] == "tli" and r.get("keep", 1.0) == 1.0
            and r["k"] in ks and r.get("schedule", "static") == "static"]
    return pruned + full


def keep_plot(rows: list[dict], out: Path, plt) -> Path:
    """Acceptance against the drafter's kept vocabulary fraction, TLI and RDK, each mode."""
    krows = _keep_rows(rows)
    modes = [m for m in ("greedy", "sample") if any(r["mode"] == m for r in krows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 3.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for algo, style in (("tli", "-o"), ("rdk", "-s")):
            pts = sorted((r["keep"], r["acceptance"]) for r in krows
                         if r["mode"] == mode and r["algorithm"] == algo and r["acceptance"] is not None)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=_algo_name(algo))
        ax.set_xscale("log")
        ax.set_xlabel("drafter vocabulary kept (fraction, log scale)")
        ax.set_ylabel("acceptance (accepted / drafted)")
        ax.set_title(f"{mode} (T={'0' if mode == 'greedy' else '1'}), k={krows[0]['k']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, out / KEEP_PNG)


def save_figure(plt, fig, path: Path) -> Path:
    """Lay out, write as PNG and free a matplotlib figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def keep_table(rows: list[dict], steps: dict[str, float]) -> str:
    """Acceptance and speed of TLI and RDK per kept fraction, and the drafter's step time."""
    krows = _keep_rows(rows)
    lines = ["| drafter vocab kept | drafter step (ms, median) | mode | TLI acceptance | RDK acceptance "
             "| TLI speedup | RDK speedup |", "|---|---|---|---|---|---|---|"]
    for keep in sorted({r["keep"] for r in krows}, reverse=True):
        step = steps.get(f"{keep:g}")
        full = steps.get("1")
        step_s = f"{step:.2f} ({step / full:.2f}x full)" if step and full else ""
        for mode in ("greedy", "sample"):
            got = {r["algorithm"]: r for r in krows if r["keep"] == keep and r["mode"] == mode}
            if not got:
                continue
            acc = [f"{got[a]['acceptance']:.1%}" if a in got and got[a]["acceptance"] is not None else ""
                   for a in ("tli", "rdk")]
            spd = [f"{got[a]['speedup_median']:.2f}x" if a in got else "" for a in ("tli", "rdk")]
            lines.append(f"| {keep:.0%} | {step_s} | {mode} | {acc[0]} | {acc[1]} | {spd[0]} | {spd[1]} |")
    return "\n".join(lines)


def markdown(results: dict, rows: list[dict], command: str, image_dir: str) -> str:
    o, m = results["options"], results["machine"]
    sets = ", ".join(f"{o['per_set']} {s}" for s in o["sets"])
    parts = [
        f"Command: `{command}` ({results['date']}).",
        f"Machine: {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}, Python {m['python']}, "
        f"{o['threads']} threads for ONNX Runtime and torch.",
        f"Prompts: {sets} (see \"Prompt sets\"); {o['max_new_tokens']} new tokens each; one run per "
        "configuration and prompt, all configurations interleaved prompt by prompt. tok/s is total new "
        "tokens over total wall time (prompt processing included); speedup is the median over prompts of "
        "tok/s against edge-sd's plain decoding of the same prompt; the time split is per generated token "
        "(target includes the prompt's prefill).",
    ]
    for mode in ("greedy", "sample"):
        if any(r["mode"] == mode for r in rows):
            title = "Greedy (temperature 0)" if mode == "greedy" else "Sampling (temperature 1, seeded per prompt)"
            parts += [f"**{title}**", table(rows, mode)]
    parts += [f"![speedup against k]({image_dir}/{SPEEDUP_PNG})", f"![time split]({image_dir}/{SPLIT_PNG})"]
    if _keep_rows(rows):
        parts += ["**Pruned drafter vocabularies** (`--drafter-vocab-keep`; TLI and RDK at "
                  f"k={_keep_rows(rows)[0]['k']}; the drafter step is one position after 64 cached, interleaved "
                  "across the drafters, median of 40):", keep_table(rows, results.get("drafter_step_ms", {})),
                  f"![acceptance against the kept vocabulary]({image_dir}/{KEEP_PNG})"]
    return "\n\n".join(parts)


def write(results: dict, out: Path, command: str, readme: Path | None = None, name: str = "real_pair") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(results)
    # The raw records without their token ids (the summary has already compared them): small enough
    # to keep beside the table.
    records = [{k: v for k, v in r.items() if k != "token_ids"} for r in results["records"]]
    (out / f"{name}.json").write_text(json.dumps({**results, "records": records, "summary": rows}) + "\n")
    images = plots(rows, out)
    (out / f"{name}.md").write_text(markdown(results, rows, command, ".") + "\n")
    if readme is not None:
        rel = Path(os.path.relpath(out.resolve(), readme.resolve().parent))
        update_readme(readme, markdown(results, rows, command, rel.as_posix()))
    return {"rows": rows, "files": [out / f"{name}.json", out / f"{name}.md", *images]}


def update_readme(readme: Path, text: str, start_marker: str = README_START, end_marker: str = README_END) -> None:
    """Replace what lies between the two markers of a README with `text`."""
    doc = readme.read_text(encoding="utf-8")
    start, end = doc.find(start_marker), doc.find(end_marker)
    if start < 0 or end < start:
        from edge_sd.errors import UsageError

        raise UsageError(f"{readme} has no {start_marker} ... {end_marker} section to write the results into")
    doc = doc[: start + len(start_marker)] + "\n" + text + "\n" + doc[end:]
    readme.write_text(doc, encoding="utf-8")
