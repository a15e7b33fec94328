"""The planner's two-clock model (nemo_fp8_align/planner/two_clocks.py): a host and a GPU clock
per rank where each call's host time is measured too, for launch-bound runs; and ``plan``'s
``--measured-*-host-ms`` flags that switch it on."""

import importlib
import json

import pytest

from nemo_fp8_align.cli import main
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner import ChunkCosts, Costs, Placement, simulate
from nemo_fp8_align.planner.program import Comm, Compute, Transpose

PP2 = InterleavedSchedule(2, 2, 4)
S = InterleavedSchedule(4, 2, 8)
MPS_SHAPE = ["--layers", "8", "--hidden", "4096", "--heads", "32", "--ffn", "16384", "--seq",
             "1024", "--tp", "1", "--pp", "4", "--vp", "2", "--micro-batch", "2",
             "--global-batch", "16", "--no-overlap-p2p-comm", "--no-batch-p2p-comm"]


def _with_programs(monkeypatch, programs):
    one_clock = importlib.import_module("nemo_fp8_align.planner.one_clock")
    monkeypatch.setattr(one_clock, "step_programs", lambda s, p: programs)


def _spans(tl, rank):
    return [(i.kind, round(i.start, 9), round(i.end, 9)) for i in tl.intervals if i.rank == rank]


def test_a_launch_bound_forward_hides_most_of_a_queued_transpose(monkeypatch):
    # the host takes 1.5 to launch a forward the GPU runs in 1.0; a transpose the host queues in
    # 0.1 runs 1.2 on the GPU: the forwards behind it catch up (0.5 each), so it costs 0.2
    _with_programs(monkeypatch, [[Transpose(0), Compute("F", 0, 0), Compute("F", 0, 1)], []])
    cell = ChunkCosts(forward=1.0, backward=1.0, transpose=1.2, forward_host=1.5,
                      backward_host=1.0, transpose_host=0.1)
    tl = simulate(PP2, Placement.LAZY, Costs(1.0, 1.0, per_chunk=((cell, cell), (cell, cell))))
    assert _spans(tl, 0) == [("transpose", 0, 1.2), ("forward", 1.2, 2.2), ("forward", 2.2, 3.2)]
    assert tl.step_time == pytest.approx(3.2)  # 3.0 without the transpose; one clock: 4.2


def test_a_receive_holds_the_host_for_the_post_and_the_gpu_for_the_data(monkeypatch):
    # rank 0's GPU runs 2.0 of transposes before the forward whose output it sends; its host
    # posts the send at 1.0 and goes on. Rank 1's host leaves the receive at 1.0 (the post),
    # its GPU waits for the data (3.0 + p2p); its forward is launch-bound (host 3.5).
    channel = ("F", 0, 1)
    _with_programs(monkeypatch, [
        [Transpose(0), Compute("F", 0, 0), Comm(((channel, 0, True),))],
        [Comm(((channel, 0, False),)), Compute("F", 0, 0)]])
    sender = ChunkCosts(forward=1.0, backward=1.0, transpose=2.0, forward_host=1.0,
                        backward_host=1.0, transpose_host=0.0)
    receiver = ChunkCosts(forward=1.0, backward=1.0, forward_host=3.5, backward_host=1.0,
                          transpose_host=0.0)
    costs = Costs(1.0, 1.0, p2p=0.25, per_chunk=((sender, sender), (receiver, receiver)))
    tl = simulate(PP2, Placement.LAZY, costs)
    assert _spans(tl, 0) == [("transpose", 0, 2.0), ("forward", 2.0, 3.0)]  # no wait for rank 1
    # GPU ready at 3.25; the host launched from 1.0 to 4.5: the forward ends at 4.5 (a host that
    # waited for the data would end it at 6.75, one that did not wait for the post at 4.25)
    assert _spans(tl, 1) == [("p2p_wait", 0, 3.25), ("forward", 3.25, 4.5)]


def _two_clock_costs(forward_host, transpose=1.0, host_wait=0.0, transpose_host=0.0):
    return Costs(forward=1.0, backward=2.0, transpose=transpose, host_wait=host_wait, p2p=0.1,
                 forward_host=forward_host, backward_host=2.0, transpose_host=transpose_host)


def _steps(costs, **kw):
    return {p: simulate(S, p, costs, **kw).step_time
            for p in (Placement.NONE, Placement.LAZY, Placement.ALIGNED)}


@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_on_megatron_cores_schedule_launch_bound_forwards_shrink_what_lazy_costs(overlap_p2p):
    paced = _steps(_two_clock_costs(forward_host=1.0), overlap_p2p=overlap_p2p)
    bound = _steps(_two_clock_costs(forward_host=1.4), overlap_p2p=overlap_p2p)
    assert paced[Placement.LAZY] > paced[Placement.ALIGNED] > paced[Placement.NONE]
    assert bound[Placement.LAZY] - bound[Placement.NONE] < \
        paced[Placement.LAZY] - paced[Placement.NONE]
    assert bound[Placement.NONE] > paced[Placement.NONE]  # the host paces the forwards


def test_lazy_transposes_run_during_the_first_forwards_host_wait():
    # no special case: the host wait moves the host clock only, the queued transposes run
    hidden = _steps(_two_clock_costs(forward_host=1.0, transpose=0.5, host_wait=0.8))
    assert hidden[Placement.LAZY] == pytest.approx(hidden[Placement.NONE])
    shown = _steps(_two_clock_costs(forward_host=1.0, transpose=0.5, host_wait=0.2))
    assert shown[Placement.LAZY] > shown[Placement.NONE]  # the wait hides 0.2 of each 0.5


def test_host_times_are_all_or_none_and_only_three_placements_are_modelled():
    with pytest.raises(ValueError, match=r"\['forward_host'\] given without"):
        ChunkCosts(forward=1.0, backward=1.0, forward_host=1.0)
    with pytest.raises(ValueError, match="ChunkCosts.transpose_host=-1"):
        ChunkCosts(forward=1.0, backward=1.0, forward_host=1.0, backward_host=1.0,
                   transpose_host=-1)
    with pytest.raises(ValueError, match="'bubble' is not modelled with host times"):
        simulate(S, Placement.BUBBLE, _two_clock_costs(forward_host=1.0))
    mixed = ((ChunkCosts(1.0, 1.0),) * 2, (ChunkCosts(1.0, 1.0, 0, 0, 1.0, 1.0, 0.0),) * 2)
    with pytest.raises(ValueError, match="for some"):
        simulate(PP2, Placement.NONE, Costs(1.0, 1.0, per_chunk=mixed))


def test_plan_with_host_times_uses_two_clocks(capsys):
    argv = ["plan", *MPS_SHAPE, "--measured-forward-ms", "2.6", "--measured-backward-ms", "7",
            "--measured-transpose-ms", "2.2", "--measured-p2p-ms", "0.13"]
    hosts = ["--measured-forward-host-ms", "3.1", "--measured-backward-host-ms", "7",
             "--measured-transpose-host-ms", "0.05"]
    assert main(argv + ["--format", "json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(argv + hosts + ["--format", "json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert not one["two_clocks"] and two["two_clocks"]
    assert set(two["step_ms"]) == {"none", "lazy", "aligned"}
    assert 0 < two["saving_ms"] < one["saving_ms"]
    costs = Costs(forward=2.6e-3, backward=7e-3, transpose=2.2e-3, p2p=0.13e-3,
                  forward_host=3.1e-3, backward_host=7e-3, transpose_host=0.05e-3)
    want = {p.value: simulate(S, p, costs).step_time * 1e3
            for p in (Placement.NONE, Placement.LAZY, Placement.ALIGNED)}
    assert two["step_ms"] == pytest.approx(want, abs=1e-6)
    assert main(argv + hosts) == 0
    assert "two clocks per rank (host and GPU times)" in capsys.readouterr().out


def test_plan_refuses_some_host_times_naming_the_missing_flags(capsys):
    assert main(["plan", *MPS_SHAPE, "--measured-forward-host-ms", "3"]) == 2
    err = capsys.readouterr().err
    assert "--measured-forward-host-ms without --measured-backward-host-ms " \
           "--measured-transpose-host-ms" in err, err


def test_a_shared_gpu_slows_only_the_aligned_transposes_on_two_clocks():
    base = _two_clock_costs(forward_host=1.0, transpose=1.0)
    shared = Costs(**{**base.__dict__, "shared_gpu_slowdown": 2.0})
    plain, slow = _steps(base), _steps(shared)
    assert slow[Placement.LAZY] == plain[Placement.LAZY]
    assert slow[Placement.ALIGNED] > plain[Placement.ALIGNED]
