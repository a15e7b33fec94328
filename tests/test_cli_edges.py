"""Edges a new user reaches with ``plan`` and ``report`` (issue 40, item 4): each is one line
naming the setting, the value and the fix, exit status 2, no traceback; Ctrl-C is one line and
exit status 130."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8_align.cli import main

ROOT = Path(__file__).parent.parent
DATA = Path(__file__).parent / "data"
GOOD = DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl"
T5 = DATA / "upstream" / "launcher" / "t5_220m.yaml"
ONE_GPU_GPT = DATA / "upstream" / "nemo_v2.3.2" / "megatron_gpt_config.yaml"
SIZES = ["--hidden", "4096", "--heads", "32", "--ffn", "16384"]


def _one_line(err):
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # no argparse usage block above it either
    return lines[0]


def _run(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv,needles", [
    (["--layers", "1e20", *SIZES], ["argument --layers: '1e20' is not a whole number",
                                     "give it in digits"]),
    (["--layers", str(10 ** 20), *SIZES],
     [f"--layers {10 ** 20}: outside the range plan models, 1 to 4096"]),
    (["--model", "gpt3-175b", "--seq", str(10 ** 12)],
     [f"--seq {10 ** 12}: outside the range plan models, 1 to 16777216"]),
    (["--model", "gpt3-175b", "--dp", str(10 ** 9)],
     [f"--dp {10 ** 9}: outside the range plan models, 1 to 1048576"]),
    (["--model", "gpt3-175b", "--global-batch", str(10 ** 20)],
     [f"--global-batch {10 ** 20}: outside the range plan models"]),
    (["--model", "gpt3-175b", "--global-batch", str(2 ** 40)],
     [f"--global-batch {2 ** 40}: M = global batch / (micro-batch x DP) = {2 ** 40} / 1 = "
      f"{2 ** 40} microbatches per step, outside the range plan models, 1 to 4096",
      "pass a --global-batch of at most 4096"]),
    (["--model", "gpt3-175b", "--tflops", "1e300"],
     ["--tflops 1e+300: outside the range plan models, above 0 up to 1e+06"]),
    (["--model", "gpt3-175b", "--global-batch", "100", "--dp", "3"],
     ["the nearest global batch that fits: --global-batch 96 (M=32)"]),
    (["--model", "gpt3-175b", "--global-batch", "100"],
     ["M a multiple of N", "the nearest global batch that fits: --global-batch 104 (M=104)"]),
    ([str(T5)], ["an encoder-decoder model (model.encoder and model.decoder): not planned",
                 "plan models a GPT (decoder-only) model"]),
    ([str(ONE_GPU_GPT), "model.fp8=True", "model.pipeline_model_parallel_size=2",
      "model.virtual_pipeline_model_parallel_size=2"],
     ["trainer.devices x trainer.num_nodes = 1 GPU, fewer than TP x PP x CP = 2",
      "pass --dp 1 to plan one model replica on 2 GPUs"]),
], ids=["layers-1e20", "layers-huge", "seq-huge", "dp-huge", "global-batch-huge",
        "microbatches-huge", "tflops-huge", "nearest-multiple", "nearest-schedule", "t5",
        "one-gpu-config"])
def test_plan_edges_are_one_line_exit_2(capsys, argv, needles):
    status, out, err = _run(["plan", *argv], capsys)
    assert status == 2, out + err
    line = _one_line(err)
    assert line.startswith("nemo-fp8-align plan: error: "), line
    for needle in needles:
        assert needle in line, line
    assert "give a CONFIG.yaml" not in line


def test_a_config_size_out_of_range_names_its_key(capsys):
    status, _, err = _run(["plan", str(ONE_GPU_GPT), "model.fp8=True",
                           f"model.num_layers={10 ** 20}"], capsys)
    assert status == 2
    assert (f"model.num_layers={10 ** 20}: outside the range plan models, 1 to 4096 (override it "
            "with a value in that range)") in _one_line(err)


def test_the_dp_hint_works_on_a_one_gpu_config(capsys):
    status, out, err = _run(["plan", str(ONE_GPU_GPT), "model.fp8=True",
                             "model.pipeline_model_parallel_size=2",
                             "model.virtual_pipeline_model_parallel_size=2", "--dp", "1"], capsys)
    assert status == 0, err
    assert "TP=1 PP=2 VP=2 DP=1" in out


def test_nearest_global_batch_is_integer_exact():
    from nemo_fp8_align.cli.plan import nearest_global_batch

    per = 2 ** 36 + 1  # micro-batch x DP, odd and large
    assert nearest_global_batch(2, 2, None, per, 4000 * per + 7) == 4000 * per
    # M=4001 leaves a last group of 1 < PP: the nearer of 4000 and 4002
    assert nearest_global_batch(2, 2, None, per, 4001 * per + 1) == 4002 * per
    assert nearest_global_batch(2, 2, None, per, 4001 * per) == 4002 * per  # a tie goes up
    assert nearest_global_batch(2, 2, 1, per, 4000 * per) is None  # N below PP: none fits


def test_report_reads_stdin_when_given_dash():
    with open(GOOD, "rb") as f:
        run = subprocess.run([sys.executable, "-m", "nemo_fp8_align", "report", "-"], stdin=f,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "24 records: steps 0-2" in run.stdout and "OK: every record" in run.stdout


def test_report_dash_from_a_terminal_is_refused(capsys, monkeypatch):
    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    status, _, err = _run(["report", "-"], capsys)
    assert status == 2
    line = _one_line(err)
    assert "standard input, but it is a terminal" in line and "give the files' paths" in line


def test_report_dash_for_both_runs_is_refused(capsys):
    status, _, err = _run(["report", "-", "--baseline", "-"], capsys)
    assert status == 2
    assert "given for both TELEMETRY and --baseline" in _one_line(err)


def test_report_unknown_option_value_is_one_line(capsys):
    status, _, err = _run(["report", str(GOOD), "--pp-size", "two"], capsys)
    assert status == 2
    assert ("argument --pp-size: invalid int value: 'two' (see nemo-fp8-align report --help)"
            in _one_line(err))


@pytest.mark.parametrize("command", ["plan", "report", "check"])
def test_ctrl_c_is_one_line_exit_130(capsys, monkeypatch, command):
    import nemo_fp8_align.cli.check as check
    import nemo_fp8_align.cli.plan as plan
    import nemo_fp8_align.cli.report as report

    def interrupted(args):
        raise KeyboardInterrupt

    module = {"plan": plan, "report": report, "check": check}[command]
    name = {"plan": "run_plan", "report": "run_report", "check": "run_check"}[command]
    monkeypatch.setattr(module, name, interrupted)
    argv = {"plan": ["plan", "--model", "gpt3-175b"], "report": ["report", str(GOOD)],
            "check": ["check", str(ONE_GPU_GPT)]}[command]
    try:
        status, _, err = _run(argv, capsys)
    except KeyboardInterrupt:  # would end the test session: a plain failure instead
        pytest.fail("KeyboardInterrupt escaped main()")
    assert status == 130
    assert _one_line(err) == f"nemo-fp8-align {command}: interrupted"


def test_ctrl_c_on_a_real_process(tmp_path):
    # `report -` waits on a pipe that never ends; SIGINT, as Ctrl-C sends it
    code = ("import sys; from nemo_fp8_align.cli import main; print('ready', flush=True); "
            "sys.exit(main(['report', '-']))")
    run = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert run.stdout.readline() == "ready\n"
        import time

        time.sleep(1.0)  # inside main, blocked reading stdin
        os.kill(run.pid, signal.SIGINT)
        status = run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    err = run.stderr.read()
    assert status == 130, err
    assert err == "nemo-fp8-align report: interrupted\n", err
