"""How much of a drafter step its LM head takes, full and pruned (RDK / TLI's `--drafter-vocab-keep`).

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    .venv/bin/python benchmarks/head_share.py [--pair DIR] [--keep 1,0.5,0.25,0.1] [--steps 200]

Pruning keeps a fraction of the head's rows, so it can save at most that share of a step. Counting
multiply-adds overstates the share (the head is one large matrix product that runs near the machine's
peak, the layers many small ones that do not), so this measures it: ONNX Runtime's profiler times
every kernel of one-position drafter steps (`--context` positions cached, 2 threads that do not
spin between runs), the drafters
(the pair's own and pruned copies, built into the cache on first use) taking turns step by step.
Writes benchmarks/results/head_share.{md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
OUT = ROOT / "benchmarks" / "results" / "head_share"
WARMUP = 10


def session(folder: Path, context: int, prefix: str):
    """A profiling ONNX Runtime session over the drafter engine in `folder`, and a one-position feed."""
    import numpy as np
    import onnxruntime as ort

    from edge_sd.manifest import load_engine_manifest

    m = load_engine_manifest(folder)
    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, prefix
    so.intra_op_num_threads = 2
    # Four sessions take turns: threads left spinning after a run would slow the next one's.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(folder / m.model_file), so, providers=["CPUExecutionProvider"])
    kv = np.zeros((1, m.num_kv_heads, context, m.head_dim), np.float16 if m.kv_dtype == "float16" else np.float32)
    feed = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, context + 1), np.int64)}
    if m.has_position_ids:
        feed["position_ids"] = np.array([[context]], np.int64)
    for i in range(m.num_layers):
        feed[m.past_key_template.format(i=i)] = feed[m.past_value_template.format(i=i)] = kv
    return sess, feed


def kernel_ms(profile: Path, steps: int) -> tuple[float, float]:
    """Median ms per step of all kernels and of the LM head's, over the last `steps` runs profiled."""
    events = json.loads(profile.read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-steps:]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    total, head = [], []
    for r in runs:
        inside = [e for e in nodes if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        total.append(sum(e["dur"] for e in inside) / 1e3)
        head.append(sum(e["dur"] for e in inside if "lm_head" in e["name"]) / 1e3)
    return statistics.median(total), statistics.median(head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--keep", default="1,0.5,0.25,0.1", help="kept fractions of the drafter vocabulary")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--context", type=int, default=150)
    args = ap.parse_args()

    from edge_sd.export.prune import pruned_copy
    from edge_sd.manifest import load_pair_manifest

    cache = cache_dir()
    fractions = [float(f) for f in args.keep.split(",")]
    drafter = load_pair_manifest(args.pair).drafter
    folders = {f: (args.pair if f == 1.0 else pruned_copy(args.pair, f, cache)) / drafter for f in fractions}
    tmp = cache / "profiles"
    tmp.mkdir(parents=True, exist_ok=True)
    sessions = {f: session(d, args.context, str(tmp / f"keep{f:g}")) for f, d in folders.items()}
    wall: dict[float, list[float]] = {f: [] for f in fractions}
    for step in range(WARMUP + args.steps):
        for f, (sess, feed) in sessions.items():
            start = time.perf_counter()
            sess.run(None, feed)
            if step >= WARMUP:
                wall[f].append(1e3 * (time.perf_counter() - start))
    rows = []
    for f, (sess, _) in sessions.items():
        profile = Path(sess.end_profiling())
        total, head = kernel_ms(profile, args.steps)
        profile.unlink()
        rows.append((f, statistics.median(wall[f]), total, head))

    full = rows[0]
    lines = [
        f"Command: `python benchmarks/head_share.py --keep {args.keep} --steps {args.steps}` "
        f"({datetime.date.today()}); "
        f"pair `{args.pair.name}`, drafter steps over one position with {args.context} cached, 2 threads "
        "not spinning between runs, ONNX Runtime's profiler on (it adds to the step). Medians over the steps.",
        "",
        "| kept | step (ms) | kernels (ms) | LM head (ms) | head share | step vs full | step saved (ms) "
        "| head saved (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f, step, total, head in rows:
        lines.append(f"| {f:g} | {step:.2f} | {total:.2f} | {head:.2f} | {100 * head / total:.1f}% | "
                     f"{step / full[1]:.2f}x | {full[1] - step:.2f} | {full[3] - head:.2f} |")
    if full[0] == 1.0:
        lines += ["", f"The full drafter's head takes {100 * full[3] / full[2]:.1f}% of its kernel time (the profiler "
                  "adds a little to each kernel: more to the layers' many small ones than to the head's one). "
                  "Pruning pays when a step saves at least what the head's kernel saves."]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"{f:g}" for f, *_ in rows]
    ax.bar(labels, [t - h for _, _, t, h in rows], label="layers and the rest")
    ax.bar(labels, [h for *_, h in rows], bottom=[t - h for _, _, t, h in rows], label="LM head")
    ax.set_xlabel("kept fraction of the drafter vocabulary")
    ax.set_ylabel("kernel ms per drafter step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
