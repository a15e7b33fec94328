"""Times for the rank programs of :mod:`~nemo_fp8_align.planner.program`: an event-level
simulation of one training step.

Rules (one rank = one compute stream):

* compute, transposes and all-gather waits run one after another on their rank;
* a p2p call posts all its sends and receives when the rank reaches it and returns when every
  transfer is done; a transfer is done ``p2p`` seconds after both of its ends were posted
  (rendezvous: gloo and NCCL both wait for the receiver). This is megatron-core's
  ``batch_p2p_comm=True`` (one batched call) and, as timed here, also its unbatched isend/irecv
  pairs, which are waited for together too;
* ``overlap_p2p_comm=True`` (Megatron-LM's default with interleaving): the call only posts; the
  rank waits for a receive just before the compute that reads it (a received activation before
  the next forward, a received gradient before the next backward), never for its sends;
* a chunk's all-gather completes ``allgather`` seconds after its launch (data-parallel peers
  are assumed to run the same timeline); a wait before that completion is idle;
* ``bubble``: the transposes of chunks whose all-gather completed are slid into the rank's p2p
  waits (earliest first backward first; cut at any point, an upper bound for per-weight
  kernels); what did not fit is built just before the chunk's first backward;
* ``overlap``: from the aligned slot, the transposes run on a side stream: they use the rank's
  p2p waits for free, and whatever is left slows the next compute by ``overlap_penalty`` times
  its own duration (> 1 where side-stream transposes slow the GEMMs by more than they cost
  alone; the default's source is in :mod:`nemo_fp8_align.planner.costs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner.program import (BubbleDeadline, Comm, Compute, GatherWait, Launch,
                                             Placement, SideStart, Transpose, step_programs)

__all__ = ["Costs", "Interval", "Timeline", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Durations in seconds (the same for every chunk on every rank)."""

    forward: float
    backward: float
    transpose: float = 0.0  #: one chunk's transposes on one rank (delta)
    allgather: float = 0.0  #: one chunk's parameter all-gather, launch to completion
    p2p: float = 0.0  #: one activation / gradient transfer between neighbouring stages
    overlap_penalty: float = 1.0  #: side-stream transposes cost this many times their own time

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "transpose", "allgather", "p2p"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name}={getattr(self, name)} must be >= 0")
        if self.overlap_penalty < 0:
            raise ValueError(f"Costs.overlap_penalty={self.overlap_penalty} must be >= 0")


@dataclass(frozen=True)
class Interval:
    rank: int
    kind: str  # forward, backward, transpose, gather_wait, p2p_wait, overlap_penalty
    start: float
    end: float
    chunk: int = -1
    microbatch: int = -1


@dataclass
class Timeline:
    schedule: InterleavedSchedule
    placement: Placement
    costs: Costs
    intervals: List[Interval] = field(default_factory=list)
    overlap_p2p: bool = False  #: megatron-core's overlap_p2p_comm

    @property
    def step_time(self) -> float:
        """From the step's start to the end of the last backward on any rank."""
        return max(i.end for i in self.intervals)

    def busy(self, rank: int) -> float:
        """Compute and transposes on ``rank`` (what is not idle)."""
        return sum(i.end - i.start for i in self.intervals if i.rank == rank
                   and i.kind in ("forward", "backward", "transpose", "overlap_penalty"))

    def idle(self, rank: int) -> float:
        return self.step_time - self.busy(rank)

    def of_kind(self, kind: str, rank: Optional[int] = None) -> List[Interval]:
        return [i for i in self.intervals if i.kind == kind and (rank is None or i.rank == rank)]


class _Rank:
    def __init__(self, rank: int, ops: list) -> None:
        self.rank, self.ops, self.pc, self.t = rank, ops, 0, 0.0
        self.gather_done: Dict[int, float] = {}
        self.pending: List[List] = []  # bubble / side work: [chunk, remaining, eligible]
        self.receiving: List[Tuple] = []  # overlap_p2p_comm: posted receives not yet waited for

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.ops)


class _Sim:
    def __init__(self, tl: Timeline) -> None:
        self.tl, self.c = tl, tl.costs
        self.posted: Dict[Tuple, float] = {}
        self.ranks = [_Rank(r, ops) for r, ops in
                      enumerate(step_programs(tl.schedule, tl.placement))]
        self.deadline_order = {r.rank: [op.chunk for op in r.ops if isinstance(op, BubbleDeadline)]
                               for r in self.ranks}

    def add(self, rank: _Rank, kind: str, start: float, end: float, chunk: int = -1,
            mb: int = -1) -> None:
        if end > start:
            self.tl.intervals.append(Interval(rank.rank, kind, start, end, chunk, mb))

    def run(self) -> None:
        while not all(r.finished for r in self.ranks):
            progressed = False
            for rank in self.ranks:
                while not rank.finished and self.step(rank):
                    rank.pc += 1
                    progressed = True
            if not progressed:
                where = {r.rank: r.ops[r.pc] for r in self.ranks if not r.finished}
                raise RuntimeError(f"timeline model deadlocked (a model bug): {where}")

    def step(self, rank: _Rank) -> bool:
        """Execute ``rank``'s current op; False when it must wait for a peer to post."""
        op, c = rank.ops[rank.pc], self.c
        # overlap_p2p_comm: megatron-core waits for the receives before the forward (backward)
        # step, i.e. before the module hooks that wait for all-gathers and build transposes.
        kind = op.kind if isinstance(op, Compute) else "B" if isinstance(op, BubbleDeadline) \
            else "F" if isinstance(op, (GatherWait, Transpose, SideStart)) else None
        if kind is not None and not self.await_receives(rank, kind):
            return False
        if isinstance(op, Compute):
            dur = c.forward if op.kind == "F" else c.backward
            self.add(rank, "forward" if op.kind == "F" else "backward", rank.t, rank.t + dur,
                     op.chunk, op.microbatch)
            rank.t += dur
            self.side_penalty(rank)
        elif isinstance(op, Comm):
            return self.comm(rank, op)
        elif isinstance(op, Launch):
            rank.gather_done[op.chunk] = rank.t + c.allgather
            if self.tl.placement is Placement.BUBBLE and c.transpose > 0:
                rank.pending.append([op.chunk, c.transpose, rank.gather_done[op.chunk]])
                order = self.deadline_order[rank.rank]
                rank.pending.sort(key=lambda p: order.index(p[0]) if p[0] in order else 0)
        elif isinstance(op, GatherWait):
            end = max(rank.t, rank.gather_done[op.chunk])
            self.add(rank, "gather_wait", rank.t, end, op.chunk)
            rank.t = end
        elif isinstance(op, Transpose):
            self.add(rank, "transpose", rank.t, rank.t + c.transpose, op.chunk)
            rank.t += c.transpose
        elif isinstance(op, BubbleDeadline):
            for p in [p for p in rank.pending if p[0] == op.chunk]:
                start = max(rank.t, p[2])
                self.add(rank, "gather_wait", rank.t, start, op.chunk)
                self.add(rank, "transpose", start, start + p[1], op.chunk)
                rank.t = start + p[1]
                rank.pending.remove(p)
        elif isinstance(op, SideStart):
            if c.transpose > 0:
                rank.pending.append([op.chunk, c.transpose, rank.t])
        return True

    def await_receives(self, rank: _Rank, kind: str) -> bool:
        """overlap_p2p_comm: wait for the posted receives a ``kind`` compute reads."""
        due = [x for x in rank.receiving if x[0][0] == kind]
        if any((ch, i, True) not in self.posted for ch, i, _ in due):
            return False
        done = max([rank.t] + [max(t, self.posted[(ch, i, True)]) + self.c.p2p for ch, i, t in due])
        self.add(rank, "p2p_wait", rank.t, done)
        self.fill_idle(rank, rank.t, done)
        rank.t = done
        rank.receiving = [x for x in rank.receiving if x[0][0] != kind]
        return True

    def comm(self, rank: _Rank, op: Comm) -> bool:
        for channel, index, is_send in op.transfers:
            self.posted.setdefault((channel, index, is_send), rank.t)
        if self.tl.overlap_p2p:
            rank.receiving += [(ch, i, rank.t) for ch, i, is_send in op.transfers if not is_send]
            return True
        done = rank.t
        for channel, index, is_send in op.transfers:
            peer = self.posted.get((channel, index, not is_send))
            if peer is None:
                return False
            done = max(done, max(rank.t, peer) + self.c.p2p)
        self.add(rank, "p2p_wait", rank.t, done)
        self.fill_idle(rank, rank.t, done)
        rank.t = done
        return True

    def fill_idle(self, rank: _Rank, start: float, end: float) -> None:
        """Bubble / side-stream work slides into [start, end) where it is eligible."""
        cur = start
        for p in list(rank.pending):
            begin = max(cur, p[2])
            if begin >= end:
                continue
            used = min(p[1], end - begin)
            self.add(rank, "transpose", begin, begin + used, p[0])
            p[1] -= used
            cur = begin + used
            if p[1] <= 1e-15:
                rank.pending.remove(p)

    def side_penalty(self, rank: _Rank) -> None:
        """Overlap: side work still running slows the compute that just ran (it stretches)."""
        if self.tl.placement is not Placement.OVERLAP:
            return
        for p in list(rank.pending):
            if p[2] <= rank.t:
                extra = p[1] * self.c.overlap_penalty
                self.add(rank, "overlap_penalty", rank.t, rank.t + extra, p[0])
                rank.t += extra
                rank.pending.remove(p)


def simulate(schedule: InterleavedSchedule, placement: Placement, costs: Costs, *,
             overlap_p2p: bool = False) -> Timeline:
    """One training step's timeline on every rank (``overlap_p2p``: megatron-core's
    ``overlap_p2p_comm``; without it, its batched or unbatched blocking calls)."""
    tl = Timeline(schedule, Placement(placement), costs, overlap_p2p=overlap_p2p)
    sim = _Sim(tl)
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
