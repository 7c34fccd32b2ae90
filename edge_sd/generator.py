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

A request is in one of four states: EMPTY (nothing appended yet), READY (a reply started, its new
ids not yet prefilled), RUNNING (rounds under way) and ENDED (the reply ended; appending more starts
the next).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_sd import text_input
from edge_sd.algorithms import menu
from edge_sd.algorithms.base import Proposer
from edge_sd.algorithms.chain import ChainProposer
from edge_sd.algorithms.lookup import LookupProposer
from edge_sd.chat import Conversation
from edge_sd.config import GenerationConfig, GenerationResult
from edge_sd.decoder import Decoder, Emitted
from edge_sd.errors import ContextLimitError, UsageError
from edge_sd.schedules import Schedule
from edge_sd.schedules.choose import choose, cost_schedule_of
from edge_sd.schedules.cost import CostSchedule
from edge_sd.stats import Stats
from edge_sd.text_stream import TextStream

if TYPE_CHECKING:
    from edge_sd.model import Model

EMPTY, READY, RUNNING, ENDED = "empty", "ready", "running", "ended"


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
        self.state = EMPTY
        self.ids: list[int] = []  # the whole sequence: prompts, replies, later turns
        self.reply_start = 0  # where the current reply begins in `ids`
        self._drafter_context = ""  # the text the drafter's context is made of, before the current reply
        self._chat = Conversation()
        self._decoder: Decoder | None = None
        self._pieces: list[str] = []
        self._borrowed: tuple | None = None  # the key of a cost schedule borrowed from the model
        self._own_schedule: CostSchedule | None = None  # seeded: kept by this generator, never shared
        self.stats = Stats(algorithm=self.algorithm)
        # Prompt positions one generate_next_tokens prefills at most before its round (None: all): a
        # server that interleaves requests sets it, so that a long prompt does not hold up the
        # others' rounds (a call then returns no ids until the prompt is cached).
        self.prefill_slice: int | None = None

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
        self.append_messages([{"role": role, "content": content}])

    def append_messages(self, messages: Sequence[dict[str, str]]) -> None:
        """Append chat turns at once (a whole conversation, as an OpenAI-style message list: each a
        "role" and its "content"), rendered by the chat template, and start the reply to the last."""
        if not messages:
            raise UsageError("no messages")
        for i, m in enumerate(messages):
            where = "the message" if len(messages) == 1 else f"message {i}"
            text_input.check(m["content"], where)
            if not m["content"]:
                raise UsageError(f"{where} is empty")
        self._end_reply()
        # The caches need no restoring: they hold a prefix of the sequence, and the next reply feeds
        # what they lack.
        saved = (list(self.ids), self._chat.copy(), self._drafter_context, self.reply_start, self.state)
        try:
            self._append_turns(list(messages))
        except BaseException:
            self.ids[:], self._chat, self._drafter_context, self.reply_start, self.state = saved
            raise

    def _append_turns(self, messages: list[dict[str, str]]) -> None:
        drafter = self.model.drafter
        turn = self._chat.add(messages, self.model.target.manifest, drafter.manifest if drafter is not None else None)
        if turn.refeed_from is not None:
            self._cut(turn.refeed_from)
            self._drafter_context = self._text_of(self.ids)
        d_text: str | None = None
        if turn.drafter_text is not None:
            self._drafter_context = turn.drafter_text  # the drafter's own rendering, whole (its cache keeps the prefix)
            d_text = ""
        ids = self.model.target.vocab.encode_text(turn.new)
        if not self.ids:
            ids = self.model.target.with_bos(ids)
        self.append_tokens(ids, drafter_text=d_text)
        self._chat.base = (len(self.ids), turn.rendered)  # where the coming reply starts, as ids and as text

    def rewind_to(self, n: int) -> None:
        """Keep the first n ids of the sequence (the caches keep what they hold of them); the reply in
        progress ends, and a conversation starts anew from those ids."""
        if not 0 <= n <= len(self.ids):
            raise UsageError(f"cannot rewind to {n}: the sequence has {len(self.ids)} ids")
        self._end_reply()
        self._cut(n)
        self._drafter_context = self._text_of(self.ids)
        self._chat = Conversation()

    def _cut(self, n: int) -> None:
        del self.ids[n:]
        # The cache may keep all n: appending (what comes next) cuts it to a prefix of the sequence
        # that leaves at least the last id to feed.
        self.target.truncate(min(self.target.n_cached, n))
        self.reply_start = n

    def stop(self, reason: str = "stopped") -> Emitted:
        """End the reply in progress here (what it generated stays in the sequence); returns the text
        it still held back (a possible stop string's start, an incomplete character). reason: the
        statistics' stop_reason."""
        if self.state not in (READY, RUNNING):
            return Emitted([], "")
        assert self._decoder is not None
        tail = self._decoder.finish(reason)
        self._pieces.append(tail.text)
        self._end_reply()
        return tail

    # --- decoding ---------------------------------------------------------------------------------

    @property
    def is_done(self) -> bool:
        """Whether the reply has ended (True before anything was appended)."""
        return self.state in (EMPTY, ENDED)

    def generate_next_tokens(self) -> Emitted:
        """One round: the ids it committed and the text that became printable with them (at the end
        of the reply, with the text held back until then); nothing while a prompt is still being
        prefilled a slice at a time (prefill_slice)."""
        if self.state == EMPTY:
            raise UsageError("nothing to continue: append a prompt first")
        if self.state == ENDED:
            return Emitted([], "")
        dec = self._decoder
        assert dec is not None
        if self.state == READY:
            if not dec.prefill(self.prefill_slice):
                return Emitted([], "")
            self.state = RUNNING
        emitted = dec.step()
        self.ids += emitted.ids
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

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat turns so far (`append_chat`'s, and the replies to them)."""
        return self._chat.messages

    # --- internals ----------------------------------------------------------------------------------

    def _text_of(self, ids: list[int]) -> str:
        return self.model.target.vocab.ids_bytes(ids).decode("utf-8", errors="replace")

    def _start_reply(self) -> None:
        model, cfg = self.model, self.config
        self.reply_start = len(self.ids)
        algos = model.candidates(self.algorithm, self.sampling.greedy)
        state = None
        if any(a != "lookup" for a in algos):
            assert self._drafter_engine is not None
            state = menu.drafter_state(model, self._drafter_engine, self._drafter_context, algos)
            if state is None:  # the context does not fit the drafter: it is only a helper
                algos = tuple(a for a in algos if a == "lookup")
        proposers = menu.proposers(model, algos, state, self.sampling, self.rng, self.ids) if algos else {}
        choice = choose(model, cfg, self.algorithm, proposers, state, self._own_schedule)
        self._own_schedule, self._borrowed = choice.own, choice.key
        schedule, k = choice.schedule, choice.k
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
        # Prompt lookup reads the committed ids: the menu's lookup, and the one a chain drafts with.
        lookups = [p.lookup if isinstance(p, ChainProposer) else p for p in proposers.values()]
        readers = list({id(p): p for p in lookups if isinstance(p, LookupProposer)}.values())
        self._decoder = Decoder(self.target, self.sampling, self.rng, schedule, state, self.ids, stream, self.stats,
                                readers)
        self.state = READY
        self._pieces = []

    def _end_reply(self) -> None:
        """After a reply: the drafter's context takes the reply's text, a borrowed schedule goes back."""
        dec = self._decoder
        if self.state not in (READY, RUNNING) or dec is None:
            return
        if not dec.stream.done:  # ended by the caller (more appended, a rewind): no more rounds
            self._pieces.append(dec.finish("stopped").text)
        self.state = ENDED
        reply = self._text_of(self.ids[self.reply_start:])
        self._drafter_context += reply
        if self._chat.started:
            self._chat.replied(self.text, reply)
        if self._borrowed is not None:
            inner = cost_schedule_of(dec.schedule)
            if inner is not None and self.config.seed is None:
                self.model.return_schedule(self._borrowed, inner)
            self._borrowed = None
