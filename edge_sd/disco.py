"""DISCO (Mamou et al. 2024): a small classifier that decides after each drafted token whether to draft
another (docs/algorithms.md, "Choosing per round: `auto`"). numpy only; `edge-sd calibrate` fits it on
traces of real runs.

Features of a drafted token: the drafter's top probability and the entropy of its distribution (at
temperature 1, whatever the sampling settings: they measure the drafter's confidence), the token's
position in the draft, the recent acceptance (an exponential average over rounds) and the algorithm.
Label: whether the verifier accepted the text that token drafted. Every algorithm's accepted
candidates spell a prefix of the drafted text (SLEM re-tokenizes it, TLI proposes twins, SLRS
prefixes), so a drafted token was accepted when the accepted candidates cover its last byte.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_sd.errors import ArtifactError
from edge_sd.layout import DISCO_FILE
from edge_sd.manifest import write_aside

FEATURES = ("top_prob", "entropy", "position", "recent_acceptance", "slem", "tli", "slrs", "standard")
ALGORITHMS = FEATURES[4:]
# Recent acceptance follows each round's acceptance rate with this weight.
RECENT_WEIGHT = 0.3


def token_features(logits: np.ndarray, position: int, recent: float, algorithm: str) -> np.ndarray:
    """The feature vector of a drafted token drawn from drafter logits [V_d] at draft `position` (1..)."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    onehot = [1.0 if algorithm == a else 0.0 for a in ALGORITHMS]
    return np.array([float(p.max()), entropy, float(position), recent, *onehot])


@dataclass
class DiscoModel:
    """Logistic regression on standardised features, and the probability below which drafting stops."""

    weights: list[float]
    bias: float
    mean: list[float]
    scale: list[float]
    threshold: float
    k: int  # the longest draft it was calibrated for
    trained_on: int  # drafted tokens in the calibration traces
    features: tuple[str, ...] = FEATURES
    # The temperature of the calibration runs (files written before it was recorded: greedy, the
    # default). Acceptance and the threshold that pays differ between greedy decoding and sampling.
    temperature: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def prob(self, x: np.ndarray) -> float:
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        return float(1.0 / (1.0 + np.exp(-(z @ np.asarray(self.weights) + self.bias))))

    def save(self, folder: Path) -> Path:
        text = json.dumps({**asdict(self), "features": list(self.features)}, indent=1) + "\n"
        return write_aside(Path(folder) / DISCO_FILE, text)

    @classmethod
    def load(cls, folder: Path) -> DiscoModel | None:
        path = Path(folder) / DISCO_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            data["features"] = tuple(data["features"])
            model = cls(**data)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ArtifactError(f"{path}: not a DISCO model ({e}); run `edge-sd calibrate` again") from None
        if model.features != FEATURES or len(model.weights) != len(FEATURES):
            raise ArtifactError(f"{path}: made for other features; run `edge-sd calibrate` again")
        return model


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iters: int = 50) -> tuple[np.ndarray, float,
                                                                                            np.ndarray, np.ndarray]:
    """Logistic regression by Newton's method on standardised features: (weights, bias, mean, scale)."""
    mean = x.mean(0)
    scale = x.std(0)
    scale[scale == 0] = 1.0
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    reg = l2 * np.eye(len(w))
    reg[-1, -1] = 0.0  # the bias is not shrunk
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        grad = z.T @ (p - y) + reg @ w
        hess = (z * (p * (1 - p))[:, None]).T @ z + reg
        step = np.linalg.solve(hess + 1e-9 * np.eye(len(w)), grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w[:-1], float(w[-1]), mean, scale


def best_threshold(rounds: list[tuple[list[float], list[int]]], target_cost: dict[int, float],
                   draft_cost: float, k: int) -> float:
    """The stop threshold that maximises tokens per second over recorded rounds.

    rounds: per round, the classifier's probability and the label of each drafted token (drafted to
    k, never stopped early). A threshold t stops a round after its first token with probability < t;
    that round then emits its accepted tokens up to there, plus one.
    """
    best, best_rate = 0.0, -1.0
    for t in np.linspace(0.0, 0.95, 39):
        tokens = cost = 0.0
        for probs, labels in rounds:
            m = next((j + 1 for j, pr in enumerate(probs) if pr < t), len(probs))
            accepted = next((j for j, lab in enumerate(labels[:m]) if not lab), m)
            tokens += accepted + 1
            cost += target_cost[min(m + 1, k + 1)] + m * draft_cost
        if tokens / cost > best_rate:
            best, best_rate = float(t), tokens / cost
    return best
