"""A forced synchronous all-gather between steps (Megatron-LM's evaluate / checkpoint save:
``disable_forward_pre_hook()``), then the next step's backward (issue 18 item 5).

The demo's FP8 weights behave as TE's under megatron-core >= 0.16 (``--manual-post-processing``:
a transpose stays flagged valid across new data until megatron-core's post-all-gather
processing, emulated for them where megatron-core runs it for TE). Every GEMM checks that what
it reads was built from the parameter's current bytes (StaleFP8Error otherwise). On
megatron-core 0.16 / 0.17 nothing post-processes after a forced all-gather, and with
``overlap_param_gather_with_optimizer_step`` chunk 0 is not gathered again before its
forwards: without the plugin the next backward reads the old weights. Runs on megatron-core
0.16.1 and 0.19.2 (Makefile); skipped on 0.12.3, which has no such processing.
"""

import pytest

pytest.importorskip("megatron.core")

from support.demo_runs import demo  # noqa: E402
from support.rank_errors import check_every_rank_raised  # noqa: E402

from lab.demo.launch import alignment_problems, differences  # noqa: E402
from lab.demo.ranks import DemoRankError  # noqa: E402


SHAPE = (2, 2, 2, 4)  # PP, VP, DP, M
STEPS = 3


def _mcore_post_processing():
    from megatron.core.distributed import param_and_grad_buffer as pgb

    manual = hasattr(pgb, "post_all_gather_processing")  # >= 0.16
    after_forced = hasattr(pgb._ParamAndGradBucketGroup, "_post_param_sync")  # >= 0.18
    return manual, after_forced


MANUAL, AFTER_FORCED = _mcore_post_processing()
needs_manual = pytest.mark.skipif(
    not MANUAL, reason="megatron-core < 0.16 runs no FP8 post-all-gather processing (TE "
    "invalidates the transposes at the cast): nothing to model")


def _run(policy, gather_with_optimizer, evaluate=True):
    return demo(*SHAPE, policy, steps=STEPS, eval_after_each_step=evaluate,
                eval_forced_sync=evaluate, gather_with_optimizer=gather_with_optimizer,
                manual_post_processing=True)


@pytest.mark.slow
@needs_manual
@pytest.mark.parametrize("policy,gather_with_optimizer", [
    ("aligned", True), ("lazy", True), ("aligned", False)])
def test_after_a_forced_all_gather_the_next_backward_reads_current_transposes(
        policy, gather_with_optimizer):
    run = _run(policy, gather_with_optimizer)
    assert alignment_problems(run) == []
    # The plugin off and no evaluation: no forced all-gather, nothing stale.
    assert differences(run, _run("off", gather_with_optimizer, evaluate=False)) == []
    for rank in run.ranks:
        weights = len(rank["builds_per_step"][0])
        if AFTER_FORCED:  # >= 0.18 post-processes itself: the plugin builds nothing more
            assert not rank["forced_sync_watch"] and rank["forced_sync_rebuilds"] == 0
        else:  # every weight rebuilt once per forced all-gather (one per evaluation)
            assert rank["forced_sync_watch"]
            assert rank["forced_sync_rebuilds"] == weights * STEPS


@pytest.mark.slow
@needs_manual
@pytest.mark.skipif(AFTER_FORCED, reason="megatron-core >= 0.18 post-processes forced "
                    "all-gathers itself: no watch, nothing of the plugin's to fail there")
def test_a_rebuild_failing_on_one_rank_stops_every_rank_at_the_next_step_end():
    """Issue 40: the watch's rebuild failing on one rank, inside the evaluation's forced
    all-gather (between steps), used to raise there: its peers then died in the evaluation's
    pipeline receives with gloo's errors. Now it is held to the next step's end, where every
    rank raises the plugin's error, the faulty one with its own message, within seconds."""
    with pytest.raises(DemoRankError) as info:
        demo(*SHAPE, "aligned", steps=STEPS, eval_after_each_step=True, eval_forced_sync=True,
             manual_post_processing=True, fault="rebuild_fails_on_one_rank")
    check_every_rank_raised(info.value, SHAPE[0] * SHAPE[2], "StaleFP8Error",
                            "could not be rebuilt after a forced all-gather on this rank only")


@pytest.mark.slow
@needs_manual
def test_without_the_plugin_the_backward_reads_stale_transposes_before_0_18():
    """The hazard itself (megatron-core alone, Megatron-LM PRs #4560/#4563): a stale read on
    0.16 / 0.17; none from 0.18 on."""
    if AFTER_FORCED:
        run = _run("off", True)
        assert differences(run, _run("off", True, evaluate=False)) == []
    else:
        with pytest.raises(DemoRankError, match="transpose read by the backward GEMM was built "
                                                "from parameter bytes that are not the current"):
            _run("off", True)


@pytest.mark.skipif(MANUAL, reason="megatron-core >= 0.16 has the processing the flag models")
def test_manual_post_processing_is_refused_where_megatron_core_has_none(capsys):
    from lab.demo.cli import main

    assert main(["--manual-post-processing"]) == 2
    err = capsys.readouterr().err
    assert "--manual-post-processing" in err and "megatron-core >= 0.16" in err
