"""``nemo-fp8-align`` (also ``python -m nemo_fp8_align``): one command line, one sub-command per
module here: ``demo`` (the CPU demo), ``check`` (the startup config check), ``plan`` (the timeline
model) and ``report`` (the telemetry judge)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from nemo_fp8_align.cli.demo import add_demo_parser  # validates flags before any import

    add_demo_parser(sub)
    from nemo_fp8_align.cli.check import add_check_parser  # imports no NeMo

    add_check_parser(sub)
    from nemo_fp8_align.cli.plan import add_plan_parser  # pure Python: the timeline model

    add_plan_parser(sub)
    from nemo_fp8_align.cli.report import add_report_parser

    add_report_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
