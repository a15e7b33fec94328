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
from nemo_fp8_align.demo.launch import DemoRankError, run_demo  # noqa: E402
from nemo_fp8_align.demo.train import DemoOptions  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
SHAPES = {"pp2-dp2": dict(pp=2, vp=2, dp=2, microbatches=4),
          "pp4-dp1": dict(pp=4, vp=2, dp=1, microbatches=4)}
#: fault -> (error class every rank raises, what the faulty rank's own message says)
EXPECTED = {
    "mismatch_on_one_rank": ("StepMismatchError", "ran model chunk 0, but the interleaved "
                             "schedule (PP={pp}, VP=2, M=4, N={pp}) runs chunk 1 there: either "
                             "an extra"),
    "extra_forward_on_one_rank": ("StepMismatchError", "ran a forward beyond its 8th (model "
                                  "chunk 1), but its schedule"),
    "capture_on_one_rank": ("CudaGraphCaptureError", "model chunks [1] are due at forward 1 of "
                            "step 1, which runs inside a CUDA-graph capture"),
    "verify_fails_on_one_rank": ("TransposeVerifyError", "step 1, pipeline rank {last_pp}, model "
                                 "chunk 1, FP8 weight stage"),
}


def stopped_ranks(shape, fault):
    opts = DemoOptions(**SHAPES[shape], steps=2, policy=Policy.ALIGNED, fault=fault,
                       pg_timeout_s=TIMEOUT_S)
    with pytest.raises(DemoRankError) as info:
        run_demo(opts)
    return opts, info.value


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_an_error_on_one_rank_stops_every_rank_at_the_step_end(shape, fault):
    opts, err = stopped_ranks(shape, fault)
    reports, times = err.reports, err.times
    cls, own = EXPECTED[fault]
    own = own.format(pp=opts.pp, last_pp=opts.pp - 1)
    faulty = opts.world_size - 1
    assert sorted(reports) == list(range(opts.world_size)), reports  # every rank raised
    for rank, text in reports.items():
        assert text.startswith(f"rank {rank}: {cls}: nemo_fp8_align"), text  # not gloo's error
        first = text.splitlines()[0]
        if rank == faulty:
            assert own in first, first
            assert "this rank only" in text
        else:
            assert f"rank {rank} (pipeline rank" in first and "no problem of its own" in first
            assert f"rank {faulty} (pipeline rank {opts.pp - 1}" in text and own in text
    # At one point: seconds apart, far from the timeout a rank waiting on a lone peer would hit.
    assert max(times.values()) - min(times.values()) < 10.0, times


def test_demo_command_exits_1_with_every_ranks_message(capsys):
    from nemo_fp8_align.cli import main

    assert main(["demo", "--fault", "mismatch_on_one_rank", "--timeout", str(TIMEOUT_S)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: rank 0: StepMismatchError: nemo_fp8_align: rank 0 (pipeline rank 0" in err
    assert "FAILED: rank 1: StepMismatchError: nemo_fp8_align: forward 2 of step 1 on " \
           "pipeline rank 1 ran model chunk 0" in err


def test_demo_command_refuses_an_unknown_fault(capsys):
    from nemo_fp8_align.cli import main

    assert main(["demo", "--fault", "no_such_fault"]) == 2
    assert "--fault no_such_fault: not a known fault; pass one of" in capsys.readouterr().err
