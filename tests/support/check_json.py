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


#: A Megatron-LM list that both the plugin's check and Megatron-LM's own validate_args accept
#: (4 processes: PP 2, DP 2, M 8): the model, data and tokenizer flags validate_args asks for.
VALIDATED_ARGV = ("--pipeline-model-parallel-size 2 --num-layers 8 "
                  "--num-layers-per-virtual-pipeline-stage 2 --fp8-format hybrid "
                  "--fp8-param-gather --use-distributed-optimizer --overlap-param-gather "
                  "--overlap-grad-reduce --micro-batch-size 1 --global-batch-size 16 --bf16 "
                  "--seq-length 128 --max-position-embeddings 128 --lr 1e-4 --hidden-size 64 "
                  "--num-attention-heads 4 --train-iters 10 --tokenizer-type NullTokenizer "
                  "--vocab-size 128 --mock-data").split()
