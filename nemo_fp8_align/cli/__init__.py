"""``nemo-fp8-align`` (also ``python -m nemo_fp8_align``): one command line, one sub-command per
module here: ``check`` (the startup config check), ``plan`` (the timeline model) and ``report``
(the telemetry judge). The CPU demo is the lab's, run from a checkout: ``python -m lab.demo``.

Results go to stdout (the verdict, the violation list, the fix line, the table, JSON);
diagnostics that are not the result (an unreadable input, a failed plot) go to stderr. A reader
that closes the pipe early (``| head -1``) ends nothing early: the command exits with its own
status (:mod:`nemo_fp8_align.cli.common`)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = ["main"]


#: The exit status of a command ended by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def main(argv: Optional[List[str]] = None) -> int:
    """Run one sub-command; Ctrl-C ends any of them with one line and exit status 130 (it
    printed a KeyboardInterrupt traceback from wherever the command was)."""
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        command = next((a for a in (sys.argv[1:] if argv is None else argv)
                        if a in ("check", "plan", "report")), "")
        print(f"nemo-fp8-align{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _dispatch(argv: Optional[List[str]]) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from nemo_fp8_align.cli.check import add_check_parser  # imports no NeMo

    add_check_parser(sub)
    from nemo_fp8_align.cli.plan import add_plan_parser  # pure Python: the timeline model

    add_plan_parser(sub)
    from nemo_fp8_align.cli.report import add_report_parser

    add_report_parser(sub)
    args = parser.parse_args(argv)
    from nemo_fp8_align.cli.common import closed_pipes_discarded

    with closed_pipes_discarded():  # `... | head -1`: the command's own status, no traceback
        return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
