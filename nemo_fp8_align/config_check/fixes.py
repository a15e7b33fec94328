"""The check's fixes as one pasteable override line, re-checked before it is shown.

Each violation's ``fix`` is either Hydra overrides (``key=value``, ``+key=value``, ``~key``,
shell-quoted where a value needs it) or, where no override can fix it, a sentence.
:func:`fix_line` joins the overrides of every violation, applies them to the same config through
the caller's ``recheck`` (the command line composes the YAML again with the user's overrides
and the line, exactly as pasting it would), and adds the fixes of what the next round still
finds, until the line passes or a round adds nothing. Only a line that passed is shown as
passing; otherwise it says what is left. Pure string work: no Hydra, no NeMo.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from nemo_fp8_align.config_check.reader import Violation

__all__ = ["FixLine", "fix_line", "override_key", "pasteable", "with_form"]

_OVERRIDE = re.compile(r"^(~|\+\+|\+)?([A-Za-z_][\w.-]*)(?:=(.*))?$", re.S)
_MAX_ROUNDS = 4


def pasteable(fix: str) -> Optional[List[str]]:
    """The overrides in ``fix``; None when it is not a list of overrides (a sentence, a
    ``<placeholder>``, a command-line flag)."""
    try:
        tokens = shlex.split(fix)
    except ValueError:
        return None
    if not tokens:
        return None
    for token in tokens:
        match = _OVERRIDE.match(token)
        if match is None or "<" in token or (match.group(1) != "~" and match.group(3) is None):
            return None
    return tokens


def override_key(override: str) -> str:
    """``model.x`` of ``+model.x=1``; ``~model.x`` stays its own key (a deletion)."""
    match = _OVERRIDE.match(override)
    if match is None:
        return override
    return ("~" if match.group(1) == "~" else "") + match.group(2)


def with_form(override: str, present: Callable[[str], bool]) -> str:
    """``override`` written as the checked config needs it: plain where the key is there,
    ``+`` where it is not (Hydra refuses a plain override of an absent key, and ``+`` of a
    present one)."""
    match = _OVERRIDE.match(override)
    if match is None or match.group(1) == "~":
        return override
    key, value = match.group(2), match.group(3)
    return f"{'' if present(key) else '+'}{key}={value}"


def _merge(line: List[str], new: Sequence[str]) -> List[str]:
    """``line`` with ``new`` added; a later value of the same key replaces the earlier one."""
    merged: Dict[str, str] = {override_key(o): o for o in line}
    for override in new:
        merged[override_key(override)] = override
    return list(merged.values())


@dataclass
class FixLine:
    """The combined fix: ``overrides`` (pasteable, in order); ``passes`` when the re-check of
    the config with them found nothing; ``manual`` the fixes no override can make; ``left``
    what the last re-check still found."""

    overrides: List[str] = field(default_factory=list)
    passes: bool = False
    manual: List[Violation] = field(default_factory=list)
    left: List[Violation] = field(default_factory=list)

    @property
    def text(self) -> str:
        return shlex.join(self.overrides)


def fix_line(violations: Sequence[Violation],
             recheck: Callable[[List[str]], List[Violation]],
             present: Callable[[str], bool]) -> FixLine:
    """Combine the fixes of ``violations`` and re-check them (see the module docstring).

    Args:
        violations: what the check found on the config as given.
        recheck: the violations of the same config with these extra overrides.
        present: whether a key is in the config as given (decides ``+`` or plain).
    """
    result = FixLine()
    found = list(violations)
    for _ in range(_MAX_ROUNDS):
        new: List[str] = []
        for v in found:
            overrides = pasteable(v.fix)
            if overrides is None:
                if v not in result.manual:
                    result.manual.append(v)
            else:
                new.extend(with_form(o, present) for o in overrides)
        merged = _merge(result.overrides, new)
        if merged == result.overrides:
            break  # this round adds nothing: what is left needs a person
        result.overrides = merged
        found = recheck(result.overrides)
        if not found:
            result.passes = True
            result.left = []
            return result
    result.left = found
    return result
