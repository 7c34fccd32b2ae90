"""`pip install .` is the runtime: numpy, onnxruntime and tokenizers, nothing else. A fresh
virtual environment with only those three (from the package registry) and edge-sd without its
extras loads a pair and generates; the command line says which extra it needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = {"numpy", "onnxruntime", "tokenizers"}


def test_the_runtime_depends_on_three_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert names == RUNTIME
    assert "onnxruntime-gpu" not in json.dumps(project["optional-dependencies"])  # never two builds at once


@pytest.mark.slow
def test_a_bare_environment_generates(tiny_root: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pins = [f"{name}=={_version(name)}" for name in sorted(RUNTIME)]  # what this environment runs, from the registry
    subprocess.run([py, "-m", "pip", "install", "-q", *pins], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(ROOT)], check=True,
                   cwd=tmp_path)
    script = f"""
import importlib.util, json
from edge_sd import GenerationConfig, Pipeline
missing = [m for m in ("typer", "rich", "jinja2", "torch", "transformers", "matplotlib")
           if importlib.util.find_spec(m) is None]
pipe = Pipeline.from_folder({str(tiny_root / "pairs" / "gemma_qwen")!r}, provider="cpu", threads=2)
r = pipe.generate("The cat", GenerationConfig(max_new_tokens=8, algorithm="slem", lookahead=2))
print(json.dumps({{"n": len(r.token_ids), "missing": missing, "harness": importlib.util.find_spec("edge_sd.bench")
                  is not None}}))
"""
    out = subprocess.run([py, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"n": 8, "missing": ["typer", "rich", "jinja2", "torch", "transformers", "matplotlib"],
                      "harness": False}  # the benchmark harness runs from a clone, not from the package
    cli = subprocess.run([str(venv / "bin" / "edge-sd"), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert cli.returncode != 0 and "pip install '.[cli]'" in cli.stderr + cli.stdout


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)
