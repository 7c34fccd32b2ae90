"""The engine benchmark: what one forward costs, side by side with ONNX Runtime's own LLM runtime.

Per engine folder, in one process and interleaved (a slow spell of the machine hits all alike):
- ms per forward of 1 and of k+1 positions after `context` cached ones, and the cut-back back to
  `context` positions (medians over repeats); a forward as the loop runs it, re-feeding included;
- plain greedy decoding through edge-sd's loop: tokens per second and the share of time outside the
  engine;
- onnxruntime-genai's generator decoding the same graph from the same token ids (builder graphs carry
  its genai_config.json), and transformers' `generate` on the fp32 weights (when an HF folder is given).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_sd.costs import median_forward
from edge_sd.engines.ort import OrtEngine


@dataclass(frozen=True)
class EngineCase:
    label: str
    folder: Path
    hf: Path | None = None  # fp32 HF folder of the same weights, for transformers
    # Forwards of fewer positions than this re-feed cached ones (None: the manifest's). A drafter runs
    # with 1 in a pair, since its forwards need not agree with each other.
    min_step: int | None = None


@dataclass
class EngineOptions:
    cases: list[EngineCase]
    prompts: list[str]
    context: int = 64
    k: int = 3
    repeats: int = 20
    new_tokens: int = 64
    threads: int = 2
    provider: str = "cpu"  # auto|cpu|cuda|tensorrt (engines/providers.py)
    genai: bool = True
    transformers: bool = True
    results: dict = field(default_factory=dict)


def time_forwards(engine: OrtEngine, context: int, k: int, repeats: int, seed: int = 0) -> dict:
    """Medians (ms) of a 1-position forward and a (k+1)-position forward, timed as auto's costs are
    (costs.median_forward), and of the cut-back after the longer one."""
    ids = np.random.default_rng(seed).integers(3, engine.manifest.scored_ids, size=context + k + 1)
    one = median_forward(engine, ids, context, 1, repeats)
    many = median_forward(engine, ids, context, k + 1, repeats)
    engine.reserve(context + k + 1)
    engine.forward(ids[:context])
    cut = []
    for _ in range(repeats):
        engine.forward(ids[context : context + k + 1])
        t = time.perf_counter()
        engine.truncate(context)
        cut.append(time.perf_counter() - t)
    engine.reset()
    return {"ms_forward_1": 1e3 * one, f"ms_forward_{k + 1}": 1e3 * many, "ms_cut_back": 1e3 * statistics.median(cut)}


def edge_decode(pipe, prompt: str, n: int) -> dict:
    """Plain greedy decoding through the loop (EOS ignored by the prompt choice, not by the loop)."""
    from edge_sd import GenerationConfig

    r = pipe.generate(prompt, GenerationConfig(max_new_tokens=n, algorithm="ar"))
    return {"tokens": r.stats.decoded_tokens, "decode_s": r.stats.decode_s, "other_s": r.stats.time_other_s,
            "prompt_ids": r.prompt_ids, "token_ids": r.token_ids}


class GenaiRunner:
    """onnxruntime-genai's generator on an engine folder's graph, in a process of its own.

    Two runtimes in one process measure each other: with both models loaded and both thread pools
    alive, the one measured second loses time to the other's threads. A worker process
    holds genai alone; the benchmark still alternates prompt by prompt between the two.
    """

    def __init__(self, folder: Path, threads: int):
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "edge_sd.bench.engine_timing", "--genai-worker", str(folder), "--threads",
             str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._proc.stdout.readline() if self._proc.stdout else ""
        if not ready.startswith("ready"):
            self.close()
            raise ImportError(f"onnxruntime-genai could not load {folder}: {ready.strip() or 'worker died'}")

    def decode(self, prompt_ids: list[int], n: int) -> dict:
        assert self._proc.stdin and self._proc.stdout
        self._proc.stdin.write(json.dumps({"ids": [int(i) for i in prompt_ids], "n": n}) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def genai_worker(folder: Path, threads: int) -> None:
    """The worker's side: load the graph with onnxruntime-genai, then decode requests from stdin."""
    import sys

    import onnxruntime_genai as og

    # The generator reads its session options from genai_config.json: a copy of the folder (links to
    # the model files) with the thread count set, so that both runtimes use the same cores.
    tmp = Path(tempfile.mkdtemp(prefix="edge-sd-genai-"))
    try:
        for f in folder.iterdir():
            if f.is_file() and f.name != "genai_config.json":
                os.symlink(f.resolve(), tmp / f.name)
        cfg = json.loads((folder / "genai_config.json").read_text())
        cfg["model"]["decoder"].setdefault("session_options", {}).update(
            {"intra_op_num_threads": threads, "inter_op_num_threads": 1})
        (tmp / "genai_config.json").write_text(json.dumps(cfg))
        model = og.Model(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(req["ids"]) + req["n"], do_sample=False)
        gen = og.Generator(model, params)
        t = time.perf_counter()
        gen.append_tokens(req["ids"])
        prefill = time.perf_counter() - t
        ids: list[int] = []
        start = time.perf_counter()
        while len(ids) < req["n"] and not gen.is_done():
            gen.generate_next_token()
            ids.append(int(gen.get_next_tokens()[0]))
        print(json.dumps({"tokens": len(ids), "decode_s": time.perf_counter() - start, "prefill_s": prefill,
                          "token_ids": ids}), flush=True)


def hf_decode(model, prompt_ids: list[int], n: int) -> dict:
    """transformers' greedy `generate`: seconds per token = (time for n+1 tokens - time for 1) / n."""
    import torch

    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        one = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
        full = time.perf_counter() - t
    return {"tokens": n, "decode_s": full - one, "token_ids": out[0, len(prompt_ids):].tolist()[:n]}


def run(opts: EngineOptions, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Measure every case; returns {"cases": [...]} with one summary dict per case."""
    from edge_sd import Pipeline

    out = []
    for case in opts.cases:
        progress(f"{case.label}: forwards")
        pipe = Pipeline.from_folder(case.folder, provider=opts.provider, threads=opts.threads)
        if case.min_step is not None:
            pipe.target.engine.min_step = case.min_step
        m = pipe.target.manifest
        row: dict = {"label": case.label, "name": m.name, "export_path": m.export_path, "precision": m.precision,
                     "kv_layout": m.kv_layout, "min_step_positions": pipe.target.engine.min_step,
                     **time_forwards(pipe.target.engine, opts.context, opts.k, opts.repeats)}
        genai = None
        if opts.genai and (case.folder / "genai_config.json").is_file():
            try:
                genai = GenaiRunner(case.folder, opts.threads)
            except ImportError as e:  # the bench extra is not installed: the columns stay empty
                progress(f"{case.label}: no onnxruntime-genai comparison ({e})")
                genai = None
        model = None
        if opts.transformers and case.hf is not None:
            import torch
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(opts.threads)
            model = AutoModelForCausalLM.from_pretrained(case.hf, dtype=torch.float32).eval()
        runs: dict[str, list[dict]] = {"edge": [], "genai": [], "hf": []}
        for i, prompt in enumerate(opts.prompts):
            progress(f"{case.label}: decoding prompt {i + 1}/{len(opts.prompts)}")
            e = edge_decode(pipe, prompt, opts.new_tokens)
            runs["edge"].append(e)
            if e["tokens"] < 2:
                e["decode_s"] = max(e["decode_s"], 1e-9)
            if genai is not None:
                runs["genai"].append(genai.decode(e["prompt_ids"], e["tokens"]))
            if model is not None:
                runs["hf"].append(hf_decode(model, e["prompt_ids"], e["tokens"]))
        if genai is not None:
            genai.close()
        row.update(_decode_summary(runs))
        out.append(row)
        del pipe, model, genai
    return {"cases": out}


def _decode_summary(runs: dict[str, list[dict]]) -> dict:
    def rate(rs: list[dict]) -> float:
        return sum(r["tokens"] for r in rs) / max(1e-9, sum(r["decode_s"] for r in rs))

    edge = runs["edge"]
    row = {
        "token_ids": [e["token_ids"] for e in edge],  # for output comparisons; not written out
        "decode_tok_s": rate(edge),
        "other_share": sum(r["other_s"] for r in edge) / sum(r["decode_s"] for r in edge),
        "prompts": len(edge),
    }
    for key in ("genai", "hf"):
        rs = runs[key]
        if rs:
            row[f"{key}_tok_s"] = rate(rs)
            # Per prompt: edge-sd's decode rate over the other runtime's, then the median (a prompt
            # whose output ended at once, EOS first, has no rate).
            row[f"vs_{key}_median"] = statistics.median(
                (e["tokens"] / e["decode_s"]) / (r["tokens"] / r["decode_s"])
                for e, r in zip(edge, rs, strict=True) if e["tokens"] > 1 and r["tokens"] > 1)
            row[f"{key}_same_tokens"] = sum(_same_prefix(e["token_ids"], r["token_ids"])
                                            for e, r in zip(edge, rs, strict=True))
    return row


def _same_prefix(a: list[int], b: list[int]) -> bool:
    """Equal over the shorter of the two (either side may stop at EOS first)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_profile(folder: Path, n: int, threads: int, checkpoints: tuple[int, ...] = (256, 512, 1024)) -> dict:
    """Resident memory while one engine decodes n tokens greedily (EOS ignored): after loading, then at
    checkpoints. Run it in a fresh process (`python -m edge_sd.bench.engine_timing --memory`): a process that
    loaded other models keeps their memory."""
    before = rss_bytes()
    engine = OrtEngine(folder, provider="cpu", threads=threads)
    m = engine.manifest
    weights = sum(f.bytes for f in m.files if f.path.startswith(m.model_file))
    per_position = 2 * m.num_layers * m.num_kv_heads * m.head_dim * np.dtype(m.kv_dtype).itemsize
    engine.reserve(n + 1)
    loaded = rss_bytes()
    seen = {}
    last = 2
    engine.forward(np.asarray([m.bos_token_id or 2, 3]))
    for i in range(1, n):
        last = int(np.argmax(engine.forward(np.asarray([last]))[0]))
        if i + 1 in checkpoints or i + 1 == n:
            seen[i + 1] = rss_bytes()
    kv = per_position * (n + 1)
    return {
        "weights_bytes": weights, "kv_bytes": kv, "rss_before_load": before, "rss_loaded": loaded,
        "rss_at": seen, "ratio_to_weights_and_kv": (seen[n] - before) / (weights + kv),
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="memory of one engine over a long greedy generation (JSON), or "
                                             "the onnxruntime-genai worker of GenaiRunner")
    ap.add_argument("--memory", type=Path, help="engine folder")
    ap.add_argument("--genai-worker", type=Path, help="engine folder")
    ap.add_argument("-n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.genai_worker:
        genai_worker(a.genai_worker, a.threads)
    else:
        print(json.dumps(memory_profile(a.memory, a.n, a.threads)))
