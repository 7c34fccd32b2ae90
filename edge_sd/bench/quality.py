"""What a target precision costs in output quality: perplexity on news articles and top-1 agreement
with a reference engine (the fp32 export of the same weights), both from one forward per article."""

from __future__ import annotations

import numpy as np

from edge_sd.engines.base import Engine


def quality(engine: Engine, reference: Engine, texts: list[list[int]], max_len: int = 256) -> dict:
    """texts: token ids of each article (BOS included where the model takes one)."""
    nll, count, agree = 0.0, 0, 0
    for ids in texts:
        ids = np.asarray(ids[:max_len])
        engine.reset()
        logits = engine.forward(ids)[:-1].astype(np.float64)  # [L-1, V]: predictions of ids[1:]
        reference.reset()
        ref = reference.forward(ids)[:-1]
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        count += len(ids) - 1
    return {"perplexity": float(np.exp(nll / count)), "top1_agreement": agree / count, "positions": count}
