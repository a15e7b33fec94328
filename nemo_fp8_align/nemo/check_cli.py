"""``nemo-fp8-align check CONFIG.yaml [overrides...]``: the startup check from the command line.

The YAML is composed by Hydra exactly as a NeMo training script would compose it (defaults lists,
``key=value`` / ``+key=value`` / ``++key=value`` / ``~key`` overrides, values parsed by Hydra's
grammar so ``True`` and ``2`` are a bool and an int), with the plugin's structured config
registered. A NeMo-Framework-Launcher training YAML (``run:``, ``trainer:``, ``exp_manager:``,
``model:``) works as it is. Exit status: 0 and one line when the config is valid, 2 with every
violation (or with the reason the file could not be read).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import warnings
from pathlib import Path
from typing import Any, List, Optional, Sequence, TextIO

__all__ = ["EXIT_OK", "EXIT_INVALID", "add_check_parser", "load_config", "run_check"]

EXIT_OK = 0
EXIT_INVALID = 2


class ConfigLoadError(Exception):
    """The config file is missing, unreadable, or Hydra could not compose it."""


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to an ``argparse`` subparsers object; returns its parser.

    The parser's defaults carry ``func=run_check``, so a main can dispatch with
    ``return args.func(args)``.
    """
    parser = subparsers.add_parser(
        "check", help="check a NeMo GPT config for the aligned FP8-transpose plugin",
        description=("Report every setting of a NeMo training config that stops the aligned "
                     "FP8-transpose plugin from working, each with the Hydra override that "
                     "fixes it. Exit 0 when valid, 2 otherwise."))
    parser.add_argument("config", metavar="CONFIG.yaml",
                        help="NeMo training YAML (NeMo 1.x layout or NeMo-Framework-Launcher)")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra overrides: a.b=c, +a.b=c, ++a.b=c, ~a.b")
    parser.add_argument("--data-parallel-size", type=int, default=None, metavar="DP",
                        help="data-parallel size for the microbatch checks (default: from "
                             "trainer.devices * trainer.num_nodes / (TP * PP * CP))")
    parser.set_defaults(func=run_check)
    return parser


def load_config(path: Path, overrides: Sequence[str] = ()) -> Any:
    """Compose ``path`` with Hydra and apply ``overrides``; raises :class:`ConfigLoadError`."""
    if not path.is_file():
        raise ConfigLoadError(f"{path}: no such file")
    if path.suffix != ".yaml":
        raise ConfigLoadError(f"{path}: Hydra reads only .yaml files; rename it to "
                              f"{path.with_suffix('.yaml').name}")
    from hydra import compose, initialize_config_dir

    from nemo_fp8_align.nemo.structured import register_configs

    register_configs()
    try:
        with warnings.catch_warnings(), \
                initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
            # Launcher YAMLs name /opt/NeMo/... in hydra.searchpath; absent here, and not needed.
            warnings.filterwarnings("ignore", message="provider=hydra.searchpath")
            return compose(config_name=path.stem, overrides=list(overrides))
    except Exception as err:  # noqa: BLE001 - Hydra, OmegaConf and YAML errors: report them all
        reason = str(err).strip() or type(err).__name__
        cause = err.__cause__
        if cause is not None and str(cause).strip() and str(cause) not in reason:
            reason += f" ({str(cause).strip()})"
        hints = "".join(f"\n{hint}" for hint in _block_key_hints(overrides))
        raise ConfigLoadError(f"{path}: could not compose the config: {reason}{hints}") from err


def _block_key_hints(overrides: Sequence[str]) -> List[str]:
    """"did you mean" for overrides that misspell a key of the plugin block."""
    from nemo_fp8_align.nemo.structured import BLOCK_KEY, block_fields

    prefix = f"model.{BLOCK_KEY}."
    fields = list(block_fields())
    hints = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name is None or name in fields:
            continue
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "known keys: " + ", ".join(fields)
        hints.append(f"{key}: no such key in the plugin block; {hint}")
    return hints


def run_check(args: argparse.Namespace, *, out: Optional[TextIO] = None,
              err: Optional[TextIO] = None) -> int:
    """Run the check for parsed ``args``; returns the exit status (0 valid, 2 otherwise)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    path = Path(args.config)
    try:
        cfg = load_config(path, args.overrides)
    except ConfigLoadError as error:
        print(f"error: {error}", file=err)
        return EXIT_INVALID

    from nemo_fp8_align.nemo.check import (FP8AlignConfigError, align_config_from,
                                           data_parallel_size_of, find_violations)

    violations = find_violations(cfg, data_parallel_size=args.data_parallel_size)
    if violations:
        print(f"{path}: {FP8AlignConfigError(violations)}", file=err)
        return EXIT_INVALID
    align = align_config_from(cfg)
    if not align.active:
        state = "plugin inactive, nothing to check"
    elif args.data_parallel_size is None and data_parallel_size_of(cfg) is None:
        state = (f"policy={align.policy.value}; microbatch checks skipped: data-parallel size "
                 "unknown, pass --data-parallel-size")
    else:
        state = f"policy={align.policy.value}"
    print(f"{path}: OK ({state})", file=out)
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry, ``python -m nemo_fp8_align.nemo.check_cli CONFIG.yaml ...``."""
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
