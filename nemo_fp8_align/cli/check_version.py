"""Which megatron-core version ``nemo-fp8-align check`` checks against: ``--megatron-core X.Y``,
else the importable one (its version read from its files, nothing imported:
:func:`~nemo_fp8_align.mcore_versions.importable_version`), else none (the newest
rules, and a note saying so). Returns the version's rules, or the error naming the flag."""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple, Optional

from nemo_fp8_align.mcore_versions import (NEWEST, OLDEST, VersionRules,
                                                       importable_rules, importable_version,
                                                       parse_version, rules_for)

__all__ = ["FLAG", "Target", "megatron_core_target"]

FLAG = "--megatron-core"
_KNOWN = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


class Target(NamedTuple):
    """The rules to check against (None: the newest), the note that says which, or the error
    of a malformed or unknown ``--megatron-core``."""

    rules: Optional[VersionRules]
    note: str
    error: Optional[str] = None


def megatron_core_target(args: argparse.Namespace) -> Target:
    given = getattr(args, "megatron_core", None)
    if given is not None:
        parsed = parse_version(given)
        if parsed is None or re.fullmatch(r"\d+\.\d+(\.\d+)?", given) is None:
            return Target(None, "", f"{FLAG} {given!r}: not a version; pass X.Y or X.Y.Z, e.g. "
                          f"{FLAG} 0.9.0 (the checked versions: {_KNOWN})")
        if not OLDEST <= parsed[:2] <= NEWEST:
            return Target(None, "", f"{FLAG} {given}: outside the versions the check knows "
                          f"({_KNOWN}); pass one of them, or leave the flag out to check "
                          "against the installed megatron-core")
        return Target(rules_for(given), f"checked against megatron-core {given} ({FLAG})")
    installed, rules = importable_version(), importable_rules()
    if installed is None:
        return Target(None, "megatron-core is not installed: checked against the newest "
                      f"megatron-core's rules; pass {FLAG} X.Y to check against another")
    if rules is None:
        return Target(None, f"megatron-core {installed} is installed, outside the versions the "
                      f"check knows ({_KNOWN}): checked against the newest megatron-core's "
                      f"rules; pass {FLAG} X.Y to check against another")
    return Target(rules, f"checked against megatron-core {installed} (the installed one; "
                  f"{FLAG} X.Y for another)")
