"""No plugin error hangs a rank: every rank stops at the same step end, each with its own message.

Each fault of ``RANK_ERRORS`` makes the plugin find an error on the job's last rank only, in
step 1, inside the schedule (a forward pre-hook): an extra chunk forward (the next forwards run
other chunks), a forward beyond the schedule's, a CUDA-graph capture where transposes are due,
a transpose failing verification. The demo's real megatron-core run (gloo processes, process
groups with a 60 s timeout) must end with every rank raising the plugin's error class at that
step's end, within seconds of each other: the faulty rank with what differed there, the others
naming it. Raised inside the schedule, the faulty rank's peers would instead die in (or block
on) their p2p receives and collectives.
"""

import pytest

pytest.importorskip("megatron.core")

from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.launch import DemoRankError, run_demo  # noqa: E402
from lab.demo.train import DemoOptions  # noqa: E402
from support.rank_errors import (EXPECTED, check_every_rank_raised,  # noqa: E402
                                 check_every_rank_stopped)

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
SHAPES = {"pp2-dp2": dict(pp=2, vp=2, dp=2, microbatches=4),
          "pp4-dp1": dict(pp=4, vp=2, dp=1, microbatches=4)}


def stopped_ranks(shape, fault):
    opts = DemoOptions(**SHAPES[shape], steps=2, policy=Policy.ALIGNED, fault=fault,
                       pg_timeout_s=TIMEOUT_S)
    with pytest.raises(DemoRankError) as info:
        run_demo(opts)
    return opts, info.value


def _runs_here(shape):
    """0.7.0 refuses interleaving at PP 2 (its own rule): the PP 4 shape runs there."""
    from nemo_fp8_align import mcore_versions as mcore_version

    rule = mcore_version.installed_rules().interleaved_pp_rule(SHAPES[shape]["pp"])
    return pytest.param(shape, marks=pytest.mark.skipif(rule is not None, reason=str(rule)))


@pytest.mark.parametrize("shape", [_runs_here(s) for s in sorted(SHAPES)])
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_an_error_on_one_rank_stops_every_rank_at_the_step_end(shape, fault):
    opts, err = stopped_ranks(shape, fault)
    check_every_rank_stopped(opts, err, fault)


def test_demo_command_exits_1_with_every_ranks_message(capsys):
    """The demo's default shape (PP 2); 0.7.0 refuses it before any rank starts
    (test_mcore_versions.py), and the pp4-dp1 rows above stop every rank there."""
    from lab.demo.cli import main
    from nemo_fp8_align import mcore_versions as mcore_version

    rule = mcore_version.installed_rules().interleaved_pp_rule(2)
    if rule is not None:
        pytest.skip(rule)

    assert main(["--fault", "mismatch_on_one_rank", "--timeout", str(TIMEOUT_S)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: rank 0: StepMismatchError: nemo_fp8_align: rank 0 (pipeline rank 0" in err
    assert "FAILED: rank 1: StepMismatchError: nemo_fp8_align: forward 2 of step 1 on " \
           "pipeline rank 1 ran model chunk 0" in err


def test_demo_command_refuses_an_unknown_fault(capsys):
    from lab.demo.cli import main
    from nemo_fp8_align import mcore_versions as mcore_version

    # a shape this version runs (0.7.0 refuses the default PP 2 first, as it should)
    pp = "4" if mcore_version.installed_rules().interleaved_pp_rule(2) else "2"
    assert main(["--pp", pp, "--fault", "no_such_fault"]) == 2
    assert "--fault no_such_fault: not a known fault; pass one of" in capsys.readouterr().err


# --- Issue 40: errors at the run's end (after the last step end's agreement used to pass).

def _pp2_rule():
    from nemo_fp8_align import mcore_versions as mcore_version

    return mcore_version.installed_rules().interleaved_pp_rule(2)


#: The PP 2 DP 2 shape below (0.7.0 refuses interleaving at PP 2: its own rule).
needs_pp2 = pytest.mark.skipif(_pp2_rule() is not None, reason=str(_pp2_rule()))


def _forced_sync_watch():
    """Whether the plugin watches forced all-gathers here: megatron-core 0.9 to 0.17 (0.18 on
    post-processes them itself; 0.7/0.8's optimizer chain has no DDP forced all-gather)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    group = getattr(pgb, "_ParamAndGradBucketGroup", None)
    return group is not None and not hasattr(group, "_post_param_sync")


def end_error(fault, **extra):
    """A 3-step PP 2 DP 2 run with ``fault``; the error every rank raised."""
    opts = DemoOptions(**SHAPES["pp2-dp2"], steps=3, policy=Policy.ALIGNED, fault=fault,
                       pg_timeout_s=TIMEOUT_S, **extra)
    with pytest.raises(DemoRankError) as info:
        run_demo(opts)
    return opts, info.value


@needs_pp2
def test_a_telemetry_write_failing_at_the_last_step_stops_every_rank():
    """The telemetry flush fails (ENOSPC) on the last rank at the last step's end: it used to be
    held for a next step end that never came, logged at detach, and every rank exited 0 (the
    demo printed OK). Now the step end flushes before its agreement: every rank raises the
    plugin's TelemetryError at step 2's end, the faulty one naming the file and the fix."""
    opts, err = end_error("telemetry_fails_at_the_last_step")
    check_every_rank_raised(err, opts.world_size, "TelemetryError",
                            "No space left on device (injected)); free space there")
    assert "data-parallel rank 1, step 2)" in err.reports[0], err.reports[0]


@needs_pp2
def test_a_detach_failing_on_one_rank_stops_every_rank():
    """The final telemetry flush fails on the last rank as the aligner detaches after the run:
    the peers used to die in the teardown barrier with gloo's errors. The demo detaches with
    ``detach(agree=True)`` on every rank: every rank raises the plugin's error."""
    opts, err = end_error("detach_fails_on_one_rank")
    check_every_rank_raised(err, opts.world_size, "TelemetryError",
                            "No space left on device (injected)); free space there")
    assert "detaching after step 2)" in err.reports[0], err.reports[0]


@needs_pp2
@pytest.mark.skipif(not _forced_sync_watch(), reason="no forced-sync watch "
                    "on this megatron-core (0.18 on post-processes forced all-gathers itself)")
def test_a_failure_held_at_detach_stops_every_rank():
    """The forced-sync watch's rebuild fails on the last rank in the evaluation after the last
    step (no step end follows): it used to be only logged at detach, exit 0. It is agreed on at
    the detach: every rank raises it."""
    opts, err = end_error("rebuild_fails_after_the_last_step", eval_after_each_step=True,
                          eval_forced_sync=True)
    check_every_rank_raised(err, opts.world_size, "StaleFP8Error",
                            "after the last evaluation's forced all-gather on this rank only")


@needs_pp2
def test_a_stale_read_shows_its_cause_on_every_rank():
    """``demo --dp 2 --fault no_wait``: the GEMMs' stale-byte check used to raise inside the
    schedule on pipeline rank 0, and ranks 2 and 3 (pipeline rank 1) died in their p2p receives
    showing only gloo's "Connection closed by peer". The demo holds the check to the schedule's
    end and agrees on it: every rank raises StaleFP8Error, naming what pipeline rank 0 read."""
    opts = DemoOptions(**SHAPES["pp2-dp2"], steps=2, policy=Policy.ALIGNED, fault="no_wait",
                       pg_timeout_s=TIMEOUT_S)
    with pytest.raises(DemoRankError) as info:
        run_demo(opts)
    reports, times = info.value.reports, info.value.times
    assert sorted(reports) == [0, 1, 2, 3], reports
    for rank, text in sorted(reports.items(), reverse=True):  # pipeline rank 1's first
        assert "Connection closed" not in text, text
        assert text.startswith(f"rank {rank}: StaleFP8Error: "), text
        assert "nemo_fp8_align stopped this training step on all 4 ranks" in text, text
    for rank in (2, 3):  # pipeline rank 1: what was read stale (by pipeline rank 0 at least)
        assert "(pipeline rank 0, data-parallel rank 0, step " in reports[rank], reports[rank]
        assert "StaleFP8Error: FP8 weight 'stage0." in reports[rank], reports[rank]
    assert max(times.values()) - min(times.values()) < 10.0, times
