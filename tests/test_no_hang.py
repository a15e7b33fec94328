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
from support.rank_errors import EXPECTED, check_every_rank_stopped  # noqa: E402

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
