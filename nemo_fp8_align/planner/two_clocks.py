"""The timeline model with a host clock and a GPU clock per rank: for runs whose host, not GPU,
paces some calls (launch-bound: small chunks, many small kernels).

The one-clock model (:mod:`nemo_fp8_align.planner.simulate`) lets the host keep pace with the
GPU, so work queued on the GPU (a transpose) delays everything after it by its full time. When
the host takes longer to launch a forward than the GPU takes to run it, a transpose queued before
that forward partly runs while the host is still launching, and the forwards after it catch up;
and a delay a rank's GPU carries is passed to the next stage only through the data it sends.
Measured on one H100 split by CUDA MPS (round 3 of issue 27): forwards queued behind a generic
transpose took 2.6 ms, the same forwards 3.1 ms elsewhere; the one-clock model over-predicted
the generic transpose's saving by 37%.

Rules (per rank; ``t`` the host clock, ``g`` the GPU clock: when its stream has run what was
queued):

* a call (a chunk's forward or backward, a chunk's transposes) of host time ``h`` and GPU time
  ``d``: the GPU starts at ``max(g, t)`` and ends no sooner than ``start + d`` nor than the
  host's last launch ``t + h``; then ``t += h``, ``g = end``;
* the host wait at a chunk's first forward of a step moves the host clock only (lazily built
  transposes queued before it run on the GPU meanwhile: no special case);
* a p2p call posts its sends without waiting (the send's data is ready at the sender's ``g``);
  a receive holds the host until the peer's host has posted the send and the GPU until the
  data is there (sender's ``g`` + ``p2p``). That is the MPS harness's IPC path (the slot number
  travels over gloo, the data through a CUDA IPC event); NCCL's host does not wait at all, so a
  cluster with NCCL is not what this models;
* all-gather waits hold the GPU only;
* aligned transposes on a shared GPU take ``shared_gpu_slowdown`` times their GPU time.

Modelled for ``none``, ``lazy`` and ``aligned``; the modelled-only placements (bubble, overlap)
are not defined on two clocks.
"""

from __future__ import annotations

from typing import List, Tuple

from nemo_fp8_align.planner.program import Comm, Compute, Placement
from nemo_fp8_align.planner.one_clock import OneClockSim, RankState
from nemo_fp8_align.planner.timeline import Timeline

__all__ = ["TWO_CLOCK_PLACEMENTS", "TwoClockSim"]

TWO_CLOCK_PLACEMENTS = (Placement.NONE, Placement.LAZY, Placement.ALIGNED)


class TwoClockSim(OneClockSim):
    """Runs every rank's program on a host and a GPU clock per rank (the rules above)."""

    def __init__(self, tl: Timeline) -> None:
        if tl.placement not in TWO_CLOCK_PLACEMENTS:
            raise ValueError(f"placement {tl.placement.value!r} is not modelled with host times "
                             f"(two clocks); one of {[p.value for p in TWO_CLOCK_PLACEMENTS]}")
        super().__init__(tl)
        self.gpu = {r.rank: 0.0 for r in self.ranks}
        self.sent: dict = {}  # (channel, index) -> (host post time, data ready on the GPU)

    def call(self, rank: RankState, kind: str, host: float, gpu: float, chunk: int = -1,
             mb: int = -1) -> None:
        start = max(self.gpu[rank.rank], rank.t)
        end = max(start + gpu, rank.t + host)
        self.add(rank, kind, start, end, chunk, mb)
        rank.t += host
        self.gpu[rank.rank] = end

    def compute(self, rank: RankState, op: Compute) -> None:
        mine = self.c.of(rank.rank, op.chunk)
        fwd = op.kind == "F"
        self.call(rank, "forward" if fwd else "backward",
                  mine.forward_host if fwd else mine.backward_host,
                  mine.forward if fwd else mine.backward, op.chunk, op.microbatch)

    def gather_wait(self, rank: RankState, chunk: int) -> None:
        """The all-gather wait holds the GPU clock, not the host's."""
        g = self.gpu[rank.rank]
        end = max(g, rank.gather_done[chunk])
        self.add(rank, "gather_wait", g, end, chunk)
        self.gpu[rank.rank] = end

    def transpose(self, rank: RankState, chunk: int) -> None:
        """Queued like any call: lazy ones fill the host wait by themselves (no special case)."""
        mine = self.c.of(rank.rank, chunk)
        slow = 1.0 if self.tl.placement is Placement.LAZY else self.c.shared_gpu_slowdown
        self.call(rank, "transpose", mine.transpose_host, mine.transpose * slow, chunk)

    def comm(self, rank: RankState, op: Comm) -> bool:
        for channel, index, is_send in op.transfers:
            if is_send:
                self.sent.setdefault((channel, index), (rank.t, self.gpu[rank.rank]))
        receives = [(ch, i) for ch, i, is_send in op.transfers if not is_send]
        if self.tl.overlap_p2p:
            rank.receiving += [(ch, i, rank.t) for ch, i in receives]
            return True
        return self.receive(rank, receives)

    def await_receives(self, rank: RankState, kind: str) -> bool:
        """overlap_p2p_comm: the receives a ``kind`` compute reads are waited for before it."""
        due = [(ch, i) for ch, i, _ in rank.receiving if ch[0] == kind]
        if not self.receive(rank, due):
            return False
        rank.receiving = [x for x in rank.receiving if x[0][0] != kind]
        return True

    def receive(self, rank: RankState, receives: List[Tuple]) -> bool:
        if any(key not in self.sent for key in receives):
            return False
        g = self.gpu[rank.rank]
        ready = max([g] + [self.sent[key][1] + self.c.p2p for key in receives])
        self.add(rank, "p2p_wait", g, ready)
        rank.t = max([rank.t] + [self.sent[key][0] for key in receives])
        self.gpu[rank.rank] = ready
        return True
