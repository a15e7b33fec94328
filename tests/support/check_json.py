"""``nemo-fp8-align check`` in-process, as the check tests call it: ``check_cli`` gives the exit
status, stdout and stderr; ``check_json`` the status and the last JSON object printed
(``--format json`` goes before a Megatron-LM ``--``). ``megatron_lm_version``: the megatron-core
a Megatron-LM argument list is judged as (the trials' lists are of the 0.19 era, with layout
strings megatron-core < 0.13 lacks), whatever is installed."""

from __future__ import annotations

import argparse
import io
import json
from typing import List, Optional, Tuple

from nemo_fp8_align.cli.check import add_check_parser


def check_cli(*argv: str) -> Tuple[int, str, str]:
    """Parse ``check *argv`` the way the console script does and run it: (status, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = args.func(args, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def check_json(argv: List[str], megatron_lm_version: Optional[str] = None) -> Tuple[int, dict]:
    if "--" in argv:
        at = argv.index("--")
        version = ["--megatron-core", megatron_lm_version] if megatron_lm_version else []
        argv = argv[:at] + ["--format", "json", *version] + argv[at:]
    else:
        argv = argv + ["--format", "json"]
    status, out, _ = check_cli(*argv)
    return status, json.loads(out.strip().splitlines()[-1])
