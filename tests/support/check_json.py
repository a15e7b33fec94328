"""``nemo-fp8-align check ... --format json`` in-process, as the trial tests call it: the exit
status and the last JSON object it printed (``--format json`` goes before a Megatron-LM ``--``).
``megatron_lm_version``: the megatron-core a Megatron-LM argument list is judged as (the trials'
lists are of the 0.19 era, with layout strings megatron-core < 0.13 lacks), whatever is installed."""

from __future__ import annotations

import argparse
import io
import json
from typing import List, Optional, Tuple

from nemo_fp8_align.cli.check import add_check_parser


def check_json(argv: List[str], megatron_lm_version: Optional[str] = None) -> Tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    if "--" in argv:
        at = argv.index("--")
        version = ["--megatron-core", megatron_lm_version] if megatron_lm_version else []
        argv = argv[:at] + ["--format", "json", *version] + argv[at:]
    else:
        argv = argv + ["--format", "json"]
    args = parser.parse_args(["check", *argv])
    out = io.StringIO()
    status = args.func(args, out=out, err=io.StringIO())
    return status, json.loads(out.getvalue().strip().splitlines()[-1])
