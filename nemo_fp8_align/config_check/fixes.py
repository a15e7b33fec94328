"""The check's fixes as one pasteable override line, re-checked before it is shown.

Each violation's ``fix`` is either Hydra overrides (``key=value``, ``+key=value``, ``~key``,
shell-quoted where a value needs it) or, where no override can fix it, a sentence.
:func:`fix_line` joins the overrides of every violation, applies them to the same config through
the caller's ``recheck`` (the command line composes the YAML again with the user's overrides
and the line, exactly as pasting it would), and adds the fixes of what the next round still
finds, until the line passes or a round adds nothing. Only a line that passed is shown as
passing; otherwise it says what is left. Pure string work: no Hydra, no NeMo.

The same machinery serves Megatron-LM's argument lists: a :class:`Spelling` says how a fix is
cut into edits, which setting an edit changes and how the line is written (:data:`HYDRA` here;
Megatron-LM's flags in :mod:`.megatron_lm_edits`). :func:`agreeing` rewrites one violation's
fix with the line's values, so the per-violation fixes never contradict the line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from nemo_fp8_align.config_check.reader import Violation

__all__ = ["FixLine", "HYDRA", "Spelling", "agreeing", "fix_line", "override_key", "pasteable",
           "with_form"]

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


@dataclass(frozen=True)
class Spelling:
    """How fixes are written in one kind of command line.

    ``split``: the edits of one violation's fix (None: a sentence, not edits); ``key``: the
    setting an edit changes (a later edit of the same key replaces an earlier one); ``form``:
    an edit as the checked command line needs it, given ``present(key)``; ``join``: the edits
    as one printed line.
    """

    split: Callable[[str], Optional[List[str]]]
    key: Callable[[str], str]
    form: Callable[[str, Callable[[str], bool]], str]
    join: Callable[[List[str]], str]


#: Hydra overrides (NeMo configs and launcher YAMLs).
HYDRA = Spelling(pasteable, override_key, with_form, shlex.join)


def _merge(line: List[str], new: Sequence[str], key: Callable[[str], str]) -> List[str]:
    """``line`` with ``new`` added; a later value of the same key replaces the earlier one."""
    merged: Dict[str, str] = {key(o): o for o in line}
    for override in new:
        merged[key(override)] = override
    return list(merged.values())


@dataclass
class FixLine:
    """The combined fix: ``overrides`` (pasteable, in order); ``passes`` when the re-check of
    the config with them found nothing; ``manual`` the fixes no override can make; ``left``
    what the last re-check still found; ``later`` what a re-check found that the config as
    given did not show (its fix is in the line: each part of the line has its reason)."""

    overrides: List[str] = field(default_factory=list)
    passes: bool = False
    manual: List[Violation] = field(default_factory=list)
    left: List[Violation] = field(default_factory=list)
    later: List[Violation] = field(default_factory=list)
    spelling: Spelling = HYDRA

    @property
    def text(self) -> str:
        return self.spelling.join(self.overrides)


def agreeing(fix: str, line: FixLine) -> str:
    """``fix`` (one violation's) with every edit of a setting the line also changes replaced by
    the line's edit: each violation's fix is then a part of the re-checked line, never a value
    the line contradicts (say VP 2 for one violation and VP 3 for the next). A sentence, or a
    fix the line agrees with, is returned as it is."""
    spelling = line.spelling
    edits = spelling.split(fix)
    if edits is None or not line.overrides:
        return fix
    chosen = {spelling.key(o): o for o in line.overrides}
    if all(chosen.get(spelling.key(e), e) == e for e in edits):
        return fix
    return spelling.join(_merge([], [chosen.get(spelling.key(e), e) for e in edits],
                                spelling.key))


def fix_line(violations: Sequence[Violation],
             recheck: Callable[[List[str]], List[Violation]],
             present: Callable[[str], bool], spelling: Spelling = HYDRA) -> FixLine:
    """Combine the fixes of ``violations`` and re-check them (see the module docstring).

    Args:
        violations: what the check found on the config as given.
        recheck: the violations of the same config with these extra overrides.
        present: whether a key is in the config as given (decides ``+`` or plain).
        spelling: how the command line writes a fix (Hydra overrides by default).
    """
    result = FixLine(spelling=spelling)
    found = list(violations)
    for _ in range(_MAX_ROUNDS):
        new: List[str] = []
        for v in found:
            overrides = spelling.split(v.fix)
            if overrides is None:
                if v not in result.manual:
                    result.manual.append(v)
            else:
                new.extend(spelling.form(o, present) for o in overrides)
        merged = _merge(result.overrides, new, spelling.key)
        if merged == result.overrides:
            break  # this round adds nothing: what is left needs a person
        result.overrides = merged
        found = recheck(result.overrides)
        given = {v.key for v in violations}  # a key found again is the same problem
        result.later += [v for v in found if spelling.split(v.fix) is not None
                         and v.key not in given and v not in result.later]
        if not found:
            result.passes = True
            result.left = []
            return result
    result.left = found
    return result
