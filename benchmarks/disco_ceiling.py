"""How much any stopping rule could add over the best static draft length (greedy SLEM): DISCO's ceiling.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    edge-sd calibrate engines/gemma3-270m_smollm2-135m --per-set 4 --draft-max 6 -n 48   # DISCO's classifier
    .venv/bin/python benchmarks/disco_ceiling.py [--pair DIR] [--skip 4] [--per-set 8] [-n 48] [-k 8]

DISCO decides after each drafted token whether to draft another. The best such rule knows the answer:
an oracle that has the plain greedy output (decoded first, on the same engine) and stops a draft right
after its first wrong token (one wrong token still costs its drafter step and its target position), or
at the longest draft, -k. Side by side on held-out prompts, in one process: plain decoding, SLEM at
every static k up to -k, the heuristic and confidence schedules, DISCO (the pair's classifier at its
calibrated k) and the oracle. "oracle, ideal" also takes away the drafter steps of the wrong tokens it
drafted (their count times the generation's one-position drafter step): a rule that stopped *before* them.
Every output is checked equal to plain decoding. Speedup: median of per-prompt ratios of tokens per
second against plain decoding. Writes benchmarks/results/disco_ceiling.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
OUT = ROOT / "benchmarks" / "results" / "disco_ceiling"


class Oracle:
    """Stops a draft after the first drafted token whose bytes leave the known plain output."""

    def __init__(self, state, plain_bytes: bytes):
        self.state, self.truth = state, state.head + plain_bytes
        self.wrong = 0  # drafted tokens that left the known text

    def __call__(self, logits, position: int) -> bool:
        s = self.state
        tb = s.vocab.token_bytes
        text = b"".join(tb[i] or b"" for i in s.ids[s.n_prompt :])
        right = self.truth.startswith(text)
        self.wrong += not right
        return right


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--skip", type=int, default=4, help="prompts of each set left to calibration")
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("-n", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("-k", type=int, default=8, help="longest draft: static k runs 1..k, the oracle up to k")
    args = ap.parse_args()

    import numpy as np

    from edge_sd.manifest import load_pair_manifest
    from edge_sd.pipeline import GenerationConfig, Pipeline
    from edge_sd.schedules import StaticSchedule, StoppedSchedule
    from edge_sd.tools import prompt_sets

    cache = cache_dir()
    plist = [p for s in ("code", "summarisation")
             for p in prompt_sets.load(s, cache, args.skip + args.per_set)[args.skip:]]
    pipe = Pipeline.from_folder(args.pair)
    plain = Pipeline.from_folder(args.pair / load_pair_manifest(args.pair).target)
    configs: dict[str, dict] = {f"SLEM k={k}": {"algorithm": "slem", "lookahead": k} for k in range(1, args.k + 1)}
    configs["SLEM heuristic"] = {"algorithm": "slem", "schedule": "heuristic"}
    configs["SLEM confidence"] = {"algorithm": "slem", "lookahead": 6, "schedule": "confidence"}
    if pipe.disco is not None and pipe.disco.greedy:
        configs[f"SLEM DISCO (k={pipe.disco.k})"] = {"algorithm": "slem", "schedule": "disco"}
    configs["auto"] = {}
    configs[f"oracle (k={args.k})"] = {"algorithm": "slem", "lookahead": args.k}
    for p in (plain, pipe):  # warm-up
        p.generate(plist[0].text, GenerationConfig(max_new_tokens=4, algorithm="ar" if p is plain else "slem"))
    rows: dict[str, list[tuple[str, float]]] = {}
    ideal: list[tuple[str, float]] = []
    steps: list[float] = []
    for prompt in plist:
        base = plain.generate(prompt.text, GenerationConfig(max_new_tokens=args.n, algorithm="ar"))
        plain_bytes = plain.target.vocab.ids_bytes(base.token_ids)
        base_rate = base.stats.tokens_per_second
        for label, kw in configs.items():
            oracle: list[Oracle] = []
            make = None
            if label.startswith("oracle"):
                def make(proposers, _o=oracle, _b=plain_bytes):
                    (proposer,) = proposers.values()
                    _o.append(Oracle(proposer.drafter, _b))
                    return StoppedSchedule(StaticSchedule(proposer, args.k), _o[-1])
            res = pipe.generate(prompt.text, GenerationConfig(max_new_tokens=args.n, **kw), make_schedule=make)
            if res.token_ids != base.token_ids:
                raise SystemExit(f"{label} on {prompt.id}: output differs from plain decoding")
            rows.setdefault(label, []).append((prompt.set, res.stats.tokens_per_second / base_rate))
            if oracle:
                st = res.stats
                step = oracle[0].state.step_s or 0.0  # one-position drafter forwards (running mean)
                steps.append(step)
                ideal.append((prompt.set, st.new_tokens / (st.wall_s - oracle[0].wrong * step) / base_rate))
        print(f"{prompt.id}: " + ", ".join(f"{lab} {r[-1][1]:.2f}x" for lab, r in rows.items()), flush=True)
    rows[f"oracle (k={args.k}), ideal"] = ideal

    def median(rs: list[tuple[str, float]], subset: str | None = None) -> float:
        return statistics.median(r for s, r in rs if subset in (None, s))

    static = {lab: median(rs) for lab, rs in rows.items() if lab.startswith("SLEM k=")}
    best = max(static, key=static.get)
    lines = [
        f"Command: `python benchmarks/disco_ceiling.py --skip {args.skip} --per-set {args.per_set} -n {args.n} "
        f"-k {args.k}` ({datetime.date.today()}); pair `{args.pair.name}`, greedy, prompts {args.skip + 1}-"
        f"{args.skip + args.per_set} of each set (held out from calibration), {args.n} new tokens, one process. "
        "Speedup: median of per-prompt ratios of tokens per second against plain decoding of the same target "
        f"engine; every output equal to plain decoding. The oracle knows the plain output and stops a draft "
        f"after its first wrong token; \"ideal\" also takes away those wrong tokens' drafter steps "
        f"(median one-position drafter step {1e3 * float(np.median(steps)):.2f} ms).",
        "",
        f"| configuration | speedup (median) | code | news | over the best static k ({best}) |",
        "|---|---|---|---|---|",
    ]
    for lab, rs in rows.items():
        lines.append(f"| {lab} | {median(rs):.2f}x | {median(rs, 'code'):.2f}x | {median(rs, 'summarisation'):.2f}x "
                     f"| x{median(rs) / static[best]:.2f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    OUT.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"pair": str(args.pair)},
                                                    "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = list(rows)
    ax.bar(range(len(labels)), [median(rows[lab]) for lab in labels],
           color=["tab:blue" if lab.startswith("SLEM k=") else "tab:orange" for lab in labels])
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.axhline(static[best], color="gray", linewidth=0.8, linestyle="--")
    ax.axhline(1.10 * static[best], color="tab:red", linewidth=0.8, linestyle=":")
    ax.set_ylabel("speedup over plain (median)")
    ax.set_title("greedy SLEM: static k, schedules and an oracle stop (dotted: 1.10x best static)", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
