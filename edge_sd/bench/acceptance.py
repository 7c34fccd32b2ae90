"""Expected acceptance of TLI and RDK against the drafter's kept vocabulary, without sampling noise.

Along the target's own greedy continuation of each prompt, at every position: p is the target's distribution
(temperature 1), q the drafter's given the same text (synced as in decoding). A drafted token's acceptance
probability is sum_t min(p(t), psi(t)) for the proposal psi (docs/algorithms.md, "The verification rules"):
TLI's psi is q restricted to the kept tokens with a target twin; RDK's is that pushed through the kernel M.
Under greedy decoding a drafted token is accepted when it is p's argmax. A pruned head's logits are the full
head's on the kept rows (checked at export: equal), so one drafter pass serves every fraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sd.algorithms.base import DrafterState, scatter_to_targets
from edge_sd.algorithms.rdk import Kernel
from edge_sd.export.prune import build_kernel, calibration_samples, choose_kept, frequencies
from edge_sd.pipeline import GenerationConfig, Pipeline
from edge_sd.sampling import SamplingConfig, warp
from edge_sd.token_bytes import utf8_complete

T1 = SamplingConfig(temperature=1.0)


@dataclass
class Variant:
    fraction: float
    kept: np.ndarray
    twins: np.ndarray  # [V_d] bool: kept with a target twin (TLI's support)
    kernel: Kernel
    rowed: np.ndarray  # [V_d] bool: drafter ids with a kernel row


def variants(pipe: Pipeline, fractions: list[float], texts: list[str]) -> list[Variant]:
    assert pipe.drafter is not None and pipe.maps is not None
    dv, maps = pipe.drafter.vocab, pipe.maps
    d_freq = frequencies(dv, texts)
    samples = calibration_samples(pipe.target, pipe.drafter, maps, texts)
    out = []
    for f in fractions:
        kept = choose_kept(maps, dv, d_freq, f)
        mask = np.zeros(dv.size, dtype=bool)
        mask[kept] = True
        kernel = Kernel.of(*build_kernel(maps, kept, samples))
        out.append(Variant(f, kept, mask & (maps.intersection[: dv.size] >= 0), kernel, kernel.has_row(dv.size)))
    return out


def measure(pipe: Pipeline, prompt: str, n: int, vs: list[Variant]) -> dict[float, dict[str, list[float]]]:
    """Per variant, per position: TLI and RDK expected acceptance (sampling) and greedy hits."""
    assert pipe.drafter is not None and pipe.maps is not None
    cont = pipe.generate(prompt, GenerationConfig(max_new_tokens=n, algorithm="ar")).token_ids
    ids = pipe.target.prompt_ids(prompt, False)
    target = pipe.target.engine
    width = target.manifest.scored_ids
    target.reset()
    target.reserve(len(ids) + len(cont))
    logits = target.forward(np.asarray(ids + cont))[len(ids) - 1 : len(ids) - 1 + len(cont), :width]
    target.reset()
    state = DrafterState(pipe.drafter.engine, pipe.drafter.vocab, pipe.drafter.prompt_ids(prompt, False))
    state.engine.reset()
    inter = pipe.maps.intersection
    out: dict[float, dict[str, list[float]]] = {v.fraction: {"tli": [], "rdk": [], "tli_greedy": [],
                                                             "rdk_greedy": []} for v in vs}
    generated = b""
    for j in range(len(cont)):
        if j:
            generated += pipe.target.vocab.token_bytes[cont[j - 1]] or b""
        if utf8_complete(generated) != generated:
            continue  # the drafter is fed whole characters only
        state.sync(generated)
        if state.lagging:
            continue
        q = warp(state.next_logits(), T1)  # [V_d]
        p = warp(logits[j], T1)  # [V_t]
        top = int(np.argmax(logits[j]))
        for v in vs:
            tli = q * v.twins
            rdk = q * v.rowed
            if tli.sum() > 0:
                psi = scatter_to_targets(tli / tli.sum(), inter, width)
                out[v.fraction]["tli"].append(float(np.minimum(p, psi).sum()))
                out[v.fraction]["tli_greedy"].append(float(inter[int(np.argmax(tli))] == top))
            if rdk.sum() > 0:
                psi = v.kernel.push(rdk / rdk.sum(), width)
                out[v.fraction]["rdk"].append(float(np.minimum(p, psi).sum()))
                out[v.fraction]["rdk_greedy"].append(float(int(np.argmax(psi)) == top))
    state.engine.reset()
    return out
