"""Reading a NeMo config for the startup check: values, their absence, and the violations.

A :class:`Reader` wraps one OmegaConf node; every rule of :mod:`nemo_fp8_align.config_check.check` reads
through it, so a missing key, a value of the wrong type, a parent that is not a mapping or an
unresolvable interpolation becomes a :class:`Violation` with the full key and the Hydra override
that fixes it. Reading never raises: whatever a YAML holds ends as a violation, not a traceback.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass, replace
from typing import Any, List, Mapping, Optional, Set, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["ABSENT", "UNRESOLVED", "Reader", "Violation", "hydra_value", "show_value",
           "with_typo_hints"]


@dataclass(frozen=True)
class Violation:
    """One setting that stops the plugin from working.

    Attributes:
        key: full dotted key, e.g. ``model.fp8_params``.
        found: the value found, as text (``<missing>`` when the key is absent).
        expected: what the key must hold, and why.
        fix: the Hydra override that fixes it (``+key=value`` when the key is absent).
    """

    key: str
    found: str
    expected: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: found {self.found}; expected {self.expected} | fix: {self.fix}"


class _Absent:
    def __repr__(self) -> str:
        return "<missing>"


ABSENT: Any = _Absent()


class _Unresolved:
    """A value that could not be read (an interpolation that fails, a parent that is not a
    mapping): reported once, where it was first read; later rules do not report it again."""

    def __repr__(self) -> str:
        return "<unreadable>"


UNRESOLVED: Any = _Unresolved()


def show_value(value: Any) -> str:
    if value is ABSENT:
        return "<missing>"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) + " (a string)"
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            return repr(OmegaConf.to_container(value, resolve=False))
        except Exception:  # noqa: BLE001 - a value shown in a message must never raise
            return type(value).__name__
    return repr(value)


#: A string Hydra's override grammar reads back unquoted as the same string.
_PLAIN_STRING = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./:+-]*$")
#: ``<the model's layer count>``: a value the user must choose (never quoted, never pasteable).
_PLACEHOLDER = re.compile(r"^<.*>$")
_OTHER_TYPE = re.compile(r"^(true|false|null|nan|inf|[-+]?[0-9][0-9_.e+-]*)$", re.I)


def hydra_value(value: Any) -> str:
    """``value`` as Hydra's override grammar reads it back: a string that it would parse as
    something else (``{rank}`` braces, ``True``, ``1``) is quoted."""
    if value is None:
        return "null"
    if isinstance(value, str) and not _PLACEHOLDER.match(value) and (
            not _PLAIN_STRING.match(value) or _OTHER_TYPE.match(value)):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


class Reader:
    """Reads keys of one node, recording violations with full keys and Hydra fixes."""

    def __init__(self, node: Any, prefix: str,
                 violations: Optional[List[Violation]] = None) -> None:
        self.node = node if isinstance(node, DictConfig) else OmegaConf.create({})
        self.prefix = prefix
        #: Shared between the readers of one check, so violations keep the rules' order.
        self.violations: List[Violation] = [] if violations is None else violations
        #: Every key a rule asked for: a missing key is never "corrected" to one of these.
        self.read_keys: Set[str] = set()
        self._unreadable: Set[str] = set()

    def get(self, key: str) -> Any:
        """The resolved value at dotted ``key``; ABSENT when missing (or ``???``, or under a
        null parent); UNRESOLVED (reported here, once) when an interpolation on the way fails
        or a parent is not a mapping."""
        self.read_keys.add(key)
        parts = key.split(".")
        node: Any = self.node
        for depth, part in enumerate(parts):
            path = ".".join(parts[:depth + 1])
            if path in self._unreadable:
                return UNRESOLVED
            value = self._child(node, part, path)
            if value is ABSENT or value is UNRESOLVED or depth == len(parts) - 1:
                return value
            if value is None:
                return ABSENT  # `optim: null` reads like no optim block (NeMo uses .get)
            if not isinstance(value, DictConfig):
                self._unreadable.add(path)
                self.violations.append(Violation(
                    self.prefix + path, show_value(value),
                    f"a mapping (it holds {'.'.join(parts[depth + 1:])})",
                    f"{self.prefix}{path}={{}} and then set the keys it needs"))
                return UNRESOLVED
            node = value
        return ABSENT  # unreachable: the loop returns at the last part

    def _child(self, node: DictConfig, part: str, path: str) -> Any:
        try:
            if part not in node:
                return ABSENT
            return OmegaConf.select(node, part, default=ABSENT, throw_on_resolution_failure=True)
        except Exception as err:  # noqa: BLE001 - OmegaConf, a resolver's own error, ...
            self._unreadable.add(path)
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            self.violations.append(Violation(
                self.prefix + path, "an interpolation that does not resolve",
                f"a value that resolves ({type(err).__name__}: {reason})",
                f"{self.prefix}{path}=<a literal value>"))
            return UNRESOLVED

    def override(self, key: str, value: Any, present: bool) -> str:
        """The Hydra override setting ``key`` to ``value`` (``+`` when the key is absent),
        shell-quoted when the value needs it (so the printed line can be pasted)."""
        text = f"{'' if present else '+'}{self.prefix}{key}={hydra_value(value)}"
        return text if _PLACEHOLDER.match(str(value)) else shlex.quote(text)

    def add(self, key: str, found: Any, expected: str, value: Any = None, *,
            fix: Optional[str] = None) -> None:
        """Record a violation; the fix sets ``key`` to ``value`` unless ``fix`` is given.
        An exact repeat of a recorded violation is dropped."""
        violation = self.violation(key, found, expected, value, fix=fix)
        if violation is not None and violation not in self.violations:
            self.violations.append(violation)

    def violation(self, key: str, found: Any, expected: str, value: Any = None, *,
                  fix: Optional[str] = None) -> Optional[Violation]:
        """The violation :meth:`add` records, not recorded (None for an unreadable value,
        already reported by :meth:`get`)."""
        if found is UNRESOLVED:
            return None
        if fix is None:
            fix = self.override(key, value, present=found is not ABSENT)
        return Violation(self.prefix + key, show_value(found), expected, fix)

    def require_true(self, key: str, why: str) -> bool:
        value = self.get(key)
        if value is True:
            return True
        self.add(key, value, f"True ({why})", True)
        return False

    def bool_or_default(self, key: str, default: bool, why: str) -> Optional[bool]:
        """A bool that may be absent (then ``default``); None after a type violation."""
        value = self.get(key)
        if value is ABSENT:
            return default
        if isinstance(value, bool):
            return value
        self.add(key, value, f"a bool ({why})", default)
        return None

    def int_at_least(self, key: str, minimum: int, why: str, *,
                     default: Any = ABSENT) -> Optional[int]:
        """An int >= ``minimum``; ``default`` when absent (a violation if no default)."""
        value = self.get(key)
        if value is ABSENT and default is not ABSENT:
            return default
        if type(value) is int and value >= minimum:
            return value
        suggestion = minimum
        if isinstance(value, str) and value.strip().isdigit() and int(value) >= minimum:
            suggestion = int(value)  # right number, wrong type ("2")
        self.add(key, value, f"an int >= {minimum} ({why})", suggestion)
        return None

    def peek_int(self, key: str, default: Optional[int] = None) -> Optional[int]:
        """A valid positive int at ``key`` (``default`` when absent), else None; records
        nothing but an unreadable value (the rule that owns the key reports the rest)."""
        value = self.get(key)
        if value is ABSENT:
            return default
        return value if type(value) is int and value >= 1 else None

    def optional_int(self, key: str, minimum: int, why: str) -> Tuple[bool, Optional[int]]:
        """(ok, value) of an int key that may be absent or null."""
        value = self.get(key)
        if value is ABSENT or value is None:
            return True, None
        if type(value) is int and value >= minimum:
            return True, value
        self.add(key, value, f"null or an int >= {minimum} ({why})", None)
        return False, None


def with_typo_hints(violations: List[Violation], readers: Mapping[str, Reader]
                    ) -> List[Violation]:
    """A ``<missing>`` key whose node holds a key spelt almost alike (that no rule reads) is
    most likely that key misspelt: say so, and make the fix a rename."""
    out = []
    for v in violations:
        hint = _close_sibling(v.key, readers) if v.found == "<missing>" else None
        if hint is not None:
            value = v.fix.rpartition("=")[2]
            v = replace(v, expected=f"{v.expected}; {hint} is set: did you mean "
                                    f"{v.key}? (the fix renames it)",
                        fix=f"~{hint} +{v.key}={value}")
        out.append(v)
    return out


def _close_sibling(full_key: str, readers: Mapping[str, Reader]) -> Optional[str]:
    for prefix, reader in readers.items():
        if not full_key.startswith(prefix):
            continue
        parent, _, leaf = full_key[len(prefix):].rpartition(".")
        node = reader.node if not parent else OmegaConf.select(reader.node, parent, default=None,
                                                                 throw_on_resolution_failure=False)
        if not isinstance(node, DictConfig):
            return None
        known = {k.rpartition(".")[2] for k in reader.read_keys
                 if k.rpartition(".")[0] == parent}
        siblings = [str(k) for k in node.keys() if str(k) not in known]
        close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.8)
        return f"{prefix}{parent + '.' if parent else ''}{close[0]}" if close else None
    return None
