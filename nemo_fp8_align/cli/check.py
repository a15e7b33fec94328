"""``nemo-fp8-align check CONFIG.yaml [overrides...]``: the startup check from the command line.

The YAML is composed by Hydra exactly as a NeMo training script would compose it (defaults lists,
``key=value`` / ``+key=value`` / ``++key=value`` / ``~key`` overrides, values parsed by Hydra's
grammar so ``True`` and ``2`` are a bool and an int), with the plugin's structured config
registered. A NeMo-Framework-Launcher training YAML (``run:``, ``trainer:``, ``exp_manager:``,
``model:``) works as it is. Exit status: 0 and one line when the config is valid, 2 with every
violation (or with the reason the file could not be read). ``--megatron-core X.Y`` picks the
version whose rules judge (:func:`megatron_core_target`); ``--megatron-lm`` checks a Megatron-LM
argument list instead (:mod:`.check_megatron_lm`); the NeMo mode's report is
:mod:`.check_output`, imported only after the dependencies are found (it needs OmegaConf).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, TextIO

from nemo_fp8_align.cli.check_load import file_problem, load_config, load_source
from nemo_fp8_align.cli.common import CHECK_NEEDS, missing_dependency
from nemo_fp8_align.errors import ConfigLoadError
from nemo_fp8_align.mcore_versions import (NEWEST, OLDEST, VersionRules, importable_rules,
                                           importable_version, parse_version, rules_for)

__all__ = ["EXIT_OK", "EXIT_INVALID", "Target", "add_check_parser", "file_problem",
           "load_config", "load_source", "megatron_core_target", "run_check"]

EXIT_OK = 0
EXIT_INVALID = 2
DP_FLAG = "--data-parallel-size"


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to an ``argparse`` subparsers object; returns its parser.

    The parser's defaults carry ``func=run_check``, so a main can dispatch with
    ``return args.func(args)``.
    """
    parser = subparsers.add_parser(
        "check", help="check a NeMo GPT config for the aligned FP8-transpose plugin",
        description=("Report every setting of a NeMo training config that stops the aligned "
                     "FP8-transpose plugin from working, and one override line, re-checked "
                     "before it is printed, that fixes them all. Exit 0 when valid, 2 "
                     "otherwise."))
    parser.add_argument("config", metavar="CONFIG.yaml", nargs="?",
                        help="NeMo training YAML (NeMo 1.x layout), a NeMo-Framework-Launcher "
                             "training YAML, or the launcher's conf/config.yaml (with "
                             "training=<model>/<size>)")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: a.b=c, +a.b=c, ++a.b=c, ~a.b")
    parser.add_argument(DP_FLAG, type=int, default=None, metavar="DP",
                        help="data-parallel size for the microbatch checks (default: from "
                             "trainer.devices * trainer.num_nodes / (TP * PP * CP))")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: one JSON object on stdout (ok, violations with key, found, "
                             "expected and fix, fix_overrides), for job-submission scripts")
    parser.add_argument("--mixin", action="store_true",
                        help="the model class has FP8TransposeAlignMixin (the plugin runs without "
                             "a model.fp8_transpose_align block); default: the entry-point "
                             "callback, which stays inert without the block")
    parser.add_argument("--megatron-lm", action="store_true",
                        help="check a Megatron-LM argument list instead: check --megatron-lm "
                             "[--world-size N] -- --pipeline-model-parallel-size 2 ...")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --megatron-lm: processes of the job (default: $WORLD_SIZE)")
    parser.add_argument("--megatron-core", default=None, metavar="X.Y[.Z]",
                        help="check against this megatron-core version's own rules (0.7 to "
                             "0.19: its schedule rules, the options it has); default: the "
                             "installed one")
    parser.set_defaults(func=run_check)
    return parser


def run_check(args: argparse.Namespace, *, out: Optional[TextIO] = None,
              err: Optional[TextIO] = None) -> int:
    """Run the check for parsed ``args``; returns the exit status (0 valid, 2 otherwise)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    target = megatron_core_target(args)
    args.mcore_rules, args.mcore_note = target.rules, target.note
    problem = _mode_problem(args) or target.error
    if problem is not None:
        if getattr(args, "format", "text") == "json":
            print(json.dumps({"ok": False, "config": args.config, "error": problem,
                              "violations": [], "fix_overrides": []}), file=out)
        else:
            print(f"error: {problem}", file=err)
        return EXIT_INVALID
    if getattr(args, "megatron_lm", False):
        from nemo_fp8_align.cli.check_megatron_lm import run_megatron_lm_check

        argv = ([args.config] if args.config else []) + list(args.overrides)
        return run_megatron_lm_check(args, argv, out, err)
    if args.config is None:
        print("error: CONFIG.yaml is missing: pass a NeMo training YAML, or --megatron-lm -- "
              "ARGS for a Megatron-LM command line", file=err)
        return EXIT_INVALID
    problem = _argument_problem(args) or missing_dependency("check", CHECK_NEEDS)
    if problem is not None:  # before anything imports OmegaConf or Hydra
        if getattr(args, "format", "text") == "json":
            print(json.dumps({"ok": False, "config": args.config, "error": problem,
                              "violations": [], "fix_overrides": []}), file=out)
        else:
            print(f"error: {problem}", file=err)
        return EXIT_INVALID
    from nemo_fp8_align.cli.check_output import Report

    report = Report(args, out, err)
    try:
        source, cfg = load_source(Path(args.config), args.overrides)
    except ConfigLoadError as error:
        return report.error(str(error))
    if len(cfg) == 0:
        return report.error(f"{args.config}: the file holds no settings; expected a NeMo "
                            "training config with trainer: and model:")
    return report.run(source, cfg)


# ---------------------------------------------------------------------------------------------
# Which megatron-core the check judges by: ``--megatron-core X.Y``, else the importable one (its
# version read from its files, nothing imported: :func:`~nemo_fp8_align.mcore_versions.
# importable_version`), else none (the newest rules, and a note saying so). The note names the
# version whose rules judged, the recipe verdict included.

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


def _mode_problem(args: argparse.Namespace) -> Optional[str]:
    """A flag of the other mode is an error, never silently ignored: ``--world-size`` belongs to
    ``--megatron-lm``; ``--data-parallel-size`` and ``--mixin`` to a NeMo config; and a YAML
    file is not a Megatron-LM argument list."""
    if not getattr(args, "megatron_lm", False):
        if getattr(args, "world_size", None) is not None:
            return (f"--world-size {args.world_size} applies only with --megatron-lm; a NeMo "
                    "config's world size is trainer.devices x trainer.num_nodes: change those "
                    f"with overrides (e.g. trainer.num_nodes=...) or pass {DP_FLAG} instead")
        return None
    config = args.config or ""
    if not config and not list(getattr(args, "overrides", None) or []):
        # Checked against nothing, every Megatron-LM default would be listed as a violation.
        return ("--megatron-lm: no Megatron-LM arguments given; pass the training script's "
                "arguments after --: check --megatron-lm [--world-size N] -- "
                "--pipeline-model-parallel-size 2 ... (the whole command line)")
    if config.endswith((".yaml", ".yml")):
        return (f"--megatron-lm checks the Megatron-LM argument list after --, but {config} is "
                f"a config file: leave out --megatron-lm to check it (check {config}), or pass "
                "the arguments: check --megatron-lm -- --pipeline-model-parallel-size 2 ...")
    if args.data_parallel_size is not None:
        return (f"{DP_FLAG} applies only to a NeMo config, not with --megatron-lm: there the "
                "data-parallel size follows from --world-size N; pass that instead")
    if getattr(args, "mixin", False):
        return ("--mixin applies only to a NeMo config (the class of the model NeMo builds), not "
                "with --megatron-lm: leave it out")
    return None


def _argument_problem(args: argparse.Namespace) -> Optional[str]:
    dp = args.data_parallel_size
    if dp is not None and dp < 1:
        return (f"{DP_FLAG} {dp}: the data-parallel size must be an int >= 1 (the number of "
                f"data-parallel replicas); pass e.g. {DP_FLAG} 1, or leave the flag out to "
                "derive it from trainer.devices * trainer.num_nodes / (TP * PP * CP)")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry, ``python -m nemo_fp8_align.cli.check CONFIG.yaml ...``."""
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", *(sys.argv[1:] if argv is None else argv)])
    from nemo_fp8_align.cli.common import closed_pipes_discarded

    with closed_pipes_discarded():
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
