"""``nemo-fp8-align`` (also ``python -m nemo_fp8_align``): the CPU demo and the config check."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from nemo_fp8_align.config import Policy

__all__ = ["main"]


def _add_demo_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("demo", help="train a small GPT on CPU/gloo with megatron-core's "
                       "interleaved schedule and report where FP8 transposes ran")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    p.add_argument("--vp", type=int, default=2, help="model chunks per pipeline rank (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step, M")
    p.add_argument("--group-size", type=int, default=None,
                   help="microbatch_group_size_per_vp_stage N (default: PP)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.ALIGNED.value)
    p.add_argument("--telemetry", metavar="PATH", default=None,
                   help="write one JSON line per (step, pp_rank, dp_rank, chunk) here")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from nemo_fp8_align.demo.launch import alignment_problems, format_report, run_demo
    from nemo_fp8_align.demo.train import DemoOptions
    from nemo_fp8_align.engine.schedule import InterleavedSchedule, ScheduleError

    try:
        InterleavedSchedule(args.pp, args.vp, args.microbatches, args.group_size)
    except ScheduleError as err:
        print(f"nemo-fp8-align demo: {err}", file=sys.stderr)
        return 2
    opts = DemoOptions(pp=args.pp, vp=args.vp, dp=args.dp, microbatches=args.microbatches,
                       group_size=args.group_size, steps=args.steps, policy=Policy(args.policy))
    result = run_demo(opts, args.telemetry)
    print(format_report(result))
    problems = alignment_problems(result)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    if not problems and opts.policy is Policy.OFF:
        print("OK: every FP8 weight was transposed once per step (plugin off: no telemetry).")
    elif not problems:
        print("OK: every chunk's transposes ran once per step per weight, after its all-gather, "
              + ("at the same slot on every pipeline rank." if opts.policy is Policy.ALIGNED
                 else "at each rank's first use (lazy)."))
    return 1 if problems else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(sub)
    from nemo_fp8_align.nemo.check_cli import add_check_parser  # imports no NeMo

    add_check_parser(sub)
    from nemo_fp8_align.plan_cli import add_plan_parser  # pure Python: the timeline model

    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
