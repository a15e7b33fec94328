"""Table-driven bad-input battery: every invocation of ``check``, ``plan``, ``report`` and
``demo`` below is a user error that must end in exactly one line on stderr, exit status 2 and
no traceback. Run in-process through ``nemo_fp8_align.cli.main`` (fast; ``demo`` is the lab's,
``lab.demo.cli.main``, ``python -m lab.demo``); a few as real subprocesses, as a shell runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.demo.cli import main as demo_main
from nemo_fp8_align.cli import main

DATA = Path(__file__).parent / "data"
GOOD = DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl"
LAUNCHER = DATA / "upstream" / "launcher"
GPT = ["--model", "gpt3-175b"]
RECORD = json.loads(GOOD.read_text().splitlines()[0])


def _record(**change):
    return json.dumps({**RECORD, **change}) + "\n"


#: report: (file content or None for a path argument as given, extra args)
REPORT_FILES = {
    "slot_zero": _record(slot="zero"), "slot_null": _record(slot=None),
    "step_string": _record(step="1"), "weights_string": _record(weights="4"),
    "slot_float": _record(slot=1.5), "step_bool": _record(step=True),
    "negative_step": _record(step=-1), "negative_weights": _record(weights=-4),
    "policy_unknown": _record(policy="eager"), "policy_number": _record(policy=3),
    "after_all_gather_string": _record(after_all_gather="yes"),
    "valid_string": _record(valid="4"), "t_slot_string": _record(t_slot="now"),
    "t_done_nan": _record(t_done=float("nan")).replace("NaN", "NaN"),
    "obs_at_string": _record(obs_at="early"), "obs_at_bad_pair": _record(obs_at=[[0]]),
    "obs_built_negative": _record(obs_built=-1), "pp_size_zero": _record(pp_size=0),
    "rank_string": _record(rank="0"), "vmid_below": _record(vmid=-2),
    "missing_fields": '{"step": 0}\n', "a_list": "[1, 2]\n", "a_number": "7\n",
    "a_string": '"record"\n', "not_json": "{not json\n", "empty": "", "blank_lines": "\n\n",
    "yaml_text": "model:\n  fp8: true\n",
}

CASES = []
for name, content in REPORT_FILES.items():
    CASES.append(pytest.param("report", content, [], id=f"report-{name}"))
CASES += [pytest.param("report", b"\xff\xfe\x00bad", [], id="report-non-utf8"),
          pytest.param("report", None, ["/nonexistent/t.jsonl"], id="report-no-file"),
          pytest.param("report", None, ["/tmp"], id="report-directory"),
          pytest.param("report", None, ["/nonexistent/t.rank{rank}.jsonl"], id="report-template-none"),
          pytest.param("report", None, [str(GOOD), "--plot", "/nonexistent/dir/s.png"],
                       id="report-plot-no-dir"),
          pytest.param("report", None, [str(GOOD), "--plot", "x.yaml"], id="report-plot-yaml"),
          pytest.param("report", None, [str(GOOD), "--plot", "/tmp"], id="report-plot-dir"),
          pytest.param("report", None, [str(GOOD), "--plot", "noext"], id="report-plot-noext"),
          pytest.param("report", None, [str(GOOD), "--baseline", "/nonexistent/b.jsonl"],
                       id="report-baseline-missing"),
          pytest.param("report", None, [str(GOOD), str(DATA / "telemetry_observed_pp2_vp2_dp2_lazy.jsonl")],
                       id="report-two-policies"),
          pytest.param("report", None, ["--bogus", str(GOOD)], id="report-unknown-flag"),
          pytest.param("report", None, [], id="report-no-args"),
          # second trial: one file twice read as every record twice, "invariants broken" (exit 1)
          pytest.param("report", None, [str(GOOD), str(GOOD)], id="report-same-file-twice")]

PLAN = [
    ["--seq", "0"], ["--micro-batch", "0"], ["--transpose-tbps", "nan"], ["--tflops", "inf"],
    ["--tflops", "-1"], ["--transpose-tbps", "0"], ["--allgather-gbps", "nan"],
    ["--p2p-gbps", "0"], ["--overlap-penalty", "nan"], ["--kv-heads", "5"], ["--kv-heads", "0"],
    ["--tp", "0"], ["--pp", "0"], ["--pp", "1"], ["--vp", "1"], ["--vp", "0"], ["--dp", "0"],
    ["--cp", "0"], ["--ep", "0"], ["--expert-tp", "0"], ["--experts", "0"], ["--topk", "0"],
    ["--global-batch", "0"], ["--global-batch", "100", "--dp", "3"], ["--group-size", "0"],
    ["--group-size", "3"], ["--layers", "0"], ["--layers", "97"], ["--hidden", "1000"],
    ["--heads", "0"], ["--ffn", "0"], ["--gpu", "a100"], ["--gpu", ""], ["--tp", "7"],
    ["--experts", "8", "--ep", "3"], ["--experts", "4", "--topk", "5"],
    ["--experts", "8", "--ep", "8", "--dp", "1", "--tp", "1"], ["--plot", "/nonexistent/dir/p.png"],
    ["--plot", "/tmp"], ["--plot", "p.yaml"], ["--overlap-p2p-comm", "--batch-p2p-comm"],
    ["--recipe", "fp4"], ["--tp", "x"], ["--seq", "1.5"], ["--plot-window", "half"],
    ["--model", "gpt5"], ["--no-such-flag"],
]
for i, argv in enumerate(PLAN):
    model = [] if "--model" in argv else GPT
    CASES.append(pytest.param("plan", None, [*model, *argv], id=f"plan-{i}-{'_'.join(argv)[:30]}"))
CASES += [
    pytest.param("plan", None, ["--layers", "8"], id="plan-missing-sizes"),
    pytest.param("plan", None, [], id="plan-nothing"),
    pytest.param("plan", None, ["/nonexistent/c.yaml"], id="plan-config-missing"),
    pytest.param("plan", None, ["/tmp"], id="plan-config-directory"),
    pytest.param("plan", None, [str(GOOD)], id="plan-config-not-yaml"),
    pytest.param("plan", None, ["model.fp8=True", *GPT], id="plan-override-without-config"),
    pytest.param("plan", None, [str(LAUNCHER / "gpt3_5b.yaml"), "model.num_layers=abc"],
                 id="plan-config-bad-layers"),
    pytest.param("plan", None, [str(LAUNCHER / "gpt3_5b.yaml"), "model.no_such_key=1"],
                 id="plan-config-unknown-key"),
]

DEMO = [["--pp", "1"], ["--vp", "1"], ["--dp", "0"], ["--steps", "0"], ["--microbatches", "1"],
        ["--group-size", "1"], ["--microbatches", "5"], ["--telemetry", "/nonexistent/d/t.jsonl"],
        ["--telemetry", "/tmp"], ["--telemetry", ""], ["--policy", "eager"], ["--pp", "x"],
        ["--fault", "no_such_fault"], ["--bogus"], ["--dist-opt-instances", "0"],
        ["--dp", "2", "--dist-opt-instances", "3"],
        # issue 40: absurd sizes, refused before any rank starts (--microbatches 1e20 spawned
        # the ranks, then failed with OverflowError, exit 1)
        ["--microbatches", "100000000000000000000"], ["--pp", "100000000000000000000"],
        ["--vp", "100000"], ["--dp", "1000000"], ["--steps", "100000000000000000000"],
        ["--group-size", "100000000000000000000"], ["--pp", "8", "--dp", "8"],
        ["--timeout", "1e400"], ["--timeout", "1e20"], ["--resume-at", "100000000000000000000"],
        ["--dp", "4", "--dist-opt-instances", "100000000000000000000"]]
CASES += [pytest.param("demo", None, argv, id=f"demo-{'_'.join(argv)[:30]}") for argv in DEMO]

CHECK = [["/nonexistent/c.yaml"], [str(GOOD)], [str(LAUNCHER / "gpt3_5b.yaml"), "model.no_such_key=1"],
         [str(LAUNCHER / "gpt3_5b.yaml"), "--data-parallel-size", "0"],
         [str(LAUNCHER / "gpt3_5b.yaml"), "--data-parallel-size", "x"], ["--bogus"], []]
CASES += [pytest.param("check", None, argv, id=f"check-{i}") for i, argv in enumerate(CHECK)]

#: issue 25 items 4-6: plan's CP and config reading, report's size flags, flags of the other mode
GPT3_LAUNCHER = str(Path(__file__).parent.parent / "conf" / "launcher" / "gpt3_175b_fp8_align.yaml")
MLM = ["--", "--pipeline-model-parallel-size", "2"]
CASES += [
    pytest.param("plan", None, [*GPT, "--cp", "3"], id="plan-cp-not-dividing-seq"),
    pytest.param("plan", None, [GPT3_LAUNCHER, "trainer.num_nodes=3"], id="plan-world-not-divisible"),
    pytest.param("plan", None, [GPT3_LAUNCHER, "model.fp8_recipe=fp4"], id="plan-config-recipe"),
    pytest.param("plan", None, [GPT3_LAUNCHER, "model.fp8=yes"], id="plan-config-fp8-string"),
    pytest.param("report", None, [str(GOOD), "--pp-size", "3"], id="report-size-contradicts"),
    pytest.param("report", None, [str(GOOD), "--dp-size", "0"], id="report-size-zero"),
    pytest.param("check", None, [GPT3_LAUNCHER, "--world-size", "3"], id="check-world-size-nemo"),
    pytest.param("check", None, [GPT3_LAUNCHER, "--megatron-lm"], id="check-yaml-megatron-lm"),
    pytest.param("check", None, ["--megatron-lm", "--mixin", *MLM], id="check-mlm-mixin"),
    pytest.param("check", None, ["--megatron-lm", "--data-parallel-size", "2", *MLM],
                 id="check-mlm-dp"),
]


def _argv(tmp_path, command, content, extra):
    if content is None:
        return [command, *extra]
    path = tmp_path / "t.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return [command, str(path), *extra]


def _one_line_error(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    # argparse prints its usage first: the error itself is still one line
    lines = [line for line in lines if not line.startswith(("usage:", "       ", "  "))]
    assert len(lines) == 1, err


def _command(argv):
    """The shipped command line, or for a "demo" case the lab's (``python -m lab.demo``)."""
    return [sys.executable, "-m", "lab.demo", *argv[1:]] if argv[0] == "demo" else \
        [sys.executable, "-m", "nemo_fp8_align", *argv]


@pytest.mark.parametrize("command,content,extra", CASES)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, command, content, extra):
    argv = _argv(tmp_path, command, content, extra)
    try:
        code = demo_main(argv[1:]) if command == "demo" else main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    _one_line_error(err)


def test_the_battery_is_large_enough():
    assert len(CASES) >= 100


@pytest.mark.parametrize("argv", [
    ["report", str(GOOD), "--plot", "/nonexistent/dir/s.png"],
    ["plan", "--model", "gpt3-175b", "--seq", "0"],
    ["plan", "--model", "gpt3-175b", "--kv-heads", "5"],
    ["demo", "--pp", "1"],
    ["check", "/nonexistent/c.yaml"],
], ids=["report", "plan-seq", "plan-kv", "demo", "check"])
def test_as_real_subprocesses(argv):
    run = subprocess.run(_command(argv), capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert run.returncode == 2, run.stderr
    _one_line_error(run.stderr)


def test_an_engine_fault_in_megatron_lm_loop_is_refused_not_ignored(capsys):
    """Issue 24: `demo --loop megatron-lm --fault NAME` printed OK with nothing injected. The
    one-rank errors now run there (tests/test_megatron_lm_loop.py); the engine faults, judged
    by the demo loop's own evidence, are refused with exit 2 before any rank starts."""
    assert demo_main(["--loop", "megatron-lm", "--fault", "no_wait"]) == 2
    err = capsys.readouterr().err
    _one_line_error(err)
    assert "--fault no_wait: runs in the demo's own loop only (pass --loop schedule); in " \
           "Megatron-LM's loop pass one of args_check_fails_on_one_rank, capture_on_one_rank, " \
           "detach_fails_on_one_rank, extra_forward_on_one_rank, metrics_fail_on_one_rank, " \
           "mismatch_on_one_rank, telemetry_fails_at_the_last_step, verify_fails_on_one_rank" in err
