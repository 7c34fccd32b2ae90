"""Loading an artifact folder: the Model every request of an app shares.

A Model holds what does not change while it serves requests: both engines' ONNX Runtime sessions,
tokenizers, vocabulary maps, RDK's kernel, DISCO's classifier and the engines' measured costs. It is
loaded once and safe to share between threads; each request runs on a Generator of its own
(generator.py), which owns what a request changes (KV caches, drafter state, schedule, random
generator, statistics).
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edge_sd import costs as costs_module
from edge_sd.algorithms.rdk import Kernel
from edge_sd.chat import render_chat
from edge_sd.config import GenerationConfig
from edge_sd.costs import Costs
from edge_sd.disco import DiscoModel
from edge_sd.engines.engine import OrtEngine
from edge_sd.engines.session import OrtSession
from edge_sd.errors import ArtifactError, UsageError
from edge_sd.layout import CACHE_DIR
from edge_sd.manifest import (
    EngineManifest,
    export_kind,
    load_engine_manifest,
    load_pair_manifest,
    sha256_file,
)
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import VocabMaps, build_maps, same_vocabulary

# Seconds a session being built gets to reach ONNX Runtime (which lets go of Python's lock) before a
# tokenizer is read (which holds it): the few milliseconds of Python before it, with room to spare.
SESSION_HEAD_START = 0.05


_M = TypeVar("_M", bound="Model")  # load() of a subclass (Pipeline) returns that subclass
_READING = threading.Lock()  # LoadedEngine: tokenizer reads, one at a time

def _session(folder: Path, provider: str, threads: int | None, verify: bool, spin: str, drafter: bool,
             defer: bool = False) -> OrtSession:
    return OrtSession(folder, provider=provider, threads=threads, verify_files=verify, spin=spin,
                      min_step_positions=1 if drafter else None, defer=defer)


def _head_in_parts(folder: Path) -> bool:
    """Whether an engine's LM head is computed in parts (its build then holds one part's copy)."""
    q = load_engine_manifest(folder).quantization or {}
    return int(q.get("lm_head_parts", 1)) > 1


class LoadedEngine:
    """An engine folder, loaded: its manifest, ONNX Runtime session and tokenizer (Vocab).

    A drafter runs every forward at its natural size: its forwards need not agree with each other,
    only with what it proposes, so it skips the target's `min_step_positions` re-feeding.
    """

    def __init__(self, folder: Path, provider: str, threads: int | None, verify: bool, spin: str = "always",
                 drafter: bool = False, session: OrtSession | None = None, defer: bool = False):
        """session: built already (a pair's target with a whole LM head, built alone: Model.load);
        else built here, in a thread while the tokenizer is read, or with `defer` (a drafter's) when
        its first forward needs it."""
        from concurrent.futures import ThreadPoolExecutor

        m = load_engine_manifest(folder)
        read = functools.partial(Vocab.from_file, folder / m.tokenizer_file, m.eos_token_ids, cache=folder / CACHE_DIR)

        def vocab() -> Vocab:
            # One tokenizer read at a time: they hold Python's lock for most of it anyway, and
            # CPython 3.11's parser, which np.load's header goes through, is not safe to run in two
            # threads at once ("AST constructor recursion depth mismatch").
            with _READING:
                return read()
        if session is not None or defer:
            self.session = session or _session(folder, provider, threads, verify, spin, drafter, defer=True)
            self.vocab = vocab()
        else:
            # ONNX Runtime builds the session outside Python's lock, but `tokenizers` holds the lock
            # while it reads a tokenizer.json (a second for a 262k vocabulary): the session is started
            # first, in a thread, and given a head start into ONNX Runtime before the tokenizer is read.
            started = threading.Event()

            def build() -> OrtSession:
                started.set()
                return _session(folder, provider, threads, verify, spin, drafter)

            with ThreadPoolExecutor(1) as pool:
                building = pool.submit(build)
                started.wait()
                time.sleep(SESSION_HEAD_START)
                self.vocab = vocab()
                self.session = building.result()
        self.manifest: EngineManifest = self.session.manifest
        self.kept = _kept_ids(folder, self.manifest, self.vocab.size)
        self._engine: OrtEngine | None = None

    @property
    def engine(self) -> OrtEngine:
        """An engine of this side's own, for direct use (checks, benchmarks); generators make theirs."""
        if self._engine is None:
            self._engine = self.session.engine()
        return self._engine

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """The ids of a prompt (rendered as one user turn with `chat`), BOS first where the model takes one."""
        text = render_chat(self.manifest, [{"role": "user", "content": prompt}]) if chat else prompt
        return self.with_bos(self.vocab.encode_text(text))

    def with_bos(self, ids: list[int]) -> list[int]:
        m = self.manifest
        if m.add_bos and m.bos_token_id is not None and (not ids or ids[0] != m.bos_token_id):
            return [m.bos_token_id] + ids
        return ids


class Model:
    """A target engine and, for a pair folder, a drafter engine with the vocabulary maps.

    Example:
        >>> model = Model.load("engines/gemma3-270m_smollm2-135m")
        >>> gen = model.generator(GenerationConfig(max_new_tokens=32))
        >>> gen.append_text("Once upon a time")
        >>> while not gen.is_done:
        ...     print(gen.generate_next_tokens().text, end="")
    """

    def __init__(self, target: LoadedEngine, drafter: LoadedEngine | None = None, maps: VocabMaps | None = None,
                 same_vocab: bool = False, notes: list[str] | None = None, folder: Path | None = None):
        self.target = target
        self.drafter = drafter
        self.maps = maps
        self.same_vocab = same_vocab
        self._notes = notes or []
        self.folder = folder
        self.disco: DiscoModel | None = None  # the pair folder's disco.json (edge-sd calibrate)
        self.kernel: Kernel | None = None  # RDK's kernel M (export --drafter-vocab-keep)
        self._costs: Costs | None = None  # measured by costs()
        self._lock = threading.Lock()
        # Cost schedules of earlier unseeded generations, by sampling mode and algorithms: a new
        # generation borrows one, so that it starts from what earlier texts taught (generator.py).
        self._schedules: dict[tuple, list[Any]] = {}

    @property
    def notes(self) -> list[str]:
        """What a user should hear of the load: files found unreadable or damaged and made again."""
        sides = [s for s in (self.target, self.drafter) if s is not None]
        return self._notes + [n for s in sides for n in s.session.notes]

    @classmethod
    def load(cls: type[_M], path: str | Path, provider: str = "auto", threads: int | None = None,
             verify: bool = False, defer_drafter: bool = True) -> _M:
        """Load a pair folder (pair.json) or a single engine folder (engine.json).

        defer_drafter: a pair's drafter session (its weights repacked by ONNX Runtime, the drafter's
        share of start-up time and memory) is built when a generation first drafts with it: `auto`
        may never, where prompt lookup and plain steps pay better. False builds it now, so that a
        damaged drafter fails the load rather than a generation.
        """
        folder = Path(path)
        if export_kind(folder) == "pair":
            pm = load_pair_manifest(folder)
            # Target and drafter take turns: their threads spin inside a run only (engines/session.py).
            # ONNX Runtime repacks each quantized weight while it builds a session, holding a copy
            # beside the weight for a moment: a whole LM head's copy is the load's peak of memory. A
            # target whose head is in parts (export/logits.py) holds one part's, and its session is
            # built while its tokenizer is read, as a single engine's is (LoadedEngine). Another target's is
            # built first and alone. The drafter's session, unless deferred, is built outside
            # Python's lock while the tokenizers are read (which hold it, one after the other).
            from concurrent.futures import ThreadPoolExecutor

            if _head_in_parts(folder / pm.target):
                target = LoadedEngine(folder / pm.target, provider, threads, verify, spin="run")
                drafter = LoadedEngine(folder / pm.drafter, provider, threads, verify, spin="run", drafter=True,
                               defer=defer_drafter)
                return cls._pair(folder, pm, target, drafter)
            session = _session(folder / pm.target, provider, threads, verify, "run", drafter=False)
            with ThreadPoolExecutor(1) as pool:
                loading = pool.submit(LoadedEngine, folder / pm.drafter, provider, threads, verify, spin="run",
                                      drafter=True, defer=defer_drafter)
                target = LoadedEngine(folder / pm.target, provider, threads, verify, spin="run", session=session)
                drafter = loading.result()
            return cls._pair(folder, pm, target, drafter)
        return cls(LoadedEngine(folder, provider, threads, verify), folder=folder)

    @classmethod
    def _pair(cls: type[_M], folder: Path, pm: Any, target: LoadedEngine, drafter: LoadedEngine) -> _M:
        maps, notes = _load_maps(folder, pm, target, drafter)
        model = cls(target, drafter, maps, same_vocabulary(target.vocab, drafter.vocab), notes, folder)
        model.disco = DiscoModel.load(folder)
        model.kernel = Kernel.load(folder / pm.rdk_file) if pm.rdk_file else None
        return model

    # Kept under its earlier name: Pipeline.from_folder.
    from_folder = load

    def generator(self, config: GenerationConfig | None = None) -> Any:
        """A new request on this model (generator.Generator)."""
        from edge_sd.generator import Generator

        return Generator(self, config)

    def resolve_algorithm(self, cfg: GenerationConfig) -> str:
        """The algorithm a configuration runs (auto on a single engine: plain steps and prompt lookup)."""
        algo = cfg.check().algorithm
        if algo in ("auto", "plain", "lookup"):
            return algo
        drafting = algo.removeprefix("lookup+")  # lookup+X drafts with X after the lookup's candidates
        if self.drafter is None:
            raise UsageError(f"--algorithm {algo} needs a pair folder; this folder has a single engine")
        if drafting == "rdk" and self.kernel is None:
            raise UsageError("--algorithm rdk needs the pair's RDK kernel: export the pair with --drafter-vocab-keep")
        if drafting == "standard" and not self.same_vocab:
            raise UsageError(
                "--algorithm standard needs one vocabulary for target and drafter; these differ "
                "(use slem, tli or slrs)"
            )
        return algo

    def candidates(self, algo: str, greedy: bool = False) -> tuple[str, ...]:
        """The algorithms a resolved algorithm drafts with. auto: `standard` for a shared vocabulary;
        across vocabularies SLEM alone in greedy decoding, TLI and SLRS (and RDK on a pair with a
        kernel) when sampling; prompt lookup on every menu, and each drafting algorithm chained after
        it (`lookup+X`: the lookup's continuation, extended by X's draft).

        Greedy, every rule accepts a candidate exactly when it is the target's argmax, and SLEM's
        candidates are the target's own tokenization of the drafter's greedy text, which TLI (drafting
        from the shared tokens only) and SLRS (proposing prefixes of the drafter's tokens) approximate.
        Sampling, SLEM's candidate is accepted only when the target samples the drafter's greedy text
        exactly, TLI's and SLRS's with min(1, p/q). So SLEM is accepted more than the other two greedy
        and less sampling, and auto weighing all three ran slower in both modes than with the menu cut
        this way: exploring the weaker ones costs and never finds them better."""
        if algo == "plain":
            return ()
        if algo != "auto":
            return (algo,)
        # Prompt lookup costs no forward: it is on every menu, taken where the text repeats itself.
        if self.drafter is None:
            return ("lookup",)
        if self.same_vocab:
            drafting: tuple[str, ...] = ("standard",)
        elif greedy:
            drafting = ("slem",)
        else:
            drafting = ("tli", "slrs", "rdk") if self.kernel is not None else ("tli", "slrs")
        return (*drafting, "lookup", *(f"lookup+{a}" for a in drafting))

    def costs(self, k_max: int) -> Costs:
        """Target forwards over s = 1..k_max+1 positions, a drafter step and a drafter position caught
        up: the folder's costs.json (measured at export on these engines) where there is one, else
        measured now on engines of their own, which takes seconds; the cost schedule then follows
        live timings from there."""
        with self._lock:
            if self._costs is None:
                self._costs = self._stored_costs() or self._measure(k_max)
        return self._costs.extended(k_max)

    def measure_costs(self, k_max: int) -> Costs:
        """Target forwards over s = 1..k_max+1 positions and the drafter's costs, measured now (what
        `edge-sd calibrate` stores), and used by this model's later generations."""
        costs = self._measure(k_max)
        with self._lock:
            self._costs = costs
        return costs

    def _stored_costs(self) -> Costs | None:
        stored, why = costs_module.load(self.folder)
        if why:
            self._notes.append(why)
        return stored

    def fixed_costs(self, k_max: int) -> Costs:
        """Costs that do not depend on this run's timings, for seeded generations: those `edge-sd
        calibrate` measured and stored in the pair folder, else ones derived from the engines' sizes."""
        stored = self._stored_costs()
        if stored is not None:
            return stored.extended(k_max)
        size = lambda side: sum(f.bytes for f in side.manifest.files)  # noqa: E731
        return costs_module.by_size(size(self.target), None if self.drafter is None else size(self.drafter), k_max)

    def _measure(self, k_max: int) -> Costs:
        drafter = self.drafter.session.engine() if self.drafter is not None else None
        return costs_module.measure(self.target.session.engine(), drafter, k_max)

    def borrow_schedule(self, key: tuple) -> Any | None:
        """A cost schedule an earlier generation left for this key (None: none free)."""
        with self._lock:
            free = self._schedules.get(key)
            return free.pop() if free else None

    def return_schedule(self, key: tuple, schedule: Any) -> None:
        with self._lock:
            self._schedules.setdefault(key, []).append(schedule)


def _load_maps(folder: Path, pm: Any, target: LoadedEngine, drafter: LoadedEngine) -> tuple[VocabMaps, list[str]]:
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
