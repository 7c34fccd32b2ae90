"""The public Python API: load an artifact folder, generate or stream text."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from edge_sd.algorithms import (
    ALGORITHMS,
    DrafterState,
    LookupProposer,
    MappedProposer,
    SLEMProposer,
    SLRSProposer,
    TLIProposer,
)
from edge_sd.algorithms.base import Proposer
from edge_sd.algorithms.rdk import Kernel, RDKProposer
from edge_sd.disco import DiscoModel
from edge_sd.engines.ort import OrtEngine
from edge_sd.errors import ArtifactError, ContextLimitError, UsageError
from edge_sd.lookahead import (
    ConfidenceSchedule,
    CostSchedule,
    DiscoSchedule,
    HeuristicSchedule,
    Schedule,
    StaticSchedule,
)
from edge_sd.loop import Decoder, Emitted
from edge_sd.manifest import ENGINE_FILE, PAIR_FILE, EngineManifest, load_pair_manifest, sha256_file
from edge_sd.sampling import SamplingConfig
from edge_sd.stats import Stats
from edge_sd.text_stream import TextStream
from edge_sd.vocab import Vocab, VocabMaps, build_maps, same_vocabulary

# Settled by the real-pair benchmark on the default pair (int4 drafter; README, "Measured"): greedy
# SLEM ran fastest at k=2 in each of its runs on the Zen 3 CPU (1.41x against k=3's 1.30x; 1.32x
# against 1.25x), sampling at k=1 (SLRS k=1 0.97x against k=2's 0.93x over 32 held-out generations:
# a drafted token that is rejected half the time barely pays for itself).
DEFAULT_LOOKAHEAD = {"greedy": 2, "sample": 1}
# The cost-aware schedule (auto) chooses each round's draft length in 0..this (or -k).
DEFAULT_MAX_LOOKAHEAD = 6
SCHEDULES = ("static", "heuristic", "confidence", "cost", "disco")
# The cost model's calibration at load: target forwards over 1 and K+1 positions (linear in between)
# and drafter steps, after this many cached positions, median of CALIBRATION_REPEATS.
CALIBRATION_CONTEXT = 64
CALIBRATION_REPEATS = 3


class Costs(NamedTuple):
    """What the engines cost, measured at load: seconds of a target forward over s positions (s -> s),
    of a one-position drafter step, and of each position a drafter forward feeds beyond its first
    (catching up: the prompt, or the tokens committed during plain steps)."""

    target: dict[int, float]
    step: float
    position: float


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. temperature 0 is greedy; seed fixes sampling (same seed, same output)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # The text ends where the first stop string begins (the ids keep the token that completed it);
    # include_stop keeps the stop string in the text.
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    chat: bool = False
    algorithm: str = "auto"
    # static / heuristic: the (first) draft length [DEFAULT_LOOKAHEAD]; cost: the longest draft
    # [DEFAULT_MAX_LOOKAHEAD]
    lookahead: int | None = None
    # None: cost for auto (which picks the algorithm too; with DISCO on top when the pair folder holds
    # a disco.json calibrated for this kind of decoding, greedy or sampling, else in greedy decoding with
    # the confidence cut on top), static for a named algorithm
    schedule: str | None = None

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.lookahead is not None and self.lookahead < 0:
            raise UsageError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if any(not s for s in self.stop):
            raise UsageError("stop strings must not be empty")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise UsageError(f"unknown lookahead schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


class _Side:
    """One engine with its tokenizer.

    A drafter runs every forward at its natural size: its forwards need not agree with each other,
    only with what it proposes, so it skips the target's `min_step_positions` re-feeding.
    """

    def __init__(self, folder: Path, provider: str, threads: int | None, verify: bool, spin: str = "always",
                 drafter: bool = False):
        self.engine = OrtEngine(folder, provider=provider, threads=threads, verify_files=verify, spin=spin,
                                min_step_positions=1 if drafter else None)
        self.manifest: EngineManifest = self.engine.manifest
        self.vocab = Vocab.from_file(folder / self.manifest.tokenizer_file, self.manifest.eos_token_ids)
        self.kept = _kept_ids(folder, self.manifest, self.vocab.size)

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        m = self.manifest
        text = render_chat(m, prompt) if chat else prompt
        ids = self.vocab.encode_text(text)
        bos = m.bos_token_id
        if m.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids


def render_chat(m: EngineManifest, prompt: str) -> str:
    """Apply the engine's chat template (jinja2, as Hugging Face's templates are written)."""
    if not m.chat_template:
        raise UsageError(f"{m.name} has no chat template; drop --chat")
    try:
        import jinja2
    except ImportError:
        raise UsageError("--chat needs jinja2 (pip install jinja2)") from None
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise UsageError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    specials = {"bos_token": "", "eos_token": ""}
    return env.from_string(m.chat_template).render(
        messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **specials
    )


class Pipeline:
    """A target engine and, for a pair folder, a drafter engine with the vocabulary maps.

    Example:
        >>> pipe = Pipeline.from_folder("engines/gemma3-270m_smollm2-135m")
        >>> result = pipe.generate("Once upon a time", GenerationConfig(max_new_tokens=32))
        >>> print(result.text, result.stats.tokens_per_second)
    """

    def __init__(self, target: _Side, drafter: _Side | None = None, maps: VocabMaps | None = None,
                 same_vocab: bool = False, notes: list[str] | None = None):
        self.target = target
        self.drafter = drafter
        self.maps = maps
        self.same_vocab = same_vocab
        self.notes = notes or []
        self._costs: Costs | None = None  # calibrated by costs()
        self.disco: DiscoModel | None = None  # the pair folder's disco.json (edge-sd calibrate)
        self.kernel: Kernel | None = None  # RDK's kernel M (export --drafter-vocab-keep)
        # The cost schedule of each sampling mode and set of algorithms, kept between generations: its
        # cost and acceptance estimates carry over, so a generation does not start from the prior.
        self._cost_schedules: dict[tuple, CostSchedule] = {}

    @classmethod
    def from_folder(cls, path: str | Path, provider: str = "auto", threads: int | None = None,
                    verify: bool = False) -> Pipeline:
        """Load a pair folder (pair.json) or a single engine folder (engine.json)."""
        folder = Path(path)
        if not folder.is_dir():
            raise ArtifactError(f"{folder} is not a folder (expected an edge-sd export)")
        if (folder / PAIR_FILE).is_file():
            pm = load_pair_manifest(folder)
            # Target and drafter take turns: their threads spin inside a run only (engines/ort.py).
            target = _Side(folder / pm.target, provider, threads, verify, spin="run")
            drafter = _Side(folder / pm.drafter, provider, threads, verify, spin="run", drafter=True)
            maps, notes = _load_maps(folder, pm, target, drafter)
            pipe = cls(target, drafter, maps, same_vocabulary(target.vocab, drafter.vocab), notes)
            pipe.disco = DiscoModel.load(folder)
            pipe.kernel = Kernel.load(folder / pm.rdk_file) if pm.rdk_file else None
            return pipe
        if (folder / ENGINE_FILE).is_file():
            return cls(_Side(folder, provider, threads, verify))
        raise ArtifactError(f"{folder} has neither {PAIR_FILE} nor {ENGINE_FILE}: not an edge-sd export")

    def resolve_algorithm(self, cfg: GenerationConfig) -> str:
        """The algorithm a configuration runs (auto on a single engine: plain steps and prompt lookup)."""
        algo = cfg.algorithm
        if algo in ("auto", "ar", "lookup"):
            return algo
        if self.drafter is None:
            raise UsageError(f"--algorithm {algo} needs a pair folder; this folder has a single engine")
        if algo == "rdk" and self.kernel is None:
            raise UsageError("--algorithm rdk needs the pair's RDK kernel: export the pair with --drafter-vocab-keep")
        if algo == "standard" and not self.same_vocab:
            raise UsageError(
                "--algorithm standard needs one vocabulary for target and drafter; these differ "
                "(use slem, tli or slrs)"
            )
        return algo

    def candidates(self, algo: str, greedy: bool = False) -> tuple[str, ...]:
        """The algorithms a resolved algorithm drafts with. auto: `standard` for a shared vocabulary;
        across vocabularies SLEM alone in greedy decoding, TLI and SLRS (and RDK on a pair with a
        kernel) when sampling.

        Greedy, every rule accepts a candidate exactly when it is the target's argmax, and SLEM's
        candidates are the target's own tokenization of the drafter's greedy text, which TLI (drafting
        from the shared tokens only) and SLRS (proposing prefixes of the drafter's tokens) approximate.
        Sampling, SLEM's candidate is accepted only when the target samples the drafter's greedy text
        exactly, TLI's and SLRS's with min(1, p/q). Measured on both pairs here, SLEM was accepted more
        than the other two at every k greedy and less at every k sampling (T=1); side by side, auto
        weighing all three ran at 1.21x plain decoding greedy (mean of 32 generations; median 1.20x)
        against 1.29x (1.25x) with SLEM alone, and sampling at medians of 0.98x and 1.01x (two passes of
        16 generations) against 1.02x and 1.05x without SLEM: exploring the weaker ones costs and never
        finds them better."""
        if algo == "ar":
            return ()
        if algo != "auto":
            return (algo,)
        # Prompt lookup costs no forward: it is on every menu, taken where the text repeats itself.
        if self.drafter is None:
            return ("lookup",)
        if self.same_vocab:
            return ("standard", "lookup")
        if greedy:
            return ("slem", "lookup")
        return ("tli", "slrs", "rdk", "lookup") if self.kernel is not None else ("tli", "slrs", "lookup")

    def _proposers(self, algos: tuple[str, ...], cfg: SamplingConfig, rng: np.random.Generator,
                   state: DrafterState | None, history: list[int]) -> dict[str, Proposer]:
        """One proposer per algorithm, all drafting from one drafter state (synced after each round);
        prompt lookup reads the committed ids (`history`, which the decoder extends)."""
        drafter, maps, target = self.drafter, self.maps, self.target.vocab
        # Proposals cover the ids the target can emit: its logits, cut to its tokenizer (loop.Decoder).
        width = min(self.target.manifest.logits_width, self.target.manifest.vocab_size)

        def make(algo: str) -> Proposer:
            if algo == "lookup":
                return LookupProposer(history)
            assert drafter is not None and maps is not None and state is not None
            if algo == "standard":
                identity = np.arange(drafter.vocab.size, dtype=np.int64)
                return MappedProposer(state, identity, width, cfg, rng, target.eos_ids)
            if algo == "tli":
                return TLIProposer(state, maps.intersection, width, cfg, rng, target.eos_ids)
            if algo == "slem":
                return SLEMProposer(state, target, drafter.vocab.eos_ids)
            if algo == "rdk":
                assert self.kernel is not None
                return RDKProposer(state, self.kernel, maps.intersection, target, width, cfg, rng)
            return SLRSProposer(state, target, maps.prefix, width, cfg, rng)

        return {a: make(a) for a in algos}

    def costs(self, k_max: int) -> Costs:
        """Target forwards over s = 1..k_max+1 positions, a drafter step and a drafter position caught
        up, measured on the loaded engines (kept for later generations; the cost schedule then follows
        them online)."""
        if self._costs is None:
            t = self.target.engine
            span = min(k_max + 1, t.manifest.max_context - CALIBRATION_CONTEXT)
            t_ids = np.arange(CALIBRATION_CONTEXT + span) % min(t.manifest.vocab_size, 1000) + 3
            # Each size runs once untimed first: a GPU's first forward of a new shape pays one-off costs
            # (Gemma-3-270M int4 on CUDA: ~30 ms against 3), and a size first met mid-generation would
            # teach the cost model that drafting costs ten times what it does.
            _median_forward(t, t_ids, CALIBRATION_CONTEXT, range(2, span), repeats=0)
            one, many = _median_forward(t, t_ids, CALIBRATION_CONTEXT, 1), _median_forward(t, t_ids,
                                                                                          CALIBRATION_CONTEXT, span)
            step = fill = 0.0  # no drafter (prompt lookup alone): no drafter forwards to pay
            if self.drafter is not None:
                d = self.drafter.engine
                d_ids = np.arange(CALIBRATION_CONTEXT + 1) % min(d.manifest.vocab_size, 1000) + 3
                step = _median_forward(d, d_ids, CALIBRATION_CONTEXT, 1)
                # A prompt's worth of positions at once (once untimed, once timed): from it alone auto
                # judges whether a generation's first draft gains back the drafter's prompt, until one has.
                fill = _median_forward(d, d_ids, 1, CALIBRATION_CONTEXT - 1, repeats=1)
            self._costs = Costs({s: one + (many - one) * (s - 1) / max(1, span - 1) for s in range(1, span + 1)},
                                step, max(0.0, fill - step) / (CALIBRATION_CONTEXT - 2))
        target = self._costs.target
        last = max(target)
        slope = (target[last] - target[1]) / max(1, last - 1)
        return self._costs._replace(target={s: target.get(s, target[1] + slope * (s - 1)) for s in range(1, k_max + 2)})

    def _schedule(self, algo: str, cfg: GenerationConfig, proposers: dict[str, Proposer], state: DrafterState | None,
                  greedy: bool) -> tuple[Schedule, int]:
        name = cfg.schedule or ("cost" if algo == "auto" else "static")
        if not proposers:
            return StaticSchedule(None, 0), 0
        disco = self.disco if state is not None else None  # a stopper ends drafter drafts only
        if name == "disco" and disco is None:
            raise UsageError("the disco schedule needs a calibrated pair and a drafter: run `edge-sd calibrate PAIR` "
                             "first")
        if name == "confidence" and state is None:
            raise UsageError("the confidence schedule cuts a drafter's drafts: it needs a pair folder")
        names = {id(p): a for a, p in proposers.items()}
        if name == "disco" and algo != "auto":
            assert disco is not None and state is not None
            k = cfg.lookahead if cfg.lookahead is not None else disco.k
            (proposer,) = proposers.values()
            return DiscoSchedule(StaticSchedule(proposer, k), disco, state, names), k
        if name in ("cost", "disco"):
            k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_MAX_LOOKAHEAD
            key = (greedy, cfg.top_k, cfg.top_p, cfg.temperature, k, tuple(proposers))
            if key in self._cost_schedules:
                self._cost_schedules[key].rebind(proposers)
            else:
                costs = self.costs(k)
                self._cost_schedules[key] = CostSchedule(proposers, k, costs.target, {a: costs.step for a in proposers},
                                                         greedy=greedy, catch_up=costs.position)
            # A draft's catching up is told apart from its drafting against a one-position step; until
            # the drafter has run one (probes only catch up), the step measured at load stands in.
            if state is not None and state.step_s is None:
                state.step_s = self.costs(k).step
            cost = self._cost_schedules[key]
            # auto: the cost model decides whether to draft, a stopper when to stop: DISCO where the
            # pair's classifier was calibrated for this kind of decoding (greedy or sampling; asked for
            # by name, it runs either way), else in greedy decoding the confidence cut.
            if disco is not None and state is not None and (
                    name == "disco" or (cfg.schedule is None and disco.greedy == greedy)):
                return DiscoSchedule(cost, disco, state, names), k
            if cfg.schedule is None and greedy and state is not None:
                return ConfidenceSchedule(cost, state), k
            return cost, k
        k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_LOOKAHEAD["greedy" if greedy else "sample"]
        if len(proposers) > 1:
            raise UsageError(f"the {name} schedule drafts with one algorithm: name it with --algorithm")
        (proposer,) = proposers.values()
        if name == "heuristic":
            return HeuristicSchedule(proposer, k, max(k, DEFAULT_MAX_LOOKAHEAD)), k
        if name == "confidence":
            assert state is not None
            return ConfidenceSchedule(StaticSchedule(proposer, k), state), k
        return StaticSchedule(proposer, k), k

    def stream_events(self, prompt: str, config: GenerationConfig | None = None,
                      make_schedule: Callable[[dict[str, Proposer]], Schedule] | None = None,
                      ) -> Generator[Emitted, None, GenerationResult]:
        """Yield one `Emitted` per round, then return the GenerationResult (generator return value).

        make_schedule: build the lookahead schedule from the proposers (calibration records traces
        this way); by default the configuration's schedule."""
        cfg = config or GenerationConfig()
        cfg.check()
        if not prompt:
            raise UsageError("the prompt is empty")
        algo = self.resolve_algorithm(cfg)
        ids = self.target.prompt_ids(prompt, cfg.chat)
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        max_ctx = self.target.manifest.max_context
        if len(ids) > max_ctx:
            raise ContextLimitError(
                f"the prompt is {len(ids)} tokens; {self.target.manifest.name} takes at most {max_ctx}"
            )
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
        rng = np.random.default_rng(cfg.seed)
        history = list(ids)  # the committed ids: the decoder extends it, prompt lookup reads it
        algos = self.candidates(algo, sampling.greedy)
        state, d_ids = None, []
        if any(a != "lookup" for a in algos):
            assert self.drafter is not None
            d_ids = self.drafter.prompt_ids(prompt, cfg.chat and bool(self.drafter.manifest.chat_template))
            # A prompt that does not fit the drafter is decoded without it: the drafter is only a helper.
            if 0 < len(d_ids) < self.drafter.manifest.max_context:
                # Healing the prompt's end suits proposers that hand over text; the others map the
                # drafter's tokens one by one, and the healed first token spans the prompt's end.
                state = DrafterState(self.drafter.engine, self.drafter.vocab, d_ids, self.drafter.kept,
                                     heal="slem" in algos and not {"tli", "slrs", "rdk", "standard"} & set(algos))
            else:
                algos = tuple(a for a in algos if a == "lookup")
        proposers = self._proposers(algos, sampling, rng, state, history) if algos else {}
        schedule, k = self._schedule(algo, cfg, proposers, state, sampling.greedy)
        if make_schedule is not None and proposers:
            schedule = make_schedule(proposers)
        if state is not None:
            state.engine.reset()
        # Size preallocated caches for the whole generation now (they never grow mid-way). The
        # drafter's tokens for the same text may outnumber the target's: twice as many is a guess that
        # covers the pairs here; beyond it the cache grows by doubling.
        self.target.engine.reserve(len(ids) + cfg.max_new_tokens + k + 1)
        if state is not None:
            state.engine.reserve(len(d_ids) + 2 * (cfg.max_new_tokens + k) + 1)
        stats = Stats(algorithm=algo, lookahead=k if proposers else 0)
        decoder = Decoder(self.target.engine, sampling, rng, schedule, state)
        stream = TextStream(self.target.vocab, cfg.max_new_tokens, tuple(s.encode("utf-8") for s in cfg.stop),
                            cfg.include_stop)
        pieces = []
        for event in decoder.run(history, stream, stats):
            pieces.append(event.text)
            yield event
        return GenerationResult("".join(pieces), stream.ids, stats, ids)

    def stream(self, prompt: str, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as they become printable (never half a UTF-8 character)."""
        for event in self.stream_events(prompt, config):
            if event.text:
                yield event.text

    def generate(self, prompt: str, config: GenerationConfig | None = None,
                 make_schedule: Callable[[dict[str, Proposer]], Schedule] | None = None) -> GenerationResult:
        gen = self.stream_events(prompt, config, make_schedule)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value


def _load_maps(folder: Path, pm: Any, target: _Side, drafter: _Side) -> tuple[VocabMaps, list[str]]:
    """Load the pair's vocabulary maps, rebuilding them (and saying so) when missing or stale."""
    notes: list[str] = []
    t_sha = sha256_file(folder / pm.target / target.manifest.tokenizer_file)
    d_sha = sha256_file(folder / pm.drafter / drafter.manifest.tokenizer_file)
    path = folder / pm.maps_file if pm.maps_file else None
    fresh = t_sha == pm.target_tokenizer_sha256 and d_sha == pm.drafter_tokenizer_sha256
    if path is not None and path.is_file() and fresh:
        try:
            return VocabMaps.load(path), notes
        except Exception as e:  # a damaged maps file is rebuilt, not fatal
            notes.append(f"vocabulary maps in {path} unreadable ({e}); rebuilt them")
    else:
        why = "missing" if path is None or not path.is_file() else "stale (tokenizers changed)"
        notes.append(f"vocabulary maps {why}; rebuilt them in memory")
    return build_maps(drafter.vocab, target.vocab), notes


def _kept_ids(folder: Path, m: EngineManifest, size: int) -> np.ndarray | None:
    """A pruned LM head's drafter ids (manifest `kept_ids_file`), checked against the logits width."""
    if not m.kept_ids_file:
        return None
    try:
        kept = np.load(folder / m.kept_ids_file).astype(np.int64)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{folder / m.kept_ids_file}: unreadable ({e})") from None
    if kept.ndim != 1 or len(kept) != m.logits_width or (kept < 0).any() or (kept >= size).any():
        raise ArtifactError(f"{folder / m.kept_ids_file}: expected {m.logits_width} drafter ids below {size}")
    return kept


def _median_forward(engine: OrtEngine, ids: np.ndarray, context: int, sizes: int | range,
                    repeats: int = CALIBRATION_REPEATS) -> float:
    """Median seconds of a forward over s positions after `context` cached ones (sizes: one s, or
    several, each run `repeats` times), after one untimed forward of each."""
    sizes = range(sizes, sizes + 1) if isinstance(sizes, int) else sizes
    engine.reset()
    engine.reserve(context + max(sizes, default=1))
    engine.forward(ids[:context])
    times = []
    for s in sizes:
        for i in range(repeats + 1):
            engine.truncate(context)
            start = time.perf_counter()
            engine.forward(ids[context : context + s])
            if i:
                times.append(time.perf_counter() - start)
    engine.reset()
    return float(np.median(times)) if times else 0.0
