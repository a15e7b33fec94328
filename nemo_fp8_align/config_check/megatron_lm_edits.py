"""The check's fixes as edits of a Megatron-LM argument list, so that the combined fix line of
:mod:`.fixes` (the same machinery as for Hydra overrides) can be applied, parsed and checked
again before it is printed.

A Megatron-LM violation's fix is ``; ``-separated parts, each one edit::

    --pipeline-model-parallel-size 4     set a flag (replacing any occurrence of it)
    --fp8-param-gather                   set a switch
    drop --no-align-param-gather         remove a flag (and its values)
    launch 128 processes ..., and check with --world-size 128    the world size

and anything else (``none that keeps ...``, ``<a ... layout>``, ``correct --x ...``) is a
sentence, which no edit makes. An edit is kept as one string (``--flag v``, ``drop --flag``,
``--world-size N``); :func:`edit_key` is the setting it changes (the flag's ``dest``, so a VP
given twice, or a flag and its drop, are one setting), and :func:`apply_edits` replaces each
set flag where the list has it and appends it otherwise: what a user editing the launch script
does, and what the re-check parses. Pure string work; no Megatron-LM import.
"""

from __future__ import annotations

import re
import shlex
from typing import List, Optional, Sequence, Tuple

from nemo_fp8_align.config_check.fixes import Spelling
from nemo_fp8_align.config_check.megatron_lm_parser import flag_spec

__all__ = ["MEGATRON_LM", "WORLD_FLAG", "apply_edits", "edit_key", "join_edits", "split_fix"]

WORLD_FLAG = "--world-size"
_DROP = "drop "
_LAUNCH = re.compile(r"^launch (\d+) processes\b.*--world-size (\d+)\)?$")


def _value_count(flag: str) -> Optional[int]:
    """Values a set edit of ``flag`` carries (0 for a switch); None: not a Megatron-LM flag."""
    row = flag_spec().get(flag)
    if row is None:
        return None
    if row["kind"] != "store":
        return 0
    nargs = row["nargs"]
    return 1 if nargs is None else nargs if type(nargs) is int else -1  # -1: one or more


def _edit_of(part: str) -> Optional[str]:
    """One part of a fix as an edit, or None when it is a sentence."""
    launch = _LAUNCH.match(part)
    if launch is not None and launch.group(1) == launch.group(2):
        return f"{WORLD_FLAG} {launch.group(1)}"
    if part.startswith(_DROP):
        target = part[len(_DROP):].strip()
        return part if target and " " not in target and "<" not in target else None
    try:
        tokens = shlex.split(part)
    except ValueError:
        return None
    if not tokens or "<" in part:
        return None
    count = _value_count(tokens[0])
    values = len(tokens) - 1
    if count is None or (count >= 0 and values != count) or (count < 0 and values < 1):
        return None
    return shlex.join(tokens)


def split_fix(fix: str) -> Optional[List[str]]:
    """The edits of one violation's fix; None when any part of it is a sentence."""
    edits = [_edit_of(part.strip()) for part in fix.split("; ")]
    return None if not edits or any(e is None for e in edits) else edits  # type: ignore


def _target(edit: str) -> str:
    """The flag (or stray token) an edit sets or drops."""
    return edit[len(_DROP):] if edit.startswith(_DROP) else shlex.split(edit)[0]


def edit_key(edit: str) -> str:
    """The setting ``edit`` changes: the flag's ``dest`` (one key for every spelling of it)."""
    target = _target(edit)
    row = flag_spec().get(target)
    return row["dest"] if row is not None else target


def join_edits(edits: Sequence[str]) -> str:
    """The edits as one line: the flags to set, then ``drop ...``, then the world size."""
    sets = [e for e in edits if not e.startswith(_DROP) and _target(e) != WORLD_FLAG]
    drops = [_target(e) for e in edits if e.startswith(_DROP)]
    world = [e.split()[1] for e in edits if _target(e) == WORLD_FLAG]
    parts = [" ".join(sets)] if sets else []
    if drops:
        parts.append("drop " + " ".join(drops))
    if world:
        parts.append(f"launch {world[-1]} processes ({WORLD_FLAG} {world[-1]})")
    return "; ".join(parts)


def _occurrences(argv: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``argv`` cut into (token, the values read with it): a flag with the values its
    ``nargs`` reads, an unknown flag with the values after it (the parser reports them
    together as 'unrecognized arguments'), a stray value alone."""
    out: List[Tuple[str, List[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        count = (0 if eq or not token.startswith("--") else
                 _value_count(name) if name in flag_spec() else -1)
        i += 1
        values: List[str] = []
        while i < len(argv) and count != 0 and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
            count -= 1
        out.append((token, values))
    return out


def _without(argv: Sequence[str], dest: str, target: str) -> List[str]:
    """``argv`` without every flag of ``dest`` (and its values); where ``target`` is no
    Megatron-LM flag, without that token (an unknown flag, a stray value) instead."""
    spec = flag_spec()
    out: List[str] = []
    for token, values in _occurrences(argv):
        name = token.partition("=")[0]
        row = spec.get(name) if token.startswith("--") else None
        if (row is not None and row["dest"] == dest) or (row is None and name == target):
            continue
        out += [token, *values]
    return out


def apply_edits(argv: Sequence[str], edits: Sequence[str],
                world: Optional[int]) -> Tuple[List[str], Optional[int]]:
    """(argument list, world size) after ``edits``: each set flag replaces every occurrence of
    its setting and is appended; each drop removes its flag; ``--world-size N`` is the world."""
    out = list(argv)
    appended: List[str] = []
    for edit in edits:
        target = _target(edit)
        if target == WORLD_FLAG:
            world = int(edit.split()[1])
            continue
        out = _without(out, edit_key(edit), target)
        if not edit.startswith(_DROP):
            appended += shlex.split(edit)
    return out + appended, world


#: Megatron-LM's flags, for :func:`.fixes.fix_line` (no ``+`` forms: ``present`` is unused).
MEGATRON_LM = Spelling(split_fix, edit_key, lambda edit, present: edit, join_edits)
