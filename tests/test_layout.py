"""The shape of the code: the runtime (what an app imports) apart from the tools, no import cycles,
small modules and functions, nothing in the runtime beyond numpy, onnxruntime, tokenizers and jinja2,
and a wheel without the benchmark harness."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edge_sd"
# What is not the runtime: the command line and its helpers, the exporter, the benchmark harness.
TOOLS = ("tools", "export", "bench")
RUNTIME_IMPORTS = {"numpy", "onnxruntime", "tokenizers", "jinja2"}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def runtime(name: str) -> bool:
    parts = name.split(".")
    return not (len(parts) > 1 and parts[1] in TOOLS)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at run time) for every import in a file: False for those under `if TYPE_CHECKING`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) not in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(f"{node.module}.{a.name}", id(node) not in typing_only) for a in node.names]
            found.append((node.module, id(node) not in typing_only))
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (a package's own submodules aside:
    importing them from its __init__ is how it exports them)."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, at_run_time in imports(path):
            if at_run_time and target in mods and target != name and not name.startswith(target + "."):
                if not (path.name == "__init__.py" and target.startswith(name + ".")):
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []
    # the check finds one where there is one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_the_runtime_imports_neither_tools_nor_heavy_libraries() -> None:
    stdlib = set(sys.stdlib_module_names)
    wrong = []
    for name, path in modules().items():
        if not runtime(name):
            continue
        for target, _ in imports(path):
            top = target.split(".")[0]
            if top == "edge_sd":
                if target in modules() and not runtime(target):
                    wrong.append(f"{name} imports the tool {target}")
            elif top not in stdlib and top not in RUNTIME_IMPORTS:
                wrong.append(f"{name} imports {top}")
    assert not wrong, wrong


def test_modules_and_functions_are_small() -> None:
    big = []
    for name, path in modules().items():
        if not runtime(name):
            continue
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name}: {length} lines")
    assert not big, big


def test_the_wheel_holds_no_benchmark_harness(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = tmp_path.glob("edge_sd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "edge_sd/generator.py" in names and "edge_sd/tools/cli.py" in names
    assert not [n for n in names if n.startswith("edge_sd/bench/")]
