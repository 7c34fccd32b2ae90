"""The real pair: Gemma-3-270M target (the GGUF's own Q4_K_M weights, precision gguf), SmolLM2-135M
(int4) drafter, 262k vs 49k vocabularies, both exported through onnxruntime-genai's model builder.

`scripts/test.sh` exports the pair into the cache (EDGE_SD_REAL_PAIR) and writes the fp32 Hugging Face
folders these tests compare against; running pytest by hand without them fails with the command to run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge_sd import GenerationConfig, Pipeline
from edge_sd.tools.paths import cache_dir

from test_lossless import assert_same_or_near_tie, count_takes, is_exact, plain_greedy

pytestmark = pytest.mark.real

CACHE = cache_dir()
PAIR = Path(os.environ.get("EDGE_SD_REAL_PAIR", CACHE / "pairs" / "gemma3-270m_smollm2-135m"))
HF = CACHE / "real" / "hf"
PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The capital of France is Paris. The capital of Germany is",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 12?\nA:",
    "Le chat est sur la table. Il",
    "A recipe for pancakes:\n1.",
    "The key differences between TCP and UDP are",
    "Article: The city council approved a new budget on Monday that raises spending on public "
    "transport by ten percent.\n\nSummary:",
    "for (int i = 0; i < n; i++) {",
]
NEW_TOKENS = 32
ALGOS = ("slem", "tli", "slrs")
# Acceptance floors: about two thirds of what these prompts measured (32 greedy tokens each, gguf
# target, int4 drafter, 2-core x86-64), so that another CPU's rounding cannot trip them while a broken
# map or sync (an untrained drafter measured below 10% on the tiny pairs) still does. Measured at k=3 /
# 5: SLEM 0.449 / 0.336, TLI 0.377 / 0.279, SLRS 0.394 / 0.288.
ACCEPTANCE_FLOOR = {
    ("slem", 3): 0.30, ("slem", 5): 0.22,
    ("tli", 3): 0.26, ("tli", 5): 0.19,
    ("slrs", 3): 0.27, ("slrs", 5): 0.19,
}
# The target computes with the GGUF's weights exactly, but with int8 activations (MatMulNBits accuracy
# level 4): its argmax agrees with torch's fp32 dequantization of the same file on most positions of
# these prompts (0.92, the mean over the first four); a wrong weight leaves next to none.
TARGET_TOP1 = 0.8
# The drafter is int4 (weight-only, int8 activations; the GGUF's 4-bit weights quantized a second
# time): it need not match torch's fp32 drafter, only draft well enough to pay. Its argmax agrees with
# fp32 on 48% of these short prompts' positions (int8: 96%); a broken export agrees on next to none.
DRAFTER_TOP1 = 0.32


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    if not (PAIR / "pair.json").is_file():
        pytest.fail(f"the real pair is not exported at {PAIR}: run `bash scripts/test.sh` (or "
                    f"`bash scripts/prepare_real_pair.sh {PAIR} --hf`) first")
    return Pipeline.from_folder(PAIR, provider="cpu", threads=2)


@pytest.fixture(scope="module")
def references(pipe):
    return {p: plain_greedy(pipe, pipe.target.prompt_ids(p, False), NEW_TOKENS) for p in PROMPTS}


def test_manifests(pipe) -> None:
    t, d = pipe.target.manifest, pipe.drafter.manifest
    assert (t.precision, t.vocab_size, t.logits_width) == ("gguf", 262144, 262144)
    # both from their GGUF files alone; Gemma's file has no chat template, its markers name Gemma's format
    assert [m.exporter["tokenizer"] for m in (t, d)] == ["the GGUF file's metadata"] * 2
    assert t.exporter["chat_template"].startswith("built-in gemma")
    assert d.exporter["chat_template"] == "the GGUF file's metadata"
    q = t.quantization
    assert q["float_matmuls"] == 0 and q["embedding"] == "GatherBlockQuantized, shared with the LM head"
    assert set(q["weights_by_type"]) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    assert q["lm_head_parts"] == 4  # 262,144 rows in parts of 65,536 (export/logits.py)
    assert q["fused_matmuls"] == 18  # each layer's gate and up projections (both Q5_0), one node
    # The attention reads the previous position back from the cache, so that a one-position step can
    # agree bit for bit with longer forwards: where it did at export (AVX-512 CPUs), plain steps
    # re-feed nothing; where it did not (an AVX2-only AMD EPYC), they feed two positions.
    assert t.previous_row_attention and not d.previous_row_attention
    one = t.validation["max_rel_diff_single_position"] == 0.0
    assert t.min_step_positions == (1 if one else 2)
    assert t.validation["max_rel_diff_steps_vs_forward"] == 0.0
    assert d.precision == "int4" and d.vocab_size == 49152
    # Both through the model builder: fused attention with a shared KV buffer.
    assert (t.export_path, t.kv_layout, d.export_path, d.kv_layout) == ("builder", "shared", "builder", "shared")
    assert not pipe.same_vocab
    # SmolLM2 takes no BOS; Gemma does.
    assert t.add_bos and not d.add_bos
    assert pipe.drafter.prompt_ids("Hello", False)[0] != d.bos_token_id


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_engines_match_transformers(pipe, role: str) -> None:
    torch = pytest.importorskip("torch")  # the export extra is installed by scripts/setup.sh
    from transformers import AutoModelForCausalLM

    name = {"target": "gemma3-270m", "drafter": "smollm2-135m"}[role]
    if not (HF / name / "config.json").is_file():
        pytest.fail(f"{HF / name} missing: run `bash scripts/prepare_real_pair.sh {PAIR} --hf`")
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(HF / name, dtype=torch.float32).eval()
    side = getattr(pipe, role)
    worst, agree = 0.0, []
    for prompt in PROMPTS[:4]:
        ids = side.prompt_ids(prompt, False)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        side.engine.reset()
        got = side.engine.forward(np.asarray(ids))
        worst = max(worst, float(np.abs(got - ref).max()) / max(1.0, float(np.abs(ref).max())))
        agree.append(float(np.mean(got.argmax(-1) == ref.argmax(-1))))
    if role == "target":
        assert np.mean(agree) >= TARGET_TOP1, f"gguf target argmax agrees with torch on {np.mean(agree):.0%}"
    else:
        assert np.mean(agree) >= DRAFTER_TOP1, (
            f"{side.manifest.precision} drafter argmax agrees with fp32 torch on {np.mean(agree):.0%}")


def test_plain_decoding_is_the_reference(pipe, references) -> None:
    """The pipeline's own plain decoding equals the step-by-step reference the other tests use."""
    for prompt in PROMPTS[:3]:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="ar"))
        assert r.token_ids == references[prompt][0]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("k", [3, 5])
def test_greedy_equals_plain_and_acceptance(pipe, references, algo: str, k: int) -> None:
    proposed = accepted = 0
    for prompt in PROMPTS:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo, lookahead=k))
        plain, gaps = references[prompt]
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"real/{algo}/k={k}/{prompt!r}", is_exact(pipe))
        assert r.stats.target_forwards <= len(r.token_ids)
        proposed += r.stats.proposed
        accepted += r.stats.accepted
    rate = accepted / proposed
    print(f"\n{algo} k={k}: acceptance {rate:.3f} ({accepted}/{proposed})")
    assert rate >= ACCEPTANCE_FLOOR[algo, k], f"{algo} k={k}: acceptance {rate:.1%} below its floor"


def test_chain_greedy_equals_plain(pipe, references, monkeypatch) -> None:
    """lookup+slem on the real pair: plain decoding's output, with rounds where SmolLM2 took the
    lookup's continuation in and drafted on from it."""
    taken = count_takes(monkeypatch)
    # Texts repeating a short period: the lookup's continuation often runs to the text's end, shorter
    # than the draft, so the drafter drafts on.
    for prompt in [*PROMPTS, "Monday Tuesday Monday Tuesday Monday", "ha ha ha ha"]:
        r = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm="lookup+slem", lookahead=5))
        plain, gaps = references[prompt] if prompt in references else plain_greedy(
            pipe, pipe.target.prompt_ids(prompt, False), NEW_TOKENS)
        assert_same_or_near_tie(r.token_ids, plain, gaps, f"real/lookup+slem/{prompt!r}", is_exact(pipe))
    assert sum(taken) > 5


def test_verification_forwards_across_64_positions_agree_with_plain_steps(pipe) -> None:
    """On an AVX-512 VNNI Xeon and an AVX-512 EPYC, the default target's forwards spanning position 64
    (on the EPYC 192 too) computed their positions otherwise than plain decoding's steps, and greedy
    outputs changed; the engine runs them as the steps meet those positions (test_split.py)."""
    from edge_sd.engines.consistency import across_split

    engine = pipe.target.session.engine()
    ids = pipe.target.prompt_ids("There are three reasons why cities should plant more trees. The first", False)
    ids = ids + [int(i) for i in np.random.default_rng(0).integers(1000, 20000, size=210 - len(ids))]
    for ends in (range(56, 76), range(184, 204)):  # every row of forwards of 3, 5 and 17 positions
        assert across_split(engine, ids, ends) == 0.0, ends


def _views_against_whole(session, granule: int, ids: list[int], start: int, end: int) -> tuple[int, int, int]:
    """consistency.views_against_whole on two engines of a target session, one with views from
    offsets in steps of `granule`, forwards of up to 17 positions (auto's longest verification)."""
    from edge_sd.engines.consistency import views_against_whole

    viewed, whole = session.engine(), session.engine()
    viewed.window_granule, whole.window_granule = granule, 0
    assert viewed.can_view_windows
    return views_against_whole(viewed, whole, np.asarray(ids), start, end, np.random.default_rng(1),
                               sizes=(1, 1, 2, 4, 7, 17))


def test_sliding_window_views_compute_what_the_whole_cache_does(pipe, monkeypatch) -> None:
    """Gemma 3's sliding-window layers (15 of 18, a window of 512) read their cache through a view that
    starts at an offset (manifest window_views, engines/kv.py window_offset): every forward's logits
    equal, bit for bit, those of an engine reading the whole cache, across three offsets, through
    ONNX Runtime's attention node and through edge-sd's kernel where it runs.
    With offsets a multiple of half the granule the same comparison finds forwards that differ through
    ONNX Runtime's node (its kernel sums positions in blocks: of 128 on an AVX-512 AMD EPYC, of 64 on an
    AVX2-only one), so this comparison can fail; edge-sd's kernel sums in blocks of 16 positions, so
    half the granule is exact there too."""
    from edge_sd.engines import attention
    from edge_sd.engines.consistency import WINDOW_GRANULES
    from edge_sd.engines.ort import OrtSession

    views = pipe.target.manifest.window_views
    assert views["layers"] == [i for i in range(18) if i % 6 != 5] and views["window"] == 512
    assert views["granule"] in WINDOW_GRANULES  # measured at export: the smallest that is exact
    granule = views["granule"]
    # Enough positions for the forwards up to 600 + 4 granules (the largest granule's too).
    ids = [int(i) for i in np.random.default_rng(0).integers(1000, 200000, size=600 + 4 * granule + 32)]
    kernel = pipe.target.session if attention.wanted()[0] is not None else None  # as the pipe was loaded
    monkeypatch.setenv("EDGE_SD_RUNTIME_CACHE", "0")  # the session below is built as it is, cached nowhere
    monkeypatch.setenv(attention.ENV, "0")
    plain = OrtSession(PAIR / "target", provider="cpu", threads=2)
    for session in (plain, kernel):
        if session is None:
            continue
        forwards, unequal, offset = _views_against_whole(session, granule, ids, 600, 600 + 4 * granule)
        assert unequal == 0 and forwards > 50 and offset >= 2 * granule
    forwards, unequal, offset = _views_against_whole(plain, granule // 2, ids, 600, 800)
    assert unequal > 0 and offset > 0
    if kernel is not None:
        forwards, unequal, offset = _views_against_whole(kernel, granule // 2, ids, 600, 800)
        assert unequal == 0 and offset > 0


def test_greedy_equals_plain_over_a_long_prompt(pipe) -> None:
    """Past 641 positions the target's sliding-window layers read views of their cache: auto and
    SLEM, greedy, give the tokens of plain decoding over the whole cache. A generator's target gives
    back the window layers' positions below its views; rewound below them, it feeds the sequence
    again and continues as a fresh generator would."""
    text = "\n".join(PROMPTS * 12)
    ids = pipe.target.prompt_ids(text, False)[:900]
    assert len(ids) == 900
    engine = pipe.target.engine
    granule, engine.window_granule = engine.window_granule, 0
    try:
        plain, gaps = plain_greedy(pipe, ids, NEW_TOKENS)
    finally:
        engine.window_granule = granule
    for algo in ("auto", "slem"):
        g = pipe.generator(GenerationConfig(max_new_tokens=NEW_TOKENS, algorithm=algo))
        g.append_tokens(ids)
        out: list[int] = []
        while not g.is_done:
            out += g.generate_next_tokens().ids
        assert_same_or_near_tie(out, plain, gaps, f"real/{algo}/long prompt", is_exact(pipe))
        # views from 256 or further on (granule 64 or 128); none where the export found no exact offset step
        assert g.target.released >= 256 if granule else g.target.released == 0
    g.rewind_to(400)
    g.append_tokens(ids[400:700])
    assert g.target.n_cached == (0 if granule else 400)  # what it held from 400 on needs positions it gave back
    out = []
    while not g.is_done:
        out += g.generate_next_tokens().ids
    plain, gaps = plain_greedy(pipe, ids[:700], NEW_TOKENS)
    assert_same_or_near_tie(out, plain, gaps, "real/slem/rewound long prompt", is_exact(pipe))
