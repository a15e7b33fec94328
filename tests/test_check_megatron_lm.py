"""The startup check on Megatron-LM's arguments: the NeMo check's rules, keyed and fixed in
Megatron-LM's flags (config_check/megatron_lm_args.py), and ``check --megatron-lm``."""

import subprocess
import sys

import pytest

from nemo_fp8_align.config_check.megatron_lm_args import (megatron_lm_violations,
                                                          parse_megatron_lm_argv)

GOOD = ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer "
        "--overlap-param-gather --overlap-grad-reduce --micro-batch-size 1 "
        "--global-batch-size 16 --bf16 --seq-length 128 --lr 1e-4").split()


def _found(extra=(), drop=(), world=4):
    argv = [a for a in GOOD if a not in drop]
    return megatron_lm_violations(parse_megatron_lm_argv(argv + list(extra)), world_size=world)


def test_a_valid_command_line_passes_and_other_arguments_are_ignored():
    assert _found() == []
    assert _found(["--num-virtual-stages-per-pipeline-rank", "2"],
                  drop=["--num-layers-per-virtual-pipeline-stage"]) == []


@pytest.mark.parametrize("extra, drop, flag, fix", [
    ((), ["--fp8-param-gather"], "--fp8-param-gather", "--fp8-param-gather"),
    ((), ["--overlap-param-gather"], "--overlap-param-gather", "--overlap-param-gather"),
    ((), ["--overlap-grad-reduce"], "--overlap-grad-reduce", "--overlap-grad-reduce"),
    ((), ["--use-distributed-optimizer"], "--use-distributed-optimizer",
     "--use-distributed-optimizer"),
    (["--no-align-param-gather"], [], "--no-align-param-gather", "drop --no-align-param-gather"),
    (["--overlap-param-gather-with-optimizer-step"], [],
     "--overlap-param-gather-with-optimizer-step", "drop --overlap-param-gather-with-optimizer-step"),
    (["--fp8-recipe", "mxfp8"], [], "--fp8-recipe", "--fp8-recipe delayed"),
    (["--transformer-impl", "local"], [], "--transformer-impl",
     "--transformer-impl transformer_engine"),
    (["--cuda-graph-impl", "full_iteration"], [], "--cuda-graph-impl",
     "--cuda-graph-impl transformer_engine"),
    (["--overlap-moe-expert-parallel-comm"], [], "--overlap-moe-expert-parallel-comm",
     "drop --overlap-moe-expert-parallel-comm"),
    (["--use-torch-fsdp2"], [], "--use-torch-fsdp2", None),
    (["--num-layers-per-virtual-pipeline-stage", "4"], ["--num-layers-per-virtual-pipeline-stage"],
     "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank 2"),
    (["--global-batch-size", "6"], ["--global-batch-size", "16"],  # M = 3 with N = PP = 2
     "--microbatch-group-size-per-virtual-pipeline-stage",
     "--microbatch-group-size-per-virtual-pipeline-stage 3"),
])
def test_each_bad_setting_is_reported_with_its_flag_and_fix(extra, drop, flag, fix):
    found = _found(extra, drop)
    assert [v.key for v in found] == [flag], [str(v) for v in found]
    if fix is not None:
        assert found[0].fix == fix


def test_every_violation_at_once_and_the_fp8_format_once():
    found = _found(drop=["--fp8-format", "hybrid", "--fp8-param-gather", "--overlap-grad-reduce"])
    assert [v.key for v in found] == ["--fp8-format", "--fp8-param-gather",
                                      "--overlap-grad-reduce"]


def test_microbatch_checks_need_the_world_size():
    assert _found(["--global-batch-size", "6"], ["--global-batch-size", "16"], world=None) == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "nemo_fp8_align", "check", *args],
                          capture_output=True, text=True)


def test_cli_accepts_a_megatron_lm_argument_list():
    ok = _cli("--megatron-lm", "--world-size", "4", "--", *GOOD)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    bad = _cli("--megatron-lm", "--world-size", "4", "--", *GOOD, "--no-align-param-gather")
    assert bad.returncode == 2
    assert "--no-align-param-gather: found False" in bad.stderr
    assert "fix: drop --no-align-param-gather" in bad.stderr
    assert _cli("--megatron-lm", "--world-size", "0", "--", *GOOD).returncode == 2
    assert _cli().returncode == 2
