"""The runtime never imports torch (or transformers, optimum): proven in a subprocess that cannot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'optimum'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_runtime_generates_without_torch(tiny_root: Path) -> None:
    code = BLOCK + f"""
import json
from edge_sd import Pipeline, GenerationConfig
from edge_sd.tools.cli import app
pipe = Pipeline.from_folder({str(tiny_root / 'pairs' / 'gemma_qwen')!r}, provider='cpu', threads=1)
r = pipe.generate('The cat', GenerationConfig(max_new_tokens=8, algorithm='slrs'))
try:
    import torch
    ok = False
except ImportError:
    ok = True
print(json.dumps({{'n': len(r.token_ids), 'blocked': ok,
                  'loaded': sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"n": 8, "blocked": True, "loaded": []}
