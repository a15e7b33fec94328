"""The startup check on Megatron-LM's arguments: the NeMo check's rules, keyed and fixed in
Megatron-LM's flags (config_check/megatron_lm_args.py), and ``check --megatron-lm``."""

import subprocess
from pathlib import Path
import sys

import pytest

from nemo_fp8_align.config_check.fix_search import FIX_SEARCH
from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
from nemo_fp8_align.config_check.megatron_lm_parser import parse_megatron_lm_argv

GOOD = ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer "
        "--overlap-param-gather --overlap-grad-reduce --micro-batch-size 1 "
        "--global-batch-size 16 --bf16 --seq-length 128 --lr 1e-4").split()


def _without(argv, drop):
    """``argv`` without the flags in ``drop`` and their values."""
    out, skip = [], False
    for token in argv:
        if token in drop:
            skip = True
            continue
        if skip and not token.startswith("--"):
            continue
        skip = False
        out.append(token)
    return out


def _found(extra=(), drop=(), world=4):
    """The violations and the command line's fixes (its fix search) of GOOD changed."""
    argv = _without(GOOD, drop)
    return megatron_lm_violations(parse_megatron_lm_argv(argv + list(extra)), world_size=world,
                                  fixer=FIX_SEARCH)


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
    (["--fp8-recipe", "custom"], [], "--fp8-recipe",
     "none that keeps --fp8-recipe custom: train without the plugin (do not attach it)"),
    (["--transformer-impl", "local"], [], "--transformer-impl",
     "--transformer-impl transformer_engine"),
    (["--cuda-graph-impl", "full_iteration"], [], "--cuda-graph-impl",
     "--cuda-graph-impl transformer_engine"),
    (["--overlap-moe-expert-parallel-comm"], [], "--overlap-moe-expert-parallel-comm",
     "drop --overlap-moe-expert-parallel-comm"),
    (["--use-torch-fsdp2"], [], "--use-torch-fsdp2",
     "drop --use-torch-fsdp2; --use-distributed-optimizer"),
    (["--num-layers-per-virtual-pipeline-stage", "4"], ["--num-layers-per-virtual-pipeline-stage"],
     "--num-layers-per-virtual-pipeline-stage", "--num-layers-per-virtual-pipeline-stage 2"),
    (["--global-batch-size", "6"], ["--global-batch-size"],  # M = 3 with N = PP = 2
     "--microbatch-group-size-per-virtual-pipeline-stage",
     "--microbatch-group-size-per-virtual-pipeline-stage 3"),
])
def test_each_bad_setting_is_reported_with_its_flag_and_fix(extra, drop, flag, fix):
    found = _found(extra, drop)
    assert [v.key for v in found] == [flag], [str(v) for v in found]
    if fix is not None:
        assert found[0].fix == fix


def test_every_violation_at_once_and_the_fp8_format_once():
    found = _found(drop=["--fp8-format", "--fp8-param-gather", "--overlap-grad-reduce"])
    assert [v.key for v in found] == ["--fp8-format", "--fp8-param-gather",
                                      "--overlap-grad-reduce"]


def test_each_requirement_cites_megatron_lm_not_nemo():
    """Second trial (records/check-held-out-trials.md): Megatron-LM mode gave --overlap-grad-reduce NeMo's
    reason; Megatron-LM 0.19.2's validate_args asserts 'Must use --overlap-param-gather with
    --overlap-grad-reduce'."""
    found = _found(drop=["--overlap-grad-reduce"])
    assert "NeMo" not in found[0].expected
    assert "Must use --overlap-param-gather with --overlap-grad-reduce" in found[0].expected
    # --no-align-param-gather had NeMo's reason too (its mcore_distributed_optim): Megatron-LM's
    # train() is what binds config.param_sync_func
    found = _found(["--no-align-param-gather"])
    assert "NeMo" not in found[0].expected
    assert "Megatron-LM's train() binds config.param_sync_func" in found[0].expected


def test_microbatch_checks_need_the_world_size():
    assert _found(["--global-batch-size", "6"], ["--global-batch-size"], world=None) == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "nemo_fp8_align", "check", *args],
                          capture_output=True, text=True)


def test_cli_accepts_a_megatron_lm_argument_list():
    ok = _cli("--megatron-lm", "--world-size", "4", "--", *GOOD)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    bad = _cli("--megatron-lm", "--world-size", "4", "--", *GOOD, "--no-align-param-gather")
    assert bad.returncode == 2
    assert "--no-align-param-gather: found False" in bad.stdout  # the result: stdout
    assert "fix: drop --no-align-param-gather" in bad.stdout
    assert _cli("--megatron-lm", "--world-size", "0", "--", *GOOD).returncode == 2
    assert _cli().returncode == 2


# --- Megatron-LM 0.19.2's own validation (issue 25 item 1) -----------------------------------

UPSTREAM = Path(__file__).parent / "data" / "upstream" / "megatron_lm"


def _keys(found):
    return [v.key for v in found]


def test_an_unknown_flag_is_named_with_the_flag_meant():
    found = _found(["--virtual-pipeline-model-parallel-size", "2"])
    assert _keys(found) == ["--virtual-pipeline-model-parallel-size"], found
    assert "did you mean --num-virtual-stages-per-pipeline-rank" in found[0].expected


def test_two_virtual_pipeline_flags_are_a_conflict():
    found = _found(["--num-virtual-stages-per-pipeline-rank", "2"])
    assert _keys(found) == ["--num-layers-per-virtual-pipeline-stage"], found
    assert found[0].fix == "drop --num-layers-per-virtual-pipeline-stage"


def test_accounting_flags_count_in_the_split_with_layers_per_virtual_stage():
    """30 layers + embedding + loss = 32 = PP 2 x VP 4 x 4 layers: Megatron-LM accepts it."""
    argv = ["--num-layers", "30", "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "4"]
    assert _found(argv, drop=["--num-layers", "--num-layers-per-virtual-pipeline-stage"]) == []
    # one flag only: NeMo's own chunk assertion does not apply to Megatron-LM
    argv = ["--num-layers", "31", "--account-for-loss-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage", "4"]
    assert _found(argv, drop=["--num-layers", "--num-layers-per-virtual-pipeline-stage"]) == []


def test_every_entry_of_the_step_batch_schedule_is_checked_and_rampup_is_not_read():
    # world 4, PP 2: DP 2; entry 2 gives M = 1 < PP
    found = _found(["--step-batch-size-schedule", "0:2 1000:16"], drop=["--global-batch-size"])
    assert _keys(found) == ["--step-batch-size-schedule"], found
    assert found[0].fix == "--step-batch-size-schedule '0:4 1000:16'"
    assert _found(["--rampup-batch-size", "4", "4", "1000"]) == []  # 0.19.2 only warns
    found = _found(["--step-batch-size-schedule", "0:16"])
    assert _keys(found) == ["--global-batch-size"] and found[0].fix == "drop --global-batch-size"


def test_heads_and_query_groups_against_tensor_parallelism():
    found = _found(["--num-attention-heads", "8", "--group-query-attention",
                    "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], world=8)
    assert _keys(found) == ["--tensor-model-parallel-size"], found
    assert found[0].fix == "--tensor-model-parallel-size 2"


def test_fp4_with_fp8_is_named_and_neither_is_chosen_for_the_user():
    """megatron-core raises with both; which to keep is a choice of the numerics (the fix used
    to drop --fp4-format). NVFP4 itself is checked in tests/test_check_recipes.py."""
    found = _found(["--fp4-format", "e2m1"])
    assert _keys(found) == ["--fp4-format"] and found[0].fix.startswith("none that keeps both")


def test_a_layout_string_gives_the_split_and_its_stages_give_vp():
    layout = ["--pipeline-model-parallel-layout", "Et|tt|tt|ttL"]  # 4 stages on PP 2: VP 2
    argv = ["--num-layers", "7"] + layout
    assert _found(argv, drop=["--num-layers", "--num-layers-per-virtual-pipeline-stage"]) == []
    found = _found(["--num-layers", "8"] + layout,
                   drop=["--num-layers", "--num-layers-per-virtual-pipeline-stage"])
    assert _keys(found) == ["--pipeline-model-parallel-layout"], found


def test_optimizer_instances_must_split_the_data_parallel_ranks():
    """megatron-core's initialize_model_parallel asserts DP x CP divisible by the instances
    (validate_args does not: the job starts, then stops). 4 GPUs at PP 2: DP 2."""
    assert _found(["--num-distributed-optimizer-instances", "2"]) == []
    found = _found(["--num-distributed-optimizer-instances", "3"])
    assert [(v.key, v.fix) for v in found] == [("--num-distributed-optimizer-instances",
                                               "--num-distributed-optimizer-instances 2")]
    assert "DP x CP = 2 on 4 GPUs" in found[0].expected
    found = _found(["--num-distributed-optimizer-instances", "4", "--global-batch-size", "48"],
                   drop=["--global-batch-size"], world=24)  # DP 12: 4 divides it
    assert found == []
    assert _found(["--num-distributed-optimizer-instances", "5"], world=None) == []  # DP unknown


def test_interleaving_on_two_ranks_needs_overlapped_p2p():
    found = _found(["--no-overlap-p2p-communication"])
    assert _keys(found) == ["--no-overlap-p2p-communication"], found


def test_the_expert_parallel_fixes_agree_in_one_step():
    """6 experts, EP 8, 32 GPUs at PP 2: the divisor rule and the world-size rule name the same
    EP (2), instead of 6, then 4, then 3, then 2 over four rounds."""
    found = _found(["--num-experts", "6", "--expert-model-parallel-size", "8",
                    "--global-batch-size", "64"], drop=["--global-batch-size"], world=32)
    assert [(v.key, v.fix) for v in found] == [("--expert-model-parallel-size",
                                               "--expert-model-parallel-size 2")], found


@pytest.mark.parametrize("script", sorted(p.name for p in UPSTREAM.glob("*.args")))
def test_upstream_example_scripts_use_only_megatron_lm_flags(script):
    argv = (UPSTREAM / script).read_text().split("\n")
    args = parse_megatron_lm_argv([a for a in argv if a])
    found = megatron_lm_violations(args, world_size=8)
    unknown = [v.key for v in found if "not a Megatron-LM" in v.found]
    # gpt-oss's --enable-gpt-oss and --export-force-local-attention come from ModelOpt's
    # arguments, which pretrain_gpt.py adds itself: not errors (a fix dropping them would break
    # that script), named in a note (test_script_flags_are_named_and_kept_by_the_fix_line)
    assert unknown == []
    if not script.startswith("ft_"):  # the example scripts; Megatron-LM's CI configs
        # none interleaves; a hybrid model's VP is its pattern's segments (mamba_train)
        vp_key = ("--hybrid-layer-pattern" if "--hybrid-layer-pattern" in argv
                  else "--num-virtual-stages-per-pipeline-rank")
        assert vp_key in _keys(found)
    if script.startswith("train_gpt3"):  # both batch flags: Megatron-LM 0.19.2 raises
        assert "--global-batch-size" in _keys(found)


def test_without_the_fix_search_the_world_size_and_schedule_fixes_need_none():
    """Megatron-LM's check_args at attach has no fixer: a world size that TP * PP * CP does not
    divide gets a multiple of it (the command line's nearest that fits the batch needs the
    search), a step-schedule entry gets what it must be and the command that proposes one."""
    args = parse_megatron_lm_argv(_without(GOOD, ["--pipeline-model-parallel-size"])
                                  + ["--pipeline-model-parallel-size", "4"])
    (world,) = [v for v in megatron_lm_violations(args, world_size=6) if v.key == "--world-size"]
    assert world.fix == ("launch 12 processes (the world size, a multiple of TP * PP * CP) and "
                         "check with --world-size 12")
    args = parse_megatron_lm_argv(_without(GOOD, ["--global-batch-size"])
                                  + ["--step-batch-size-schedule", "0:2 1000:16"])
    (entry,) = megatron_lm_violations(args, world_size=4)
    assert entry.key == "--step-batch-size-schedule"
    assert "`nemo-fp8-align check --megatron-lm -- ARGS` proposes the nearest" in entry.fix
