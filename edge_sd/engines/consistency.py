"""Whether an engine's forwards agree with each other: what the verification of a draft needs.

A verification forward over s positions must compute what plain decoding's forwards compute, or a
greedy speculative run may pick another token where the target's top two logits are close. Kernels
can differ with the number of positions: on x86, ONNX Runtime's GroupQueryAttention takes another path
for one query row (1e-5 of its output) and int4 MatMulNBits too, which int8 activations then round into
1e-2 of the logits; on CUDA, fp16 GEMV against GEMM kernels. The export measures this on the provider it
validates on (export/validate.py); an engine run on another provider measures it again at load
(engines/engine.py), with the same forwards, no torch needed.
"""

from __future__ import annotations

import numpy as np

# A forward that crosses a multiple of this many positions is run as plain decoding's two-position
# steps meet it: split there, its second part starting at the position before the multiple, which a
# forward starting at the multiple feeds again. With ONNX Runtime 1.32, on an AVX-512 VNNI Xeon and on
# an AMD EPYC with AVX-512, a forward holding positions on both sides of 64 (or 192) computed them
# otherwise than the steps do, its first row included, enough to change a greedy output; run so, every
# row agrees (docs/artifact-format.md; export validation checks it: across_split below). It costs one
# extra forward at most every SPLIT_AT positions. Where edge-sd's attention kernel computes every
# attention of the graph (engines/attention.py), a row is computed alike in any forward and no
# forward is split.
SPLIT_AT = 64

# Relative to the logits' scale: the most two forwards of the same positions may differ.
CACHE_RTOL = 1e-4
# Beyond this, forwards that disagree are broken, not rounded (int4 on CUDA: 3e-3 between one and two
# positions; a KV cache written wrongly: order 1).
BROKEN_RTOL = 5e-2
PROMPT_LEN = 12
STEPS = 4
N_PROMPTS = 3
SPLIT_IDS = 80  # ids for across_split: past the first split (64) and the forwards that end beyond it
# The forwards across_split compares with the steps: short drafts, and the longest verification auto
# runs (a prompt lookup draft of schedules.choose.DEFAULT_MAX_LOOKUP tokens and the position after it).
SPLIT_SIZES = (3, 5, 17)


def rel(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) / scale


def steps(engine, ids: np.ndarray, min_step: int, head_rows: int | None = None) -> np.ndarray:
    """Logits of positions PROMPT_LEN .. PROMPT_LEN+STEPS-1 fed one step at a time after a prefill,
    each step over min_step positions, its LM head over head_rows (default min_step) of them."""
    engine.min_step = min_step
    engine.head_rows = min_step if head_rows is None else head_rows
    engine.reset()
    engine.forward(ids[:PROMPT_LEN])
    return np.stack([engine.forward(ids[j : j + 1])[0] for j in range(PROMPT_LEN, PROMPT_LEN + STEPS)])


def measure(engine, ids: np.ndarray, full: np.ndarray, worst: dict[str, float]) -> None:
    """Update worst["single"], ["multi"], ["small"] and ["head"] with one sequence of PROMPT_LEN + STEPS ids.

    full: the engine's logits of every position from one forward over ids. single: one-position steps
    against it; multi: two-position steps (re-feeding the last cached token) and a STEPS-position
    forward after a cut-back, against it; small: those two against each other, the forwards a
    speculative loop with `min_step_positions` 2 runs after the prefill; head: two-position steps
    whose LM head computes the last row only, against two-position steps."""
    scale = max(1.0, float(np.abs(full).max()))
    ref = full[PROMPT_LEN:]
    worst["single"] = max(worst["single"], rel(steps(engine, ids, 1), ref, scale))
    pairs = steps(engine, ids, 2)
    worst["head"] = max(worst["head"], rel(steps(engine, ids, 2, head_rows=1), pairs, scale))
    engine.truncate(PROMPT_LEN)
    multi = engine.forward(ids[PROMPT_LEN:])
    worst["multi"] = max(worst["multi"], rel(pairs, ref, scale), rel(multi, ref, scale))
    worst["small"] = max(worst["small"], rel(pairs, multi, scale))


def across_split(engine, ids: np.ndarray, ends: range | None = None, sizes: tuple[int, ...] = SPLIT_SIZES) -> float:
    """Forwards of `sizes` positions ending at each T of `ends` (default: on either side of the
    engine's first split, SPLIT_AT) against the two-position steps of plain
    decoding, every row of each: the most they differ, relative to the logits' scale. A verification
    reads every row of its forward, the first (the last committed token's) included, so a forward
    that starts just below a split and computes its first row otherwise than the step that wrote it
    changes an output. ids: at least max(ends) of them. An engine not stepping two positions yet is
    set to (with its head over both), unless its attention reads the previous position from the cache
    (manifest `previous_row_attention`), whose steps are of one position; it is left empty."""
    if engine.min_step < 2 and not engine.manifest.previous_row_attention:
        engine.min_step = engine.head_rows = 2
    ends = ends or range(SPLIT_AT - 4, SPLIT_AT + 8)
    first = max(1, ends.start - max(sizes))  # the first position a forward below starts at
    engine.reset()
    engine.forward(np.asarray(ids[:first]))
    # The steps' logits of every position a forward below computes (position p: feeding ids[p]).
    stepped = {p: engine.forward(np.asarray(ids[p : p + 1]))[-1].copy() for p in range(first, ends.stop - 1)}
    scale = max(1.0, max(float(np.abs(v).max()) for v in stepped.values()))
    worst = 0.0
    for t in ends:
        for s in sizes:
            if s >= t:  # a forward from the first position is a prefill, not a verification
                continue
            _steps_to(engine, ids, t - s)  # the cache as plain decoding's steps write it
            rows = engine.forward(np.asarray(ids[t - s : t]))
            for p, row in zip(range(t - s, t), rows, strict=True):
                if p in stepped:
                    worst = max(worst, rel(row, stepped[p], scale))
            engine.truncate(t - s)
    engine.reset()
    return worst


def _steps_to(engine, ids: np.ndarray, n: int) -> None:
    """Cut the cache back to n positions, or step up to n one position at a time."""
    engine.truncate(min(engine.n_cached, n))
    while engine.n_cached < n:
        engine.forward(np.asarray(ids[engine.n_cached : engine.n_cached + 1]))


def measure_split(engine, min_step: int, worst: dict[str, float], rng: np.random.Generator, vocab: int) -> bool:
    """Where the engine's forwards split at multiples of SPLIT_AT (engines/engine.py: with two-position
    steps, or over a graph whose attention reads the previous position back), add `across_split`,
    stepping `min_step` positions, to worst["small"]; whether they split."""
    if min_step < 2 and not engine.manifest.previous_row_attention:
        return False
    engine.min_step = engine.head_rows = min_step
    worst["small"] = max(worst["small"], across_split(engine, rng.integers(0, vocab, size=SPLIT_IDS)))
    return True


def min_step_for(worst: dict[str, float], kv_layout: str) -> int:
    """2 where single steps are off and forwards of two or more positions agree exactly: the price of
    batch consistency (a re-fed position per step), paid only where it buys exactness; re-feeding
    copies a concat-layout cache, so only the shared layout takes it."""
    return 2 if kv_layout == "shared" and worst["single"] > CACHE_RTOL and worst["small"] == 0.0 else 1


def min_head_rows_for(worst: dict[str, float], min_step: int) -> int | None:
    """1 where two-position steps are needed but the LM head gives its last row alone exactly what it
    gives it beside another (8-bit MatMulNBits: a one-row head then saves the second row's pass over
    the largest weight); None where the head must compute min_step rows like the rest."""
    return 1 if min_step > 1 and worst["head"] == 0.0 else None


def check(engine) -> dict:
    """Measure an engine on random ids (N_PROMPTS sequences) and return the figures with the
    `min_step_positions` they call for; the engine is left empty, its counters as they were."""
    rng = np.random.default_rng(0)
    vocab = engine.manifest.scored_ids
    saved = engine.min_step, engine.head_rows, engine.forward_count, engine.forward_time
    worst = {"single": 0.0, "multi": 0.0, "small": 0.0, "head": 0.0}
    try:
        for _ in range(N_PROMPTS):
            ids = rng.integers(0, vocab, size=PROMPT_LEN + STEPS)
            engine.min_step = 1
            engine.reset()
            measure(engine, ids, engine.forward(ids), worst)
        min_step = min_step_for(worst, engine.manifest.kv_layout)
        measure_split(engine, min_step, worst, rng, vocab)
    finally:
        engine.min_step, engine.head_rows, engine.forward_count, engine.forward_time = saved
        engine.reset()
    return {**worst, "min_step_positions": min_step, "min_head_rows": min_head_rows_for(worst, min_step)}


# The offsets' steps tried for sliding-window views (manifest `window_views`), smallest first. A view
# computes what the whole cache does only where its start falls on the blocks the attention kernel
# sums positions in: with ONNX Runtime 1.32, Gemma-3-270M's heads of 256 were exact from a step of
# 128 and not of 64 on an AVX-512 AMD EPYC, from 64 and not 32 on an AVX2-only one.
WINDOW_GRANULES = (64, 128, 256, 512, 1024)


def views_against_whole(viewed, whole, ids: np.ndarray, start: int, end: int, rng: np.random.Generator,
                        sizes: tuple[int, ...] = (1, 1, 1, 2, 4, 7), first_only: bool = False) -> tuple[int, int, int]:
    """Forwards of `sizes` positions (drawn by rng) from `start` to `end` of ids, some cut back as a
    rejected draft is, on two engines over one session: `viewed`, whose sliding-window layers read
    views (its window_granule), and `whole`. Returns (forwards, forwards whose logits differ in any
    bit, the largest offset a view started at); first_only: stop at the first that differs."""
    for e in (viewed, whole):
        e.reset()
        e.reserve(end + max(sizes))
        e.forward(ids[:start], last=1)
    forwards = unequal = offset = 0
    pos = start
    while pos < end and not (first_only and unequal):
        s = int(rng.choice(sizes))
        a = viewed.forward(ids[pos : pos + s]).copy()
        offset = max(offset, viewed.view_offset)
        forwards += 1
        unequal += not np.array_equal(a, whole.forward(ids[pos : pos + s]))
        if s > 1 and rng.random() < 0.5:  # a draft rejected after its first token
            viewed.truncate(pos + 1)
            whole.truncate(pos + 1)
            pos += 1
        else:
            pos += s
    return forwards, unequal, offset


def window_granule(engine, rng: np.random.Generator, vocab: int) -> int:
    """The smallest of WINDOW_GRANULES at which the engine's sliding-window views give every forward
    bit for bit the logits the whole cache gives (another engine over the same ONNX Runtime session,
    views off, stepping alike): forwards of 1 to 7 positions, some cut back as a rejected draft is,
    across two offsets; 0 where none does within the context, or the engine has no views.
    The engine is left empty, views off."""
    views = engine.manifest.window_views
    if not views.get("layers") or not engine.can_view_windows:
        return 0
    window = int(views["window"])
    whole = engine.shared.engine()
    # The same steps as the engine (its session's defaults may be export's single positions): only
    # the views may differ, or a one-position step's other kernel would be blamed on them.
    whole.window_granule, whole.min_step, whole.head_rows = 0, engine.min_step, engine.head_rows
    try:
        for granule in WINDOW_GRANULES:
            start, end = window + granule - 8, window + 1 + 3 * granule
            if end + 8 > engine.manifest.max_context:
                break
            engine.window_granule = granule
            ids = rng.integers(0, vocab, size=end + 8)
            if views_against_whole(engine, whole, ids, start, end, rng, first_only=True)[1] == 0:
                return granule
        return 0
    finally:
        engine.window_granule = 0
        engine.reset()
        whole.reset()
