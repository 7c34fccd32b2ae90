"""Model and Generator: requests that share a model without sharing state, step-wise decoding, token
ids in and out, continuing a sequence, and seeds that fix the output whatever the clock says."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_sd import GenerationConfig, Generator, Model, Pipeline, decoder
from edge_sd.engines import consistency
from edge_sd.errors import EdgeSDError, UsageError

from conftest import PROVIDER

PROMPTS = ["The cat", "def add(a, b):", "A small robot reads", "for i in range(10):\n"]
CONFIGS = {
    "greedy-slem": GenerationConfig(max_new_tokens=24, algorithm="slem", lookahead=3),
    "greedy-auto": GenerationConfig(max_new_tokens=24),
    "sampled-tli": GenerationConfig(max_new_tokens=24, algorithm="tli", lookahead=2, temperature=1.0, seed=3),
    "sampled-auto": GenerationConfig(max_new_tokens=24, temperature=1.0, top_k=8, seed=5),
}


@pytest.fixture(scope="module")
def model(tiny_root: Path) -> Pipeline:
    return Pipeline.from_folder(tiny_root / "pairs" / "gemma_qwen", provider=PROVIDER, threads=2)


def alone(model: Model, prompt: str, cfg: GenerationConfig) -> list[int]:
    gen = model.generator(cfg)
    gen.append_text(prompt)
    while not gen.is_done:
        gen.generate_next_tokens()
    return gen.result().token_ids


@pytest.mark.parametrize("name", list(CONFIGS))
def test_interleaved_generators_do_not_interfere(model: Pipeline, name: str) -> None:
    """Two requests on one model, their rounds interleaved on one thread: each gives what it gives
    alone (before Generator, the second request's prefill reset the cache the first was verifying
    against)."""
    cfg = CONFIGS[name]
    a_alone, b_alone = alone(model, PROMPTS[0], cfg), alone(model, PROMPTS[1], cfg)
    a, b = model.generator(cfg), model.generator(cfg)
    a.append_text(PROMPTS[0])
    b.append_text(PROMPTS[1])
    for gen in itertools.cycle([a, b]):
        if a.is_done and b.is_done:
            break
        if not gen.is_done:
            gen.generate_next_tokens()
    assert a.result().token_ids == a_alone and b.result().token_ids == b_alone
    # The same through the one-call API: two streams of one Pipeline, advanced in turn.
    s1, s2 = model.stream(PROMPTS[0], cfg), model.stream(PROMPTS[1], cfg)
    texts = ["", ""]
    for pieces in itertools.zip_longest(s1, s2, fillvalue=""):
        texts = [t + p for t, p in zip(texts, pieces, strict=True)]
    assert texts == [model.generate(PROMPTS[0], cfg).text, model.generate(PROMPTS[1], cfg).text]


def test_generators_in_threads(model: Pipeline) -> None:
    """Four requests in four threads at once, each with its own configuration."""
    jobs = [(p, cfg) for p, cfg in zip(PROMPTS, CONFIGS.values(), strict=True)]
    expected = [alone(model, p, cfg) for p, cfg in jobs]
    got: list = [None] * len(jobs)
    errors: list = []

    def run(i: int) -> None:
        try:
            got[i] = alone(model, *jobs[i])
        except Exception as e:  # reported below: a thread's exception is not raised in the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == expected


def test_token_ids_in_and_out_and_step_by_step(model: Pipeline) -> None:
    """Token ids in give what the same text gives; each round's ids add up to the reply."""
    cfg = CONFIGS["greedy-slem"]
    by_text = model.generate(PROMPTS[2], cfg)
    gen = model.generator(cfg)
    gen.append_tokens(by_text.prompt_ids)
    rounds = []
    while not gen.is_done:
        rounds.append(gen.generate_next_tokens())
    assert [t for r in rounds for t in r.ids] == gen.result().token_ids == by_text.token_ids
    assert "".join(r.text for r in rounds) == gen.text == by_text.text
    assert gen.ids == by_text.prompt_ids + by_text.token_ids
    with pytest.raises(UsageError, match="token ids must be in"):
        gen.append_tokens([model.target.vocab.size + 5])


def test_rewind_and_continue(model: Pipeline) -> None:
    """rewind_to keeps the first n ids; decoding again from there gives the same reply (greedy), and
    appending after a reply continues the sequence (the target prefills only what is new)."""
    cfg = CONFIGS["greedy-auto"]
    gen = model.generator(cfg)
    gen.append_text(PROMPTS[3])
    prompt_len = len(gen.ids)
    while not gen.is_done:
        gen.generate_next_tokens()
    first = gen.result().token_ids
    gen.rewind_to(prompt_len)
    gen.append_tokens(first[:3])  # the reply's start, given as input this time
    while not gen.is_done:
        gen.generate_next_tokens()
    assert first[:3] + gen.result().token_ids[: len(first) - 3] == first
    before = len(gen.ids)
    gen.append_text(" and then")
    gen.generate_next_tokens()
    assert gen.stats.prompt_tokens == len(gen.ids) - len(gen.result().token_ids)
    assert gen.stats.prefilled_tokens < before  # only the new text, not the whole sequence again
    fresh = model.generator(cfg)
    fresh.append_tokens(gen.ids[: gen.reply_start])
    while not gen.is_done:
        gen.generate_next_tokens()
    while not fresh.is_done:
        fresh.generate_next_tokens()
    assert gen.result().token_ids == fresh.result().token_ids
    with pytest.raises(UsageError, match="cannot rewind"):
        gen.rewind_to(len(gen.ids) + 1)


def test_a_broken_invariant_is_an_error(model: Pipeline) -> None:
    """A round starts only where the target's cache holds the sequence but its last token."""
    gen = model.generator(CONFIGS["greedy-slem"])
    gen.append_text(PROMPTS[0])
    gen.generate_next_tokens()
    gen.target.truncate(gen.target.n_cached - 1)  # what a second user of the same engine would do
    with pytest.raises(EdgeSDError, match="cache holds"):
        gen.generate_next_tokens()


@pytest.mark.parametrize("name", ["greedy-auto", "sampled-auto"])
def test_seeded_auto_ignores_the_clock(tiny_root: Path, model: Pipeline, monkeypatch, name: str) -> None:
    """With a seed, auto plans from fixed costs: the same output on a fresh model, on one that served
    other requests before, and with a clock that jumps at random (a busy machine's timings)."""
    import time

    cfg = CONFIGS[name]
    reference = [model.generate(p, cfg).token_ids for p in PROMPTS]
    for p in PROMPTS:  # requests in between, seeded or not, greedy and sampled
        model.generate(p, GenerationConfig(max_new_tokens=16, temperature=1.0, seed=None))
        model.generate(p, GenerationConfig(max_new_tokens=16))
    assert [model.generate(p, cfg).token_ids for p in PROMPTS] == reference
    rng = np.random.default_rng(0)
    clock = [0.0]

    def jumpy() -> float:
        clock[0] += float(rng.exponential(0.05))
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", jumpy)
    fresh = Pipeline.from_folder(tiny_root / "pairs" / "gemma_qwen", provider=PROVIDER, threads=2)
    got = [fresh.generate(p, cfg) for p in PROMPTS]
    assert [r.token_ids for r in got] == reference
    assert any(r.stats.proposed for r in got)  # auto did draft: this was not plain decoding throughout


def test_unseeded_auto_follows_live_timings(tiny_root: Path) -> None:
    """Without a seed, auto's schedule carries its costs and acceptance from one request to the next."""
    model = Pipeline.from_folder(tiny_root / "pairs" / "gemma_qwen", provider=PROVIDER, threads=2)
    model.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16))
    key = next(k for k in model._schedules if k[0].greedy)
    schedule = model._schedules[key][0]
    assert schedule.costs.learn and schedule.idle_generations >= 0
    model.generate(PROMPTS[1], GenerationConfig(max_new_tokens=16))
    assert model._schedules[key] == [schedule]  # borrowed and returned, not made anew


def test_generator_before_anything_is_appended(model: Pipeline) -> None:
    gen = Generator(model)
    assert gen.is_done
    with pytest.raises(UsageError, match="append a prompt first"):
        gen.generate_next_tokens()
    with pytest.raises(UsageError, match="empty"):
        gen.append_text("")


def test_a_pairs_drafter_session_is_built_when_first_drafted(tiny_root: Path) -> None:
    """The drafter's session waits for the first draft that needs it: plain steps and prompt lookup
    never build it; a drafting algorithm does, and decodes as the eagerly loaded pair does."""
    folder = tiny_root / "pairs" / "gemma_qwen"
    eager = Model.load(folder, provider=PROVIDER, threads=2, defer_drafter=False)
    assert eager.drafter is not None and eager.drafter.session.loaded
    model = Model.load(folder, provider=PROVIDER, threads=2)
    assert model.drafter is not None and not model.drafter.session.loaded
    for algo in ("plain", "lookup"):
        cfg = GenerationConfig(max_new_tokens=16, algorithm=algo)
        assert alone(model, PROMPTS[0], cfg) == alone(eager, PROMPTS[0], cfg)
    assert not model.drafter.session.loaded
    cfg = GenerationConfig(max_new_tokens=16, algorithm="slem", lookahead=3)
    gen = model.generator(cfg)
    gen.append_text(PROMPTS[0])
    while not gen.is_done:
        gen.generate_next_tokens()
    got = gen.result()
    assert model.drafter.session.loaded and got.stats.drafter_forwards > 0
    assert got.token_ids == alone(eager, PROMPTS[0], cfg) == alone(eager, PROMPTS[0], GenerationConfig(
        max_new_tokens=16, algorithm="plain"))


def test_a_deferred_session_is_built_once_by_threads_that_need_it(tiny_root: Path, monkeypatch) -> None:
    from edge_sd.engines.ort import OrtSession

    builds = []
    load = OrtSession._load

    def counted(self: OrtSession) -> None:
        builds.append(threading.get_ident())
        time.sleep(0.2)  # long enough for every thread to ask while it is being built
        load(self)

    monkeypatch.setattr(OrtSession, "_load", counted)
    folder = tiny_root / "pairs" / "gemma_qwen" / "drafter"
    session = OrtSession(folder, provider=PROVIDER, threads=1, min_step_positions=1, defer=True)
    assert not session.loaded and not builds
    engines = [session.engine() for _ in range(4)]  # engines before the build: bound at first forward
    engines[0].reserve(100)
    engines[0].truncate(0)
    engines[0].reset()
    assert not session.loaded and not builds  # none of these needs the session
    ids = np.arange(1, 6)
    outs: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda e=e: outs.append(e.forward(ids))) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and session.loaded and session.device in ("cpu", "cuda")
    assert len(outs) == 4 and all(np.array_equal(o, outs[0]) for o in outs)
    with pytest.raises(ValueError, match="min_step_positions"):
        OrtSession(folder, defer=True)


def test_a_drafters_build_is_not_timed_as_drafting(tiny_root: Path, monkeypatch) -> None:
    """The cost schedule learns a draft's cost from its time: the one-off build of a deferred drafter
    session happens before that clock starts, and outside the drafter's forward time."""
    from edge_sd.engines.ort import OrtSession
    from edge_sd.schedules import StaticSchedule

    load = OrtSession._load
    monkeypatch.setattr(OrtSession, "_load", lambda self: (time.sleep(0.5), load(self))[1])
    model = Model.load(tiny_root / "pairs" / "gemma_qwen", provider=PROVIDER, threads=2)
    rounds = []

    class Recording(StaticSchedule):
        def observe(self, plan, r) -> None:
            rounds.append(r)

    gen = Generator(model, GenerationConfig(max_new_tokens=12, algorithm="slem"),
                    make_schedule=lambda proposers: Recording(next(iter(proposers.values())), 3))
    gen.append_text(PROMPTS[0])
    while not gen.is_done:
        gen.generate_next_tokens()
    assert model.drafter is not None and model.drafter.session.loaded
    assert rounds and max(r.draft_s for r in rounds) < 0.5
    assert gen.result().stats.time_drafter_s < 0.5


LONG = " ".join(["the cat sat on the mat and the dog ran to the park"] * 7)  # about 180 tokens


@pytest.mark.parametrize("name", ["greedy-auto", "sampled-auto", "greedy-slem"])
def test_a_long_prompt_prefilled_a_slice_at_a_time(model: Pipeline, monkeypatch, name: str) -> None:
    """Chunks of 64 positions (PREFILL_CHUNK, 512 in use, made small for the tiny models' context): a
    slice a call (as the server feeds it) gives what a whole prefill gives, the calls before the
    prompt is cached return nothing, the call that caches it returns the first token alone (drawn
    from the prompt's last row, no round run), and greedy auto equals plain decoding."""
    monkeypatch.setattr(decoder, "PREFILL_CHUNK", 64)
    cfg = CONFIGS[name]
    whole = alone(model, LONG, cfg)
    gen = model.generator(cfg)
    gen.prefill_slice = 64
    gen.append_text(LONG)
    n = len(gen.ids)
    assert n > 2 * 64 + 1
    empty = 0
    while not gen.generate_next_tokens().ids:
        assert gen.stats.target_forwards == 0
        empty += 1
    assert gen.result().token_ids == whole[:1] and gen.stats.target_forwards == 0
    while not gen.is_done:
        gen.generate_next_tokens()
    assert gen.result().token_ids == whole and empty == -(-n // 64) - 1
    assert gen.stats.prefilled_tokens == n and gen.stats.prefill_emitted == 1 and gen.stats.prefill_s > 0
    if cfg.temperature == 0:
        assert whole == alone(model, LONG, replace(cfg, algorithm="plain"))


def test_prefill_chunks_shrink_with_depth_and_end_where_they_would_whole() -> None:
    """A deep prefill's chunks: from PREFILL_CHUNK down to the engines' split as the cache grows, each
    the largest within PREFILL_AREA (the split at least), ending on a multiple of its size; the last
    at the prompt's end."""
    end, n, sizes = 20_000, 0, []
    while n < end:
        stop = decoder.prefill_stop(n, end)
        size = stop - n
        sizes.append(size)
        if stop == end:
            break
        assert size in (64, 128, 256, 512) and stop % size == 0
        assert size * (n + size) <= decoder.PREFILL_AREA or size == consistency.SPLIT_AT
        assert size == decoder.PREFILL_CHUNK or 2 * size * (n + 2 * size) > decoder.PREFILL_AREA
        n = stop
    assert sizes[0] == decoder.PREFILL_CHUNK and sizes[-2] == consistency.SPLIT_AT
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True) and sum(sizes) == end
    assert decoder.prefill_stop(8190, 8191) == 8191 and decoder.prefill_stop(100, 10_000) == 512


def test_a_chunked_prefill_caches_what_a_whole_one_does(model: Pipeline) -> None:
    """The next position's logits after a prefill in chunks of 64 against one whole prefill: within
    the bounds two forwards of the same positions keep to (engines/consistency.py)."""
    ids = np.asarray(model.target.with_bos(model.target.vocab.encode_text(LONG)))
    chunked, whole = model.target.session.engine(), model.target.session.engine()
    for start in range(0, len(ids) - 1, 64):
        chunked.forward(ids[start : min(start + 64, len(ids) - 1)], last=1)
    whole.forward(ids[:-1], last=1)
    a, b = chunked.forward(ids[-1:]), whole.forward(ids[-1:])
    assert consistency.rel(a, b, float(np.abs(b).max())) < consistency.CACHE_RTOL
    # the comparison fails a prefill that lost one position
    lost = model.target.session.engine()
    lost.forward(np.delete(ids[:-1], 100), last=1)
    assert consistency.rel(lost.forward(ids[-1:]), b, float(np.abs(b).max())) > consistency.CACHE_RTOL
