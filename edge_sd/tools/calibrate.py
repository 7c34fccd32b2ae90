"""`edge-sd calibrate`: run a pair on calibration prompts, record every drafted token's features and
whether it was accepted, fit DISCO's classifier and its stop threshold, and store them in the pair
folder (disco.json), where `--lookahead-schedule disco` and `auto` find them."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from edge_sd import costs as costs_module
from edge_sd.algorithms.base import DrafterState, Proposer
from edge_sd.disco import RECENT_WEIGHT, DiscoModel, best_threshold, fit_logistic, token_features
from edge_sd.errors import ContextLimitError, UsageError
from edge_sd.pipeline import GenerationConfig, Pipeline
from edge_sd.schedules import Plan, Round, StaticSchedule


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: JSON lines with a "text" (or "prompt") field, or one prompt per line."""
    if not path.is_file():
        raise UsageError(f"prompt file {path} not found")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        try:
            rows = [json.loads(ln) for ln in lines]
            return [r["text"] if "text" in r else r["prompt"] for r in rows]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: each line must be a JSON object with a \"text\" field ({e})") from None
    return lines


def calibrate(pipe: Pipeline, folder: Path, prompts: list[str], algorithms: tuple[str, ...], k: int,
              new_tokens: int, temperature: float = 0.0,
              progress: Callable[[str], None] = lambda s: None) -> dict:
    """Record traces, fit, choose the threshold, save disco.json; returns what was found."""
    if pipe.drafter is None:
        raise UsageError("calibrate needs a pair folder")
    if not prompts:
        raise UsageError("no calibration prompts")
    rounds: list[tuple[list[np.ndarray], list[int]]] = []
    draft_s: list[float] = []
    for i, prompt in enumerate(prompts):
        for algo in algorithms:
            progress(f"prompt {i + 1}/{len(prompts)} {algo}")
            recorders: list[TraceRecorder] = []

            def record(proposers: dict, algo: str = algo, into: list = recorders) -> TraceRecorder:
                into.append(TraceRecorder(proposers[algo], k, algo))
                return into[-1]

            cfg = GenerationConfig(max_new_tokens=new_tokens, temperature=temperature, seed=i, algorithm=algo,
                                   lookahead=k)
            try:
                pipe.generate(prompt, cfg, make_schedule=record)
            except ContextLimitError:  # a prompt longer than the target's context teaches nothing here
                progress(f"prompt {i + 1}/{len(prompts)} skipped: longer than the target's context")
                break
            for r in recorders:  # none when the prompt did not fit the drafter
                rounds += r.rounds
                draft_s += r.draft_s
    x = np.array([f for feats, _ in rounds for f in feats])
    y = np.array([lab for _, labels in rounds for lab in labels], dtype=np.float64)
    if len(set(y.tolist())) < 2:
        raise UsageError(f"the {len(y)} drafted tokens were all {'accepted' if y.all() else 'rejected'}: "
                         "nothing to learn from; use more or other prompts")
    w, b, mean, scale = fit_logistic(x, y)
    model = DiscoModel([float(v) for v in w], b, [float(v) for v in mean], [float(v) for v in scale],
                       threshold=0.0, k=k, trained_on=len(y), temperature=temperature)
    scored = [([model.prob(f) for f in feats], labels) for feats, labels in rounds]
    # Measured anew, not read from the folder: the costs a calibration stored on a busy machine would
    # otherwise stay. Seeded generations plan from these instead of live timings (Model.fixed_costs).
    costs = pipe.measure_costs(k)
    target_cost = costs.target
    costs_module.save(folder, costs)
    step = statistics.median(draft_s)
    model.threshold = best_threshold(scored, target_cost, step, k)
    path = model.save(folder)
    predicted = np.array([p >= 0.5 for probs, _ in scored for p in probs])
    return {
        "file": str(path), "prompts": len(prompts), "rounds": len(rounds), "drafted_tokens": len(y),
        "acceptance": float(y.mean()), "classifier_accuracy": float((predicted == (y > 0.5)).mean()),
        "threshold": model.threshold, "draft_ms_per_token": 1e3 * step,
        "target_ms": {s: 1e3 * c for s, c in target_cost.items()},
    }


class TraceRecorder(StaticSchedule):
    """`edge-sd calibrate`: drafts a fixed k and records every drafted token's features and whether it
    was accepted (disco.py says how the label is found)."""

    name = "record"

    def __init__(self, proposer: Proposer, k: int, algo: str):
        super().__init__(proposer, k)
        self.algo = algo
        assert proposer.drafter is not None, "calibration records drafter drafts"
        self.state: DrafterState = proposer.drafter
        self.recent = 0.5
        self.rounds: list[tuple[list[np.ndarray], list[int]]] = []
        self.draft_s: list[float] = []  # seconds per drafted token, per round
        self._features: list[np.ndarray] = []
        self._ends: list[int] = []
        self._start = 0

    def _record(self, logits: np.ndarray, position: int) -> bool:
        self._features.append(token_features(logits, position, self.recent, self.algo))
        last = self.state.vocab.token_bytes[self.state.ids[-1]] or b""
        self._ends.append((self._ends[-1] if self._ends else self._start) + len(last))
        return True

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        self._features, self._ends = [], []
        self._start = -len(self.state.healing)  # a healed first token begins with the prompt's end
        return replace(super().plan(budget), stop=self._record)  # records each drafted token, stops none

    def observe(self, plan: Plan, r: Round) -> None:
        if not self._features:
            return
        labels = [int(end <= r.accepted_bytes) for end in self._ends]
        self.rounds.append((self._features, labels))
        self.draft_s.append(r.draft_s / len(self._features))
        if r.proposed:
            self.recent += RECENT_WEIGHT * (r.accepted / r.proposed - self.recent)
