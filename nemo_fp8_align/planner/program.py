"""Each pipeline rank's program for one training step, as megatron-core's interleaved schedule
runs it, with the all-gather launches and the FP8 transposes of a placement put in.

The program is the order of what a rank does, not when: compute (a chunk's forward or
backward), pipeline communication (one call of megatron-core's ``p2p_communication``: its sends
and receives are posted together and the call waits for all of them), the parameter all-gather
launches and waits, and the transposes. :mod:`nemo_fp8_align.planner.simulate` gives it times.

It follows megatron-core's ``forward_backward_pipelining_with_interleaving`` without
``overlap_p2p_comm`` and without ``batch_p2p_comm`` (what the demo runs): warm-up forwards,
1F1B steady state (forward, backward, then one combined send/receive call), cool-down
backwards; the same ``recv_prev``/``recv_next`` rules, and sends skipped at the first and last
virtual stage. Facts from megatron-core (0.12.3 / 0.16.1), code written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Tuple, Union

from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule

__all__ = ["Placement", "Compute", "Comm", "Launch", "GatherWait", "Transpose", "BubbleDeadline",
           "SideStart", "Op", "rank_program", "step_programs", "warmup_count"]


class Placement(str, Enum):
    """Where a rank builds a chunk's FP8 transposes."""

    NONE = "none"  #: no transposes at all (the baseline the others are measured against)
    LAZY = "lazy"  #: at the rank's own first forward of the chunk (today's behaviour)
    ALIGNED = "aligned"  #: at the chunk's aligned slot, the same on every rank (this plugin)
    BUBBLE = "bubble"  #: modelled only: in the rank's idle time before the chunk's first backward
    OVERLAP = "overlap"  #: modelled only: on a side stream from the aligned slot on, with a penalty


@dataclass(frozen=True)
class Compute:
    kind: str  # "F" or "B"
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Comm:
    """One p2p call: ``(channel, index, is_send)`` per transfer; channel = (dir, src, dst)."""

    transfers: Tuple[Tuple[Tuple[str, int, int], int, bool], ...]


@dataclass(frozen=True)
class Launch:
    chunk: int  # the chunk's parameter all-gather is launched (asynchronous)


@dataclass(frozen=True)
class GatherWait:
    chunk: int  # wait until the chunk's all-gather has completed


@dataclass(frozen=True)
class Transpose:
    chunk: int  # build the chunk's transposes now, on the compute stream


@dataclass(frozen=True)
class BubbleDeadline:
    chunk: int  # bubble placement: whatever was not built in idle time is built now


@dataclass(frozen=True)
class SideStart:
    chunk: int  # overlap placement: the chunk's transposes start on a side stream


Op = Union[Compute, Comm, Launch, GatherWait, Transpose, BubbleDeadline, SideStart]


def warmup_count(s: InterleavedSchedule, rank: int) -> int:
    """Warm-up forwards on ``rank``: (PP-r-1)*2 + (C-1)*N, at most M*C (megatron-core's rule)."""
    return min((s.pp - rank - 1) * 2 + (s.vp - 1) * s.n, s.total)


class _Builder:
    """Appends one rank's ops; numbers each channel's sends and receives in FIFO order."""

    def __init__(self, s: InterleavedSchedule, rank: int, placement: Placement,
                 counters: Dict[Tuple[Tuple[str, int, int], bool], int]) -> None:
        self.s, self.r, self.placement, self.counters = s, rank, placement, counters
        self.ops: List[Op] = []
        self.nxt, self.prv = (rank + 1) % s.pp, (rank - 1) % s.pp
        self.seen_forward: set = set()
        self.seen_backward: set = set()

    # --- megatron-core's table look-ups ---------------------------------------------------
    def chunk(self, v: int, forward: bool) -> int:
        c = self.s.forward_table[v % self.s.total][1]
        return c if forward else self.s.vp - 1 - c

    def recv_from_previous(self, v: int, forward: bool) -> bool:
        """Whether the call after virtual microbatch ``v`` receives (the schedule's rule)."""
        leading = self.r == 0 if forward else self.r == self.s.pp - 1
        if not leading:
            return True
        last_chunk = self.s.vp - 1 if forward else 0
        if v < self.s.pp - 1:  # the ending stage has produced nothing yet
            return False
        return self.chunk(v - (self.s.pp - 1), forward) != last_chunk

    # --- ops -------------------------------------------------------------------------------
    def comm(self, send_next: bool = False, recv_prev: bool = False, send_prev: bool = False,
             recv_next: bool = False) -> None:
        transfers = []
        for on, direction, src, dst, is_send in (
                (send_next, "F", self.r, self.nxt, True), (recv_prev, "F", self.prv, self.r, False),
                (send_prev, "B", self.r, self.prv, True), (recv_next, "B", self.nxt, self.r, False)):
            if on:
                key = ((direction, src, dst), is_send)
                transfers.append((key[0], self.counters.get(key, 0), is_send))
                self.counters[key] = self.counters.get(key, 0) + 1
        if transfers:
            self.ops.append(Comm(tuple(transfers)))

    def placement_at(self, v: int) -> None:
        """The aligned triggers due before forward ``v`` (AT_START: before the first receive)."""
        if self.placement not in (Placement.ALIGNED, Placement.OVERLAP):
            return
        for c in range(self.s.vp):
            if self.s.trigger_vmid(self.r, c) == v:
                self.ops.append(GatherWait(c))
                self.ops.append(Transpose(c) if self.placement is Placement.ALIGNED
                                else SideStart(c))

    def forward(self, v: int) -> None:
        s, table = self.s, self.s.forward_table
        t = v + self.r  # megatron-core launches chunk c+1's all-gather at T_c on every rank
        if t < s.total and table[t][0] == 0 and 1 < table[t][1] + 1 < s.vp:
            self.ops.append(Launch(table[t][1] + 1))
        self.placement_at(v)
        mb, c = table[v]
        if c not in self.seen_forward:  # DDP's pre-hook waits for the chunk's all-gather
            self.seen_forward.add(c)
            self.ops.append(GatherWait(c))
            if self.placement is Placement.LAZY:
                self.ops.append(Transpose(c))
        self.ops.append(Compute("F", c, mb))

    def backward(self, k: int) -> None:
        c = self.chunk(k, forward=False)
        if c not in self.seen_backward:
            self.seen_backward.add(c)
            if self.placement is Placement.BUBBLE:
                self.ops.append(BubbleDeadline(c))
        self.ops.append(Compute("B", c, self.s.forward_table[k][0]))

    def sends_forward(self, v: int) -> bool:
        return not (self.r == self.s.pp - 1 and self.chunk(v, True) == self.s.vp - 1)

    def sends_backward(self, k: int) -> bool:
        return not (self.r == 0 and self.chunk(k, False) == 0)


def rank_program(s: InterleavedSchedule, rank: int, placement: Placement,
                 counters: Dict) -> List[Op]:
    """The ops of ``rank`` for one training step (``counters`` is shared by all ranks)."""
    b = _Builder(s, rank, placement, counters)
    total, w = s.total, warmup_count(s, rank)
    all_warmup, remaining = w == total, total - w
    b.ops += [Launch(0), Launch(1)]  # the schedule's two pre-loop param_sync_func calls
    b.placement_at(AT_START)
    b.comm(recv_prev=rank != 0)  # recv_forward for chunk 0 (none on the first stage)
    for k in range(w):
        recv_prev = b.recv_from_previous(k, True) and k != total - 1
        b.forward(k)
        if k == w - 1 and not all_warmup:
            b.comm(send_next=b.sends_forward(k), recv_prev=recv_prev,
                   recv_next=rank != s.pp - 1)
        else:
            b.comm(send_next=b.sends_forward(k), recv_prev=recv_prev)
    for k in range(remaining):
        fk = k + w
        b.forward(fk)
        b.backward(k)
        b.comm(send_next=b.sends_forward(fk),
               recv_prev=b.recv_from_previous(fk, True) and k != remaining - 1,
               send_prev=b.sends_backward(k), recv_next=b.recv_from_previous(k, False))
    if all_warmup:
        b.comm(recv_next=rank != s.pp - 1)  # recv_backward at the last chunk
    for k in range(remaining, total):
        b.backward(k)
        b.comm(send_prev=b.sends_backward(k),
               recv_next=b.recv_from_previous(k, False) and k != total - 1)
    return b.ops


def step_programs(s: InterleavedSchedule, placement: Placement) -> List[List[Op]]:
    """Every rank's program; raises if sends and receives do not pair up (a model bug)."""
    counters: Dict = {}
    programs = [rank_program(s, r, placement, counters) for r in range(s.pp)]
    channels = {key[0] for key in counters}
    for ch in channels:
        sends, recvs = counters.get((ch, True), 0), counters.get((ch, False), 0)
        if sends != recvs:
            raise RuntimeError(f"timeline model: channel {ch} has {sends} sends and {recvs} "
                               f"receives for {s}")
    return programs
