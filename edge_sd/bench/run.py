"""Run every configuration on every prompt, interleaved, and keep one record per run.

Configurations are interleaved per prompt (all of them on prompt 1, then all on prompt 2, ...) so that
a slow spell of this noisy machine hits every configuration alike; speedups are per-prompt ratios to
plain decoding of the same prompt, summarised by their median.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_sd.bench.record import Record
from edge_sd.errors import UsageError
from edge_sd.export.prune import pruned_copy
from edge_sd.pipeline import GenerationConfig, Pipeline
from edge_sd.sampling import SamplingConfig
from edge_sd.tools import prompt_sets

CHAT = SamplingConfig(0.8, top_k=40, top_p=0.95, min_p=0.05)

if TYPE_CHECKING:
    from edge_sd.bench.llama_cpp import LlamaCpp

# Each mode's sampler chain: greedy; temperature 1 with every filter off; and the chat setting that
# chat front-ends and llama.cpp's defaults set (llama.cpp's min-p default included).
MODES = {"greedy": SamplingConfig(), "sample": SamplingConfig(1.0), "chat": CHAT}
EDGE_ALGORITHMS = ("slem", "tli", "slrs")
# transformers' counterparts: universal assisted generation (greedy, re-tokenizes the text like SLEM)
# and universal speculative decoding (sampling, over the vocabulary intersection like TLI), as shipped
# and with its LM-head pruning off (bench/hf.py says why).
HF_ASSISTED = {"greedy": ("uag",), "sample": ("usd", "usd-unpruned")}
# Seconds to wait before each timed run. Plain decoding's lone engine lets its threads spin between
# runs (engines/session.py), for about 50 ms after its last one: the run after it, always auto, paid ~45 ms
# more for its prompt's prefill (328 against 283 ms, medians of 8, after a pause of 0.05 s or more).
SETTLE_S = 0.1
# On a GPU the pause does harm instead: after 0.1 s idle the device starts the next generation cold
# (an H200: plain decoding spent 5.3-5.8 ms a token in the target against 3.4 ms a forward back to
# back), and the threads that spin there have little to steal.


@dataclass
class BenchOptions:
    pair: Path
    cache: Path
    per_set: int = 20
    sets: tuple[str, ...] = prompt_sets.SETS
    max_new_tokens: int = 64
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    algorithms: tuple[str, ...] = EDGE_ALGORITHMS
    modes: tuple[str, ...] = ("greedy", "sample")
    seed: int = 0
    threads: int = 2
    provider: str = "auto"  # auto|cpu|cuda|tensorrt (engines/providers.py)
    transformers: bool = True
    hf_dir: Path | None = None  # holds gemma3-270m/ and smollm2-135m/ (fp32 HF folders)
    hf_ks: tuple[int, ...] = (3, 5)
    auto: bool = True  # also edge-sd's `auto` (cost-aware schedule over every algorithm)
    schedules: tuple[str, ...] = ()  # other lookahead schedules, for each algorithm at the first k (disco: its own)
    skip: int = 0  # each set starts after this many prompts (held out from `edge-sd calibrate`)
    # Drafters pruned to these fractions of their vocabulary (copies of the pair in cache/pairs/), each
    # run with TLI and RDK at keep_k; their drafter steps are timed against the full drafter's.
    keeps: tuple[float, ...] = ()
    keep_k: int = 3
    # llama.cpp's plain decoding and n-gram speculation beside edge-sd's rows (bench/llama_cpp.py): the
    # folder of its tools, and the GGUF file they run (default: the file the target was exported from).
    llama_cpp: Path | None = None
    gguf: Path | None = None

    def check(self) -> None:
        if self.per_set < 1 or self.max_new_tokens < 1:
            raise UsageError("--per-set and --max-new-tokens must be at least 1")
        if not self.algorithms or not self.modes or not self.ks:
            raise UsageError("give at least one algorithm, one mode and one k")
        if any(k < 1 for k in self.ks + self.hf_ks):
            raise UsageError("every k must be at least 1")
        for a in self.algorithms:
            if a not in EDGE_ALGORITHMS:
                raise UsageError(f"unknown algorithm {a!r} for the benchmark; choose from {', '.join(EDGE_ALGORITHMS)}")
        for m in self.modes:
            if m not in MODES:
                raise UsageError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if any(not 0.0 < f <= 1.0 for f in self.keeps) or self.keep_k < 1:
            raise UsageError("--keep fractions must be in (0, 1] and --keep-k at least 1")
        for sch in self.schedules:
            if sch not in ("heuristic", "confidence", "cost", "disco"):
                raise UsageError(f"unknown schedule {sch!r} for the benchmark; choose from heuristic, confidence, "
                                 "cost, disco")


@dataclass(frozen=True)
class Config:
    engine: str  # "edge-sd", "transformers" or "llama.cpp"
    mode: str
    algorithm: str  # ar (plain decoding), auto, slem/tli/slrs, uag/usd for transformers, ngram for llama.cpp
    k: int  # 0: the default (auto: the longest draft it may choose)
    schedule: str = "static"
    keep: float = 1.0  # the drafter's kept vocabulary fraction (below 1 or with rdk: a pruned copy)

    @property
    def label(self) -> str:
        sched = "" if self.schedule == "static" or self.algorithm == "auto" else f" {self.schedule}"
        kept = f" keep={self.keep:g}" if self.pruned else ""
        return f"{self.engine} {self.algorithm}{sched}" + (f" k={self.k}" if self.k else "") + kept

    @property
    def pruned(self) -> bool:
        """Whether it runs on a pruned copy of the pair (RDK needs one for its kernel, even at 1)."""
        return self.keep < 1.0 or self.algorithm == "rdk"


def configs(opts: BenchOptions, disco_k: int = 0) -> list[Config]:
    """disco_k: the draft length the pair's DISCO classifier was calibrated for, where DISCO's rows run
    (its stops make a long draft cheap; capped at a shorter k it can only cut); 0: the first k."""
    out = []
    for mode in opts.modes:
        out.append(Config("edge-sd", mode, "ar", 0))
        if opts.auto:
            out.append(Config("edge-sd", mode, "auto", 0, "cost"))
        out += [Config("edge-sd", mode, a, k) for a in opts.algorithms for k in opts.ks]
        out += [Config("edge-sd", mode, a, (sch == "disco" and disco_k) or opts.ks[0], sch)
                for sch in opts.schedules for a in opts.algorithms]
        for f in opts.keeps:
            out += [Config("edge-sd", mode, a, opts.keep_k, keep=f) for a in ("tli", "rdk")
                    if a == "rdk" or f < 1.0]
        if opts.transformers and mode in HF_ASSISTED:
            out.append(Config("transformers", mode, "ar", 0))
            out += [Config("transformers", mode, a, k) for a in HF_ASSISTED[mode] for k in opts.hf_ks]
        if opts.llama_cpp is not None:
            out.append(Config("llama.cpp", mode, "ar", 0))
            out.append(Config("llama.cpp", mode, "ngram", 0))
    return out


def machine() -> dict:
    import onnxruntime

    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "platform": platform.platform(terse=True),
    }


def _cpu_name() -> str:
    """The CPU's model name and its widest vector instructions on x86-64 (ONNX Runtime's and
    llama.cpp's kernels differ between AVX2 and AVX-512, and model names do not tell them apart)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    simd = "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else ""
    name = names[0] if names else platform.processor() or "unknown"
    return f"{name} with {simd}" if simd else name


def run(opts: BenchOptions, on_run: Callable[[Config, Record], None] | None = None) -> dict:
    """Run the benchmark; returns {"options", "machine", "prompts", "records"}."""
    opts.check()
    plist = [p for s in opts.sets for p in prompt_sets.load(s, opts.cache, opts.skip + opts.per_set)[opts.skip:]]
    pipe = Pipeline.from_folder(opts.pair, provider=opts.provider, threads=opts.threads)
    if pipe.drafter is None:
        raise UsageError(f"{opts.pair} holds a single engine; the benchmark needs a pair folder")
    # Plain decoding runs on the target folder alone, as `edge-sd generate PAIR/target` does: a lone
    # engine lets its threads spin between steps, which a pair must not (engines/session.py).
    plain = Pipeline.from_folder(pipe.target.engine.folder, provider=opts.provider, threads=opts.threads)
    variants = {f: Pipeline.from_folder(pruned_copy(opts.pair, f, opts.cache), provider=opts.provider,
                                        threads=opts.threads)
                for f in opts.keeps}
    hf = None
    if opts.transformers:
        from edge_sd.bench.hf import HFPair

        hf = HFPair.load(opts.hf_dir, pipe, opts.threads)
    llama = None
    if opts.llama_cpp is not None:
        from edge_sd.bench.llama_cpp import LlamaCpp

        llama = LlamaCpp(opts.llama_cpp, opts.gguf or Path(pipe.target.manifest.source), opts.threads)
    todo = configs(opts, pipe.disco.k if pipe.disco else 0)
    settle = SETTLE_S if pipe.target.engine.device == "cpu" else 0.0
    # Warm-up: the first runs of a fresh session pay for memory allocation; time none of that.
    warm = plist[0].text
    plain.generate(warm, GenerationConfig(max_new_tokens=4, algorithm="ar"))
    pipe.generate(warm, GenerationConfig(max_new_tokens=4, algorithm=opts.algorithms[0], lookahead=2))
    if opts.auto:  # also calibrates the cost model (once per pipeline), outside the timed runs
        pipe.generate(warm, GenerationConfig(max_new_tokens=4))
    for v in variants.values():
        v.generate(warm, GenerationConfig(max_new_tokens=4, algorithm="rdk", lookahead=2))
    if hf is not None:
        hf.generate(pipe.target.prompt_ids(warm, False), "greedy", "ar", 0, 4, 0)
    drafter_steps = _drafter_steps(pipe, variants) if variants else {}
    records: list[Record] = []
    for i, prompt in enumerate(plist):
        seed = opts.seed + i
        ids = pipe.target.prompt_ids(prompt.text, False)  # transformers gets edge-sd's exact token ids
        for cfg in todo:
            if settle:
                time.sleep(settle)
            if cfg.engine == "edge-sd":
                runner = plain if cfg.algorithm == "ar" else variants[cfg.keep] if cfg.pruned else pipe
                rec = _run_edge(runner, prompt, cfg, opts.max_new_tokens, seed)
            elif cfg.engine == "llama.cpp":
                assert llama is not None
                rec = _run_llama(llama, prompt, cfg, opts.max_new_tokens, seed)
            else:
                assert hf is not None
                rec = hf.generate(ids, cfg.mode, cfg.algorithm, cfg.k, opts.max_new_tokens, seed)
                rec.prompt = prompt.id
            records.append(rec)
            if on_run:
                on_run(cfg, rec)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
    return {
        "options": options,
        "machine": machine(),
        "prompts": [{"set": p.set, "id": p.id} for p in plist],
        "records": [asdict(r) for r in records],
        "drafter_step_ms": drafter_steps,
        "date": time.strftime("%Y-%m-%d"),
    }


# A drafter step is timed after this many cached positions, interleaved across the drafters, this many
# rounds (median): the full head's share of a step shows as the pruned drafters' saving.
STEP_CONTEXT = 64
STEP_ROUNDS = 40


def _drafter_steps(pipe: Pipeline, variants: dict[float, Pipeline]) -> dict[str, float]:
    """Median ms of one drafter step (one position) of the full drafter and of each pruned one."""
    engines = {"1": pipe.drafter.engine} if pipe.drafter else {}
    engines |= {f"{f:g}": v.drafter.engine for f, v in variants.items() if v.drafter and f < 1.0}
    ids = np.arange(STEP_CONTEXT + 1) % 1000 + 3
    times: dict[str, list[float]] = {name: [] for name in engines}
    for e in engines.values():
        e.reset()
        e.reserve(STEP_CONTEXT + 1)
        e.forward(ids[:STEP_CONTEXT])
    for _ in range(STEP_ROUNDS):
        for name, e in engines.items():
            e.truncate(STEP_CONTEXT)
            t0 = time.perf_counter()
            e.forward(ids[STEP_CONTEXT:])
            times[name].append(time.perf_counter() - t0)
    for e in engines.values():
        e.reset()
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def _run_edge(pipe: Pipeline, prompt: prompt_sets.Prompt, cfg: Config, max_new: int, seed: int) -> Record:
    # auto runs as `edge-sd generate` runs it by default: the cost schedule, with DISCO's stops where
    # the pair folder holds a calibrated disco.json.
    gen = GenerationConfig(max_new_tokens=max_new, seed=seed, **asdict(MODES[cfg.mode]),
                           algorithm=cfg.algorithm, lookahead=cfg.k or None,
                           schedule=None if cfg.algorithm == "auto" else cfg.schedule)
    # Timed from outside, as transformers' generate() is: tokenizing the prompt and setting up the
    # drafter count too.
    t0 = time.perf_counter()
    res = pipe.generate(prompt.text, gen)
    wall = time.perf_counter() - t0
    s = res.stats
    return Record(
        engine="edge-sd", mode=cfg.mode, algorithm=cfg.algorithm, k=cfg.k, prompt=prompt.id, schedule=cfg.schedule,
        new_tokens=s.new_tokens, wall_s=wall, prefill_s=s.prefill_s,
        target_s=s.time_target_s + s.prefill_s, drafter_s=s.time_drafter_s,
        # The prefill's last forward gave the first token: counted, as transformers' hook counts its
        # prompt's call.
        target_forwards=s.target_forwards + s.prefill_emitted, proposed=s.proposed, accepted=s.accepted,
        token_ids=res.token_ids, keep=cfg.keep,
    )


def _run_llama(llama: LlamaCpp, prompt: prompt_sets.Prompt, cfg: Config, max_new: int, seed: int) -> Record:
    # Timed by the tool itself, its model load left out as edge-sd's is: the prompt's prefill plus the
    # decoding. Its token ids are not read, so its rows are compared on speed only.
    t = (llama.ngram(prompt.text, max_new, MODES[cfg.mode], seed) if cfg.algorithm == "ngram"
         else llama.plain(prompt.text, max_new, MODES[cfg.mode], seed))
    prefill = t.prefill_s or 0.0
    drafted = t.accept is not None
    return Record(engine="llama.cpp", mode=cfg.mode, algorithm=cfg.algorithm, k=0, prompt=prompt.id,
                  new_tokens=t.tokens, wall_s=prefill + t.decode_s, prefill_s=prefill, target_s=prefill + t.decode_s,
                  drafter_s=0.0, target_forwards=0 if drafted else t.tokens, proposed=0, accepted=0)


def write_results(out: Path, name: str, report: Callable[[dict], str], plot: Callable[[dict, Path], None],
                  result: dict | None = None) -> str:
    """Write a benchmark's result as out/name.json, its table (name.md) and its plot (name.png); with
    result None (a script's --report), read the JSON written before and write table and plot again.
    Returns the table."""
    if result is None:
        result = json.loads((out / f"{name}.json").read_text())
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = report(result)
    (out / f"{name}.md").write_text(table)
    plot(result, out / f"{name}.png")
    return table
