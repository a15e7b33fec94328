"""The house rules of the layout, checked on the tree: no import cycle between the project's
modules (the package, lab/, validation/), the package imports nothing from the folders beside
it (lab/, validation/, benchmarks/, tests/), and a wheel that holds exactly the runtime package
(an allow-list: no test scaffolding, no fault injection, no evidence or judges)."""

import ast
import fnmatch
import zipfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from support.wheel import BESIDE, PACKAGE, build_wheel

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> Dict[str, Path]:
    files = (list((ROOT / PACKAGE).rglob("*.py")) + list((ROOT / "lab").rglob("*.py"))
             + list((ROOT / "validation").glob("*.py")))
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


#: The top-level names of what runs from a checkout only: the package importing one of them
#: works in the checkout and fails from the wheel (``support`` is tests/support/ on the tests'
#: path).
CHECKOUT_ONLY = (*BESIDE, "support")


def _imported_names(tree: ast.AST) -> List[Tuple[ast.AST, str]]:
    """(node, dotted module name) for every import statement and every ``import_module`` /
    ``__import__`` call with a literal name, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node, node.module or ""))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node, node.args[0].value))
    return found


def checkout_imports(package: Path) -> List[str]:
    """``file:line: module`` for every import in ``package`` of a checkout-only folder."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        imports = _imported_names(ast.parse(path.read_text(encoding="utf-8")))
        for node, name in sorted(imports, key=lambda found: found[0].lineno):
            if name.split(".")[0] in CHECKOUT_ONLY:
                bad.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name}")
    return bad


def test_the_package_imports_nothing_from_the_checkout():
    """The wheel is the plugin: no module of the package imports lab/, validation/,
    benchmarks/ or tests/ (each is missing from a pip install)."""
    assert checkout_imports(ROOT / PACKAGE) == []


def test_an_import_of_the_lab_is_found(tmp_path):
    package = tmp_path / PACKAGE
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("import torch\n")
    (package / "core" / "a.py").write_text(
        "def f():\n    from lab.demo import train\n    import validation.real_stack_mcore\n")
    (package / "core" / "b.py").write_text(
        "import importlib\nimportlib.import_module('benchmarks.x')\nfrom support import y\n")
    assert checkout_imports(package) == [
        f"{PACKAGE}/core/a.py:2: lab.demo", f"{PACKAGE}/core/a.py:3: validation.real_stack_mcore",
        f"{PACKAGE}/core/b.py:2: benchmarks.x", f"{PACKAGE}/core/b.py:3: support"]


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
#: ships only once it is named here).
WHEEL_DIRS = ("", "adapters", "backends", "cli", "config_check", "config_check/rules", "core",
              "integrations", "integrations/nemo", "kernels", "nemo", "planner", "sync")
#: Names of modules and packages that exist for tests or evidence, never for a training job:
#: fault injection, evidence logs and judges, CPU redirects that patch torch, sleep models.
#: They live in lab/; the wheel holds none of them, wherever in the package one would appear.
EVIDENCE_NAMES = ("faults", "evidence", "cpu_redirects*", "*_judge", "sleep_model", "demo")
#: Data files that ship with the modules (pyproject.toml's package-data).
DATA_FILES = ("config_check/megatron_lm_flags.txt",)
DIST_INFO = ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")


def is_evidence(path: str) -> bool:
    """Whether a file path names a module or package of :data:`EVIDENCE_NAMES` (``a/faults/x.py``,
    ``a/cpu_redirects_x.py``, ``a/gpu_judge.py``)."""
    parts = Path(path).with_suffix("").parts
    return any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in EVIDENCE_NAMES)


def allowed_wheel_files(package: Path, version: str) -> Set[str]:
    """Every runtime module of the checkout (``*.py`` directly in a :data:`WHEEL_DIRS`
    directory, not named as evidence) and the wheel's own metadata."""
    modules = {f"{PACKAGE}/{d + '/' if d else ''}{p.name}"
               for d in WHEEL_DIRS for p in (package / d).glob("*.py")}
    return ({m for m in modules if not is_evidence(m)}
            | {f"{PACKAGE}/{name}" for name in DATA_FILES}
            | {f"{PACKAGE}-{version}.dist-info/{n}" for n in DIST_INFO})


def test_evidence_modules_are_not_allowed(tmp_path):
    """A module of the evidence kind is refused even in a directory that ships."""
    for rel in ("core/evidence.py", "core/faults/__init__.py", "backends/cpu_redirects.py",
                "backends/cpu_redirects_megatron_lm.py", "sync/megatron_lm_gpu_judge.py",
                "planner/sleep_model.py", "aligner_ok.py"):
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text("")
    allowed = allowed_wheel_files(tmp_path / PACKAGE, "0")
    assert {n for n in allowed if n.endswith(".py")} == {f"{PACKAGE}/aligner_ok.py"}


@pytest.mark.slow
def test_the_wheel_holds_exactly_the_runtime_package(tmp_path):
    """Allow-list: the wheel's files are the runtime modules and the metadata, nothing else (no
    tests/support scaffolding, no fault injection), and every runtime module is there."""
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    version = wheel.name.split("-")[1]
    allowed = allowed_wheel_files(ROOT / PACKAGE, version)
    assert f"{PACKAGE}/core/aligner.py" in allowed
    assert [n for n in names if is_evidence(n)] == [], "evidence shipped"
    assert sorted(names - allowed) == [], "shipped but not allowed"
    assert sorted(allowed - names) == [], "runtime modules missing from the wheel"
