"""llama.cpp's tools as benchmark rows: plain decoding (`llama-completion`) and its drafter-free n-gram
speculation (`llama-speculative-simple --spec-type ngram-simple`) on a GGUF file, one process per
prompt, timed by what the tools report of themselves.

The tools are not part of edge-sd: `benchmarks/llama_cpp.sh` builds them from the llama-cpp-python
sdist and prints the folder that holds them, which `edge-sd bench --llama-cpp` and
`benchmarks/llama_cpp.py` take.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edge_sd.engines import large_pages
from edge_sd.errors import UsageError
from edge_sd.sampling import SamplingConfig

COMPLETION = "llama-completion"
SPECULATIVE = "llama-speculative-simple"
# A completion, not a chat; no empty warm-up run before the timed one.
PLAIN_ARGS = ("-no-cnv", "--no-warmup")
NGRAM_ARGS = ("--spec-type", "ngram-simple")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Timing:
    """One run: new tokens, seconds decoding them, seconds of the prompt's prefill (None where the tool
    does not report it), and the share of drafted tokens accepted (speculation only). eval_s: for
    llama-completion, its `eval time` alone, the model's forwards without choosing the tokens (its
    own tokens-per-second figure); decode_s adds the time its sampler took."""

    tokens: int
    decode_s: float
    prefill_s: float | None = None
    accept: float | None = None
    eval_s: float | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0


# edge-sd's sampler order (sampling.py); llama.cpp's default puts temperature last.
SAMPLERS = "penalties;temperature;top_k;top_p;min_p"


def sampling_args(cfg: SamplingConfig) -> list[str]:
    """llama.cpp's options for edge-sd's sampler chain: every setting given, its defaults (top-k 40,
    top-p 0.95, min-p 0.05) off where edge-sd's are, in edge-sd's order; greedy at temperature 0."""
    penalties = ["--repeat-penalty", str(cfg.repetition_penalty), "--repeat-last-n", str(cfg.repeat_last_n),
                 "--presence-penalty", str(cfg.presence_penalty), "--frequency-penalty", str(cfg.frequency_penalty)]
    if cfg.greedy:
        return ["--temp", "0", *penalties]
    return ["--temp", str(cfg.temperature), "--top-k", str(cfg.top_k), "--top-p", str(cfg.top_p),
            "--min-p", str(cfg.min_p), *penalties, "--samplers", SAMPLERS]


def tool_args(gguf: Path, n: int, threads: int, sampling: SamplingConfig, seed: int, ctx: int) -> list[str]:
    """Arguments both tools share: the model, n new tokens, threads, the sampler chain, the seed, the
    context (positions the KV cache holds). The logical batch is the whole context because
    llama-speculative-simple refuses a prompt longer than one batch."""
    return ["-m", str(gguf), "-n", str(n), "-t", str(threads), "-tb", str(threads), "--seed", str(seed),
            "-c", str(ctx), "-b", str(ctx), *sampling_args(sampling)]


def run_tool(binary: Path, args: list[str], prompt: str, speculative: bool) -> Timing:
    """Run one of the tools on a prompt (passed as a file: no shell quoting) and read its timings."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    cmd = [str(binary), *args, "-f", f.name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    finally:
        Path(f.name).unlink()
    log = proc.stderr + proc.stdout
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {log[-2000:]}")
    return parse(log, speculative, binary.name)


def parse(log: str, speculative: bool, tool: str = "llama.cpp") -> Timing:
    """Timings from a tool's log: llama-speculative-simple's summary (`encoded N tokens in S seconds`,
    `decoded N tokens in S seconds`, `accept = P%`), or llama-completion's performance lines (`prompt
    eval time = MS ms / N tokens`, then `eval time = MS ms / N runs`)."""
    if speculative:
        m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds", log)
        if not m:
            raise RuntimeError(f"no decoding time in the output of {tool}: {log[-1500:]}")
        enc = re.search(r"encoded\s+\d+\s+tokens in\s+([\d.]+)\s+seconds", log)
        acc = re.search(r"accept\s*=\s*([\d.]+)%", log)
        return Timing(int(m.group(1)), float(m.group(2)), float(enc.group(1)) if enc else None,
                      float(acc.group(1)) / 100 if acc else None)
    prompt = re.search(r"prompt eval time =\s*([\d.]+) ms", log)
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", log.split("prompt eval time")[-1])
    if not m:
        raise RuntimeError(f"no eval time in the output of {tool}: {log[-1500:]}")
    runs, eval_s = int(m.group(2)), float(m.group(1)) / 1e3
    # `eval time` leaves out choosing each token, which over a large vocabulary with every filter off
    # is a sizeable share of a step (benchmarks/results/llama_cpp.md). edge-sd's decode time includes
    # its own, so the sampler's time goes in too: `sampling time` covers the runs + 1 tokens sampled
    # (the first from the prompt's logits), counted here for the runs' tokens.
    sampling = re.search(r"sampling time =\s*([\d.]+) ms", log)
    sample_s = float(sampling.group(1)) / 1e3 * runs / (runs + 1) if sampling else 0.0
    return Timing(runs, eval_s + sample_s, float(prompt.group(1)) / 1e3 if prompt else None, eval_s=eval_s)


def version(folder: Path) -> str:
    """The version llama.cpp reports of itself, and the llama-cpp-python sdist the tools were built from
    where the folder is laid out as benchmarks/llama_cpp.sh lays it out (<version>/build/bin)."""
    proc = subprocess.run([str(Path(folder) / COMPLETION), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (\S+)", proc.stderr + proc.stdout)
    own = m.group(1) if m else "version unknown"
    built = Path(folder).parent.parent.name
    return f"vendored in llama-cpp-python {built} ({own})" if Path(folder).name == "bin" else own


def in_large_pages(gguf: Path) -> None:
    """Read the GGUF file that llama.cpp maps into large folios of the page cache, as edge-sd's load does
    for its own weights (engines/large_pages.py): the tools compared with their files in the same state."""
    if hasattr(large_pages.os, "posix_fadvise"):
        large_pages.reread(Path(gguf), ())  # no spans: all of it kept


class LlamaCpp:
    """llama.cpp's tools in `folder`, run on `gguf` with `threads` threads and a `ctx`-position cache."""

    def __init__(self, folder: Path, gguf: Path, threads: int, ctx: int = 2048):
        self.folder, self.gguf, self.threads, self.ctx = Path(folder), Path(gguf), threads, ctx
        missing = [t for t in (COMPLETION, SPECULATIVE) if not (self.folder / t).is_file()]
        if missing:
            raise UsageError(f"{self.folder} lacks llama.cpp's {', '.join(missing)} "
                             "(bash benchmarks/llama_cpp.sh builds them and prints their folder)")
        if not self.gguf.is_file():
            raise UsageError(f"GGUF file {self.gguf} not found: llama.cpp runs the file the target was exported "
                             "from (give it with --gguf)")
        in_large_pages(self.gguf)

    def plain(self, prompt: str, n: int, sampling: SamplingConfig, seed: int) -> Timing:
        args = tool_args(self.gguf, n, self.threads, sampling, seed, self.ctx) + list(PLAIN_ARGS)
        return run_tool(self.folder / COMPLETION, args, prompt, speculative=False)

    def ngram(self, prompt: str, n: int, sampling: SamplingConfig, seed: int) -> Timing:
        """n-gram speculation: the target's own draws decide, drafts accepted where they match."""
        args = tool_args(self.gguf, n, self.threads, sampling, seed, self.ctx) + list(NGRAM_ARGS)
        return run_tool(self.folder / SPECULATIVE, args, prompt, speculative=True)
