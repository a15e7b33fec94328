"""A model of megatron-core's interleaved 1F1B schedule: where each chunk's transposes go.

Names: PP pipeline ranks, C (= VP) model chunks per rank, M microbatches per
step, N = ``microbatch_group_size_per_vp_stage``. A *virtual microbatch id* v numbers a rank's
forward passes in a step, 0 .. M*C-1; every rank runs them in the same order and, in warm-up,
rank r runs forward v at wall-clock slot about v + r.

The aligned slot of chunk c is T_c, the first v that runs chunk c. Rank r builds chunk c's
transposes just before its forward v = T_c - r: the slot where megatron-core already launches
the next chunk's all-gather, so every rank pays at the same moment. Chunk 0 (T_0 = 0) is built at
the start of the schedule, before any pipeline communication (reported as v = -1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple
from nemo_fp8_align.errors import ScheduleError

__all__ = ["InterleavedSchedule", "ScheduleError", "AT_START"]

#: ``trigger_vmid`` of a chunk whose transposes run at the start of the schedule.
AT_START = -1


@dataclass(frozen=True)
class InterleavedSchedule:
    """The interleaved schedule of one training step.

    Args:
        pp: pipeline-parallel size (>= 2).
        vp: model chunks per pipeline rank (>= 2).
        microbatches: microbatches per step, M.
        group_size: N, megatron-core's ``microbatch_group_size_per_vp_stage`` (core_r0.10+);
            ``None`` means the default, PP.
        legacy_order: model the pre-0.10 ordering (chunk of v = (v mod PP*C) div PP), which
            also requires M to be a multiple of PP.
    """

    pp: int
    vp: int
    microbatches: int
    group_size: Optional[int] = None
    legacy_order: bool = False

    def __post_init__(self) -> None:
        self._validate()

    @property
    def n(self) -> int:
        """Microbatch group size N in use."""
        return self.pp if self.group_size is None else self.group_size

    @property
    def total(self) -> int:
        """Forward passes per rank per step, M * C."""
        return self.microbatches * self.vp

    def _validate(self) -> None:
        pp, vp, m, n = self.pp, self.vp, self.microbatches, self.n
        if pp < 2:
            raise ScheduleError(
                f"pipeline_model_parallel_size={pp}: the interleaved schedule needs at least 2 "
                "pipeline ranks (set pipeline_model_parallel_size >= 2)")
        if vp < 2:
            raise ScheduleError(
                f"virtual_pipeline_model_parallel_size={vp}: interleaving needs at least 2 model "
                "chunks per pipeline rank (set virtual_pipeline_model_parallel_size >= 2)")
        if m < pp:
            raise ScheduleError(
                f"num_microbatches={m} < pipeline_model_parallel_size={pp}: the interleaved "
                "schedule needs at least PP microbatches per step (raise global_batch_size or "
                "lower micro_batch_size / data parallelism)")
        if self.legacy_order:
            if m % pp != 0:
                raise ScheduleError(
                    f"num_microbatches={m} is not a multiple of pipeline_model_parallel_size={pp}, "
                    "which megatron-core before 0.10 requires with interleaving")
            return
        if not pp <= n <= m:
            raise ScheduleError(
                f"microbatch_group_size_per_vp_stage={n} must lie in [PP={pp}, M={m}] "
                "(megatron-core raises ValueError otherwise)")
        rem = m % n
        if 0 < rem < pp:
            raise ScheduleError(
                f"num_microbatches={m} mod microbatch_group_size_per_vp_stage={n} = {rem}, which "
                f"is between 0 and PP={pp}: megatron-core raises RuntimeError (make M a multiple "
                f"of N, or leave a last group of at least PP microbatches)")

    @cached_property
    def forward_table(self) -> Tuple[Tuple[int, int], ...]:
        """``(microbatch, chunk)`` of each forward virtual microbatch v, the same on every rank."""
        return tuple(self._legacy_table() if self.legacy_order else self._grouped_table())

    def _grouped_table(self) -> List[Tuple[int, int]]:
        # Groups of N microbatches; the remainder (>= PP by validation) forms the last group.
        bounds = list(range(0, self.microbatches, self.n)) + [self.microbatches]
        return [(mb, chunk) for lo, hi in zip(bounds, bounds[1:])
                for chunk in range(self.vp) for mb in range(lo, hi)]

    def _legacy_table(self) -> List[Tuple[int, int]]:
        width = self.pp * self.vp
        return [((v // width) * self.pp + v % self.pp, (v % width) // self.pp)
                for v in range(self.total)]

    def chunk_of(self, vmid: int) -> int:
        """Model chunk run by forward virtual microbatch ``vmid``."""
        return self.forward_table[vmid][1]

    def first_vmid(self, chunk: int) -> int:
        """T_c: the first forward virtual microbatch of ``chunk`` (its aligned slot)."""
        self._check_chunk(chunk)
        return next(v for v, (_, c) in enumerate(self.forward_table) if c == chunk)

    def aligned_slot(self, chunk: int) -> int:
        """The schedule slot at which every rank builds ``chunk``'s transposes."""
        return self.first_vmid(chunk)

    def trigger_vmid(self, rank: int, chunk: int) -> int:
        """On ``rank``, the forward v before which ``chunk``'s transposes are built.

        :data:`AT_START` (-1) when the slot is at or before the start of the schedule: chunk 0
        always, and any chunk whose slot passed before this rank's first forward.
        """
        self._check_rank(rank)
        v = self.aligned_slot(chunk) - rank
        return AT_START if chunk == 0 or v < 0 else v

    def param_sync_launch_vmid(self, rank: int, chunk: int) -> int:
        """Where megatron-core launches ``chunk``'s all-gather on ``rank``.

        Chunks 0 and 1 are launched before the loop (:data:`AT_START`); chunk c >= 2 before
        forward v with v + rank = T_{c-1}.
        """
        self._check_rank(rank)
        self._check_chunk(chunk)
        if chunk < 2:
            return AT_START
        return self.first_vmid(chunk - 1) - rank

    @staticmethod
    def slot_of(rank: int, vmid: int) -> int:
        """The wall-clock schedule slot of forward ``vmid`` on ``rank`` (0 for the start)."""
        return 0 if vmid == AT_START else vmid + rank

    def _check_chunk(self, chunk: int) -> None:
        if not 0 <= chunk < self.vp:
            raise ValueError(f"chunk {chunk} out of range [0, {self.vp})")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.pp:
            raise ValueError(f"pipeline rank {rank} out of range [0, {self.pp})")
