"""Unit tests on toy vocabularies: the text stream's stops and hold-back, and what each proposer hands
the verifier (candidates and their exact proposal rows), checked against arrays worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_sd.algorithms import DrafterState, SLEMProposer, SLRSProposer, TLIProposer
from edge_sd.algorithms.base import STEP_WEIGHT
from edge_sd.algorithms.slem import verify_exact
from edge_sd.algorithms.standard import verify_standard
from edge_sd.manifest import EngineManifest
from edge_sd.sampling import SamplingConfig
from edge_sd.text_stream import TextStream
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import build_maps


def toy_vocab(pieces: list[str], eos: list[int] | None = None) -> Vocab:
    """A SentencePiece-style vocabulary with exactly these pieces ("▁" is a space), id = position."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    return Vocab(tok, json.loads(tok.to_str()), eos)


class ScriptedEngine:
    """An engine whose every forward returns the next row of a script (drafter logits)."""

    def __init__(self, rows: list[list[float]], max_context: int = 100):
        self.rows = [np.asarray(r, dtype=np.float32) for r in rows]
        self.manifest = EngineManifest(
            format_version=2, name="toy", architecture="toy", num_layers=1, num_attention_heads=1,
            num_kv_heads=1, head_dim=1, hidden_size=1, kv_dtype="float32", precision="fp32",
            logits_width=len(self.rows[0]), vocab_size=len(self.rows[0]), bos_token_id=None, add_bos=False,
            eos_token_ids=[], pad_token_id=None, has_position_ids=False, max_context=max_context,
            sliding_window=None, model_file="m", tokenizer_file="t", input_names=[], output_names=[])
        self.n_cached = 0
        self.calls = 0
        self.min_step, self.head_rows, self.forward_count, self.forward_time = 1, 1, 0, 0.0
        self.seconds = lambda positions: 0.0  # what a forward over that many positions takes

    @property
    def cached_ids(self) -> np.ndarray:
        return np.zeros(self.n_cached, dtype=np.int64)  # not recorded: these tests read no cached ids

    def forward(self, ids: np.ndarray, last: int | None = None, *, scratch: bool = False) -> np.ndarray:
        self.n_cached += len(ids)
        self.forward_time += self.seconds(len(ids))
        row = self.rows[min(self.calls, len(self.rows) - 1)]
        self.calls += 1
        return np.tile(row, (last or len(ids), 1))

    def truncate(self, n: int) -> None:
        self.n_cached = min(self.n_cached, n)

    def reset(self) -> None:
        self.n_cached = 0

    def reserve(self, n: int) -> None:
        pass

    def prepare(self) -> None:
        pass


# --- the text stream -----------------------------------------------------------------------------

TEXT = toy_vocab(["<eos>", "a", "b", "\u2581", "ab", "\u2581b", "<0xE6>", "<0x97>", "<0xA5>"], eos=[0])
A, B, SP, AB, SPB, E6, X97, XA5 = range(1, 9)


def decode(ids: list[int]) -> str:
    return TEXT.ids_bytes(ids).decode("utf-8", errors="replace")


def run_stream(rounds: list[list[int]], max_new: int = 50, stops: tuple[bytes, ...] = (),
               include_stop: bool = False) -> tuple:
    s = TextStream(TEXT, max_new, stops, include_stop)
    pieces = []
    for r in rounds:
        _, text = s.push(r)
        pieces.append(text)
        if s.done:
            break
    pieces.append(s.finish("context"))
    return s.ids, "".join(pieces), s.reason, pieces


def test_held_back_text_is_handed_out_at_every_end() -> None:
    # A stop string that never matches, ending by max_new_tokens: nothing held back is lost.
    ids, text, reason, pieces = run_stream([[A, SP], [B, SP, AB]], max_new=5, stops=(b"NEVER",))
    assert (ids, text, reason) == ([A, SP, B, SP, AB], "a b ab", "max_new_tokens")
    assert pieces[0] == ""  # held back: the last 4 bytes could still begin "NEVER"
    # A trailing partial character at max_new_tokens, the context limit and EOS alike: U+FFFD.
    ids, text, reason, _ = run_stream([[A, E6, X97]], max_new=3)
    assert (ids, text, reason) == ([A, E6, X97], "a\ufffd", "max_new_tokens")
    ids, text, reason, _ = run_stream([[A, E6, X97]])
    assert (ids, text, reason) == ([A, E6, X97], "a\ufffd", "context")
    ids, text, reason, _ = run_stream([[A, E6, X97, 0]])
    assert (ids, text, reason) == ([A, E6, X97], "a\ufffd", "eos")
    ids, text, _, pieces = run_stream([[A, E6], [X97], [XA5, B]], max_new=5)
    assert text == "a日b" and pieces[:3] == ["a", "", "日b"]  # never half a character on the way


def test_stop_string_before_eos_in_one_round() -> None:
    """A round whose tokens complete a stop string and then reach EOS stops at the stop string."""
    ids, text, reason, _ = run_stream([[A, B, SP, 0]], stops=(b"b ",))
    assert (ids, text, reason) == ([A, B, SP], "a", "stop")
    ids, text, reason, _ = run_stream([[A, 0, B, SP]], stops=(b"b ",))  # EOS first: EOS wins
    assert (ids, text, reason) == ([A], "a", "eos")


def test_stop_string_spanning_rounds() -> None:
    ids, text, reason, pieces = run_stream([[A, B], [SP], [AB, SPB]], stops=(b"b b",))
    assert (ids, text, reason) == ([A, B, SP, AB, SPB], "ab a", "stop")
    assert "".join(pieces) == text
    # The ids keep the token that completes it (plain decoding generated it), not the ones after it;
    # the text ends before the stop string, or with it (include_stop), never past it.
    ids, text, reason, _ = run_stream([[A], [SPB, A, B]], stops=(b" ",))
    assert (ids, text, reason) == ([A, SPB], "a", "stop")
    ids, text, reason, pieces = run_stream([[A], [SPB, A, B]], stops=(b" ",), include_stop=True)
    assert (ids, text, reason, "".join(pieces)) == ([A, SPB], "a ", "stop", "a ")


def test_stop_string_cuts_the_text_before_it() -> None:
    """The convention of OpenAI's API, vLLM and llama.cpp's server: text up to the stop string, even
    where the token that completed it runs on past it ("a p" completed by "po" of "positive")."""
    ids, text, reason, pieces = run_stream([[A], [SP], [B, AB]], stops=(b"a b",))
    assert (ids, text, reason) == ([A, SP, B], "", "stop") and pieces == ["", "", "", ""]
    ids, text, reason, _ = run_stream([[A, SPB, B]], stops=(b"a b",), include_stop=True)
    assert (ids, text, reason) == ([A, SPB], "a b", "stop")
    # The earliest of two stop strings completed by one token wins; the text before it is whole.
    ids, text, reason, _ = run_stream([[A, B, SPB, A]], stops=(b" b", b"b b"))
    assert (ids, text, reason) == ([A, B, SPB], "a", "stop")


# --- proposals: TLI's restricted q, SLRS's psi and its chain ---------------------------------------

# Target: a, b, c, ab, abc, <eos>. Drafter: <eos>, a, b, ab, abc, bca, d (d has no target prefix).
TARGET = toy_vocab(["a", "b", "c", "ab", "abc", "<eos>"], eos=[5])
DRAFTER = toy_vocab(["<eos>", "a", "b", "ab", "abc", "bca", "d"], eos=[0])
MAPS = build_maps(DRAFTER, TARGET)
LOGITS = [0.5, 1.0, 0.0, 2.0, -1.0, 1.5, 0.25]  # drafter logits over its 7 ids (exact in float32)
TEMP = SamplingConfig(temperature=1.0)
# warp takes exponentials in float32 (the logits' precision): a few 1e-8 from float64's softmax here
RTOL = 1e-6


def softmax(x: list[float]) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - max(x))
    return e / e.sum()


def drafter_state(rows: list[list[float]]) -> DrafterState:
    return DrafterState(ScriptedEngine(rows), DRAFTER, [1])


def test_maps_of_the_toy_pair() -> None:
    # intersection: same bytes (EOS -> EOS); prefix: the longest target token prefixing the bytes.
    assert MAPS.intersection.tolist() == [5, 0, 1, 3, 4, -1, -1]
    assert MAPS.prefix.tolist() == [5, 0, 1, 3, 4, 1, -1]


def test_tli_proposal_is_q_restricted_to_the_intersection() -> None:
    q = softmax(LOGITS)
    p = TLIProposer(drafter_state([LOGITS]), MAPS.intersection, 6, TEMP, np.random.default_rng(0), [5])
    draft = p.propose(1, [0])
    assert p.verifier is verify_standard
    mass = q[[0, 1, 2, 3, 4]].sum()  # ids 5 (bca) and 6 (d) have no twin
    expected = np.array([q[1], q[2], 0.0, q[3], q[4], q[0]]) / mass  # over target ids a b c ab abc eos
    np.testing.assert_allclose(draft.q[0], expected, rtol=RTOL)
    assert draft.candidates[0] in (0, 1, 3, 4, 5)


def test_slrs_fresh_proposal_is_psi_and_leftovers_are_point_masses() -> None:
    q = softmax(LOGITS)
    # Drafter argmax (greedy drafting) is "ab" (logit 2.0); psi sums q over g(d) = t.
    psi = np.array([q[1], q[2] + q[5], 0.0, q[3], q[4], q[0]])  # bca -> b; d -> nothing
    greedy = SamplingConfig(temperature=0.0)
    p = SLRSProposer(drafter_state([LOGITS]), TARGET, MAPS.prefix, 6, TEMP, np.random.default_rng(0))
    assert p.verifier is verify_standard
    draft = p.propose(1, [0])
    np.testing.assert_allclose(draft.q[0], psi, rtol=RTOL)
    # A drafted "bca": g = "b", then the leftover "ca": "c" (point mass), then "a" (point mass).
    bca = [0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0]
    p = SLRSProposer(drafter_state([bca]), TARGET, MAPS.prefix, 6, greedy, np.random.default_rng(0))
    draft = p.propose(3, [0])
    assert draft.candidates == [1, 2, 0]
    np.testing.assert_array_equal(draft.q[1], np.eye(6)[2])
    np.testing.assert_array_equal(draft.q[2], np.eye(6)[0])
    assert p.drafter.ids == [1, 5]  # one drafter token for three candidates
    # A drafter token with no target prefix is the "none" proposal, and the chain stops there.
    d = [0.0] * 6 + [9.0]
    p = SLRSProposer(drafter_state([d]), TARGET, MAPS.prefix, 6, greedy, np.random.default_rng(0))
    assert p.propose(3, [0]).candidates == [-1]


def test_slem_drafts_text_and_lets_the_target_decide() -> None:
    rows = [[0, 0, 0, 9, 0, 0, 0], [0, 9, 0, 0, 0, 0, 0]]  # greedy drafts "ab", then "a"
    p = SLEMProposer(drafter_state(rows), TARGET, [0])
    assert p.verifier is verify_exact
    draft = p.propose(2, [])
    # "aba" re-tokenized by the target (no merges in this toy tokenizer: a, b, a), capped at k=2.
    assert draft.q is None and draft.candidates == [0, 1]


def test_the_drafter_state_times_its_forwards_on_the_engines_clock() -> None:
    """A forward over n positions takes 10 ms + 1 ms a position: a draft's first forward over the
    5-token prompt is a one-position step (11 ms) plus 4 ms of catching up, for 4 positions; a step
    after it moves the step's estimate by what it measured."""
    engine = ScriptedEngine([LOGITS])
    engine.seconds = lambda n: 0.010 + 0.001 * n
    state = DrafterState(engine, DRAFTER, [1, 2, 1, 2, 1])
    state.step_s = 0.012  # the estimate made at load
    assert state.budget(2) == 2 and state.behind == 4
    state.next_logits()
    assert abs(state.catch_up_s - (0.015 - 0.012)) < 1e-12 and state.caught_up == 4
    state.push(1)
    state.next_logits()
    assert abs(state.step_s - (0.012 + STEP_WEIGHT * (0.011 - 0.012))) < 1e-12 and state.caught_up == 4
    assert state.budget(2) == 2 and (state.catch_up_s, state.caught_up) == (0.0, 0)  # each draft its own


@pytest.mark.parametrize("k", [0, 3])
def test_budget_stops_drafting_when_lagging_or_out_of_room(k: int) -> None:
    state = drafter_state([LOGITS])
    state.lagging = True
    assert state.budget(k) == 0
    state = DrafterState(ScriptedEngine([LOGITS], max_context=3), DRAFTER, [1, 2])
    assert state.budget(k) == min(k, 1)


def test_healing_drafts_on_from_inside_the_prompts_last_token() -> None:
    """Healing takes the prompt's last token ("b") back: the first drafted token must begin with its
    bytes ("bca" over the drafter's favourite "a"), SLEM hands over only what follows them ("ca"),
    and a sync spells the healed bytes before the generated text."""
    rows = [[0, 5, 0, 0, 0, 3, 0], [0, 9, 0, 0, 0, 0, 0]]  # "a" first, "bca" best of those from "b"
    state = DrafterState(ScriptedEngine(rows), DRAFTER, [1, 2], heal=True)
    assert (state.ids, state.head, state.healing) == ([1], b"b", b"b")
    draft = SLEMProposer(state, TARGET, [0]).propose(2, [0, 1])
    assert state.ids[1] == 5 and draft.candidates == [2, 0]  # "ca" + "a": c, a
    assert state.healing == b""  # a drafted token covers the healed bytes
    state.sync(b"ca")  # the target accepted "ca": "bca" spells b + ca and stays
    assert state.ids == [1, 5] and not state.lagging
    state = DrafterState(ScriptedEngine(rows), DRAFTER, [1, 2], heal=True)
    SLEMProposer(state, TARGET, [0]).propose(2, [0, 1])
    state.sync(b"a")  # the target said "a" instead: "bca" goes, the window "ba" is re-tokenized
    assert state.ids == [1, 2, 1] and state.engine.n_cached == 1 and not state.lagging
    # Without healing the drafter continues after the prompt's "b" with its favourite "a".
    plain = DrafterState(ScriptedEngine(rows), DRAFTER, [1, 2])
    assert SLEMProposer(plain, TARGET, [0]).propose(1, [0, 1]).candidates == [0] and plain.head == b""


def test_no_healing_where_it_cannot_draft() -> None:
    """A one-token prompt, a special last token, or a pruned head that keeps none of the tokens
    beginning with the prompt's end: the prompt stays whole."""
    for ids, kept in (([2], None), ([1, 0], None), ([1, 2], np.array([0, 1, 3]))):
        state = DrafterState(ScriptedEngine([LOGITS]), DRAFTER, ids, kept, heal=True)
        assert state.ids == ids and state.head == b"" and state.healing == b""


# --- chains: the lookup's continuation, extended by the drafter ------------------------------------

def test_a_chain_proposes_the_lookups_continuation_then_the_drafters_draft() -> None:
    """History "a b a b": the lookup proposes "a b" (what followed the earlier "a b"); the drafter takes
    that text in and drafts on from it. SLEM's candidates need no q; TLI's rows follow one-hot rows of
    the lookup's point masses (the speculative sampling rule on a one-hot row is verify_point's)."""
    from edge_sd.algorithms import ChainProposer, LookupProposer

    history = [0, 1, 0, 1]
    rows = [[0, 0, 0, 0, 9, 0, 0]]  # the drafter's favourite: "abc"
    state = drafter_state(rows)
    chain = ChainProposer(LookupProposer(history), SLEMProposer(state, TARGET, [0]), TARGET, 6)
    assert chain.name == "lookup+slem" and chain.verifier is verify_exact and chain.available(4) == 2
    draft = chain.propose(4, history)
    # "abcabc" after "ab": the target's a, b (k - 2 = 2 of a, b, c, a, b, c)
    assert draft.candidates == [0, 1, 0, 1] and draft.q is None
    # the head's "a", "b" went in with the first forward: two forwards for two drafted tokens
    assert state.ids == [1, 1, 2, 4, 4] and (state.engine.n_cached, state.engine.calls) == (4, 2)
    # k no longer than the continuation: the lookup's alone, the drafter untouched.
    state = drafter_state(rows)
    chain = ChainProposer(LookupProposer(history), SLEMProposer(state, TARGET, [0]), TARGET, 6)
    assert chain.propose(2, history).candidates == [0, 1] and state.ids == [1] and state.engine.calls == 0

    q = softmax(LOGITS)
    state = drafter_state([LOGITS])
    tli = TLIProposer(state, MAPS.intersection, 6, TEMP, np.random.default_rng(0), [5])
    chain = ChainProposer(LookupProposer(history), tli, TARGET, 6)
    assert chain.verifier is verify_standard
    draft = chain.propose(3, history)
    assert draft.candidates[:2] == [0, 1] and len(draft.candidates) == 3 and draft.q.shape == (3, 6)
    np.testing.assert_array_equal(draft.q[:2], np.eye(6)[[0, 1]])
    mass = q[[0, 1, 2, 3, 4]].sum()
    np.testing.assert_allclose(draft.q[2], np.array([q[1], q[2], 0.0, q[3], q[4], q[0]]) / mass, rtol=RTOL)


def test_a_chain_drafts_alone_or_not_at_all_where_the_drafter_cannot_follow() -> None:
    """No match: the drafter drafts alone. A head the drafter cannot spell ("c"), or a drafter that
    lags behind the text: the lookup's candidates alone, nothing appended to the drafter."""
    from edge_sd.algorithms import ChainProposer, LookupProposer

    rows = [[0, 0, 0, 0, 9, 0, 0]]
    state = drafter_state(rows)
    chain = ChainProposer(LookupProposer([0, 1]), SLEMProposer(state, TARGET, [0]), TARGET, 6)
    assert chain.available(3) == 0 and chain.propose(3, [0, 1]).candidates == [0, 1, 2]
    for history, lagging in (([0, 2, 0, 2], False), ([0, 1, 0, 1], True)):
        state = drafter_state(rows)
        state.lagging = lagging
        chain = ChainProposer(LookupProposer(history), SLEMProposer(state, TARGET, [0]), TARGET, 6)
        assert chain.propose(4, history).candidates == history[2:] and state.ids == [1], history
        assert state.engine.calls == 0
    # take() refuses text ending inside a character and text that would fill the drafter's context.
    state = drafter_state(rows)
    assert not state.take("日".encode()[:2]) and not state.take(b"") and state.ids == [1]
    state = DrafterState(ScriptedEngine(rows, max_context=3), DRAFTER, [1])
    assert not state.take(b"ab") and state.take(b"a") and state.ids == [1, 1]
