"""The timeline model's math on schedules small enough to work out by hand, and its rank
programs against megatron-core's own schedule order."""

import pytest

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner import Costs, Placement, simulate
from nemo_fp8_align.planner.program import (Comm, Compute, Launch, step_programs,
                                             warmup_count)

PP2 = InterleavedSchedule(2, 2, 2)  # stages: s0 = r0c0, s1 = r1c0, s2 = r0c1, s3 = r1c1
UNIT = Costs(forward=1.0, backward=2.0)


def _compute(tl, rank):
    return [(i.kind[0].upper(), i.chunk, i.microbatch, i.start, i.end)
            for i in tl.intervals if i.rank == rank and i.kind in ("forward", "backward")]


def test_pp2_vp2_m2_by_hand():
    # Worked by hand. Rank 0 runs its 4 warm-up forwards back to back (0-4; every send is
    # matched in time by rank 1's receive). Rank 1 receives mb0 at 1, runs F(0,0) 1-2, F(0,1)
    # 2-3, F(1,0) 3-4 and, being the last stage, B(1,0) 4-6 right away; its combined call then
    # sends that gradient to rank 0 (posted at 4, matched at 6) and receives F(1,1)'s input;
    # F(1,1) 6-7, B(1,1) 7-9. Rank 0 waits 4-6 for that gradient, B(1,0) 6-8, then its call
    # sends B(1,0)'s gradient and receives B(1,1)'s, which rank 1 posts at 9: B(1,1) 9-11.
    # Rank 1 gets the s2 gradient of mb0 at 9: B(0,0) 9-11, B(0,1) 11-13; rank 0 receives
    # them at 11 and 13: B(0,0) 11-13, B(0,1) 13-15.
    tl = simulate(PP2, Placement.NONE, UNIT)
    assert _compute(tl, 0) == [("F", 0, 0, 0, 1), ("F", 0, 1, 1, 2), ("F", 1, 0, 2, 3),
                               ("F", 1, 1, 3, 4), ("B", 1, 0, 6, 8), ("B", 1, 1, 9, 11),
                               ("B", 0, 0, 11, 13), ("B", 0, 1, 13, 15)]
    assert _compute(tl, 1) == [("F", 0, 0, 1, 2), ("F", 0, 1, 2, 3), ("F", 1, 0, 3, 4),
                               ("B", 1, 0, 4, 6), ("F", 1, 1, 6, 7), ("B", 1, 1, 7, 9),
                               ("B", 0, 0, 9, 11), ("B", 0, 1, 11, 13)]
    assert tl.step_time == 15
    assert tl.idle(0) == 15 - 12 and tl.idle(1) == 15 - 12


@pytest.mark.parametrize("pp,vp,m", [(2, 2, 2), (4, 2, 4), (4, 2, 16), (4, 3, 4), (4, 3, 8)])
def test_lazy_compounds_aligned_does_not(pp, vp, m):
    # delta well below a forward: lazy adds delta on every stage's first forward of every
    # chunk, all on the critical path (PP x VP x delta); aligned pays chunk 0 on rank 0 (the
    # other ranks hide it in their warm-up wait) and each later chunk once, at the same slot
    # on every rank (VP x delta). The removed share is (PP-1)/PP.
    delta = 0.05
    s = InterleavedSchedule(pp, vp, m)
    base = simulate(s, Placement.NONE, UNIT).step_time
    lazy = simulate(s, Placement.LAZY, Costs(1.0, 2.0, transpose=delta)).step_time
    aligned = simulate(s, Placement.ALIGNED, Costs(1.0, 2.0, transpose=delta)).step_time
    assert lazy - base == pytest.approx(pp * vp * delta)
    assert aligned - base == pytest.approx(vp * delta)


def test_lazy_transposes_sit_at_each_ranks_first_use():
    tl = simulate(PP2, Placement.LAZY, Costs(1.0, 2.0, transpose=0.1))
    starts = {(i.rank, i.chunk): i.start for i in tl.of_kind("transpose")}
    # Rank 0: chunk 0 at 0; F(0,0) 0.1-1.1, F(0,1) 1.1-2.1. Rank 1: first receive at 1.1, its
    # chunk 0 transposes 1.1-1.2, F(0,0) 1.2-2.2. Rank 0's chunk 1 needs that output: its
    # transposes start at 2.2 (the delays compound), F(1,0) 2.3-3.3; rank 1's at 3.3.
    assert starts == pytest.approx({(0, 0): 0.0, (0, 1): 2.2, (1, 0): 1.1, (1, 1): 3.3})


def test_aligned_transposes_share_the_slot():
    tl = simulate(PP2, Placement.ALIGNED, Costs(1.0, 2.0, transpose=0.1))
    starts = {(i.rank, i.chunk): i.start for i in tl.of_kind("transpose")}
    # chunk 0 at the start on both ranks; chunk 1 (T_1 = 2) before rank 0's forward 2 and
    # rank 1's forward 1, which both begin at 2.1.
    assert starts == pytest.approx({(0, 0): 0.0, (1, 0): 0.0, (0, 1): 2.1, (1, 1): 2.1})


def test_allgather_wait_at_first_use():
    tl = simulate(PP2, Placement.NONE, Costs(1.0, 2.0, allgather=1.5))
    # chunks 0 and 1 launch before the loop: rank 0 waits 1.5 before F(0,0), then nothing.
    waits = [(i.rank, i.chunk, i.start, i.end) for i in tl.of_kind("gather_wait")]
    assert waits == [(0, 0, 0.0, 1.5)]
    assert tl.step_time == 15 + 1.5


def test_third_chunk_launch_at_t1_minus_rank():
    s = InterleavedSchedule(2, 3, 2)  # T_1 = 2: chunk 2 launched before forward 2 - r
    for rank, ops in enumerate(step_programs(s, Placement.NONE)):
        forwards = 0
        for op in ops:
            if isinstance(op, Launch) and op.chunk == 2:
                assert forwards == 2 - rank
            forwards += isinstance(op, Compute) and op.kind == "F"


def test_bubble_hides_small_transposes_and_pays_the_rest_before_backward():
    small = simulate(PP2, Placement.BUBBLE, Costs(1.0, 2.0, transpose=0.2))
    assert small.step_time == 15  # all inside waits: rank 1 at 0-1, rank 0 at 4-6 and 8-9
    for t in small.of_kind("transpose"):
        assert any(w.start <= t.start and t.end <= w.end
                   for w in small.of_kind("p2p_wait", t.rank))
    # Too big for rank 1's first wait (1 time unit for 2 x 0.8): 0.6 of chunk 0 is left and
    # built before its first backward.
    big = simulate(PP2, Placement.BUBBLE, Costs(1.0, 2.0, transpose=0.8))
    built = {}
    for t in big.of_kind("transpose", 1):
        built[t.chunk] = built.get(t.chunk, 0) + t.end - t.start
    assert built == pytest.approx({0: 0.8, 1: 0.8})


def test_overlap_penalty_stretches_the_next_compute():
    tl = simulate(PP2, Placement.OVERLAP, Costs(1.0, 2.0, transpose=0.1, overlap_penalty=1.5))
    pen = [(i.rank, i.chunk, i.start, round(i.end - i.start, 9))
           for i in tl.of_kind("overlap_penalty")]
    # rank 0: chunk 0 beside F(0,0) (0.15 after it); rank 1 hides chunk 0 in its first wait.
    assert pen[0] == (0, 0, 1.0, 0.15)
    assert all(r != 1 or c != 0 for r, c, _, _ in pen)


def test_warmup_counts():
    s = InterleavedSchedule(4, 2, 8)
    assert [warmup_count(s, r) for r in range(4)] == [10, 8, 6, 4]
    assert [warmup_count(InterleavedSchedule(4, 2, 4), r) for r in range(4)] == [8, 8, 6, 4]


@pytest.mark.parametrize("pp,vp,m,n", [(2, 2, 2, None), (4, 2, 4, None), (4, 3, 8, None),
                                       (4, 2, 10, 6), (4, 3, 16, 8), (8, 2, 8, None)])
def test_every_shape_pairs_and_completes(pp, vp, m, n):
    s = InterleavedSchedule(pp, vp, m, n)
    tl = simulate(s, Placement.LAZY, Costs(1.0, 2.0, transpose=0.3, p2p=0.05, allgather=2.0))
    assert len(tl.of_kind("forward")) == len(tl.of_kind("backward")) == pp * vp * m
    assert len(tl.of_kind("transpose")) == pp * vp


@pytest.mark.parametrize("pp,vp,m,n", [(2, 2, 2, None), (4, 2, 8, None), (4, 3, 10, 6),
                                       (4, 3, 4, None)])
def test_compute_order_matches_megatron(pp, vp, m, n):
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    # megatron-core 0.12 keeps the order helper in schedules.py, 0.16 in cuda_graphs.py.
    to_order = getattr(schedules, "convert_schedule_table_to_order", None) or pytest.importorskip(
        "megatron.core.transformer.cuda_graphs").convert_schedule_table_to_order
    s = InterleavedSchedule(pp, vp, m, n)
    table = schedules.get_schedule_table(m, vp, s.n)
    for rank, ops in enumerate(step_programs(s, Placement.NONE)):
        want = to_order(warmup_count(s, rank), vp, table)
        got = [op.chunk + 1 if op.kind == "F" else -(op.chunk + 1)
               for op in ops if isinstance(op, Compute)]
        assert got == want, rank


def test_a_send_waits_for_its_receiver(monkeypatch):
    # Rendezvous (gloo and NCCL): rank 0's send posted at 1 completes when rank 1 posts the
    # receive after its own 3-unit compute.
    import importlib

    sim_module = importlib.import_module("nemo_fp8_align.planner.one_clock")

    channel = ("F", 0, 1)
    programs = [[Compute("F", 0, 0), Comm(((channel, 0, True),)), Compute("F", 0, 1)],
                [Compute("B", 0, 0), Compute("F", 0, 0), Comm(((channel, 0, False),))]]
    monkeypatch.setattr(sim_module, "step_programs", lambda s, p: programs)
    tl = simulate(PP2, Placement.NONE, Costs(1.0, 2.0, p2p=0.25))
    assert [(i.kind, i.start, i.end) for i in tl.intervals if i.rank == 0] == [
        ("forward", 0, 1), ("p2p_wait", 1, 3.25), ("forward", 3.25, 4.25)]


def test_bubble_waits_for_the_allgather():
    tl = simulate(PP2, Placement.BUBBLE, Costs(1.0, 2.0, transpose=0.2, allgather=0.5))
    assert tl.of_kind("transpose", 1)
    assert all(t.start >= 0.5 for t in tl.of_kind("transpose"))
