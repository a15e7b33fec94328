"""The house rules of the layout, checked on the tree: no import cycle between the project's
modules (the package, validation/, benchmarks/), no package file over 400 lines, and no test
scaffolding in the installed wheel."""

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nemo_fp8_align"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> Dict[str, Path]:
    files = list((ROOT / PACKAGE).rglob("*.py")) + list((ROOT / "validation").glob("*.py"))
    return {_module_name(p): p for p in files}


def _imports(path: Path, name: str, known: Set[str]) -> Set[str]:
    """Project modules ``path`` imports, at any depth (a function-level import is still an
    edge of the design)."""
    is_pkg = path.name == "__init__.py"
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _graph() -> Dict[str, Set[str]]:
    modules = _project_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        # A package's __init__ importing its own submodules (re-exports) is not a cycle of the
        # design; the submodules importing the package root for a name is what would be one.
        graph[name] = {t for t in _imports(path, name, known)
                       if not (path.name == "__init__.py" and t.startswith(name + "."))}
    return graph


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_an_import_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_package_files_are_small():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / PACKAGE).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.slow
def test_the_wheel_holds_no_test_scaffolding(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n == f"{PACKAGE}/core/aligner.py" for n in names)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {PACKAGE}, top
    scaffolding = [n for n in names if any(s in n for s in (
        "cpu_nemo", "dist_checkpoint", "host_staging", "standins", "run_nemo_cpu",
        "reference_fp8_layers", "/testing/", "/compat/"))]
    assert scaffolding == []
