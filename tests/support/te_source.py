"""Transformer Engine's Python source read with ``ast`` (never imported: TE needs CUDA): the
modules, classes (through their bases and re-exports) and functions of one released version,
unpacked by ``make test`` from its wheel into ``.te-wheels/<version>/transformer_engine/``."""

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set


class TESource:
    def __init__(self, root: Path) -> None:
        self.root = root  # the folder holding transformer_engine/
        self._trees: Dict[Path, Optional[ast.Module]] = {}

    def module_file(self, dotted: str) -> Optional[Path]:
        base = self.root.joinpath(*dotted.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text(encoding="utf-8"), str(path))
        return self._trees[path]

    def _dotted(self, path: Path) -> str:
        rel = path.relative_to(self.root).with_suffix("")
        parts = list(rel.parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _import_target(self, path: Path, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self._dotted(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    def find(self, dotted: str, name: str, kind=(ast.ClassDef, ast.FunctionDef),
             _seen: Optional[Set] = None) -> Optional[tuple]:
        """``(node, file)`` of top-level ``name`` in module ``dotted``, following ``from x import
        name`` re-exports; None where the module or the name is absent."""
        seen = _seen if _seen is not None else set()
        path = self.module_file(dotted)
        if path is None or (path, name) in seen:
            return None
        seen.add((path, name))
        for node in self.tree(path).body:
            if isinstance(node, kind) and node.name == name:
                return node, path
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname in (None, name)
                                                        for a in node.names):
                target = self._import_target(path, node)
                found = self.find(target, name, kind, seen) or self.find(f"{target}.{name}", name,
                                                                          kind, seen)
                if found:
                    return found
        return None

    def hierarchy(self, cls: ast.ClassDef, path: Path) -> Iterator[ast.ClassDef]:
        """``cls`` and its bases defined in TE (resolved through the imports of each class's
        own module), depth first."""
        yield cls
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name is None:
                continue
            found = self.find(self._dotted(path), name, (ast.ClassDef,))
            if found:
                yield from self.hierarchy(*found)

    def method(self, classes: List[ast.ClassDef], name: str) -> Optional[ast.FunctionDef]:
        for cls in classes:
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return node
        return None

    @staticmethod
    def self_attributes(classes: List[ast.ClassDef]) -> Set[str]:
        """Attributes the classes' methods assign on ``self``."""
        out = set()
        for cls in classes:
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        out.add(t.attr)
        return out

    @staticmethod
    def class_properties(classes: List[ast.ClassDef]) -> Dict[str, List[str]]:
        """Class-level ``name = property(...)`` assignments: name -> the string constants in
        the call (TE 1.x: the ``_fp8_attrs`` key behind each property)."""
        out: Dict[str, List[str]] = {}
        for cls in classes:
            for node in cls.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                        and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    out.setdefault(node.targets[0].id, [
                        c.value for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)])
        return out


def accepts_keywords(fn: ast.FunctionDef, names) -> List[str]:
    """The keyword names ``fn`` does not accept (none where it takes ``**kwargs``)."""
    if fn.args.kwarg is not None:
        return []
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    return [n for n in names if n not in params]
