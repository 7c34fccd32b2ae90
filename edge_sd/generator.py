"""One request on a Model: its KV caches, drafter state, schedule, random generator and statistics.

The shape of onnxruntime-genai's generator, for a pair:

    gen = model.generator(GenerationConfig(max_new_tokens=64))
    gen.append_text("The three primary colors are")     # or append_tokens(ids), append_chat(...)
    while not gen.is_done:
        emitted = gen.generate_next_tokens()             # one round: emitted.ids, emitted.text
    result = gen.result()                                # the reply: text, token_ids, stats

After a reply, appending more (the next user turn, or any text) continues the same sequence: only
what is new is prefilled, on both engines. `rewind_to(n)` keeps the first n ids. Generators of one
model are independent (each has its own caches), in one thread or several; one generator is not
meant to be driven from two threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edge_sd import text_input
from edge_sd.algorithms import (
    ChainProposer,
    DrafterState,
    LookupProposer,
    MappedProposer,
    SLEMProposer,
    SLRSProposer,
    TLIProposer,
)
from edge_sd.algorithms.base import Proposer
from edge_sd.algorithms.rdk import RDKProposer
from edge_sd.config import GenerationConfig, GenerationResult
from edge_sd.cost_model import CostModel
from edge_sd.errors import ContextLimitError, UsageError
from edge_sd.lookahead import (
    ConfidenceSchedule,
    CostSchedule,
    DiscoSchedule,
    HeuristicSchedule,
    Schedule,
    StaticSchedule,
    estimated,
)
from edge_sd.loop import Decoder, Emitted
from edge_sd.model import Costs, Model, render_chat
from edge_sd.stats import Stats
from edge_sd.text_stream import TextStream

# Settled by the real-pair benchmark on the default pair (benchmarks/results): greedy SLEM ran fastest
# at k=2, sampling at k=1 (a drafted token rejected half the time barely pays for itself).
DEFAULT_LOOKAHEAD = {"greedy": 2, "sample": 1}
# The cost-aware schedule (auto) chooses each round's draft length in 0..this (or lookahead).
DEFAULT_MAX_LOOKAHEAD = 6
# ... and a prompt lookup draft's in 0..this: it costs no model forward to make, a text quoting its
# source is accepted for dozens of tokens at a time, and a target forward over many positions costs
# little more than over one (the weights are read once).
DEFAULT_MAX_LOOKUP = 16


class Generator:
    """A request's state on a shared Model (module docstring)."""

    def __init__(self, model: Model, config: GenerationConfig | None = None,
                 make_schedule: Callable[[dict[str, Proposer]], Schedule] | None = None):
        """make_schedule: build each reply's lookahead schedule from its proposers (calibration
        records traces this way); by default the configuration's schedule."""
        self.model = model
        self.config = cfg = (config or GenerationConfig()).check()
        self.algorithm = model.resolve_algorithm(cfg)
        self.sampling = cfg.sampling
        self.rng = np.random.default_rng(cfg.seed)
        self.make_schedule = make_schedule
        self.target = model.target.session.engine(release_window=True)
        self._drafter_engine = model.drafter.session.engine() if model.drafter is not None else None
        self.ids: list[int] = []  # the whole sequence: prompts, replies, later turns
        self.reply_start = 0  # where the current reply begins in `ids`
        self._drafter_context = ""  # the text the drafter's context is made of, before the current reply
        self._messages: list[dict[str, str]] = []  # chat turns so far
        self._rendered: dict[str, str] = {}  # per side, the chat rendering the sequence so far is made of
        self._chat_base: tuple[int, str] = (0, "")  # the last reply's start: ids before it, rendering
        self._decoder: Decoder | None = None
        self._closed = True  # no reply in progress
        self._prefilled = False
        self._pieces: list[str] = []
        self._schedule_key: tuple | None = None
        self._own_schedule: CostSchedule | None = None  # seeded: kept by this generator, never shared
        self.stats = Stats(algorithm=self.algorithm)

    # --- input ------------------------------------------------------------------------------------

    def append_tokens(self, ids: Sequence[int], drafter_text: str | None = None) -> None:
        """Append target ids to the sequence (a prompt, or more after a reply) and start a reply.
        drafter_text: what the drafter reads for them [their text]."""
        ids = [int(i) for i in ids]
        if not ids:
            raise UsageError("nothing to append: no token ids")
        size = self.model.target.vocab.size
        if min(ids) < 0 or max(ids) >= size:
            raise UsageError(f"token ids must be in [0, {size}); got {min(ids)}..{max(ids)}")
        self._end_reply()
        total = len(self.ids) + len(ids)
        if total > self.model.target.manifest.max_context:
            raise ContextLimitError(f"the sequence would be {total} tokens; {self.model.target.manifest.name} "
                                    f"takes at most {self.model.target.manifest.max_context}")
        # The target cache must hold a prefix of the sequence: a reply that ended mid-round (a stop
        # string, EOS, the token budget) may have cached accepted tokens past what it kept.
        self.target.truncate(min(self.target.n_cached, len(self.ids)))
        self.ids += ids
        self._drafter_context += drafter_text if drafter_text is not None else self._text_of(ids)
        self._start_reply()

    def append_text(self, text: str) -> None:
        """Append text, encoded by the target's tokenizer (BOS first on an empty sequence, where the
        model takes one), and start a reply."""
        text_input.check(text, "the text")
        if not text:
            raise UsageError("the prompt is empty")
        ids = self.model.target.vocab.encode_text(text)
        if not self.ids:
            ids = self.model.target.with_bos(ids)
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        self.append_tokens(ids, drafter_text=text)

    def append_chat(self, content: str, role: str = "user") -> None:
        """Append a chat turn, rendered by the chat template, and start the reply to it. Only what the
        template adds since the last reply is new; both engines prefill that alone. A turn that is
        refused (an error raised here: too long for the context, say) leaves the conversation as it
        was, so that the next turn continues it."""
        text_input.check(content, "the message")
        if not content:
            raise UsageError("the message is empty")
        self._end_reply()
        # The caches need no restoring: they hold a prefix of the sequence, and the next reply feeds
        # what they lack.
        saved = (list(self.ids), list(self._messages), dict(self._rendered), self._chat_base, self._drafter_context,
                 self.reply_start)
        try:
            self._append_turn(content, role)
        except BaseException:
            (self.ids[:], self._messages, self._rendered, self._chat_base, self._drafter_context,
             self.reply_start) = saved
            raise

    def _append_turn(self, content: str, role: str) -> None:
        self._messages.append({"role": role, "content": content})
        full = render_chat(self.model.target.manifest, self._messages)
        before = self._rendered.get("target", "")
        if not full.startswith(before):
            # The template renders the last reply otherwise than it was generated (trimmed, say):
            # that reply is fed again as the template has it; a template that rewrote an earlier
            # turn has the whole conversation fed again.
            base, text = self._chat_base if full.startswith(self._chat_base[1]) else (0, "")
            self._cut(base)
            self._drafter_context = self._text_of(self.ids)
            before = text
        drafter = self.model.drafter
        if drafter is not None and drafter.manifest.chat_template:
            d_full = render_chat(drafter.manifest, self._messages)
            self._drafter_context = d_full  # the drafter's own rendering, whole (its cache keeps the prefix)
            self._rendered["drafter"] = d_full
            d_text: str | None = ""
        else:
            d_text = None
        self._rendered["target"] = full
        new = full[len(before):]
        ids = self.model.target.vocab.encode_text(new)
        if not self.ids:
            ids = self.model.target.with_bos(ids)
        self.append_tokens(ids, drafter_text=d_text)
        self._chat_base = (len(self.ids), full)  # where the coming reply starts, as ids and as text

    def rewind_to(self, n: int) -> None:
        """Keep the first n ids of the sequence (the caches keep what they hold of them); the reply in
        progress ends, and a conversation starts anew from those ids."""
        if not 0 <= n <= len(self.ids):
            raise UsageError(f"cannot rewind to {n}: the sequence has {len(self.ids)} ids")
        self._end_reply()
        self._cut(n)
        self._drafter_context = self._text_of(self.ids)
        self._messages, self._rendered, self._chat_base = [], {}, (0, "")

    def _cut(self, n: int) -> None:
        del self.ids[n:]
        self.target.truncate(max(0, n - 1))
        self.reply_start = n

    def stop(self, reason: str = "stopped") -> Emitted:
        """End the reply in progress here (what it generated stays in the sequence); returns the text
        it still held back (a possible stop string's start, an incomplete character). reason: the
        statistics' stop_reason."""
        dec = self._decoder
        if dec is None or self._closed:
            return Emitted([], "")
        tail = dec.finish(reason)
        self._pieces.append(tail.text)
        self._end_reply()
        return tail

    # --- decoding ---------------------------------------------------------------------------------

    @property
    def is_done(self) -> bool:
        """Whether the reply has ended (True before anything was appended)."""
        return self._decoder is None or self._closed

    def generate_next_tokens(self) -> Emitted:
        """One round: the ids it committed and the text that became printable with them (at the end
        of the reply, with the text held back until then)."""
        dec = self._decoder
        if dec is None:
            raise UsageError("nothing to continue: append a prompt first")
        if self._closed:
            return Emitted([], "")
        if not self._prefilled:
            dec.prefill()
            self._prefilled = True
        emitted = dec.step()
        self._pieces.append(emitted.text)
        if dec.stream.done:
            self._end_reply()
        return emitted

    def result(self) -> GenerationResult:
        """The reply so far: its text, its ids, the statistics."""
        dec = self._decoder
        ids = dec.stream.ids if dec is not None else []
        return GenerationResult("".join(self._pieces), list(ids), self.stats, self.ids[: self.reply_start])

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    # --- internals ----------------------------------------------------------------------------------

    def _text_of(self, ids: list[int]) -> str:
        return self.model.target.vocab.ids_bytes(ids).decode("utf-8", errors="replace")

    def _start_reply(self) -> None:
        model, cfg = self.model, self.config
        self.reply_start = len(self.ids)
        algos = model.candidates(self.algorithm, self.sampling.greedy)
        state = None
        if any(a != "lookup" for a in algos):
            state = self._drafter_state(algos)
            if state is None:  # the context does not fit the drafter: it is only a helper
                algos = tuple(a for a in algos if a == "lookup")
        proposers = self._proposers(algos, state) if algos else {}
        schedule, k = self._schedule(proposers, state)
        if self.make_schedule is not None and proposers:
            schedule = self.make_schedule(proposers)
        # Size preallocated caches for the whole reply now (they never grow mid-way). The drafter's
        # tokens for the same text may outnumber the target's: twice as many is a guess that covers
        # the pairs here; beyond it the cache grows by doubling.
        self.target.reserve(len(self.ids) + cfg.max_new_tokens + k + 1)
        if state is not None:
            state.engine.reserve(len(state.ids) + 2 * (cfg.max_new_tokens + k) + 1)
        self.stats = Stats(algorithm=self.algorithm, lookahead=k if proposers else 0)
        stream = TextStream(model.target.vocab, cfg.max_new_tokens, tuple(s.encode("utf-8") for s in cfg.stop),
                            cfg.include_stop)
        self._decoder = Decoder(self.target, self.sampling, self.rng, schedule, state, self.ids, stream, self.stats)
        self._prefilled = False
        self._closed = False
        self._pieces = []

    def _end_reply(self) -> None:
        """After a reply: the drafter's context takes the reply's text, a borrowed schedule goes back."""
        dec = self._decoder
        if dec is None or self._closed:
            return
        if not dec.stream.done:  # ended by the caller (more appended, a rewind): no more rounds
            self._pieces.append(dec.finish("stopped").text)
        self._closed = True
        reply = self.ids[self.reply_start:]
        self._drafter_context += self._text_of(reply)
        if "target" in self._rendered:
            self._rendered["target"] += self._text_of(reply)
            self._messages.append({"role": "assistant", "content": self.text})
        if self._schedule_key is not None:
            inner = self._cost_schedule(dec.schedule)
            if inner is not None and self.config.seed is None:
                self.model.return_schedule(self._schedule_key, inner)
            self._schedule_key = None

    @staticmethod
    def _cost_schedule(schedule: Any) -> CostSchedule | None:
        while not isinstance(schedule, CostSchedule) and hasattr(schedule, "inner"):
            schedule = schedule.inner
        return schedule if isinstance(schedule, CostSchedule) else None

    def _drafter_state(self, algos: tuple[str, ...]) -> DrafterState | None:
        """The drafter's state for this reply: its tokens of the context (its cache keeps the prefix
        it shares with what it held), or None when the context does not fit it."""
        drafter, engine = self.model.drafter, self._drafter_engine
        assert drafter is not None and engine is not None
        d_ids = drafter.with_bos(drafter.vocab.encode_text(self._drafter_context))
        if not 0 < len(d_ids) < drafter.manifest.max_context:
            return None
        # Healing the prompt's end suits proposers that hand over text; the others map the drafter's
        # tokens one by one, and the healed first token spans the prompt's end.
        drafting = {a.removeprefix("lookup+") for a in algos}
        heal = "slem" in drafting and not {"tli", "slrs", "rdk", "standard"} & drafting
        state = DrafterState(engine, drafter.vocab, d_ids, drafter.kept, heal=heal)
        cached = engine.cached_ids
        common = 0
        limit = min(len(cached), len(state.ids) - 1)  # the last id is fed again: its logits start a draft
        while common < limit and cached[common] == state.ids[common]:
            common += 1
        engine.truncate(common)
        return state

    def _proposers(self, algos: tuple[str, ...], state: DrafterState | None) -> dict[str, Proposer]:
        """One proposer per algorithm, all drafting from one drafter state (synced after each round);
        prompt lookup reads the committed ids (which the decoder extends). A chain `lookup+X` shares
        the menu's lookup and X where the menu has them."""
        model, cfg, rng = self.model, self.sampling, self.rng
        drafter, maps, target = model.drafter, model.maps, model.target.vocab
        # Proposals cover the ids the target can emit: its logits, cut to its tokenizer (loop.Decoder).
        width = model.target.manifest.scored_ids
        made: dict[str, Proposer] = {}

        def make(algo: str) -> Proposer:
            if algo not in made:
                made[algo] = build(algo)
            return made[algo]

        def build(algo: str) -> Proposer:
            if algo.startswith("lookup+"):
                lookup = make("lookup")
                assert isinstance(lookup, LookupProposer)
                return ChainProposer(lookup, make(algo.removeprefix("lookup+")), target, width)
            if algo == "lookup":
                return LookupProposer(self.ids)
            assert drafter is not None and maps is not None and state is not None
            if algo == "standard":
                identity = np.arange(drafter.vocab.size, dtype=np.int64)
                return MappedProposer(state, identity, width, cfg, rng, target.eos_ids)
            if algo == "tli":
                return TLIProposer(state, maps.intersection, width, cfg, rng, target.eos_ids)
            if algo == "slem":
                return SLEMProposer(state, target, drafter.vocab.eos_ids)
            if algo == "rdk":
                assert model.kernel is not None
                return RDKProposer(state, model.kernel, maps.intersection, target, width, cfg, rng)
            return SLRSProposer(state, target, maps.prefix, width, cfg, rng)

        return {a: make(a) for a in algos}

    def _schedule(self, proposers: dict[str, Proposer], state: DrafterState | None) -> tuple[Schedule, int]:
        model, cfg, greedy = self.model, self.config, self.sampling.greedy
        name = cfg.schedule or ("cost" if self.algorithm == "auto" else "static")
        if not proposers:
            return StaticSchedule(None, 0), 0
        disco = model.disco if state is not None else None  # a stop rule ends drafter drafts only
        if name == "disco" and disco is None:
            raise UsageError("the disco schedule needs a calibrated pair and a drafter: run `edge-sd calibrate PAIR` "
                             "first")
        if name == "confidence" and state is None:
            raise UsageError("the confidence schedule cuts a drafter's drafts: it needs a pair folder")
        names = {id(p): a.removeprefix("lookup+") for a, p in proposers.items()}  # DISCO's features: X of lookup+X
        if name == "disco" and self.algorithm != "auto":
            assert disco is not None and state is not None
            k = cfg.lookahead if cfg.lookahead is not None else disco.k
            (proposer,) = proposers.values()
            return DiscoSchedule(StaticSchedule(proposer, k), disco, names), k
        if name in ("cost", "disco"):
            k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_MAX_LOOKAHEAD
            free = any(p.drafter is None for p in proposers.values())
            longest = cfg.lookahead if cfg.lookahead is not None else max(k, DEFAULT_MAX_LOOKUP) if free else k
            cost = self._cost_model(proposers, k, longest, greedy)
            # A draft's catching up is told apart from its drafting against a one-position step; until
            # the drafter has run one (probes only catch up), the step measured at load stands in.
            if state is not None and state.step_s is None:
                state.step_s = model.costs(k).step
            # auto: the cost model decides whether to draft, a stop rule when to stop: DISCO where the
            # pair's classifier was calibrated for this kind of decoding (greedy or sampling; asked for
            # by name, it runs either way), else in greedy decoding the confidence cut.
            if disco is not None and state is not None and (
                    name == "disco" or (cfg.schedule is None and disco.greedy == greedy)):
                return DiscoSchedule(cost, disco, names), longest
            if cfg.schedule is None and greedy and state is not None:
                return ConfidenceSchedule(cost), longest
            return cost, longest
        k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_LOOKAHEAD["greedy" if greedy else "sample"]
        if len(proposers) > 1:
            raise UsageError(f"the {name} schedule drafts with one algorithm: name it with --algorithm")
        (proposer,) = proposers.values()
        if name == "heuristic":
            return HeuristicSchedule(proposer, k, max(k, DEFAULT_MAX_LOOKAHEAD)), k
        if name == "confidence":
            return ConfidenceSchedule(StaticSchedule(proposer, k)), k
        return StaticSchedule(proposer, k), k

    def _cost_model(self, proposers: dict[str, Proposer], k: int, longest: int, greedy: bool) -> CostSchedule:
        """The cost schedule of this reply. Sampling with a seed: this generator's own, planning from
        fixed costs (Model.fixed_costs) and learning acceptance from its own rounds only, so that the
        same seed gives the same output every time (which draws are made depends on the plan). Else
        borrowed from the model, so that what earlier generations learnt (costs, acceptance) carries
        over, following live timings: greedy output is plain decoding's whatever the plan."""
        model, cfg = self.model, self.config
        if cfg.seed is not None and not greedy:
            if self._own_schedule is None:
                self._own_schedule = _new_cost_schedule(proposers, k, longest, model.fixed_costs(longest), greedy,
                                                        learn_costs=False)
            else:
                self._own_schedule.rebind(proposers)
            return self._own_schedule
        key = (self.sampling, k, longest, tuple(proposers))
        schedule = model.borrow_schedule(key)
        if schedule is None:
            schedule = _new_cost_schedule(proposers, k, longest, model.costs(longest), greedy, learn_costs=True)
        else:
            schedule.rebind(proposers)
        self._schedule_key = key
        return schedule


def _new_cost_schedule(proposers: dict[str, Proposer], k: int, longest: int, costs: Costs, greedy: bool,
                       learn_costs: bool) -> CostSchedule:
    """A cost schedule starting from the engines' costs (target forwards up to `longest` + 1
    positions), every drafting algorithm at the drafter's step cost, prompt lookup at none (at a
    drafter step a token, a lookup draft would look dearer than a plain step wherever the drafter's
    step costs more than the target's extra positions, and never run to show otherwise)."""
    free = {name for name, p in proposers.items() if p.drafter is None}
    free |= {p.lookup.name for p in proposers.values() if isinstance(p, ChainProposer)}
    drafts = {a: 0.0 if a in free else costs.step for a in estimated(proposers)}
    return CostSchedule(proposers, k, CostModel(costs.target, drafts, costs.position, learn=learn_costs), greedy=greedy,
                        lookup_max=longest)
