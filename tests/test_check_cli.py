"""``nemo-fp8-align check CONFIG.yaml [overrides...]``: exit codes, overrides, unreadable files."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8_align.cli.check import EXIT_INVALID, EXIT_OK, run_check
from support.check_json import check_cli

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
FP8_ALIGN = CONF / "megatron_gpt_fp8_align.yaml"
LAUNCHER = CONF / "launcher" / "gpt3_175b_fp8_align.yaml"

SEED_YAML = """\
trainer:
  devices: 8
  num_nodes: 1
  precision: bf16
model:
  pipeline_model_parallel_size: 4
  virtual_pipeline_model_parallel_size: 2
  num_layers: 16
  micro_batch_size: 1
  global_batch_size: 16
  megatron_amp_O2: true
  mcore_gpt: true
  transformer_engine: true
  fp8: true
  fp8_hybrid: true
  fp8_params: true
  optim:
    name: distributed_fused_adam
    overlap_param_sync: true
    overlap_grad_sync: true
  fp8_transpose_align:
    policy: aligned
"""


check = check_cli


@pytest.fixture
def seed_yaml(tmp_path):
    path = tmp_path / "seed.yaml"
    path.write_text(SEED_YAML)
    return path


def test_valid_config_exits_0_with_one_ok_line(seed_yaml):
    status, out, err = check(str(seed_yaml))
    assert status == EXIT_OK == 0
    ok, *rest = out.splitlines()
    assert ok == f"{seed_yaml}: OK (policy=aligned)"
    # the one note: which megatron-core's rules were applied (test_check_mcore_version.py)
    assert len(rest) == 1 and rest[0].startswith("  note: checked against megatron-core "), rest
    assert err == ""


def test_overrides_are_parsed_as_yaml_values(seed_yaml):
    # "False" must become a bool (a string would be a wrong type, with a different message).
    status, out, err = check(str(seed_yaml), "model.fp8=False", "model.global_batch_size=12")
    assert status == EXIT_INVALID == 2
    assert err == ""  # the violations and the fix line are the result: stdout
    assert "2 setting(s)" in out
    assert "model.fp8: found False; expected True" in out
    assert "| fix: model.fp8=True" in out
    # M = 12 / 2 = 6 does not fit N = PP = 4: the group size is what to change (a layout fix).
    assert "global_batch_size = 12 (M = 12 / (1 * DP 2) = 6)" in out
    assert "| fix: +model.microbatch_group_size_per_vp_stage=6" in out
    assert "re-checked: the config passes with it):\n  model.fp8=True " \
        "+model.microbatch_group_size_per_vp_stage=6\n" in out


def test_override_can_fix_a_config(seed_yaml):
    seed_yaml.write_text(SEED_YAML.replace("fp8_params: true", "fp8_params: false"))
    assert check(str(seed_yaml))[0] == EXIT_INVALID
    assert check(str(seed_yaml), "model.fp8_params=True")[0] == EXIT_OK


def test_delete_and_append_overrides(seed_yaml):
    status, out, err = check(str(seed_yaml), "~model.fp8_params")
    assert status == EXIT_INVALID
    assert "model.fp8_params: found <missing>" in out and "+model.fp8_params=True" in out
    status, out, err = check(str(seed_yaml), "~model.fp8_params", "+model.fp8_params=true")
    assert status == EXIT_OK, err
    status, out, err = check(str(seed_yaml), "+model.optim.align_param_gather=True",
                           "model.optim.name=mcore_distributed_optim")
    assert status == EXIT_OK, err


def test_override_of_a_missing_key_without_plus_is_an_error(seed_yaml):
    status, out, err = check(str(seed_yaml), "model.fp8_recipe=mxfp8")
    assert status == EXIT_INVALID
    assert "+model.fp8_recipe=mxfp8" in err  # Hydra's own hint
    status, out, err = check(str(seed_yaml), "+model.fp8_recipe=mxfp8")
    assert status == EXIT_INVALID and "model.fp8_recipe: found 'mxfp8'" in out


def test_inactive_plugin_is_ok(seed_yaml):
    status, out, err = check(str(seed_yaml), "model.fp8=False",
                           "+model.fp8_transpose_align.enabled=False")
    assert status == EXIT_OK
    assert "plugin inactive" in out


def test_ok_line_says_when_microbatch_checks_were_skipped(seed_yaml):
    status, out, err = check(str(seed_yaml), "trainer.devices=auto", "model.global_batch_size=3")
    assert status == EXIT_OK
    assert "microbatch checks skipped" in out and "--data-parallel-size" in out
    status, out, err = check(str(seed_yaml), "trainer.devices=auto", "model.global_batch_size=3",
                           "--data-parallel-size", "2")
    assert status == EXIT_INVALID and "model.global_batch_size" in out


def test_data_parallel_size_option(seed_yaml):
    # Without a known world size: DP 4 gives M = 16 / 4 = 4, fine; DP 8: M = 2 < PP.
    assert check(str(seed_yaml), "trainer.devices=auto", "--data-parallel-size", "4")[0] == EXIT_OK
    status, out, err = check(str(seed_yaml), "trainer.devices=auto", "--data-parallel-size", "8")
    assert status == EXIT_INVALID and "DP 8" in out
    # The trainer's own DP (8 / 4 = 2) agrees with the flag: fine.
    assert check(str(seed_yaml), "--data-parallel-size", "2")[0] == EXIT_OK


def test_data_parallel_size_that_disagrees_with_the_trainer(seed_yaml):
    # 8 devices / (TP 1 * PP 4) = DP 2, but the flag says 4: the node count that gives 4 is 2.
    status, out, err = check(str(seed_yaml), "--data-parallel-size", "4")
    assert status == EXIT_INVALID
    assert "--data-parallel-size: found 4; expected 2, the data-parallel size of the trainer" in out
    assert "| fix: trainer.num_nodes=2, or leave --data-parallel-size out" in out


def test_missing_file_exits_2(tmp_path):
    status, out, err = check(str(tmp_path / "nope.yaml"))
    assert status == EXIT_INVALID
    assert out == ""
    assert err == f"error: {tmp_path / 'nope.yaml'}: no such file\n"


def test_unparseable_file_exits_2(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [1,\n  fp8: }\n")
    status, out, err = check(str(path))
    assert status == EXIT_INVALID
    assert err.startswith(f"error: {path}: could not compose the config")


def test_not_a_yaml_suffix_exits_2(tmp_path):
    path = tmp_path / "cfg.yml"
    path.write_text(SEED_YAML)
    status, out, err = check(str(path))
    assert status == EXIT_INVALID and "cfg.yaml" in err


def test_misspelt_plugin_key_in_an_override_gets_a_suggestion():
    status, out, err = check(str(FP8_ALIGN), "model.fp8_transpose_align.polcy=lazy")
    assert status == EXIT_INVALID
    assert "did you mean model.fp8_transpose_align.policy?" in err
    assert "fix: model.fp8_transpose_align.policy=lazy" in err


def test_misspelt_plugin_key_in_a_yaml_gets_a_suggestion(seed_yaml):
    seed_yaml.write_text(SEED_YAML + "    telemetry_pth: /tmp/t\n")
    status, out, err = check(str(seed_yaml))
    assert status == EXIT_INVALID
    assert "model.fp8_transpose_align.telemetry_pth" in out
    assert "did you mean 'telemetry_path'?" in out


def test_shipped_configs_pass_and_their_overrides_are_checked():
    assert check(str(FP8_ALIGN))[0] == EXIT_OK
    assert check(str(LAUNCHER))[0] == EXIT_OK
    status, out, err = check(str(LAUNCHER), "model.virtual_pipeline_model_parallel_size=5")
    assert status == EXIT_INVALID
    assert "| fix: model.virtual_pipeline_model_parallel_size=4" in out
    status, out, err = check(str(FP8_ALIGN), "model.fp8_transpose_align.policy=eager")
    assert status == EXIT_INVALID and "one of: aligned, lazy, off" in out


def test_a_value_align_config_rejects_exits_2_with_every_violation():
    # AlignConfig rejects verify_every_n_steps < 0: a listed violation, never a traceback, and
    # it hides no other violation.
    status, out, err = check(str(FP8_ALIGN), "model.fp8_transpose_align.verify_every_n_steps=-1",
                           "model.num_layers=18")
    assert status == EXIT_INVALID
    assert "2 setting(s)" in out
    assert "| fix: model.fp8_transpose_align.verify_every_n_steps=0" in out
    assert "model.virtual_pipeline_model_parallel_size: found 2" in out  # 18 // PP 2 = 9


def test_subprocess_exit_codes(seed_yaml):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "nemo_fp8_align.cli.check"]
    ok = subprocess.run([*cmd, str(seed_yaml)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].endswith("OK (policy=aligned)")
    bad = subprocess.run([*cmd, str(seed_yaml), "model.fp8_params=false"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "model.fp8_params: found False" in bad.stdout
    missing = subprocess.run([*cmd, "/nonexistent/x.yaml"], env=env, capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_run_check_defaults_to_sys_streams(seed_yaml, capsys):
    args = argparse.Namespace(config=str(seed_yaml), overrides=[], data_parallel_size=None,
                              format="text", mixin=False)
    assert run_check(args) == EXIT_OK
    assert "OK" in capsys.readouterr().out


# --- issue 25 item 6: closed pipes, stdout for results, flags of the other mode --------------


def test_a_closed_pipe_exits_quietly_with_the_commands_status():
    # `check --format json | head -c 10`: the reader is gone before the command writes.
    run = subprocess.Popen([sys.executable, "-m", "nemo_fp8_align", "check", str(LAUNCHER),
                            "--format", "json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, cwd=ROOT)
    run.stdout.close()
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == EXIT_OK, err
    assert "Traceback" not in err and "BrokenPipe" not in err and err == ""


@pytest.mark.parametrize("argv,needle", [
    (["--world-size", "3"], "--world-size 3 applies only with --megatron-lm"),
    (["--megatron-lm"], "leave out --megatron-lm to check it"),
])
def test_a_flag_of_the_other_mode_is_an_error(argv, needle):
    status, out, err = check(str(FP8_ALIGN), *argv)
    assert status == EXIT_INVALID and out == ""
    assert err.count("\n") == 1 and needle in err


@pytest.mark.parametrize("argv,needle", [
    (["--mixin"], "--mixin applies only to a NeMo config"),
    (["--data-parallel-size", "2"], "--data-parallel-size applies only to a NeMo config"),
])
def test_a_nemo_flag_with_megatron_lm_is_an_error(argv, needle):
    status, out, err = check("--megatron-lm", *argv, "--", "--pipeline-model-parallel-size", "2")
    assert status == EXIT_INVALID and out == "" and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--megatron-lm"], ["--megatron-lm", "--"],
                                  ["--megatron-lm", "--world-size", "8"]])
def test_megatron_lm_without_arguments_is_a_usage_error(argv):
    """Issue 40: with no argument list, Megatron-LM's defaults were checked and 10 violations
    listed. It is one line saying to give the training script's arguments, exit 2."""
    status, out, err = check(*argv)
    assert status == EXIT_INVALID and out == "", out
    assert err.count("\n") == 1 and "no Megatron-LM arguments given" in err, err
    assert "check --megatron-lm [--world-size N] -- --pipeline-model-parallel-size 2" in err
