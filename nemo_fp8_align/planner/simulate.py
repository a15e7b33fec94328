"""The planner's timeline model: one simulated training step of every pipeline rank.

:func:`simulate` runs the rank programs of :mod:`~nemo_fp8_align.planner.program` on one clock
per rank (:mod:`~nemo_fp8_align.planner.one_clock`: the host keeps pace with the GPU), or, where
every call's host time is given (``ChunkCosts.forward_host`` ...), on a host and a GPU clock per
rank (:mod:`~nemo_fp8_align.planner.two_clocks`: launch-bound runs). The durations it reads and
the timeline it writes are :mod:`~nemo_fp8_align.planner.timeline`'s, re-exported here.
"""

from __future__ import annotations

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner.one_clock import OneClockSim
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.timeline import HOST_TIMES, ChunkCosts, Costs, Interval, Timeline
from nemo_fp8_align.planner.two_clocks import TwoClockSim

__all__ = ["ChunkCosts", "Costs", "HOST_TIMES", "Interval", "Timeline", "simulate"]


def simulate(schedule: InterleavedSchedule, placement: Placement, costs: Costs, *,
             overlap_p2p: bool = False) -> Timeline:
    """One training step's timeline on every rank (``overlap_p2p``: megatron-core's
    ``overlap_p2p_comm``; without it, its batched or unbatched blocking calls)."""
    costs.check_shape(schedule.pp, schedule.vp)
    tl = Timeline(schedule, Placement(placement), costs, overlap_p2p=overlap_p2p)
    sim = (TwoClockSim if costs.two_clocks else OneClockSim)(tl)
    sim.run()
    for rank in sim.ranks:  # the step ends with every posted receive waited for
        for kind in ("F", "B"):
            if not sim.await_receives(rank, kind):
                raise RuntimeError(f"timeline model: rank {rank.rank} receives never sent")
    leftover = [(r.rank, p[0]) for r in sim.ranks for p in r.pending]
    if leftover:
        raise RuntimeError(f"timeline model: transposes never built (rank, chunk): {leftover}")
    tl.intervals.sort(key=lambda i: (i.rank, i.start, i.end))
    return tl
