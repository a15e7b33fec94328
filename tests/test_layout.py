"""The house rules of the layout, checked on the tree: no import cycle between the project's
modules (the package, validation/, benchmarks/), no package file over 400 lines, and a wheel
that holds exactly the runtime package (an allow-list: no test scaffolding, no fault injection)."""

import ast
import os
import shutil
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


def test_tests_import_shared_helpers_from_support_only():
    """A test module imports no other module of tests/ (a test module or a loose helper):
    what several tests share lives in tests/support/."""
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in local]
    assert found == []


#: The allow-list of the wheel: the package's directories whose modules ship (a new directory
#: ships only once it is named here), and the test tools inside the package that do not.
WHEEL_DIRS = ("", "backends", "cli", "config_check", "config_check/rules", "core", "demo",
              "integrations", "integrations/nemo", "kernels", "nemo", "planner", "sync")
TEST_TOOLS = ("demo/faults",)
#: Data files that ship with the modules (pyproject.toml's package-data).
DATA_FILES = ("config_check/megatron_lm_flags.txt",)
DIST_INFO = ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")


def _allowed_wheel_files(version: str) -> Set[str]:
    """Every runtime module of the checkout (``*.py`` directly in a :data:`WHEEL_DIRS`
    directory, none under :data:`TEST_TOOLS`) and the wheel's own metadata."""
    modules = {f"{PACKAGE}/{d + '/' if d else ''}{p.name}"
               for d in WHEEL_DIRS for p in (ROOT / PACKAGE / d).glob("*.py")}
    return (modules | {f"{PACKAGE}/{name}" for name in DATA_FILES}
            | {f"{PACKAGE}-{version}.dist-info/{n}" for n in DIST_INFO})


def _build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of the sources: an in-tree build would also pack whatever a
    stale ``build/`` or ``*.egg-info`` left there."""
    src = out / "src"
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_holds_exactly_the_runtime_package(tmp_path):
    """Allow-list: the wheel's files are the runtime modules and the metadata, nothing else (no
    tests/support scaffolding, no fault injection), and every runtime module is there."""
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    version = wheel.name.split("-")[1]
    allowed = _allowed_wheel_files(version)
    assert f"{PACKAGE}/core/aligner.py" in allowed
    assert not any(n.startswith(f"{PACKAGE}/{t}") for t in TEST_TOOLS for n in allowed)
    assert sorted(names - allowed) == [], "shipped but not allowed"
    assert sorted(allowed - names) == [], "runtime modules missing from the wheel"


@pytest.mark.slow
def test_demo_fault_from_the_wheel_says_it_is_a_test_tool(tmp_path):
    """The installed package has no fault injection: ``demo --fault`` exits 2 saying it runs
    from a source checkout (the checkout's own package is not on the path here)."""
    site = tmp_path / "site"
    zipfile.ZipFile(_build_wheel(tmp_path)).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", PACKAGE, "demo", "--fault",
                          "mismatch_on_one_rank"], cwd=site, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "fault injection is a test tool that runs from a source checkout" in run.stderr
    where = subprocess.run([sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
                           cwd=site, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip() == str(site / PACKAGE / "__init__.py")
