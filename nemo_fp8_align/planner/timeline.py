"""What the planner's timeline model reads and writes: each (rank, chunk)'s durations
(:class:`ChunkCosts`, :class:`Costs`) and one simulated training step (:class:`Timeline` of
:class:`Interval`). :mod:`nemo_fp8_align.planner.simulate` fills a timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.planner.program import Placement

__all__ = ["ChunkCosts", "Costs", "HOST_TIMES", "Interval", "Timeline"]

#: The host time of each call: all given (two clocks) or none (one clock).
HOST_TIMES = ("forward_host", "backward_host", "transpose_host")


@dataclass(frozen=True)
class ChunkCosts:
    """One (rank, chunk)'s durations in seconds. With the ``*_host`` times given, ``forward``,
    ``backward`` and ``transpose`` are the GPU's time for each call and ``*_host`` the host's
    (launching it; for a launch-bound call the larger one)."""

    forward: float
    backward: float
    transpose: float = 0.0  #: the chunk's transposes on this rank (delta)
    host_wait: float = 0.0  #: host work at the chunk's first forward of a step, GPU idle
    forward_host: Optional[float] = None
    backward_host: Optional[float] = None
    transpose_host: Optional[float] = None

    def __post_init__(self) -> None:
        given = [n for n in HOST_TIMES if getattr(self, n) is not None]
        for name in ("forward", "backward", "transpose", "host_wait", *given):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)} must be >= 0")
        if given and len(given) < len(HOST_TIMES):
            raise ValueError(f"{type(self).__name__}: {given} given without "
                             f"{[n for n in HOST_TIMES if n not in given]}; the two-clock model "
                             "needs every call's host time (or none: one clock)")


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
        if len({c.forward_host is not None for c in self.cells()}) > 1:
            raise ValueError("Costs.per_chunk: host times given for some (rank, chunk) and not "
                             "for others; give them for every one or for none")

    def of(self, rank: int, chunk: int) -> ChunkCosts:
        return self if self.per_chunk is None else self.per_chunk[rank][chunk]

    def cells(self) -> List[ChunkCosts]:
        """Every (rank, chunk)'s durations: ``per_chunk``'s, or this one set for all."""
        return [self] if self.per_chunk is None else [c for row in self.per_chunk for c in row]

    @property
    def two_clocks(self) -> bool:
        """The cells' host times are given (all or none of the cells: checked at construction)."""
        return self.cells()[0].forward_host is not None

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
