"""A GGUF file's own tokenizer against llama.cpp, the reference for GGUF: token ids of the benchmarks'
prompt sets and of varied text (whitespace runs, digits, code, emoji, CJK, special tokens), from the
tokenizer edge-sd builds out of the file's metadata (export/gguf_tokenizer.py), from the tokenizer.json
files used with the real pair before, and from llama.cpp's `llama-tokenize` on the same file.

    bash scripts/real_pair.sh                                   # once: the real pair's files
    .venv/bin/python benchmarks/gguf_tokenizer.py --llama-cpp "$(bash benchmarks/llama_cpp.sh)"

Writes benchmarks/results/gguf_tokenizer.{md,json,png}; `--report` writes the table and plot again from
the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from edge_sd.bench.llama_cpp import version as llama_version
from edge_sd.bench.run import machine, write_results
from edge_sd.export import gguf_tokenizer
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_gguf_tokenizer import TEXTS  # noqa: E402  (the tests' varied texts)

FILES = {"gemma-3-270m-q4_k_m.gguf": "tokenizers/gemma3/tokenizer.json",
         "SmolLM2-135M-Instruct.Q4_1.gguf": "real/smollm2-tokenizer/tokenizer.json"}


def llama_tokenize(binary: Path, gguf: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as f:
        f.write(text)
        f.flush()
        out = subprocess.run([str(binary), "-m", str(gguf), "-f", f.name, "--ids", "--log-disable", "--no-bos"],
                             capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(bin_dir: Path, per_set: int) -> dict:
    cache = cache_dir()
    texts = [("varied", t) for t in TEXTS]
    texts += [(s, p.text) for s in prompt_sets.SETS for p in prompt_sets.load(s, cache, per_set)]
    rows = []
    for name, reference in FILES.items():
        gguf = cache / "real" / name
        own = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(gguf)))
        used = Tokenizer.from_file(str(cache / reference))
        for kind, text in texts:
            want = llama_tokenize(bin_dir / "llama-tokenize", gguf, text)
            rows.append({"file": name, "texts": kind,
                         "own": own.encode(text, add_special_tokens=False).ids == want,
                         "tokenizer_json": used.encode(text, add_special_tokens=False).ids == want})
        print(name, "done", file=sys.stderr)
    m = machine()
    return {"date": datetime.date.today().isoformat(), "llama_cpp": llama_version(bin_dir),
            "machine": f"{m['cpu']}, {m['cores']} cores", "per_set": per_set, "rows": rows,
            "command": "benchmarks/gguf_tokenizer.py --llama-cpp \"$(bash benchmarks/llama_cpp.sh)\""}


def report(result: dict) -> str:
    lines = ["# A GGUF file's own tokenizer against llama.cpp", "",
             f"{result['date']}, llama.cpp {result['llama_cpp']} (`llama-tokenize --no-bos`), {result['machine']}. "
             "Texts whose ids equal llama.cpp's, of all: the tokenizer edge-sd builds from the file's metadata, "
             "and the tokenizer.json the real pair was exported with before. Command: "
             f"`{result['command']}`.", "",
             "| file | texts | edge-sd, from the file | tokenizer.json used before |", "|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["file"], r["texts"]), []).append(r)
    for (name, kind), rows in groups.items():
        own = sum(r["own"] for r in rows)
        used = sum(r["tokenizer_json"] for r in rows)
        lines.append(f"| {name} | {kind} | {own} of {len(rows)} | {used} of {len(rows)} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(FILES)
    own = [sum(r["own"] for r in result["rows"] if r["file"] == n) / max(1, sum(r["file"] == n for r in
                                                                                 result["rows"])) for n in names]
    used = [sum(r["tokenizer_json"] for r in result["rows"] if r["file"] == n) /
            max(1, sum(r["file"] == n for r in result["rows"])) for n in names]
    fig, ax = plt.subplots(figsize=(7, 3))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [100 * v for v in own], width=0.4, label="edge-sd, from the file")
    ax.bar([x + 0.2 for x in xs], [100 * v for v in used], width=0.4, label="tokenizer.json used before")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("% of texts equal to llama.cpp")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, help="folder holding llama-tokenize (benchmarks/llama_cpp.sh)")
    ap.add_argument("--per-set", type=int, default=20, help="prompts from each benchmark set")
    ap.add_argument("--report", action="store_true", help="write the table and plot again from the JSON")
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results"
    if args.report:
        print(write_results(out, "gguf_tokenizer", report, plot))
        return
    if args.llama_cpp is None:
        ap.error("--llama-cpp FOLDER is needed (bash benchmarks/llama_cpp.sh prints it)")
    print(write_results(out, "gguf_tokenizer", report, plot, measure(args.llama_cpp, args.per_set)))


if __name__ == "__main__":
    main()
