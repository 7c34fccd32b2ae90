"""GGUF files of each architecture and block type, made by llama.cpp's own tools, exported by edge-sd
and compared with llama.cpp on the same file: token ids, next-token logits, greedy continuations.

For each architecture a small model (random weights, or trained for --train-steps steps on news and
code so that its next-token distributions are peaked; the dimensions llama.cpp's K-quants need) is
written with a real tokenizer (the npm tokenizer packages the set-up installs), converted to GGUF by
the `convert_hf_to_gguf.py` llama.cpp vendors, quantized to each block type by `llama-quantize`, and
exported with `edge-sd export` from the file alone. Then, on the same file:

- tokens: edge-sd's ids of varied texts against `llama-tokenize`'s;
- logits: every prompt position's next-token logits against llama.cpp's (benchmarks/llama_logits.cpp,
  the same ids fed to both): top-1 agreement, the largest difference, and near-ties (positions whose
  two best logits are closer than that difference, where a flip says nothing of either side);
- greedy: 16 tokens after each prompt, equal or not.

Not part of the set-up or the tests (they check the same export against the `gguf` package's own
dequantization on files they write). Needs benchmarks/llama_cpp.sh's build and the bench extra (sentencepiece).

    .venv/bin/python benchmarks/gguf_architectures.py [--arch llama,qwen3] [--types Q4_K,Q8_0] [--train-steps 300]

Writes benchmarks/results/gguf_architectures.{md,json} (with --train-steps,
gguf_architectures_trained.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_sd.tools.paths import cache_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M",
         "Q6_K", "IQ4_NL"]
GEMMA3_LAYERS = {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "num_hidden_layers": 6,
                 "sliding_window": 32, "query_pre_attn_scalar": 64}
# architecture -> (transformers config class, its extra fields, tokenizer package under the cache,
# where its SentencePiece model comes from: models converted from one get a tokenizer.model)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}, "tokenizers/llama3", None),
    "mistral": ("MistralConfig", {"sliding_window": None}, "tokenizers/llama2", "merges"),
    "qwen2": ("Qwen2Config", {}, "tokenizers/qwen3", None),
    "qwen3": ("Qwen3Config", {}, "tokenizers/qwen3", None),  # head size 64: not the 128 transformers assumes
    "gemma": ("GemmaConfig", {}, "tokenizers/gemma3", "gemma"),
    "gemma2": ("Gemma2Config", {"sliding_window": 32, "query_pre_attn_scalar": 64}, "tokenizers/gemma3", "gemma"),
    "gemma3": ("Gemma3TextConfig", GEMMA3_LAYERS, "tokenizers/gemma3", "gemma"),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "original_max_position_embeddings": 512}, "tokenizers/llama2",
             "merges"),  # trained at its full context: Phi-3-mini-4k, not a LongRoPE variant
}
REAL_GEMMA = "real/gemma-3-270m-q4_k_m.gguf"
PHI3_TOKENS = ["<|endoftext|>", "<|assistant|>", *(f"<|placeholder{i}|>" for i in range(1, 5)), "<|system|>",
               "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]  # ids 32000-32010
# K-quants need rows of 256 weights; heads of 64 suit ONNX Runtime's attention and llama.cpp's.
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1)
TEXTS = ["Once upon a time", "a  b\n\n\nc    d\t\te", "def f(x):\n    return x ** 2  # square\n",
         "Prices rose 12.5% in 2024, to $1,234.56.", "emoji 😀🎉 and CJK 漢字かな 한국어", "  leading spaces",
         "I'm sure they'll've done it", "über naïve café 12345678901234567890"]
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "In 1969, the first humans landed on", "Liste des courses : pommes, poires,",
           "Q: What is 17 times 3?\nA:", "<html>\n  <body>\n    <h1>", "Once upon a time, in a small village",
           "SELECT name, COUNT(*) FROM users GROUP BY"]
N_GEN = 16
# Training (--train-steps): sequences of TRAIN_SEQ tokens, TRAIN_BATCH a step.
TRAIN_SEQ, TRAIN_BATCH, TRAIN_LR = 128, 8, 2e-3


def tools() -> Path:
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "llama_cpp.sh")], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]
    return Path(out)


def llama_logits(bin_dir: Path, work: Path) -> Path:
    """Build benchmarks/llama_logits.cpp against the libllama of llama_cpp.sh's build."""
    src = bin_dir.parent.parent / "src"
    exe = work / "llama-logits"
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
                    str(ROOT / "benchmarks" / "llama_logits.cpp"), f"-L{bin_dir}", "-lllama",
                    f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe


def small_model(arch: str, folder: Path, steps: int = 0) -> tuple[Path, float | None]:
    """A small model of `arch` with its family's real tokenizer, saved as an HF folder: random
    weights, trained for `steps` steps where steps > 0 (`train`); and the last training loss."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    cls_name, extra, tok_dir, spm = ARCHITECTURES[arch]
    tok_src = cache_dir() / tok_dir
    folder.mkdir(parents=True, exist_ok=True)
    for f in tok_src.iterdir():
        shutil.copy(f, folder / f.name)
    if arch == "phi3":  # Phi-3's tokenizer: Llama 2's and these (llama.cpp looks some of them up by name)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens(PHI3_TOKENS)
        tok.save(str(folder / "tokenizer.json"))
    if spm:
        sentencepiece_model(folder / "tokenizer.json", spm, folder / "tokenizer.model")
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = getattr(transformers, cls_name)(vocab_size=vocab, **(DIMS | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    loss = train(model, Tokenizer.from_file(str(folder / "tokenizer.json")), steps, arch) if steps else None
    model.save_pretrained(folder)
    return folder, loss


def train(model, tokenizer, steps: int, arch: str) -> float:
    """Train the model for `steps` steps on English news and Python (the Lee corpus' articles and
    HumanEval's prompts, none of them a compared prompt), so that its next-token distributions are
    peaked as a language model's are rather than flat; returns the last step's loss."""
    import torch

    from edge_sd.tools import prompt_sets

    texts = prompt_sets.articles(cache_dir(), 10**6) + [p.text for p in prompt_sets.load("code", cache_dir(), 164)]
    data = torch.tensor([i for x in texts for i in tokenizer.encode(x, add_special_tokens=False).ids])
    rng = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - TRAIN_SEQ, (TRAIN_BATCH,), generator=rng).tolist()
        batch = torch.stack([data[s:s + TRAIN_SEQ] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 25 == 0 or step + 1 == steps:
            print(f"{arch}: trained {step + 1}/{steps} steps, loss {loss.item():.2f}", file=sys.stderr, flush=True)
    model.eval()
    return float(loss.item())


def sentencepiece_model(tokenizer_json: Path, source: str, dest: Path) -> None:
    """A SentencePiece model (tokenizer.model) of a tokenizer.json's pieces, as the family's own would
    be: `gemma`: the pieces, scores and types of the real Gemma-3 GGUF file (Gemma's own model, as
    llama.cpp read it); `merges`: each piece scored by the rank of the tokenizer.json merge that makes it,
    which encodes as that tokenizer does."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from edge_sd.export import gguf_tokenizer

    proto = pb.ModelProto()
    if source == "gemma":
        meta = gguf_tokenizer.read(cache_dir() / REAL_GEMMA)
        # the file writes user-defined pieces' spaces as spaces; the model, as its other pieces, "▁"
        pieces = [(t.replace(" ", "\u2581") if kind == 4 else t, score, kind)
                  for t, score, kind in zip(meta.tokens, meta.scores, meta.types, strict=True)]
        dummy_prefix = False
    else:
        tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        vocab = sorted({**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}.items(),
                       key=lambda kv: kv[1])
        special = {t["content"]: t["id"] for t in tj["added_tokens"]}
        kinds = {tj["model"].get("unk_token"): 2}
        rank: dict[str, int] = {}  # a piece's score: minus the rank of the first merge that makes it
        for r, m in enumerate(tj["model"]["merges"]):
            rank.setdefault("".join(m.split(" ", 1) if isinstance(m, str) else m), r)
        pieces = [(p, 0.0 if p in special else -float(rank.get(p, len(rank) + i)),
                   kinds.get(p, 3 if p in special else 6 if p.startswith("<0x") and len(p) == 6 else 1))
                  for p, i in vocab]
        dummy_prefix = True
    for piece, score, kind in pieces:
        proto.pieces.add(piece=piece, score=score, type=kind)
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = any(kind == 6 for _, _, kind in pieces)
    proto.trainer_spec.vocab_size = len(pieces)
    kinds_at = {kind: i for i, (_, _, kind) in reversed(list(enumerate(pieces)))}
    proto.trainer_spec.unk_id = kinds_at.get(2, 0)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    dest.write_bytes(proto.SerializeToString())


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def convert(hf: Path, dest: Path, bin_dir: Path) -> str | None:
    """llama.cpp's converter, F32 out; an error line or None."""
    converter = bin_dir.parent.parent / "src" / "convert_hf_to_gguf.py"
    p = run([sys.executable, converter, hf, "--outfile", dest, "--outtype", "f32"])
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["failed"])[-1][:200]


def quantize(f32: Path, dest: Path, kind: str, bin_dir: Path) -> str | None:
    if kind == "F32":
        if dest != f32:
            shutil.copy(f32, dest)
        return None
    p = run([bin_dir / "llama-quantize", f32, dest, kind, "2"])
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["failed"])[-1][:200]


def llama_tokenize(bin_dir: Path, gguf: Path, text: str) -> list[int]:
    p = run([bin_dir / "llama-tokenize", "-m", gguf, "-p", text, "--ids", "--log-disable", "--no-bos"])
    if p.returncode:
        raise RuntimeError(f"llama-tokenize: {(p.stderr.strip().splitlines() or ['failed'])[-1][:200]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def fp32_logits(gguf: Path, prompts: list[list[int]]) -> np.ndarray:
    """Every prompt position's next-token logits from the file's weights dequantized to fp32 and run
    by transformers, read as llama.cpp reads the file: the arithmetic both tools approximate."""
    import torch

    from edge_sd.export.gguf_tokenizer import read_fields
    from edge_sd.export.hf import load_gguf

    model = load_gguf(gguf, read_fields(gguf)).eval()
    with torch.no_grad():
        return np.concatenate([model(torch.tensor([ids])).logits[0].float().numpy() for ids in prompts])


def against_fp32(exact: np.ndarray, **sides: np.ndarray) -> dict:
    """Per side (edge-sd, llama.cpp): prompt positions whose argmax equals the fp32 reference's, and
    the largest logit difference from it."""
    return {"top1_vs_fp32": {k: f"{int((v.argmax(1) == exact.argmax(1)).sum())}/{len(exact)}"
                             for k, v in sides.items()},
            "max_diff_vs_fp32": {k: float(np.abs(v - exact).max()) for k, v in sides.items()}}


def compare(arch: str, kind: str, gguf: Path, engine: Path, bin_dir: Path, exe: Path, work: Path) -> dict:
    from edge_sd import GenerationConfig, Pipeline

    pipe = Pipeline.from_folder(engine, provider="cpu", threads=2)
    t = pipe.target
    vs_fp32 = t.manifest.validation.get("max_rel_diff_vs_torch")  # edge-sd against the file dequantized, in fp32
    # and texts with special tokens: a chat as the engine's template renders it, BOS and EOS inside text
    from edge_sd.chat import render_chat

    texts = [*TEXTS, "".join(t.vocab.tokenizer.id_to_token(i) or "" for i in (t.manifest.bos_token_id or 0,
                                                                                t.manifest.eos_token_ids[0])) + " x",
             "<|user|>\nHi<|end|>\n<|assistant|>\n"]  # Phi-3's turn, whitespace after its markers
    if t.manifest.chat_template:
        texts.append(render_chat(t.manifest, [{"role": "user", "content": "Hi there"},
                                              {"role": "assistant", "content": "Hello."},
                                              {"role": "user", "content": " Name\nthree colors. "}]))
    tokens_equal = sum(t.vocab.encode_text(x) == llama_tokenize(bin_dir, gguf, x) for x in texts)
    prompts = [t.prompt_ids(p, chat=False) for p in PROMPTS]
    (work / "prompts.txt").write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
    with open(work / "prompts.txt") as stdin:
        p = subprocess.run([exe, gguf, "2", str(N_GEN), work / "logits.bin"], stdin=stdin, capture_output=True,
                           text=True)
    if p.returncode:
        return {"error": f"llama.cpp: {(p.stderr.strip().splitlines() or ['failed'])[-1][:200]}"}
    theirs_gen = [list(map(int, ln.split())) for ln in p.stdout.strip().splitlines()]
    width = t.manifest.logits_width
    theirs = np.fromfile(work / "logits.bin", dtype=np.float32)
    n_vocab = theirs.size // sum(map(len, prompts))
    theirs = theirs.reshape(-1, n_vocab)[:, :min(width, n_vocab)]
    ours = []
    for ids in prompts:
        t.engine.reset()
        ours.append(t.engine.forward(np.asarray(ids, dtype=np.int64))[:, :theirs.shape[1]])
    ours_all = np.concatenate(ours).astype(np.float32)
    diff = np.abs(ours_all - theirs).max(axis=1)
    top = np.sort(theirs, axis=1)[:, -2:]
    near = (top[:, 1] - top[:, 0]) <= diff
    agree = ours_all.argmax(1) == theirs.argmax(1)
    greedy = split_at_tie = 0
    for ids, ref in zip(prompts, theirs_gen, strict=True):
        gen = pipe.generator(GenerationConfig(max_new_tokens=N_GEN, algorithm="plain"))
        gen.append_tokens(ids)
        while not gen.is_done:
            gen.generate_next_tokens()
        out = gen.result().token_ids  # ends early at an end-of-generation id; llama.cpp's run goes on
        if out == ref[:len(out)]:
            greedy += 1
            continue
        # where the two part: was edge-sd's own choice there a near-tie (two best logits closer than
        # the largest difference seen)?
        at = next(i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b)
        t.engine.reset()
        row = np.sort(t.engine.forward(np.asarray(ids + out[:at], dtype=np.int64), last=1)[-1])
        split_at_tie += bool(row[-1] - row[-2] <= diff.max())
    exact = fp32_logits(gguf, prompts)[:, :theirs.shape[1]]
    return against_fp32(exact, **{"edge-sd": ours_all, "llama.cpp": theirs}) | {
            "tokens_equal": f"{tokens_equal}/{len(texts)}", "top1": f"{int(agree.sum())}/{len(agree)}",
            "near_ties": int(near.sum()), "disagree_not_near": int((~agree & ~near).sum()),
            "max_diff": float(diff.max()), "logit_scale": float(np.abs(theirs).max()), "rel_diff_vs_fp32": vs_fp32,
            "greedy_equal": f"{greedy}/{len(prompts)}", "greedy_split_at_near_tie": split_at_tie}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(ARCHITECTURES))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--every-type", default="", help="architectures that get every type, whatever --types says")
    ap.add_argument("--keep", type=Path, help="keep the files made here")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="train each model this many steps on text before converting it (0: random weights)")
    ap.add_argument("-o", "--out", type=Path, default=RESULTS, help="results folder [benchmarks/results]")
    args = ap.parse_args()
    bin_dir = tools()
    work = args.keep or Path(tempfile.mkdtemp(prefix="edge-sd-gguf-arch-"))
    work.mkdir(parents=True, exist_ok=True)
    exe = llama_logits(bin_dir, work)
    edge_sd = Path(sys.executable).parent / "edge-sd"
    rows = []
    for arch in args.arch.split(","):
        hf, loss = small_model(arch, work / f"hf_{arch}", args.train_steps)
        f32 = work / f"{arch}-F32.gguf"
        error = convert(hf, f32, bin_dir)
        for kind in TYPES if arch in args.every_type.split(",") else args.types.split(","):
            row: dict = {"arch": arch, "type": kind, "train_loss": loss}
            rows.append(row)
            gguf = work / f"{arch}-{kind}.gguf"
            error = error or quantize(f32, gguf, kind, bin_dir)
            if error:
                row["error"] = f"llama.cpp: {error}"
                print(row, flush=True)
                continue
            engine = work / f"engine-{arch}-{kind}"
            start = time.perf_counter()
            p = run([edge_sd, "export", "-t", gguf, "-o", engine, "--force"], env={**os.environ, "COLUMNS": "200"})
            row["export_s"] = round(time.perf_counter() - start, 1)
            if p.returncode:
                row["refused" if p.returncode == 2 else "error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:240]
            else:
                try:
                    row |= compare(arch, kind, gguf, engine, bin_dir, exe, work)
                except RuntimeError as e:
                    row["error"] = str(e)
            print(row, flush=True)
            if not args.keep:
                if gguf != f32:
                    gguf.unlink(missing_ok=True)
                shutil.rmtree(engine, ignore_errors=True)
    write(rows, args)


def _vs_fp32(r: dict) -> str:
    """The two against-fp32 cells of a row (empty where it has none)."""
    if "top1_vs_fp32" not in r:
        return " | |"
    top, diff = r["top1_vs_fp32"], r["max_diff_vs_fp32"]
    return (f" {top['edge-sd']} / {top['llama.cpp'].split('/')[0]} |"
            f" {diff['edge-sd']:.3f} / {diff['llama.cpp']:.3f} |")


def _rel(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"


def write(rows: list[dict], args: argparse.Namespace) -> None:
    import platform

    import onnxruntime

    name = "gguf_architectures_trained" if args.train_steps else "gguf_architectures"
    fp32 = any("top1_vs_fp32" in r for r in rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    lines = [
        "# GGUF files of each architecture and block type, against llama.cpp",
        "",
        f"{time.strftime('%Y-%m-%d')}, {cpu} ({os.cpu_count()} cores), ONNX Runtime {onnxruntime.__version__}, "
        "llama.cpp from llama-cpp-python 0.3.36. Small models (hidden 256, 2 layers; Gemma-3 6) "
        + (f"trained {args.train_steps} steps of {TRAIN_BATCH} x {TRAIN_SEQ} tokens on the Lee corpus' news "
           "articles and HumanEval's prompts (none a compared prompt; last loss per row in the JSON) "
           if args.train_steps else "with random weights ")
        + "and their families' real tokenizers, converted by llama.cpp's `convert_hf_to_gguf.py`, quantized by "
        "`llama-quantize`, exported by `edge-sd export -t FILE.gguf` alone. Tokens: edge-sd's ids equal to "
        "`llama-tokenize`'s (special tokens parsed) on 8 varied texts, one with BOS and EOS inside, a Phi-3 "
        "turn and a chat as the engine's template renders it (where it has one). Top-1: prompt positions "
        "(8 prompts) whose next-token argmax equals llama.cpp's; near ties: positions whose two best logits "
        "are closer than the largest difference; "
        "greedy: 16-token continuations equal (in brackets: of the others, how many part where edge-sd's two "
        "best logits are that close). edge-sd vs fp32: the export's own check, its largest relative logit "
        "difference from the file's weights dequantized and run in fp32 by transformers."
        + (" Top-1 as fp32 and max diff from fp32: each tool's prompt positions whose argmax equals that fp32 "
           "run's (the same positions as top-1), and its largest logit difference from it." if fp32 else ""),
        "",
        ("Random weights give flat next-token distributions (least so with Gemma's scaled embeddings and "
         "capped logits): many positions are near ties, " if not args.train_steps else
         "Near ties are positions ")
        + "where each side's rounding (int8 activations in "
        "edge-sd's MatMulNBits at accuracy level 4, q8 dot products in llama.cpp) can decide the argmax, and a "
        "greedy continuation parts at the first of them. Top-1 disagreements outside near ties, all rows: "
        f"{sum(r.get('disagree_not_near', 0) for r in rows)}. "
        + ("" if fp32 else "How far llama.cpp itself is from fp32 is not measured here. ")
        + "On the real Gemma-3-270M file edge-sd's next-token distributions are closer to its fp32 "
        "export's than llama.cpp's ([fp32_distance.md](fp32_distance.md)).",
        "",
        f"    .venv/bin/python benchmarks/gguf_architectures.py --arch {args.arch} --types {args.types}"
        + (f" --every-type {args.every_type}" if args.every_type else "")
        + (f" --train-steps {args.train_steps}" if args.train_steps else ""),
        "",
        "| architecture | type | tokens | top-1 | near ties | max logit diff | edge-sd vs fp32 | greedy | export s "
        "| refused / error |" + (" top-1 as fp32: edge-sd / llama.cpp | max diff from fp32: edge-sd / llama.cpp |"
                                  if fp32 else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if fp32 else ""),
    ]
    for r in rows:
        problem = r.get("refused") or r.get("error") or ""
        greedy = f"{r['greedy_equal']} ({r['greedy_split_at_near_tie']})" if "greedy_equal" in r else ""
        diff = f"{r['max_diff']:.3f} of {r['logit_scale']:.1f}" if "max_diff" in r else ""
        lines.append(f"| {r['arch']} | {r['type']} | {r.get('tokens_equal', '')} | {r.get('top1', '')} | "
                     f"{r.get('near_ties', '')} | {diff} | {_rel(r.get('rel_diff_vs_fp32'))} | {greedy} | "
                     f"{r.get('export_s', '')} | "
                     f"{problem.replace('|', '/')} |" + (_vs_fp32(r) if fp32 else ""))
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
