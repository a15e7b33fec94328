"""``nemo-fp8-align check --megatron-lm [--world-size N] -- ARGS...``: the startup check of a
Megatron-LM command line (the arguments after ``--``, as given to Megatron-LM's GPT pretraining
script). Exit status 0 and one line when valid, 2 with every violation, each naming the flag and
its fix, and one line of changes to the argument list that fixes them all: the fixes applied
together to the list, parsed and checked again before it is printed (the machinery of the NeMo
mode, :func:`~nemo_fp8_align.config_check.fixes.fix_line`, in Megatron-LM's spelling). With
``--format json``: one object with the NeMo mode's keys."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence, TextIO

__all__ = ["run_megatron_lm_check"]

EXIT_OK, EXIT_INVALID = 0, 2
#: Megatron-LM has no flag that turns the plugin off: it runs where the script attaches it.
PLUGIN_OFF = ("do not attach the plugin (leave out megatron_lm.post_wrap_hook() / "
              "megatron_lm.attach())")


def run_megatron_lm_check(args: argparse.Namespace, argv: List[str], out: TextIO,
                          err: TextIO) -> int:
    from nemo_fp8_align.cli.common import missing_dependency

    as_json = getattr(args, "format", "text") == "json"
    missing = missing_dependency("check --megatron-lm", (("omegaconf", "omegaconf", "hydra"),))
    world = args.world_size if args.world_size is not None else _env_world_size()
    if missing is None and world is not None and world < 1:
        missing = (f"--world-size {world}: the number of processes must be >= 1; pass e.g. "
                   "--world-size 8, or leave it out (WORLD_SIZE from the environment)")
    if missing is not None:
        if as_json:
            _emit(out, {"ok": False, "error": missing, "violations": [], "fix_overrides": []})
        else:
            print(f"error: {missing}", file=err)
        return EXIT_INVALID
    from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
    from nemo_fp8_align.config_check.megatron_lm_parser import parse_megatron_lm_argv

    from nemo_fp8_align.config_check.megatron_lm_parser import flag_source, host_validate

    mcore = getattr(args, "mcore_rules", None)
    source, verdict = flag_source(), host_validate(argv, world)
    # the version note, which reads the flags, and Megatron-LM's own validate_args beside
    # the plugin's verdict (where its parser is importable)
    note = [n for n in (getattr(args, "mcore_note", ""), source.note) if n]
    if verdict is not None:
        note.append(f"Megatron-LM's validate_args: {verdict}")
    host = {"flags_read_by": source.kind, "flags_version": source.version,
            "megatron_lm_validate_args": verdict}
    from nemo_fp8_align.config_check.fix_search import FIX_SEARCH

    violations = megatron_lm_violations(parse_megatron_lm_argv(argv), world_size=world,
                                        mcore=mcore, fixer=FIX_SEARCH)
    if not violations:
        state = "OK" if world is not None else ("OK (microbatch checks skipped: world size "
                                                "unknown, pass --world-size)")
        if as_json:
            _emit(out, {"ok": True, "state": state, "world_size": world, "violations": [],
                        "fix_overrides": [], "notes": _notes(world, argv, note), **host})
        else:
            print(f"Megatron-LM arguments: {state}", file=out)
            for text in _notes(world, argv, note)[world is None:]:  # the state says the first
                print(f"note: {text}", file=out)
        return EXIT_OK
    line, fixed_argv, fixed_world = _fix_line(violations, argv, world, mcore)
    if as_json:
        _emit(out, {**_payload(violations, line, fixed_argv, fixed_world, world, argv, note),
                    **host})
    else:
        _print_text(out, violations, line, world, argv, note)
    return EXIT_INVALID


def _fix_line(violations: List[Any], argv: List[str], world: Optional[int],
              mcore: Any = None) -> Any:
    """(the re-checked fix line, the argument list and world size it gives)."""
    from nemo_fp8_align.config_check.fix_search import FIX_SEARCH
    from nemo_fp8_align.config_check.fixes import fix_line
    from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
    from nemo_fp8_align.config_check.megatron_lm_parser import parse_megatron_lm_argv
    from nemo_fp8_align.config_check.megatron_lm_edits import MEGATRON_LM, apply_edits

    def recheck(edits: List[str]) -> List[Any]:
        # exactly what the printed line asks for: the edited list, parsed and checked again
        new_argv, new_world = apply_edits(argv, edits, world)
        return megatron_lm_violations(parse_megatron_lm_argv(new_argv), world_size=new_world,
                                      mcore=mcore, fixer=FIX_SEARCH)

    line = fix_line(violations, recheck, lambda key: True, MEGATRON_LM)
    return (line, *apply_edits(argv, line.overrides, world))


def _payload(violations: List[Any], line: Any, fixed_argv: List[str],
             fixed_world: Optional[int], world: Optional[int], argv: List[str],
             note: Sequence[str] = ()) -> Dict[str, Any]:
    """The NeMo mode's keys; ``fix_overrides`` are the flags to set, as argument tokens."""
    import shlex

    from nemo_fp8_align.config_check.megatron_lm_edits import WORLD_FLAG

    sets = [e for e in line.overrides if not e.startswith("drop ")
            and not e.startswith(f"{WORLD_FLAG} ")]
    return {"ok": False, "world_size": world,
            "violations": [_violation_dict(v, line) for v in violations],
            "fix_overrides": [t for e in sets for t in shlex.split(e)],
            "fix_drop": [e[len("drop "):] for e in line.overrides if e.startswith("drop ")],
            "fix_world_size": fixed_world if fixed_world != world else None,
            "fixed_argv": fixed_argv, "fix_text": line.text, "fix_passes": line.passes,
            "found_on_recheck": [_violation_dict(v, line) for v in line.later],
            "left": [] if line.passes else [_violation_dict(v, line)
                                            for v in (line.left or line.manual)],
            "plugin_off": PLUGIN_OFF, "notes": _notes(world, argv, note)}


def _violation_dict(v: Any, line: Any) -> Dict[str, str]:
    from nemo_fp8_align.config_check.fixes import agreeing

    return {"key": v.key, "found": v.found, "expected": v.expected,
            "fix": agreeing(v.fix, line)}


def _notes(world: Optional[int], argv: List[str], lead: Sequence[str] = ()) -> List[str]:
    """The notes: the world size where unknown, then ``lead`` (the version checked against,
    what read the flags, Megatron-LM's own validate_args), then what the list holds."""
    from nemo_fp8_align.config_check.megatron_lm_parser import script_flags_given

    notes = [] if world is not None else [
        "microbatch checks skipped: world size unknown, pass --world-size"]
    notes += list(lead)
    if "--hybrid-layer-pattern" in argv or "--hybrid-override-pattern" in argv:
        notes.append("--hybrid-layer-pattern: read as Megatron-LM 0.19.2 reads it (its symbols "
                     "are the layers, whatever --num-layers says; its '|' segments the PP x VP "
                     "stages); a VP fix cuts it into segments")
    given = script_flags_given(argv)
    if given:
        notes.append(f"not read: {' '.join(given)} (Megatron-LM's GPT and hybrid pretraining "
                     "scripts add them to their parser themselves where nvidia-modelopt is "
                     "installed: ModelOpt's arguments)")
    return notes


def _print_text(out: TextIO, violations: List[Any], line: Any, world: Optional[int],
                argv: List[str], version_note: Sequence[str] = ()) -> None:
    from nemo_fp8_align.config_check.fixes import agreeing

    print(f"Megatron-LM arguments: {len(violations)} setting(s) stop the aligned "
          "FP8-transpose plugin from working:", file=out)
    for v in violations:
        print(f"  - {v.key}: found {v.found}; expected {v.expected} | fix: "
              f"{agreeing(v.fix, line)}", file=out)
    if line.later:
        print("The re-check with the fixes above found more (in the line too):", file=out)
        for v in line.later:
            print(f"  - {v.key}: found {v.found}; expected {v.expected} | fix: "
                  f"{agreeing(v.fix, line)}", file=out)
    if line.passes:
        print("Fix them all with these changes to the argument list (each flag replaces the "
              "one given, or is added; re-checked: the arguments pass with them):\n"
              f"  {line.text}", file=out)
    else:
        if line.overrides:
            print(f"These changes fix part of it (re-checked):\n  {line.text}", file=out)
        print("Still to decide by hand (no combination of the fixes passes):", file=out)
        for v in line.left or line.manual:
            print(f"  - {v.key}: {v.expected} | {v.fix}", file=out)
    for note in _notes(world, argv, version_note):
        print(f"note: {note}", file=out)
    print(f"Or {PLUGIN_OFF}.", file=out)


def _emit(out: TextIO, payload: Dict[str, Any]) -> None:
    print(json.dumps(payload), file=out)


def _env_world_size() -> Optional[int]:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None
