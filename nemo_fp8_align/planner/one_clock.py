"""The one-clock timeline model: times for the rank programs of
:mod:`~nemo_fp8_align.planner.program`, an event-level simulation of one training step.

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

Those rules keep one clock per rank: the host keeps pace with the GPU. Where each call's host
time is given too (``ChunkCosts.forward_host`` ...), each rank has a host and a GPU clock
instead: :mod:`nemo_fp8_align.planner.two_clocks` says how they move.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from nemo_fp8_align.planner.program import (BubbleDeadline, Comm, Compute, GatherWait, Launch,
                                             Placement, SideStart, Transpose, step_programs)
from nemo_fp8_align.planner.timeline import Interval, Timeline

__all__ = ["OneClockSim", "RankState"]


class RankState:
    """One rank's place in its program and its clock(s) during a simulation."""

    def __init__(self, rank: int, ops: list) -> None:
        self.rank, self.ops, self.pc, self.t = rank, ops, 0, 0.0
        self.gather_done: Dict[int, float] = {}
        self.pending: List[List] = []  # bubble / side work: [chunk, remaining, eligible]
        self.receiving: List[Tuple] = []  # overlap_p2p_comm: posted receives not yet waited for
        self.host_paid: set = set()  # chunks whose first-forward host wait is behind us

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.ops)


class OneClockSim:
    """Runs every rank's program on one clock per rank (the rules above)."""

    def __init__(self, tl: Timeline) -> None:
        self.tl, self.c = tl, tl.costs
        self.posted: Dict[Tuple, float] = {}
        self.ranks = [RankState(r, ops) for r, ops in
                      enumerate(step_programs(tl.schedule, tl.placement))]
        self.deadline_order = {r.rank: [op.chunk for op in r.ops if isinstance(op, BubbleDeadline)]
                               for r in self.ranks}

    def add(self, rank: RankState, kind: str, start: float, end: float, chunk: int = -1,
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

    def step(self, rank: RankState) -> bool:
        """Execute ``rank``'s current op; False when it must wait for a peer to post."""
        op, c = rank.ops[rank.pc], self.c
        if not self.received_for(rank, op):
            return False
        if isinstance(op, Compute):
            self.host_wait(rank, op)
            self.compute(rank, op)
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
            self.gather_wait(rank, op.chunk)
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

    def compute(self, rank: RankState, op: Compute) -> None:
        """A forward or backward: the rank's one clock moves by its duration."""
        mine = self.c.of(rank.rank, op.chunk)
        dur = mine.forward if op.kind == "F" else mine.backward
        self.add(rank, "forward" if op.kind == "F" else "backward", rank.t, rank.t + dur,
                 op.chunk, op.microbatch)
        rank.t += dur
        self.side_penalty(rank)

    def gather_wait(self, rank: RankState, chunk: int) -> None:
        """The chunk's all-gather wait before its first forward."""
        end = max(rank.t, rank.gather_done[chunk])
        self.add(rank, "gather_wait", rank.t, end, chunk)
        rank.t = end

    def received_for(self, rank: RankState, op) -> bool:
        """overlap_p2p_comm: megatron-core waits for the receives before the forward (backward)
        step, i.e. before the module hooks that wait for all-gathers and build transposes; False
        while a peer has not posted them."""
        kind = op.kind if isinstance(op, Compute) else "B" if isinstance(op, BubbleDeadline) \
            else "F" if isinstance(op, (GatherWait, Transpose, SideStart)) else None
        return kind is None or self.await_receives(rank, kind)

    def host_wait(self, rank: RankState, op: Compute) -> None:
        """At a chunk's first forward of the step the host does first-use work (the GPU idles
        unless work is queued): once per chunk, on the host's clock."""
        if op.kind == "F" and op.chunk not in rank.host_paid:
            rank.host_paid.add(op.chunk)
            wait = self.c.of(rank.rank, op.chunk).host_wait
            self.add(rank, "host_wait", rank.t, rank.t + wait, op.chunk)
            rank.t += wait

    def transpose(self, rank: RankState, chunk: int) -> None:
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

    def await_receives(self, rank: RankState, kind: str) -> bool:
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

    def comm(self, rank: RankState, op: Comm) -> bool:
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

    def fill_idle(self, rank: RankState, start: float, end: float) -> None:
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

    def side_penalty(self, rank: RankState) -> None:
        """Overlap: side work still running slows the compute that just ran (it stretches)."""
        if self.tl.placement is not Placement.OVERLAP:
            return
        for p in list(rank.pending):
            if p[2] <= rank.t:
                extra = p[1] * self.c.overlap_penalty
                self.add(rank, "overlap_penalty", rank.t, rank.t + extra, p[0])
                rank.t += extra
                rank.pending.remove(p)
