"""transformers (torch, CPU) on the same pair and prompts: plain `generate` and assisted generation.

With `tokenizer=` and `assistant_tokenizer=` transformers picks, by itself, universal assisted
generation (greedy: the draft is decoded to text and re-encoded, SLEM's idea) or universal speculative
decoding (sampling: drafting over the vocabulary intersection, TLI's idea). Both models are the fp32
Hugging Face folders dequantized from the same GGUF files the engines were exported from, and both get
the engines' own tokenizer.json files, so the two stacks see the same weights and the same token ids.

Target forwards are counted with a forward hook on the target model (its first call, the prompt, is
also its first verification), drafted tokens by wrapping the candidate generators' `get_candidates`.
Universal speculative decoding ("usd") prunes the assistant's embedding and LM head in place
(transformers 4.57), after which universal assisted generation on that same model fails, so it gets
its own copy of the drafter. Measured on this pair, its pruned proposal logits do not line up with the
tokens it drafts (the drafted token's q is ~1e-6 while q's argmax is another token), so p/q is inflated
and drafts are accepted that speculative sampling would reject: its acceptance is not that of a
lossless method. "usd-unpruned" runs the same generator with the pruning switched off (the translator
then masks the logits instead), which is the correct baseline for TLI.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edge_sd.bench.record import Record
from edge_sd.errors import UsageError

HF_NAMES = {"target": "gemma3-270m", "drafter": "smollm2-135m"}


class _Meter:
    """Counts and times the forward calls of one torch module."""

    def __init__(self, module: Any):
        self.calls = 0
        self.seconds = 0.0
        self.first_s = 0.0
        self._t0 = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def reset(self) -> None:
        self.calls, self.seconds, self.first_s = 0, 0.0, 0.0

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        dt = time.perf_counter() - self._t0
        if self.calls == 0:
            self.first_s = dt
        self.calls += 1
        self.seconds += dt


@contextmanager
def _lm_head_pruning(enabled: bool) -> Any:
    """Let transformers prune the assistant's LM head for USD (its default) or not."""
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache as Cache

    original = Cache.__dict__["get_translator"]
    if not enabled:
        def get_translator(cls: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["assistant_prune_lm_head"] = False
            return original.__func__(cls, *args, **kwargs)

        Cache.get_translator = classmethod(get_translator)
    try:
        yield
    finally:
        Cache.get_translator = original


@contextmanager
def _count_candidates() -> Any:
    """Count the target-vocabulary candidate tokens transformers' assistants propose."""
    from transformers.generation import candidate_generator as cg

    counter = {"proposed": 0, "depth": 0}
    classes = [c for c in vars(cg).values() if isinstance(c, type) and issubclass(c, cg.CandidateGenerator)
               and "get_candidates" in vars(c)]
    originals = {c: c.get_candidates for c in classes}

    def wrap(orig: Any) -> Any:
        def get_candidates(self: Any, input_ids: Any) -> Any:
            counter["depth"] += 1
            try:
                cand, logits = orig(self, input_ids)
            finally:
                counter["depth"] -= 1
            if counter["depth"] == 0:  # the outermost call only: subclasses call their parents
                counter["proposed"] += int(cand.shape[-1] - input_ids.shape[-1])
            return cand, logits

        return get_candidates

    for c, orig in originals.items():
        c.get_candidates = wrap(orig)
    try:
        yield counter
    finally:
        for c, orig in originals.items():
            c.get_candidates = orig


class HFPair:
    """The pair in transformers: the target, the drafter copies, and tokenizers from the engines' files."""

    def __init__(self, target: Any, drafters: dict[str, Any], tok: Any, dtoks: dict[str, Any], eos: list[int],
                 pad: int):
        self.target, self.drafters, self.tok, self.dtoks = target, drafters, tok, dtoks
        self.eos, self.pad = eos, pad
        self.t_meter = _Meter(target)
        self.d_meters = [_Meter(m) for m in {id(m): m for m in drafters.values()}.values()]

    @classmethod
    def load(cls, hf_dir: Path | None, pipe: Any, threads: int) -> HFPair:
        try:
            import torch
            from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
            from transformers.utils import logging as hf_logging
        except ImportError as e:
            raise UsageError(f"the transformers comparison needs torch and transformers (pip install "
                             f"'.[export]' in a clone of edge-sd), or pass --no-transformers ({e})") from None
        if hf_dir is None or not all((hf_dir / n / "config.json").is_file() for n in HF_NAMES.values()):
            raise UsageError(
                f"the transformers comparison needs the fp32 HF folders {', '.join(HF_NAMES.values())} in "
                f"{hf_dir} (scripts/prepare_real_pair.sh OUT --hf writes them), or pass --no-transformers"
            )
        hf_logging.set_verbosity_error()
        torch.set_num_threads(threads)

        def load(role: str) -> Any:
            return AutoModelForCausalLM.from_pretrained(hf_dir / HF_NAMES[role], dtype=torch.float32).eval()

        target, plain_drafter = load("target"), load("drafter")
        drafters = {"uag": plain_drafter, "usd": load("drafter"), "usd-unpruned": plain_drafter}

        def tokenizer(side: Any) -> Any:
            m = side.manifest
            eos = m.eos_token_ids[0] if m.eos_token_ids else None
            return PreTrainedTokenizerFast(
                tokenizer_file=str(Path(side.engine.folder) / m.tokenizer_file),
                bos_token=side.vocab.tokenizer.id_to_token(m.bos_token_id) if m.bos_token_id is not None else None,
                eos_token=side.vocab.tokenizer.id_to_token(eos) if eos is not None else None,
            )

        # transformers caches USD's vocabulary translator per tokenizer object (pruned or not): one each.
        dtoks = {name: tokenizer(pipe.drafter) for name in drafters}
        tm = pipe.target.manifest
        pad = tm.pad_token_id if tm.pad_token_id is not None else tm.eos_token_ids[0]
        return cls(target, drafters, tokenizer(pipe.target), dtoks, list(tm.eos_token_ids), pad)

    def generate(self, ids: list[int], mode: str, algorithm: str, k: int, max_new: int, seed: int) -> Record:
        import torch

        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new, "eos_token_id": self.eos, "pad_token_id": self.pad,
        }
        if mode == "greedy":
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:  # temperature 1, no top-k/top-p: the same distribution edge-sd samples from
            kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        drafter = self.drafters.get(algorithm)
        if drafter is not None:
            gc = drafter.generation_config
            # The same k as edge-sd: exactly k drafter tokens per round, no adaptive schedule or early stop.
            gc.num_assistant_tokens = k
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            kwargs.update(assistant_model=drafter, tokenizer=self.tok, assistant_tokenizer=self.dtoks[algorithm])
        x = torch.tensor([ids])
        for meter in (self.t_meter, *self.d_meters):
            meter.reset()
        torch.manual_seed(seed)
        with torch.no_grad(), _lm_head_pruning(algorithm != "usd-unpruned"), _count_candidates() as counted:
            t0 = time.perf_counter()
            out = self.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        while new and new[-1] in self.eos:  # edge-sd counts no EOS among its new tokens
            new.pop()
        forwards = self.t_meter.calls
        return Record(
            engine="transformers", mode=mode, algorithm=algorithm, k=k, prompt="", new_tokens=len(new),
            wall_s=wall, prefill_s=self.t_meter.first_s, target_s=self.t_meter.seconds,
            drafter_s=sum(m.seconds for m in self.d_meters), target_forwards=forwards,
            proposed=counted["proposed"],
            accepted=max(0, len(new) - forwards) if algorithm != "ar" else 0, token_ids=new,
        )
