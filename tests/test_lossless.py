"""End to end: speculative decoding gives exactly what plain decoding of the same target gives."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_sd import GenerationConfig, Pipeline
from edge_sd.sampling import SamplingConfig, warp

from conftest import CROSS_PAIRS, PROVIDER, PRUNED

PROMPTS = [
    "The cat", "A small robot reads", "Every engineer ", "The old river sees the", "My friend builds",
    "def add(a, b):", "for i in range(10):\n", "class Point:\n    def __init__(self, x, y):\n",
    "if x == 0:\n\treturn", "café naïve", "日本語の", "emoji 🙂", "Ελληνικά", "Привет",
    "  leading spaces", "trailing spaces   ", "double  spaces  here", "tabs\tand", "42 numbers.",
    "The model decodes tokens.\nThe", " ", "\n\n",
]
NEW_TOKENS = 24
# Batched (k+1)-token and single-token kernels may round differently: a divergence is accepted only
# where plain decoding's top two logits are closer than this.
NEAR_TIE = 1e-3
ALGOS = ("slem", "tli", "slrs")


def plain_greedy(pipe: Pipeline, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding, one token per forward, with each step's top-2 logit gap."""
    eng = pipe.target.engine
    eng.reset()
    if len(prompt_ids) > 1:
        eng.forward(np.asarray(prompt_ids[:-1]))
    ids, gaps, last = [], [], prompt_ids[-1]
    width = min(pipe.target.manifest.vocab_size, pipe.target.manifest.logits_width)  # no padding ids
    for _ in range(n):
        row = eng.forward(np.asarray([last]))[0][:width]
        top2 = np.sort(row)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        last = int(np.argmax(row))
        if last in pipe.target.vocab.eos_ids:
            break
        ids.append(last)
    return ids, gaps


def assert_same_or_near_tie(spec: list[int], plain: list[int], gaps: list[float], where: str,
                            exact: bool = False) -> None:
    """exact: the target's multi-position forwards were measured bit-identical to its steps at export,
    so no near-tie excuses a divergence."""
    if spec == plain[: len(spec)] and len(spec) == len(plain):
        return
    assert not exact, f"{where}: diverges from plain decoding on an engine measured exact: {spec} vs {plain}"
    i = next((j for j, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b), min(len(spec), len(plain)))
    assert i < len(gaps) and gaps[i] < NEAR_TIE, (
        f"{where}: diverges from plain decoding at token {i} where the top-2 gap is "
        f"{gaps[i] if i < len(gaps) else 'n/a'} (>= {NEAR_TIE}): spec {spec} plain {plain}"
    )


@pytest.fixture(scope="module")
def references(pipelines):
    refs = {}
    for name, pipe in pipelines.items():
        for prompt in PROMPTS:
            ids = pipe.target.prompt_ids(prompt, False)
            refs[name, prompt] = plain_greedy(pipe, ids, NEW_TOKENS)
    return refs


def is_exact(pipe: Pipeline) -> bool:
    """Measured bit-exact at export, on the provider the pair runs on (other kernels round otherwise)."""
    v = pipe.target.manifest.validation
    return v.get("max_rel_diff_steps_vs_forward") == 0.0 and v.get("provider", "cpu") == PROVIDER


def assert_text_is_the_ids(pipe: Pipeline, r) -> None:
    """The text handed out is exactly the decoding of the returned ids (nothing held back or lost)."""
    assert r.text == pipe.target.vocab.ids_bytes(r.token_ids).decode("utf-8", errors="replace"), r.token_ids


@pytest.mark.parametrize("pair", CROSS_PAIRS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain(pipelines, references, pair: str, algo: str, k: int) -> None:
    pipe = pipelines[pair]
    proposed = accepted = 0
    for prompt in PROMPTS:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=k))
        plain, gaps = references[pair, prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"{pair}/{algo}/k={k}/{prompt!r}", is_exact(pipe))
        assert_text_is_the_ids(pipe, r)
        assert r.stats.target_forwards <= len(r.token_ids)
        proposed += r.stats.proposed
        accepted += r.stats.accepted
    assert proposed > 0  # the drafter did draft: this was not plain decoding in disguise
    assert 0 < accepted < proposed


@pytest.mark.parametrize("pair", PRUNED)
@pytest.mark.parametrize("algo", (*ALGOS, "rdk"))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_pruned_drafters_greedy_equals_plain(pipelines, references, pair: str, algo: str, k: int) -> None:
    """A drafter with a pruned LM head, every algorithm and RDK's kernel: plain decoding's output."""
    test_greedy_equals_plain(pipelines, references, pair, algo, k)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_standard_same_vocabulary(pipelines, references, k: int) -> None:
    pipe = pipelines["llama_same"]
    assert pipe.same_vocab
    assert pipe.candidates(pipe.resolve_algorithm(GenerationConfig())) == ("standard", "lookup", "lookup+standard")
    for prompt in PROMPTS:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="standard",
                                                   lookahead=k))
        plain, gaps = references["llama_same", prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"standard/k={k}/{prompt!r}", is_exact(pipe))


@pytest.mark.parametrize("algo", ("standard", "slem", "tli", "slrs"))
def test_identical_drafter_accepts_everything(pipelines, references, algo: str) -> None:
    pipe = pipelines["llama_self"]
    for prompt in PROMPTS:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=4))
        plain, gaps = references["llama_self", prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"self/{algo}/{prompt!r}", is_exact(pipe))
        if algo in ("standard", "tli"):
            # Token-level proposals of the target's own argmax: all accepted (TLI's intersection
            # holds every token with bytes; these models never put their argmax on a special token).
            assert r.stats.accepted == r.stats.proposed > 0, (prompt, r.stats)
        else:
            assert r.stats.acceptance_rate > 0.8, (prompt, r.stats)


@pytest.mark.parametrize("algo", ALGOS)
def test_random_drafter_accepts_almost_nothing(pipelines, references, algo: str) -> None:
    pipe = pipelines["llama_random"]
    proposed = accepted = 0
    for prompt in PROMPTS:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=3))
        plain, gaps = references["llama_random", prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"random/{algo}/{prompt!r}", is_exact(pipe))
        proposed += r.stats.proposed
        accepted += r.stats.accepted
    assert proposed > 100 and accepted / proposed < 0.1


# --- sampling: the distribution of the first two generated tokens --------------------------------

SAMPLES = 2000
TOP_K = 4  # 16 possible (first, second) pairs: a distribution the sample count can pin down
DELTA = 1e-3
# The whole chain with strong penalties: the second token's distribution depends on the first through
# them, so a verifier that forgot a candidate before its position would sample another distribution.
# They favour repeats (a repetition penalty below 1, a negative presence penalty): a language model
# seldom repeats the token it just gave, so a penalty against repeats would change little.
CHAIN = SamplingConfig(0.8, top_k=TOP_K, top_p=0.95, min_p=0.05, repetition_penalty=0.5, presence_penalty=-2.0,
                       frequency_penalty=0.3, repeat_last_n=8)
WARPS = {"T1-top4": SamplingConfig(1.0, top_k=TOP_K), "T0.7-top_p0.6": SamplingConfig(0.7, top_p=0.6),
         "chain": CHAIN, "T0.9-min_p0.3": SamplingConfig(0.9, min_p=0.3)}


def exact_two_token_distribution(pipe: Pipeline, prompt_ids: list[int], cfg: SamplingConfig) -> dict:
    eng = pipe.target.engine
    eng.reset()
    p1 = warp(eng.forward(np.asarray(prompt_ids))[-1], cfg, cfg.window(prompt_ids))
    out = {}
    for a in np.nonzero(p1)[0]:
        eng.reset()
        seq = prompt_ids + [int(a)]
        p2 = warp(eng.forward(np.asarray(seq))[-1], cfg, cfg.window(seq))
        for b in np.nonzero(p2)[0]:
            out[int(a), int(b)] = p1[a] * p2[b]
    return out


def first_round(pipe: Pipeline, ids: list[int], cfg: GenerationConfig):
    """A reply to `ids` that starts with a round: the ids but the last cached first (a sequence
    continued by one id starts so), so that its first round verifies candidates for the first tokens.
    A prompt's prefill draws the first token itself (`from_prefill` below)."""
    gen = pipe.generator(cfg)
    gen.append_tokens(ids[:-1])
    gen.generate_next_tokens()  # caches ids[:-1] (and draws a token, dropped by the rewind)
    gen.rewind_to(len(ids) - 1)
    gen.append_tokens(ids[-1:])
    while not gen.is_done:
        gen.generate_next_tokens()
    assert gen.stats.prefilled_tokens == 0
    return gen.result()


def two_token_tv(pipe: Pipeline, algo: str, cfg: SamplingConfig, prompt: str = "A small robot",
                 from_prefill: bool = False) -> tuple:
    """(TV between sampled and exact first-two-token distributions, its bound, accepted candidates,
    samples outside the exact support). Pairs outside the support count as one more category.
    Replies start with a round (first_round); from_prefill: as `generate` runs them, the first
    token drawn from the prefill's last row, the second by the first round."""
    ids = pipe.target.prompt_ids(prompt, False)  # a context where these drafters are often right
    exact = exact_two_token_distribution(pipe, ids, cfg)
    counts: dict = {}
    accepted = 0
    for seed in range(SAMPLES):
        # Three tokens, so that two candidates are verified in the first round (k <= remaining - 1).
        gen = GenerationConfig(max_new_tokens=3, seed=seed, algorithm=algo, lookahead=3, **dataclasses.asdict(cfg))
        r = pipe.generate(prompt, gen) if from_prefill else first_round(pipe, ids, gen)
        key = tuple(r.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += r.stats.accepted
    keys = list(exact)
    outside = SAMPLES - sum(counts.get(k, 0) for k in keys)
    emp = np.array([counts.get(k, 0) for k in keys] + [outside], dtype=float) / SAMPLES
    tv = 0.5 * float(np.abs(emp - np.array([exact[k] for k in keys] + [0.0])).sum())
    bound = math.sqrt(((len(keys) + 1) * math.log(2) + math.log(1 / DELTA)) / (2 * SAMPLES))
    return tv, bound, accepted, outside


@pytest.mark.parametrize("pair,algo,warp_name", [
    ("gemma_qwen", "tli", "T1-top4"), ("gemma_qwen", "slrs", "T1-top4"), ("llama_sp2", "slem", "T1-top4"),
    ("llama_sp2", "slrs", "T1-top4"), ("llama_same", "standard", "T1-top4"), ("gemma_qwen", "ar", "T1-top4"),
    ("gemma_qwen", "tli", "T0.7-top_p0.6"), ("llama_sp2", "slrs", "T0.7-top_p0.6"),
    ("llama_sp2", "slem", "T0.7-top_p0.6"), ("gemma_qwen_keep50", "rdk", "T1-top4"),
    ("llama_sp2_keep25", "rdk", "T0.7-top_p0.6"), ("llama_qwen_keep100", "rdk", "T1-top4"),
    ("gemma_qwen_keep50", "tli", "T1-top4"),
    ("gemma_qwen", "ar", "chain"), ("gemma_qwen", "tli", "chain"), ("gemma_qwen", "slrs", "chain"),
    ("llama_sp2", "slem", "chain"), ("llama_same", "standard", "chain"), ("gemma_qwen_keep50", "rdk", "chain"),
    ("llama_sp2", "slrs", "T0.9-min_p0.3"), ("gemma_qwen", "tli", "T0.9-min_p0.3"),
])
def test_sampling_matches_plain_distribution(pipelines, pair: str, algo: str, warp_name: str) -> None:
    tv, bound, accepted, outside = two_token_tv(pipelines[pair], algo, WARPS[warp_name])
    assert outside == 0, "a token pair outside the target's warped support was emitted"
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
    if algo != "ar":
        assert accepted > 0  # candidates were accepted, so the acceptance path was exercised


@pytest.mark.parametrize("pair,algo,warp_name", [("gemma_qwen", "tli", "T1-top4"), ("gemma_qwen", "ar", "chain"),
                                                 ("llama_sp2", "slem", "chain")])
def test_sampling_from_the_prefill_matches_plain_distribution(pipelines, pair: str, algo: str,
                                                              warp_name: str) -> None:
    """As `generate` samples: the first token from the prefill's last row (penalties over the prompt),
    the second from the first round."""
    tv, bound, accepted, outside = two_token_tv(pipelines[pair], algo, WARPS[warp_name], from_prefill=True)
    assert outside == 0 and tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
    if algo != "ar":
        assert accepted > 0


@pytest.mark.parametrize("pair,algo", [("gemma_qwen", "tli"), ("gemma_qwen", "slrs")])
def test_sampling_check_catches_penalties_that_forget_the_candidates(pipelines, monkeypatch, pair: str,
                                                                     algo: str) -> None:
    """Negative control for the chain: rows whose penalties count the committed tokens but not the
    candidates before them (what plain decoding would have committed first) fail the same check."""
    from edge_sd.sampling import Rows

    monkeypatch.setattr(Rows, "window", lambda self, i: self.cfg.window(self.history))
    tv, bound, accepted, _ = two_token_tv(pipelines[pair], algo, CHAIN)
    assert accepted > 0 and tv > bound, f"a wrong chain passed: TV {tv:.4f} < {bound:.4f}"


def test_sampling_check_catches_a_wrong_verifier(pipelines, monkeypatch) -> None:
    """Negative control: a verifier that accepts every draft emits the drafter's distribution, and the
    same check fails it (so a pass above means something)."""
    from edge_sd.algorithms import TLIProposer
    from edge_sd.sampling import sample

    def accept_all(cands, q, p, rng):
        return len(cands), sample(p[len(cands)], rng)

    monkeypatch.setattr(TLIProposer, "verifier", staticmethod(accept_all))
    tv, bound, _, _ = two_token_tv(pipelines["gemma_qwen"], "tli", WARPS["T1-top4"])
    assert tv > bound, f"a wrong verifier passed: TV {tv:.4f} < {bound:.4f}"


@pytest.mark.parametrize("algo", ALGOS)
def test_seeded_sampling_with_a_drafter_is_reproducible(pipelines, algo: str) -> None:
    pipe = pipelines["gemma_qwen"]
    runs = {}
    for seed in (7, 7, 8):
        cfg = GenerationConfig(max_new_tokens=20, temperature=1.0, seed=seed, algorithm=algo, lookahead=3)
        r = pipe.generate("The old river sees the", cfg)
        if seed in runs:
            assert (r.token_ids, r.stats.accepted, r.stats.proposed) == runs[seed]
        runs[seed] = (r.token_ids, r.stats.accepted, r.stats.proposed)
    assert runs[7][0] != runs[8][0]  # the seed does matter


def test_padded_heads_never_emit_padding(pipelines, references) -> None:
    """LM heads 40 rows wider than the tokenizers, whose padding logits beat real ones: no padding id
    is emitted or drafted, and greedy decoding gives the unpadded target's output."""
    pipe = pipelines["padded"]
    for m in (pipe.target.manifest, pipe.drafter.manifest):
        assert m.logits_width == m.vocab_size + 40
    for prompt in PROMPTS[:8]:
        plain, gaps = references["llama_qwen", prompt]  # the same target weights, unpadded
        for algo in ("ar", *ALGOS):
            r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=3))
            assert_same_or_near_tie(r.token_ids, plain, gaps, f"padded/{algo}/{prompt!r}")
            assert_text_is_the_ids(pipe, r)
            for seed in range(3):
                r = pipe.generate(prompt, GenerationConfig(max_new_tokens=12, temperature=1.0, seed=seed,
                                                           algorithm=algo, lookahead=3))
                assert max(r.token_ids, default=0) < pipe.target.manifest.vocab_size
                assert_text_is_the_ids(pipe, r)


# --- edge cases ---------------------------------------------------------------------------------

def _edited_pair(tiny_root: Path, tmp_path: Path, pair: str, edit) -> Pipeline:
    folder = tmp_path / pair
    shutil.copytree(tiny_root / "pairs" / pair, folder)
    edit(folder)
    return Pipeline.from_folder(folder, provider=PROVIDER, threads=2)


def _set(folder: Path, role: str, **fields) -> None:
    path = folder / role / "engine.json"
    m = json.loads(path.read_text())
    m.update(fields)
    path.write_text(json.dumps(m))


def _compare(pipe: Pipeline, prompts, algos=("slem", "tli", "slrs"), k=5, **cfg) -> list:
    results = []
    for prompt in prompts:
        plain = pipe.generate(prompt, GenerationConfig(algorithm="ar", **cfg))
        for algo in algos:
            r = pipe.generate(prompt, GenerationConfig(algorithm=algo, lookahead=k, **cfg))
            assert r.token_ids == plain.token_ids and r.text == plain.text, (algo, prompt)
            assert r.stats.stop_reason == plain.stats.stop_reason, (algo, prompt)
            assert_text_is_the_ids(pipe, r)
            results.append((plain, r))
        assert_text_is_the_ids(pipe, plain)
    return results


def test_eos_from_target_and_drafter(tiny_root: Path, tmp_path: Path) -> None:
    """EOS made frequent: each model's newline token is made one of its EOS tokens."""
    from edge_sd.vocab import Vocab

    def edit(folder: Path) -> None:
        for role in ("target", "drafter"):
            (newline,) = Vocab.from_file(folder / role / "tokenizer.json").encode_bytes(b"\n")
            m = json.loads((folder / role / "engine.json").read_text())
            _set(folder, role, eos_token_ids=m["eos_token_ids"] + [newline])

    pipe = _edited_pair(tiny_root, tmp_path, "gemma_qwen", edit)
    results = _compare(pipe, PROMPTS[:8], max_new_tokens=40)
    assert sum(r.stats.stop_reason == "eos" for _, r in results) >= 6
    eos = set(pipe.target.vocab.eos_ids)
    assert all(not eos & set(r.token_ids) for _, r in results)


def expected_stop(pipe: Pipeline, reference: list[int], stops: tuple[bytes, ...]) -> list[int] | None:
    """Plain decoding's output under stop strings, from its output without them: up to and including
    the first token whose bytes complete one (None: no stop string occurs)."""
    text = b""
    for i, t in enumerate(reference):
        text += pipe.target.vocab.token_bytes[t] or b""
        if any(s in text for s in stops):
            return reference[: i + 1]
    return None


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stop_strings_spanning_rounds(pipelines, references, k: int) -> None:
    """Exact expected ids, text and stop reason, worked out from plain decoding without stop strings."""
    pipe = pipelines["llama_sp2"]
    stops = ("s the", "\n")
    stopped = 0
    for prompt in PROMPTS[:10]:
        expected = expected_stop(pipe, references["llama_sp2", prompt][0], tuple(s.encode() for s in stops))
        for algo in ("ar", "slem", "tli", "slrs"):
            r = pipe.generate(prompt, GenerationConfig(algorithm=algo, lookahead=k, max_new_tokens=NEW_TOKENS,
                                                       stop=stops))
            if expected is None:
                assert_text_is_the_ids(pipe, r)
                assert r.stats.stop_reason in ("max_new_tokens", "eos"), (algo, prompt)
                continue
            assert (r.token_ids, r.stats.stop_reason) == (expected, "stop"), (algo, prompt)
            # The text ends where the first stop string begins, though the last token runs past it.
            full = pipe.target.vocab.ids_bytes(expected)
            cut = min(at for s in stops if (at := full.find(s.encode())) >= 0)
            assert r.text == full[:cut].decode("utf-8", "replace"), (algo, prompt)
            stopped += 1
    assert stopped >= 8  # the check ran, across several prompts and algorithms


@pytest.mark.parametrize("algo", ("standard", "slem", "tli", "slrs"))
def test_stop_string_and_eos_in_one_round(tiny_root: Path, tmp_path: Path, pipelines, references,
                                          algo: str) -> None:
    """A round whose accepted tokens complete a stop string and then reach EOS: plain decoding stops at
    the stop string (reason `stop`), so speculative decoding must too. The drafter is the target itself
    (every draft accepted), EOS is made of a token plain decoding emits, and the stop string is the
    text of the two tokens just before it; k from 1 to 8 puts them in one round at some k."""
    ref = references["llama_self", "The cat"][0]
    t = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    eos_token = ref[t]
    stop = pipelines["llama_self"].target.vocab.ids_bytes(ref[t - 2 : t]).decode()
    def edit(folder: Path) -> None:  # both sides, so that they stay one vocabulary
        for role in ("target", "drafter"):
            _set(folder, role, eos_token_ids=[1, eos_token])

    pipe = _edited_pair(tiny_root, tmp_path, "llama_self", edit)
    plain = pipe.generate("The cat", GenerationConfig(algorithm="ar", max_new_tokens=40, stop=(stop,)))
    assert plain.stats.stop_reason == "stop" and plain.token_ids == ref[:t]
    for k in range(1, 9):
        r = pipe.generate("The cat", GenerationConfig(algorithm=algo, lookahead=k, max_new_tokens=40, stop=(stop,)))
        assert (r.token_ids, r.text, r.stats.stop_reason) == (plain.token_ids, plain.text, "stop"), k


@pytest.mark.parametrize("n", [1, 2, 3, 7, 11])
def test_max_new_tokens_mid_round(pipelines, n: int) -> None:
    results = _compare(pipelines["gemma_sp2"], PROMPTS[:6], max_new_tokens=n)
    assert all(len(r.token_ids) == n for _, r in results)


def test_context_limit_mid_round(tiny_root: Path, tmp_path: Path) -> None:
    pipe = _edited_pair(tiny_root, tmp_path, "gemma_qwen", lambda f: _set(f, "target", max_context=20))
    results = _compare(pipe, ["The cat", "def add(a, b):"], max_new_tokens=50)
    for plain, r in results:
        assert r.stats.stop_reason == "context"
        assert len(plain.prompt_ids) + len(r.token_ids) == 21  # positions 0..19 fed, one more emitted


def test_drafter_with_a_shorter_context(tiny_root: Path, tmp_path: Path) -> None:
    pipe = _edited_pair(tiny_root, tmp_path, "llama_qwen", lambda f: _set(f, "drafter", max_context=14))
    results = _compare(pipe, ["The cat", "A small robot reads"], max_new_tokens=30)
    assert all(r.stats.stop_reason == "max_new_tokens" for _, r in results)
    assert any(r.stats.proposed > 0 for _, r in results)


def test_drafter_tokens_ending_inside_a_character(pipelines) -> None:
    pipe = pipelines["gemma_qwen"]
    d = pipe.drafter.vocab
    partial = [b for b in d.token_bytes if b and b[-1] >= 0x80 and not _complete(b)]
    assert partial, "the byte-level drafter should have tokens that end inside a character"
    _compare(pipe, ["日本語のテキスト", "emoji 🙂🚀", "Ελληνικά γράμματα"], max_new_tokens=24)


def _complete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_empty_drafts_and_prompts_ending_in_space(pipelines) -> None:
    pipe = pipelines["llama_sp2"]
    _compare(pipe, ["Every engineer ", "The cat ", "x  "], k=0, max_new_tokens=12)
    _compare(pipe, ["Every engineer ", "The cat ", "x  "], k=5, max_new_tokens=12)
    r = pipe.generate("The cat", GenerationConfig(algorithm="slem", lookahead=0, max_new_tokens=5))
    assert r.stats.proposed == 0 and r.stats.drafter_forwards == 0


@pytest.mark.parametrize("pair", ["gemma_qwen", "llama_sp2", "llama_same", "llama_random"])
def test_auto_is_lossless_and_says_what_it_did(pipelines, references, pair: str) -> None:
    """auto: the cost-aware schedule picks each round's draft length (0: a plain step) from the past;
    greedy output equals plain decoding, and the statistics say what it chose. Greedy across
    vocabularies it drafts with SLEM alone (Pipeline.candidates); sampling, it weighs TLI and SLRS."""
    pipe = pipelines[pair]
    algos = {"standard", "lookup"} if pipe.same_vocab else {"slem", "lookup"}
    assert pipe.candidates("auto", greedy=False) == (
        ("standard", "lookup", "lookup+standard") if pipe.same_vocab
        else ("tli", "slrs", "lookup", "lookup+tli", "lookup+slrs"))
    for prompt in PROMPTS[:8]:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
        plain, gaps = references[pair, prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"{pair}/auto/{prompt!r}", is_exact(pipe))
        assert_text_is_the_ids(pipe, r)
        s = r.stats
        assert (s.algorithm, s.lookahead) == ("auto", 16)  # a prompt lookup's longest draft; the drafter's 6
        rounds = s.schedule["rounds"]
        assert sum(rounds.values()) == s.target_forwards == sum(s.rounds_by_drafts.values())
        assert {key.split(":")[0] for key in rounds} <= algos | {f"lookup+{a}" for a in algos - {"lookup"}} | {"plain"}
        assert set(s.schedule["target_ms"]) == set(range(1, 18)) and set(s.schedule["draft_ms_per_token"]) == algos


def test_auto_sampling_matches_plain_distribution(pipelines) -> None:
    tv, bound, _, outside = two_token_tv(pipelines["gemma_qwen"], "auto", WARPS["T1-top4"])
    assert outside == 0 and tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


def test_default_lookahead_of_named_algorithms(pipelines, monkeypatch) -> None:
    """A named algorithm drafts a fixed k by default (README, "Measured"); -k and the heuristic
    schedule change it."""
    from edge_sd.schedules import HeuristicSchedule

    steps: list[tuple[int, int, int, int]] = []  # (k before, proposed, accepted, k after) per drafting round
    observe = HeuristicSchedule.observe

    def spy(self, plan, r):
        before = self.k
        observe(self, plan, r)
        if r.proposed:
            steps.append((before, r.proposed, r.accepted, self.k))

    monkeypatch.setattr(HeuristicSchedule, "observe", spy)
    cross, same = pipelines["gemma_qwen"], pipelines["llama_same"]
    greedy = cross.generate("The cat", GenerationConfig(max_new_tokens=8, algorithm="slem")).stats
    assert (greedy.algorithm, greedy.lookahead) == ("slem", 2)
    sampled = cross.generate("The cat", GenerationConfig(max_new_tokens=8, temperature=1.0, seed=0,
                                                         algorithm="slrs")).stats
    assert (sampled.algorithm, sampled.lookahead) == ("slrs", 1)
    assert same.generate("The cat", GenerationConfig(max_new_tokens=8)).stats.schedule["rounds"]
    explicit = cross.generate("The cat", GenerationConfig(max_new_tokens=8, algorithm="tli", lookahead=4)).stats
    assert explicit.lookahead == 4 and explicit.proposed <= 4 * explicit.target_forwards
    heuristic = cross.generate("The cat", GenerationConfig(max_new_tokens=24, algorithm="tli", schedule="heuristic"))
    assert heuristic.stats.lookahead == 2 and steps
    # Whatever these locally trained models accept: +2 after a fully accepted round (at most 6), else -1.
    for before, proposed, accepted, after in steps:
        assert after == (min(6, before + 2) if accepted == proposed else max(1, before - 1))
    assert max(heuristic.stats.rounds_by_drafts) <= max(before for before, *_ in steps)


@pytest.mark.parametrize("algo", ALGOS)
def test_confidence_schedule_cuts_drafts_and_stays_lossless(pipelines, references, algo: str) -> None:
    pipe = pipelines["gemma_qwen"]
    stopped = 0
    for prompt in PROMPTS[:8]:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=5,
                                                   schedule="confidence"))
        plain, gaps = references["gemma_qwen", prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"confidence/{algo}/{prompt!r}", is_exact(pipe))
        stopped += r.stats.schedule["confidence"]["stopped_early"]
    assert stopped > 0  # the tiny drafter is often unsure: some drafts were cut


# --- prompt lookup: drafts from the text itself -----------------------------------------------------

# Texts that repeat themselves, so that n-grams of the prompt come back (and lookup has candidates).
REPEATING = ["The cat reads the map. The cat reads the map. The cat", "def add(a, b):\n    return a + b\n\ndef add(",
             "A small robot reads a long story. A small robot", "for i in range(10):\n    print(i)\nfor i in"]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lookup_greedy_equals_plain(pipelines, references, k: int) -> None:
    """On pairs (the drafter unused) and on a lone target: the output is plain decoding's, and the
    lookup did propose and get accepted."""
    proposed = accepted = 0
    for pair in ("gemma_qwen", "llama_sp2"):
        pipe = pipelines[pair]
        for prompt in PROMPTS + REPEATING:
            r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="lookup", lookahead=k))
            plain, gaps = references[pair, prompt] if (pair, prompt) in references else plain_greedy(
                pipe, pipe.target.prompt_ids(prompt, False), NEW_TOKENS)
            assert_same_or_near_tie(r.token_ids, plain, gaps, f"{pair}/lookup/k={k}/{prompt!r}", is_exact(pipe))
            assert_text_is_the_ids(pipe, r)
            assert r.stats.drafter_forwards == 0  # no model drafted
            proposed += r.stats.proposed
            accepted += r.stats.accepted
    assert 0 < accepted <= proposed


def test_auto_on_a_single_engine_is_plain_decoding_plus_lookup(tiny_root: Path) -> None:
    """auto without a drafter: the cost model between plain steps and prompt lookup; output equal to
    plain decoding, and lookup rounds where the text repeats."""
    pipe = Pipeline.from_folder(tiny_root / "engines" / "bl_llama", provider=PROVIDER, threads=2)
    assert pipe.candidates("auto", greedy=True) == ("lookup",)
    lookup_rounds = 0
    for prompt in PROMPTS[:6] + REPEATING:
        plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=40, algorithm="ar"))
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=40))
        assert r.token_ids == plain.token_ids or not is_exact(pipe), prompt
        assert r.stats.algorithm == "auto" and set(r.stats.schedule["draft_ms_per_token"]) == {"lookup"}
        lookup_rounds += sum(v for key, v in r.stats.schedule["rounds"].items() if key.startswith("lookup"))
    assert lookup_rounds > 0


def self_repeating(pipe: Pipeline, base: str = "The cat") -> str:
    """A prompt that ends as it began, after the target's own greedy continuation of its beginning:
    lookup then proposes what the target is likely to sample (so candidates are accepted too)."""
    return base + pipe.generate(base, GenerationConfig(max_new_tokens=10, algorithm="ar")).text + " " + base


def test_lookup_sampling_matches_plain_distribution(pipelines) -> None:
    """Deterministic proposals verified by speculative sampling (accept with p(c), else p without c)."""
    pipe = pipelines["gemma_qwen"]
    tv, bound, accepted, outside = two_token_tv(pipe, "lookup", WARPS["T1-top4"], self_repeating(pipe))
    assert outside == 0 and tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
    assert accepted > 0


@pytest.mark.parametrize("algo,pair", [("lookup", "gemma_qwen"), ("lookup+slem", "llama_sp2")])
def test_lookup_sampling_under_the_chain_matches_plain_distribution(pipelines, algo: str, pair: str) -> None:
    # A prompt ending in a repeated token: the lookup proposes it again, and the chain's penalties,
    # which favour recent tokens, make it likely whatever the tiny models learnt.
    pipe = pipelines[pair]
    tv, bound, accepted, outside = two_token_tv(pipe, algo, CHAIN, SHORT_MATCH)
    assert outside == 0 and tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
    assert accepted > 0


def test_lookup_sampling_check_catches_a_wrong_verifier(pipelines, monkeypatch) -> None:
    """Negative control: accepting every lookup candidate emits the text's repetition, not p."""
    from edge_sd.algorithms import LookupProposer
    from edge_sd.sampling import sample

    def accept_all(cands, q, p, rng):
        return len(cands), sample(p[len(cands)], rng)

    monkeypatch.setattr(LookupProposer, "verifier", staticmethod(accept_all))
    pipe = pipelines["gemma_qwen"]
    tv, bound, _, _ = two_token_tv(pipe, "lookup", WARPS["T1-top4"], self_repeating(pipe))
    assert tv > bound, f"a wrong verifier passed: TV {tv:.4f} < {bound:.4f}"


# --- chains: the lookup's continuation extended by the drafter --------------------------------------

CHAINS = ("lookup+slem", "lookup+tli", "lookup+slrs")
# A prompt whose target ids on the llama pairs end in one token three times: the lookup's continuation
# is that token alone (which the target gives probability 0.78 under top-4), so a draft of two chains
# one lookup candidate and one drafted candidate.
SHORT_MATCH = "Every engineer and and and"


def count_takes(monkeypatch) -> list[bool]:
    """Whether each chained round's drafter took the lookup's candidates in (DrafterState.take)."""
    from edge_sd.algorithms import DrafterState

    taken: list[bool] = []
    take = DrafterState.take

    def spy(self, text: bytes) -> bool:
        taken.append(take(self, text))
        return taken[-1]

    monkeypatch.setattr(DrafterState, "take", spy)
    return taken


@pytest.mark.parametrize("algo", CHAINS)
@pytest.mark.parametrize("k", [3, 5])
def test_chains_greedy_equal_plain(pipelines, references, monkeypatch, algo: str, k: int) -> None:
    """lookup+X: plain decoding's output, with rounds where the drafter took the lookup's candidates in
    and drafted on from them."""
    taken = count_takes(monkeypatch)
    proposed = accepted = forwards = 0
    for pair in ("gemma_qwen", "llama_sp2"):
        pipe = pipelines[pair]
        for prompt in PROMPTS + REPEATING:
            r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=k))
            plain, gaps = references[pair, prompt] if (pair, prompt) in references else plain_greedy(
                pipe, pipe.target.prompt_ids(prompt, False), NEW_TOKENS)
            assert_same_or_near_tie(r.token_ids, plain, gaps, f"{pair}/{algo}/k={k}/{prompt!r}", is_exact(pipe))
            assert_text_is_the_ids(pipe, r)
            proposed, accepted = proposed + r.stats.proposed, accepted + r.stats.accepted
            forwards += r.stats.drafter_forwards
    assert sum(taken) >= 5 and forwards > 0 and 0 < accepted < proposed


@pytest.mark.parametrize("pair,algo", [("llama_qwen", "lookup+tli"), ("llama_sp2", "lookup+slem"),
                                       ("llama_sp2", "lookup+slrs")])
def test_chain_sampling_matches_plain_distribution(pipelines, monkeypatch, pair: str, algo: str) -> None:
    """The first candidate the lookup's (a point mass), the second the drafter's, verified in one
    round: the first two tokens follow the target's distribution."""
    taken = count_takes(monkeypatch)
    tv, bound, accepted, outside = two_token_tv(pipelines[pair], algo, WARPS["T1-top4"], SHORT_MATCH)
    assert outside == 0 and tv < bound, f"TV {tv:.4f} >= {bound:.4f}"
    # The lookup's candidate is accepted about 78% of the time, so most rounds verify a drafted one.
    assert accepted > SAMPLES // 2 and sum(taken) > SAMPLES // 2


def test_chain_sampling_check_catches_a_wrong_verifier(pipelines, monkeypatch) -> None:
    """Negative control: accepting every candidate of a chain emits the lookup's and the drafter's
    proposals, not p."""
    from edge_sd.algorithms import TLIProposer
    from edge_sd.sampling import sample

    def accept_all(cands, q, p, rng):
        return len(cands), sample(p[len(cands)], rng)

    monkeypatch.setattr(TLIProposer, "verifier", staticmethod(accept_all))
    tv, bound, _, _ = two_token_tv(pipelines["llama_qwen"], "lookup+tli", WARPS["T1-top4"], SHORT_MATCH)
    assert tv > bound, f"a wrong verifier passed: TV {tv:.4f} < {bound:.4f}"


# --- greedy decoding under penalties ---------------------------------------------------------------

PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, repeat_last_n=16)
# Penalties that favour the last few tokens: whether a position counts the candidates before it then
# decides its argmax often (the negative control below shows it).
BOOST = dict(repetition_penalty=0.5, presence_penalty=-2.0, repeat_last_n=4)


@pytest.mark.parametrize("pair,algo", [
    ("gemma_qwen", "slem"), ("gemma_qwen", "tli"), ("gemma_qwen", "slrs"), ("llama_sp2", "slem"),
    ("llama_same", "standard"), ("gemma_qwen_keep50", "rdk"), ("gemma_qwen", "lookup"),
    ("llama_sp2", "lookup+slem"), ("gemma_qwen", "auto"),
])
def test_greedy_with_penalties_equals_plain(pipelines, pair: str, algo: str) -> None:
    """Penalties apply at temperature 0 too: every position's argmax is taken after the penalties that
    count the candidates before it, so speculative decoding gives plain decoding's penalized output."""
    pipe = pipelines[pair]
    changed = proposed = accepted = 0
    for penalties in (PENALTIES, BOOST):
        for prompt in PROMPTS[:8] + REPEATING:
            plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="plain", **penalties))
            r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=3,
                                                       **penalties))
            assert r.token_ids == plain.token_ids, f"{pair}/{algo}/{penalties}/{prompt!r}"
            unpenalized = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="plain"))
            changed += unpenalized.token_ids != plain.token_ids
            proposed, accepted = proposed + r.stats.proposed, accepted + r.stats.accepted
    assert changed >= 6  # the penalties did change the output, so the equality above says something
    assert accepted > 0 and accepted < proposed


def test_greedy_penalty_check_catches_forgotten_candidates(pipelines, monkeypatch) -> None:
    """Negative control: argmaxes whose penalties leave out the candidates before their position
    part from plain decoding on the same prompts."""
    from edge_sd.sampling import Rows

    monkeypatch.setattr(Rows, "window", lambda self, i: self.cfg.window(self.history))
    pipe, differ = pipelines["gemma_qwen"], 0
    for prompt in PROMPTS + REPEATING:
        plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="plain", **BOOST))
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="tli", lookahead=3, **BOOST))
        differ += r.token_ids != plain.token_ids
    assert differ > 0
