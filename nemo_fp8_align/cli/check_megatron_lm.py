"""``nemo-fp8-align check --megatron-lm [--world-size N] -- ARGS...``: the startup check of a
Megatron-LM command line (the arguments after ``--``, as given to Megatron-LM's GPT pretraining script). Exit status
0 and one line when valid, 2 with every violation, each naming the flag and its fix."""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, TextIO

__all__ = ["run_megatron_lm_check"]

EXIT_OK, EXIT_INVALID = 0, 2


def run_megatron_lm_check(args: argparse.Namespace, argv: List[str], out: TextIO,
                          err: TextIO) -> int:
    from nemo_fp8_align.cli.deps import missing_dependency

    missing = missing_dependency("check --megatron-lm", (("omegaconf", "omegaconf", "hydra"),))
    if missing is not None:
        print(f"error: {missing}", file=err)
        return EXIT_INVALID
    from nemo_fp8_align.config_check.megatron_lm_args import (megatron_lm_violations,
                                                              parse_megatron_lm_argv)

    world = args.world_size if args.world_size is not None else _env_world_size()
    if world is not None and world < 1:
        print(f"error: --world-size {world}: the number of processes must be >= 1; pass e.g. "
              "--world-size 8, or leave it out (WORLD_SIZE from the environment)", file=err)
        return EXIT_INVALID
    violations = megatron_lm_violations(parse_megatron_lm_argv(argv), world_size=world)
    if violations:
        lines = "\n".join(f"  - {v}" for v in violations)
        print(f"Megatron-LM arguments: {len(violations)} setting(s) stop the aligned "
              f"FP8-transpose plugin from working:\n{lines}\nApply the fixes above, or do not "
              "attach the plugin.", file=out)
        return EXIT_INVALID
    state = "" if world is not None else (" (microbatch checks skipped: world size unknown, "
                                          "pass --world-size)")
    print(f"Megatron-LM arguments: OK{state}", file=out)
    return EXIT_OK


def _env_world_size() -> Optional[int]:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None
