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
  alone; the default's source is in :mod:`nemo_fp8_align.planner.costs`);
* per rank and chunk: each (rank, chunk) may have its own forward, backward and transpose
  durations (``Costs.per_chunk``: a first stage carrying the embedding, a last one the loss);
* host wait: at a chunk's first forward of a step the host does first-use work (DDP's
  pre-hook, TE's first-microbatch bookkeeping) while the GPU idles (``host_wait``: measured as
  that forward's excess over the chunk's median forward where no transposes run in it);
  transposes built lazily are queued at the start of that forward, so the GPU runs them during
  the wait: the pair costs max(transposes, wait), not the sum;
* ranks sharing one GPU (CUDA MPS): transposes built at the same slot on every rank (aligned,
  overlap) contend for the one GPU's memory and take ``shared_gpu_slowdown`` times longer than
  staggered (lazy) ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner.program import (BubbleDeadline, Comm, Compute, GatherWait, Launch,
                                             Placement, SideStart, Transpose, step_programs)

__all__ = ["ChunkCosts", "Costs", "Interval", "Timeline", "simulate"]


@dataclass(frozen=True)
class ChunkCosts:
    """One (rank, chunk)'s durations in seconds."""

    forward: float
    backward: float
    transpose: float = 0.0  #: the chunk's transposes on this rank (delta)
    host_wait: float = 0.0  #: host work at the chunk's first forward of a step, GPU idle

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "transpose", "host_wait"):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class Costs(ChunkCosts):
    """Durations in seconds: one set for every chunk on every rank, unless ``per_chunk`` gives
    each (rank, chunk) its own (``per_chunk[rank][chunk]``)."""

    allgather: float = 0.0  #: one chunk's parameter all-gather, launch to completion
    p2p: float = 0.0  #: one activation / gradient transfer between neighbouring stages
    overlap_penalty: float = 1.0  #: side-stream transposes cost this many times their own time
    per_chunk: Optional[Tuple[Tuple[ChunkCosts, ...], ...]] = None
    shared_gpu_slowdown: float = 1.0  #: aligned transposes, every rank at once on one GPU

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("allgather", "p2p", "overlap_penalty"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Costs.{name}={getattr(self, name)} must be >= 0")
        if not self.shared_gpu_slowdown >= 1:
            raise ValueError(f"Costs.shared_gpu_slowdown={self.shared_gpu_slowdown} must be >= 1 "
                             "(contention does not make transposes faster)")

    def of(self, rank: int, chunk: int) -> ChunkCosts:
        return self if self.per_chunk is None else self.per_chunk[rank][chunk]

    def check_shape(self, pp: int, vp: int) -> None:
        rows = self.per_chunk
        if rows is not None and (len(rows) != pp or any(len(r) != vp for r in rows)):
            raise ValueError(f"Costs.per_chunk has {[len(r) for r in rows]} chunks per rank; "
                             f"the schedule has PP={pp} ranks of VP={vp} chunks")


@dataclass(frozen=True)
class Interval:
    rank: int
    kind: str  # forward, backward, transpose, gather_wait, p2p_wait, overlap_penalty, host_wait
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
        self.host_paid: set = set()  # chunks whose first-forward host wait is behind us

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
            mine = c.of(rank.rank, op.chunk)
            if op.kind == "F" and op.chunk not in rank.host_paid:
                rank.host_paid.add(op.chunk)
                self.add(rank, "host_wait", rank.t, rank.t + mine.host_wait, op.chunk)
                rank.t += mine.host_wait
            dur = mine.forward if op.kind == "F" else mine.backward
            self.add(rank, "forward" if op.kind == "F" else "backward", rank.t, rank.t + dur,
                     op.chunk, op.microbatch)
            rank.t += dur
            self.side_penalty(rank)
        elif isinstance(op, Comm):
            return self.comm(rank, op)
        elif isinstance(op, Launch):
            rank.gather_done[op.chunk] = rank.t + c.allgather
            delta = c.of(rank.rank, op.chunk).transpose
            if self.tl.placement is Placement.BUBBLE and delta > 0:
                rank.pending.append([op.chunk, delta, rank.gather_done[op.chunk]])
                order = self.deadline_order[rank.rank]
                rank.pending.sort(key=lambda p: order.index(p[0]) if p[0] in order else 0)
        elif isinstance(op, GatherWait):
            end = max(rank.t, rank.gather_done[op.chunk])
            self.add(rank, "gather_wait", rank.t, end, op.chunk)
            rank.t = end
        elif isinstance(op, Transpose):
            self.transpose(rank, op.chunk)
        elif isinstance(op, BubbleDeadline):
            for p in [p for p in rank.pending if p[0] == op.chunk]:
                start = max(rank.t, p[2])
                self.add(rank, "gather_wait", rank.t, start, op.chunk)
                self.add(rank, "transpose", start, start + p[1], op.chunk)
                rank.t = start + p[1]
                rank.pending.remove(p)
        elif isinstance(op, SideStart):
            delta = c.of(rank.rank, op.chunk).transpose * c.shared_gpu_slowdown
            if delta > 0:
                rank.pending.append([op.chunk, delta, rank.t])
        return True

    def transpose(self, rank: _Rank, chunk: int) -> None:
        """Lazy: queued at the start of the chunk's first forward, so they run during its host
        wait (max of the two). Aligned: every rank at the same slot (slowed on a shared GPU)."""
        mine = self.c.of(rank.rank, chunk)
        delta, wait = mine.transpose, 0.0
        if self.tl.placement is Placement.LAZY:
            rank.host_paid.add(chunk)
            wait = max(0.0, mine.host_wait - delta)
        else:
            delta *= self.c.shared_gpu_slowdown
        self.add(rank, "transpose", rank.t, rank.t + delta, chunk)
        self.add(rank, "host_wait", rank.t + delta, rank.t + delta + wait, chunk)
        rank.t += delta + wait

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
    costs.check_shape(schedule.pp, schedule.vp)
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
