"""Reading a NeMo config for the startup check: values, their absence, and the violations.

A :class:`Reader` wraps one OmegaConf node; every rule of :mod:`nemo_fp8_align.nemo.check` reads
through it, so a missing key, a value of the wrong type or an unresolvable interpolation becomes
a :class:`Violation` with the full key and the Hydra override that fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["ABSENT", "UNRESOLVED", "Reader", "Violation", "hydra_value", "show_value", "split_config"]


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
    """A value whose interpolation failed to resolve: reported once, where it was read."""

    def __repr__(self) -> str:
        return "<unresolvable interpolation>"


UNRESOLVED: Any = _Unresolved()


def split_config(cfg: Union[DictConfig, Mapping]) -> Tuple[DictConfig, Optional[DictConfig]]:
    """(model node, trainer node or None) of a full training config or of a model node."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    model = cfg.get("model") if "model" in cfg else None
    if isinstance(model, DictConfig):
        trainer = cfg.get("trainer") if "trainer" in cfg else None
        return model, trainer if isinstance(trainer, DictConfig) else None
    return cfg, None


def show_value(value: Any) -> str:
    if value is ABSENT:
        return "<missing>"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) + " (a string)"
    return repr(value)


def hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    return str(value)


class Reader:
    """Reads keys of one node, recording violations with full keys and Hydra fixes."""

    def __init__(self, node: DictConfig, prefix: str) -> None:
        self.node = node
        self.prefix = prefix
        self.violations: List[Violation] = []

    def get(self, key: str) -> Any:
        """The resolved value at dotted ``key``; ABSENT when missing (or ``???``).

        An interpolation that does not resolve is reported here and read as UNRESOLVED, which
        later rules do not report again.
        """
        try:
            return OmegaConf.select(self.node, key, default=ABSENT,
                                    throw_on_resolution_failure=True)
        except OmegaConfBaseException as err:
            self.violations.append(Violation(
                self.prefix + key, "an interpolation that does not resolve",
                f"a value that resolves ({type(err).__name__}: {str(err).splitlines()[0]})",
                f"{self.prefix}{key}=<a literal value>"))
            return UNRESOLVED

    def override(self, key: str, value: Any, present: bool) -> str:
        """The Hydra override setting ``key`` to ``value`` (``+`` when the key is absent)."""
        return f"{'' if present else '+'}{self.prefix}{key}={hydra_value(value)}"

    def add(self, key: str, found: Any, expected: str, value: Any = None, *,
            fix: Optional[str] = None) -> None:
        """Record a violation; the fix sets ``key`` to ``value`` unless ``fix`` is given."""
        if found is UNRESOLVED:
            return  # already reported by get()
        if fix is None:
            fix = self.override(key, value, present=found is not ABSENT)
        self.violations.append(Violation(self.prefix + key, show_value(found), expected, fix))

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

    def int_at_least(self, key: str, minimum: int, why: str) -> Optional[int]:
        value = self.get(key)
        if type(value) is int and value >= minimum:
            return value
        suggestion = minimum
        if isinstance(value, str) and value.strip().isdigit() and int(value) >= minimum:
            suggestion = int(value)  # right number, wrong type ("2")
        self.add(key, value, f"an int >= {minimum} ({why})", suggestion)
        return None

    def optional_int(self, key: str, minimum: int, why: str) -> Tuple[bool, Optional[int]]:
        """(ok, value) of an int key that may be absent or null."""
        value = self.get(key)
        if value is ABSENT or value is None:
            return True, None
        if type(value) is int and value >= minimum:
            return True, value
        self.add(key, value, f"null or an int >= {minimum} ({why})", "null")
        return False, None
