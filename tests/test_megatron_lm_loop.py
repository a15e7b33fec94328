"""``demo --loop megatron-lm``: the demo GPT trained by Megatron-LM's own pretrain/train()
(megatron-core 0.19's ``megatron.training``, unedited) on the CPU over gloo, PP=2 VP=2 DP=2, the
plugin attached by a ``ModelConfig.post_wrap_hooks`` entry. Needs megatron-core >= 0.19
(.venv-mcore019); each run spawns 4 processes (~1-5 minutes each, depending on load)."""

import functools

import pytest

pytest.importorskip("megatron.training.models", reason="Megatron-LM's loop ships in "
                    "megatron-core >= 0.19 (.venv-mcore019)")
pytest.importorskip("omegaconf")

from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.launch import alignment_problems, differences, format_report  # noqa: E402
from lab.demo.launch_megatron_lm import run_megatron_lm_demo  # noqa: E402
from lab.demo.train import DemoOptions  # noqa: E402
from lab.demo.ranks import DemoRankError  # noqa: E402
from support.rank_errors import (check_every_rank_raised,  # noqa: E402
                                 check_every_rank_stopped)

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def run(policy, resume_at=None):
    return run_megatron_lm_demo(DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3,
                                            policy=Policy(policy), resume_at=resume_at))


@pytest.mark.parametrize("policy", ["aligned", "lazy"])
def test_megatron_lm_loop_passes_the_judge(policy):
    result = run(policy)
    assert alignment_problems(result) == []
    # train()'s first iteration runs without launches (pre-hooks off, param_sync_func None):
    # built at first use, judged lazy; the plugin is in the loop from iteration 1 on.
    assert all(r["unlaunched_steps"] == [0] and r["unlaunched_forwards"] > 0
               for r in result.ranks)
    assert sorted({r["step"] for r in result.records}) == [1, 2]
    for rec in result.records:
        assert rec["after_all_gather"] and rec["transposed"] == rec["weights"]
        if policy == "aligned":
            assert rec["slot"] == rec["aligned_slot"]
        else:
            assert rec["slot"] == rec["aligned_slot"] + rec["pp_rank"]


@pytest.mark.parametrize("policy, skew", [("aligned", 0.0), ("lazy", 1.0)])
def test_metrics_reach_megatron_lm_writers_path_every_log_interval(policy, skew):
    """--log-interval 1: the step-end listener gathered iterations 2 and 3 over the pipeline
    group (identical on both pipeline ranks) and handed them to Megatron-LM's writers."""
    result = run(policy)
    for dp in (0, 1):  # the pipeline ranks of one pipeline gathered the same
        written = [r["metrics"] for r in result.ranks if r["dp_rank"] == dp]
        assert len(written) == 2 and written[0] == written[1]
        assert [m["iteration"] for m in written[0]] == [2, 3]
    for m in written[0]:
        assert m["fp8_align/records"] == 4.0  # 2 chunks x 2 pipeline ranks
        assert m["fp8_align/chunk0/slot_skew"] == m["fp8_align/chunk1/slot_skew"] == skew


def test_bit_identical_losses_gradients_and_parameters_across_policies():
    assert differences(run("lazy"), run("aligned")) == []


def test_save_and_resume_through_megatron_lm_checkpointing_is_bit_identical():
    resumed, whole = run("aligned", resume_at=2), run("aligned")
    assert alignment_problems(resumed) == []
    assert all(r["unlaunched_steps"] == [0, 2] for r in resumed.ranks)  # each job's first
    assert differences(resumed, whole) == []
    assert len(resumed.losses()) == 3
    # the resumed job's one step ran without launches: the summary shows the last that had them
    summary = format_report(resumed)
    assert "chunk 1: aligned slot 2; built at slots r0:2 r1:2; 9 transposes" in summary
    assert "(step 1, the last with all-gather launches" in summary


def test_cli_demo_loop_megatron_lm(tmp_path):
    from support.demo_runs import demo_cli

    out = demo_cli("--loop", "megatron-lm", "--dp", "1", "--steps", "2",
                   "--telemetry", str(tmp_path / "t.jsonl"), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "chunk 1: aligned slot 2; built at slots r0:2 r1:2" in out.stdout
    assert (tmp_path / "t.jsonl").read_text().count("\n") == 4  # step 1 x 2 ranks x 2 chunks


@pytest.mark.parametrize("fault", ["extra_forward_on_one_rank", "capture_on_one_rank",
                                   "verify_fails_on_one_rank"])
def test_an_error_on_one_rank_stops_every_rank_in_megatron_lm_loop(fault):
    """The no-hang guarantee in Megatron-LM's own train(), the plugin attached by the post-wrap
    hook: the last rank meets the error in iteration 1; the plugin holds it to the step end
    (chunk 0's finish_grad_sync), where every rank, of both pipelines, raises it within seconds
    instead of the peers dying in a p2p receive or the gradient all-reduce."""
    opts = DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3, policy=Policy.ALIGNED,
                       fault=fault, pg_timeout_s=120.0)
    with pytest.raises(DemoRankError) as info:
        run_megatron_lm_demo(opts)
    check_every_rank_stopped(opts, info.value, fault)


def test_an_argument_check_failing_on_one_rank_stops_every_rank_at_attach():
    """Issue 40: Megatron-LM's argument check failing on one rank only (at the post-wrap hook's
    attach) used to leave the other ranks blocked in the attach's agreement until gloo closed
    them ("Connection closed by peer"). The check now runs inside the agreement: every rank
    raises the plugin's error, the faulty one its own message, within seconds."""
    opts = DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3, policy=Policy.ALIGNED,
                       fault="args_check_fails_on_one_rank", pg_timeout_s=120.0)
    with pytest.raises(DemoRankError) as info:
        run_megatron_lm_demo(opts)
    check_every_rank_raised(info.value, opts.world_size, "MegatronLMArgsError",
                            "fail the check on this rank only")


def test_a_metrics_listener_failing_before_its_gather_on_one_rank_stops_every_rank():
    """Issue 40: the metrics listener failing on one rank before its all_gather_object (after
    step 1's agreement) left that rank's pipeline peers in the gather and the rest in the next
    iteration's collectives until the launcher killed them. The failure now travels through the
    gather, and the listeners run before the step end's agreement: every rank raises it at
    step 1's end, within seconds."""
    opts = DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3, policy=Policy.ALIGNED,
                       fault="metrics_fail_on_one_rank", pg_timeout_s=120.0)
    with pytest.raises(DemoRankError) as info:
        run_megatron_lm_demo(opts)
    # The pipeline group of the faulty rank held it; the other group's ranks name it.
    check_every_rank_raised(info.value, opts.world_size, "MetricsError",
                            "rank 3: OSError: injected: this rank's step records could not be read")
    assert "data-parallel rank 1, step 1): MetricsError" in info.value.reports[0]  # that step's


def test_demo_loop_megatron_lm_fault_exits_1_with_every_ranks_message(capsys):
    """Issue 24's done-when: `demo --loop megatron-lm --fault mismatch_on_one_rank` exits 1 with
    StepMismatchError named by every rank (it printed OK, the fault ignored)."""
    from lab.demo.cli import main

    code = main(["--loop", "megatron-lm", "--dp", "2", "--fault",
                 "mismatch_on_one_rank", "--steps", "3", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    failed = [line for line in err.splitlines() if line.startswith("FAILED: rank ")]
    assert len(failed) == 4, err[-3000:]
    for rank, line in enumerate(failed):
        assert line.startswith(f"FAILED: rank {rank}: StepMismatchError: nemo_fp8_align: "), line
    assert "on pipeline rank 1 ran model chunk 0, but the interleaved schedule" in failed[3]
    assert all("found no problem of its own" in line for line in failed[:3]), failed


@pytest.mark.parametrize("fault, where", [
    ("telemetry_fails_at_the_last_step", "data-parallel rank 1, step 2)"),
    ("detach_fails_on_one_rank", "detaching after step 2)")])
def test_a_failure_at_the_runs_end_stops_every_rank_in_megatron_lm_loop(fault, where):
    """Issue 40: the telemetry write failing (ENOSPC) on the last rank at the last iteration's
    step end, or at the detach after train() returned, used to be logged only ("detached with
    an error no step end reported") and every rank exited 0. The step end now flushes before its
    agreement, and the loop detaches with ``detach(agree=True)``: every rank raises the plugin's
    TelemetryError, within seconds, the others naming the faulty rank."""
    opts = DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3, policy=Policy.ALIGNED,
                       fault=fault, pg_timeout_s=120.0)
    with pytest.raises(DemoRankError) as info:
        run_megatron_lm_demo(opts)
    check_every_rank_raised(info.value, opts.world_size, "TelemetryError",
                            "No space left on device (injected)); free space there")
    assert where in info.value.reports[0], info.value.reports[0]
