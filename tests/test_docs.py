"""The documentation: the README's quick start and Python example run (on tiny models in place of the
real pair), every relative link in the docs resolves, the CLI reference names every option, and the
repository speaks of the product, not of how it was made."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_sd.tools.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAIR = "engines/gemma3-270m_smollm2-135m"


def tracked(*suffixes: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith(suffixes) and (ROOT / n).is_file()]


def block(tag: str) -> str:
    """The fenced code block after `<!-- test: tag -->` in the README."""
    m = re.search(rf"<!-- test: {tag} -->\n```\w*\n(.*?)```", README, re.S)
    assert m, f"no block tagged {tag} in the README"
    return m.group(1)


def commands(text: str) -> list[str]:
    return [ln.split("  #")[0].strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip()]


def test_readme_quick_start_runs(gguf_root: Path, tmp_path: Path) -> None:
    """The export from GGUF files (tiny ones written here), then every command of the quick start on
    the folder it wrote; the Python example on it too."""
    pair = tmp_path / "pair"
    swap = {"gemma-3-270m-q4_k_m.gguf": str(gguf_root / "llama.gguf"),
            "SmolLM2-135M-Instruct.Q4_1.gguf": str(gguf_root / "qwen.gguf"),
            PAIR: str(pair)}

    def run(cmd: str):
        for a, b in swap.items():
            cmd = cmd.replace(a, b)
        piped = re.match(r"printf '(.*)' \| (.*)", cmd)
        stdin = piped.group(1).encode().decode("unicode_escape") if piped else None
        args = shlex.split(piped.group(2) if piped else cmd)
        assert args[0] == "edge-sd", cmd
        r = CliRunner().invoke(app, args[1:], input=stdin)
        assert r.exit_code == 0, f"{cmd}\n{r.output}"
        return r

    (export_cmd,) = commands(block("export"))
    run(export_cmd)
    assert (pair / "pair.json").is_file()
    outputs = [run(c) for c in commands(block("commands"))]
    assert (pair / "disco.json").is_file() and (pair / "costs.json").is_file()
    assert "tok/s" in outputs[1].stderr and "prefilled" in outputs[-1].stderr
    inspected = outputs[3].stdout  # from the files alone: their tokenizers and chat templates
    assert inspected.count("the GGUF file's metadata") == 4, inspected
    code = block("python").replace(PAIR, str(pair))
    exec(compile(code, "README.md", "exec"), {})


def test_doc_links_resolve() -> None:
    """Every relative link of every markdown file points at a file or folder of the repository."""
    broken = []
    for doc in tracked(".md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _headings(doc: Path) -> set[str]:
    return {m.strip() for m in re.findall(r"^#+ (.*)$", doc.read_text(encoding="utf-8"), re.M)}


def _slug(heading: str) -> str:
    """The anchor a markdown heading gets (GitHub's rule: lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_references_name_real_headings() -> None:
    """Code and docs cite the docs as `docs/NAME.md, "Heading"` or link `NAME.md#anchor`: each names a
    file and a heading that are there, and nothing cites a file or numbered section the repository
    does not have."""
    broken = []
    for path in tracked(".py", ".md", ".sh"):
        if path.name == "test_docs.py":  # its own docstring shows the forms
            continue
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        for doc, heading in re.findall(r'(docs/[\w-]+\.md),?\s+"([^"]+)"', text):
            if not (ROOT / doc).is_file() or re.sub(r"\s+", " ", heading) not in _headings(ROOT / doc):
                broken.append(f"{where}: {doc}, {heading!r}")
        for doc in re.findall(r"\b(docs/[\w-]+\.md)\b", text):
            if not (ROOT / doc).is_file():
                broken.append(f"{where}: {doc}")
        if path.suffix == ".md":
            for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", text):
                doc = (path.parent / target) if target else path
                if not re.match(r"[a-z]+:", target) and anchor not in {_slug(h) for h in _headings(doc)}:
                    broken.append(f"{where}: {target}#{anchor}")
        broken += [f"{where}: {m}" for m in re.findall(r"ALGORITHMS\.md|\b[Ss]ection \d\w*", text)]
    assert not broken, broken


def test_cli_reference_names_every_option() -> None:
    """docs/cli.md describes every option each command's help offers."""
    reference = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = []
    for command in ("export", "generate", "chat", "serve", "inspect", "calibrate", "bench"):
        shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
        for option in set(re.findall(r"(--[a-z][a-z-]+)", shown)) - {"--help"}:
            if option not in reference:
                missing.append(f"{command} {option}")
    assert not missing, missing


# How the product was made is not the product's: no work sessions, no issue numbers. ONNX Runtime's
# sessions ("a session", "one session's threads") are the product's own vocabulary.
HISTORY = re.compile(r"\bsessions? \d+|\b(this|that|earlier|previous|next|later|last|same) sessions?\b"
                     r"|\bthe issue\b|\bissue's\b|\bissues? #?\d+", re.I)


@pytest.mark.parametrize("kind", [".md", ".py", ".sh", ".toml"])
def test_no_work_history_words(kind: str) -> None:
    hits = []
    for path in tracked(kind):
        if path == Path(__file__):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, hits
