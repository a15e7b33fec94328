"""The aligned FP8-transpose engine: hooks that build each chunk's transposes at its slot.

One :class:`TransposeAligner` per rank. It learns of a training step's start from the
schedule's pre-loop ``param_sync_func`` calls (chunk 0 then chunk 1, before any pipeline
communication; forward-only passes make none), counts this rank's forward virtual microbatches
with forward pre-hooks on the model chunks (one counter shared by all chunks), and at chunk c's
trigger finishes c's all-gather and builds its transposes:

* chunk 0 right after the pre-loop launch of chunk 1 (slot 0 on every rank, before the first
  receive, which module pre-hooks alone could not reach on ranks r > 0);
* chunk c >= 1 before forward ``v = T_c - r`` on rank r (slot T_c on every rank), which on
  ranks r > 0 falls inside chunk c-1's forwards.

Policy ``lazy`` changes nothing and only observes where each chunk's transposes get built (at
its first use), for A/B runs. Hooks are kept as handles; attach/detach are idempotent.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.engine.schedule import AT_START, InterleavedSchedule
from nemo_fp8_align.engine.telemetry import TelemetryWriter, TransposeRecord
from nemo_fp8_align.fp8.protocol import FP8TransposeBackend

__all__ = ["ChunkParamSync", "TransposeAligner"]

logger = logging.getLogger(__name__)


class ChunkParamSync(Protocol):
    """How the aligner completes one model chunk's parameter all-gather."""

    def finish(self, chunk: int) -> bool:
        """Wait for ``chunk``'s in-flight all-gather (issuing no new collective); return
        whether the chunk's parameters now hold this step's values."""
        ...

    def finished(self, chunk: int) -> bool:
        """Observe, without waiting, whether ``chunk``'s all-gather has completed."""
        ...


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TransposeAligner:
    """Builds each model chunk's FP8 transposes at its aligned schedule slot on this rank.

    Args:
        model_chunks: this rank's model chunks in schedule order (the modules the schedule
            calls, e.g. megatron-core DDP wrappers); hooks go on these outer modules so they
            run before DDP's own pre-hooks on inner modules.
        schedule: the step's interleaved schedule (the same on every rank).
        pp_rank, dp_rank: this rank's pipeline and data-parallel ranks.
        param_sync: finishes a chunk's all-gather (:class:`ChunkParamSync`).
        weights: per chunk, the FP8 weights whose transposes the backend builds.
        backend: the FP8 backend owning those weights.
        config: policy and telemetry settings.
        telemetry: optional writer; records are also kept in :attr:`records`.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], *, schedule: InterleavedSchedule,
                 pp_rank: int, dp_rank: int, param_sync: ChunkParamSync,
                 weights: Sequence[Sequence[Any]], backend: FP8TransposeBackend,
                 config: AlignConfig, telemetry: Optional[TelemetryWriter] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if len(model_chunks) != schedule.vp or len(weights) != schedule.vp:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={schedule.vp} but got "
                f"{len(model_chunks)} model chunks and {len(weights)} weight lists on this rank")
        if not 0 <= pp_rank < schedule.pp:
            raise ValueError(f"pp_rank={pp_rank} outside [0, pipeline_model_parallel_size="
                             f"{schedule.pp})")
        self.chunks = list(model_chunks)
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.param_sync = param_sync
        self.weights = [list(w) for w in weights]
        self.backend = backend
        self.config = config
        self.telemetry = telemetry
        self.records: List[TransposeRecord] = []
        self._clock = clock
        self._triggers: Dict[int, List[int]] = {}
        for chunk in range(schedule.vp):
            self._triggers.setdefault(schedule.trigger_vmid(pp_rank, chunk), []).append(chunk)
        self._handles: List[Any] = []
        self._model_config: Any = None
        self._original_sync_funcs: Any = None
        self._step = -1
        self._vmid: Optional[int] = None  # None: not inside a training step's forwards
        self._current: Optional[tuple] = None  # (chunk, vmid) of the forward in flight
        self._done: set = set()
        self._pending_observation: Dict[int, List[bool]] = {}

    # ------------------------------------------------------------------ attach / detach
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, model_config: Any = None) -> bool:
        """Register the hooks (idempotent). Returns whether the engine is active.

        With ``model_config`` (megatron-core's ``TransformerConfig`` the schedule reads), its
        ``param_sync_func`` entries are wrapped; callers that re-bind that function every step
        (NeMo) call :meth:`on_param_sync_launched` themselves instead.
        """
        if self.attached or not self.config.active:
            return self.attached
        needed, reason = self.backend.transpose_needed()
        if not needed:
            logger.info("nemo_fp8_align: inactive, no FP8 transpose to align: %s", reason)
            return False
        if model_config is not None:
            self._wrap_config(model_config)
        for chunk, module in enumerate(self.chunks):
            self._handles.append(module.register_forward_pre_hook(
                partial(self._pre_forward, chunk), prepend=True))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, chunk)))
        return True

    def detach(self) -> None:
        """Remove every hook and restore ``param_sync_func`` (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._model_config is not None:
            self._model_config.param_sync_func = self._original_sync_funcs
            self._model_config = self._original_sync_funcs = None
        self._vmid = self._current = None
        if self.telemetry is not None:
            self.telemetry.close()

    def _wrap_config(self, model_config: Any) -> None:
        funcs = model_config.param_sync_func
        if funcs is None:
            raise ValueError(
                "config.param_sync_func is None: the aligned FP8 transposes need the schedule's "
                "aligned all-gather launches. Set DistributedDataParallelConfig("
                "overlap_param_gather=True, align_param_gather=True) and config.param_sync_func "
                "= [chunk.start_param_sync for chunk in model] before attaching.")
        per_chunk = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * self.schedule.vp
        if len(per_chunk) != self.schedule.vp:
            raise ValueError(f"config.param_sync_func has {len(per_chunk)} entries for "
                             f"{self.schedule.vp} model chunks")
        self._model_config, self._original_sync_funcs = model_config, funcs
        model_config.param_sync_func = [self.param_sync_wrapper(c, f)
                                        for c, f in enumerate(per_chunk)]

    def param_sync_wrapper(self, chunk: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a chunk's all-gather launch) followed by :meth:`on_param_sync_launched`."""
        def launch_then_notify(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.on_param_sync_launched(chunk)
            return out
        return launch_then_notify

    # ------------------------------------------------------------------ schedule events
    def on_param_sync_launched(self, chunk: int) -> None:
        """The schedule has just launched ``chunk``'s all-gather.

        Chunk 0's launch opens a training step (forward-only passes launch nothing); after
        chunk 1's launch, both pre-loop calls are done and no pipeline communication has
        happened yet: the slot-0 chunks (chunk 0) are handled here on every rank.
        """
        if not self.attached:
            return
        if chunk == 0:
            self._step += 1
            self._vmid, self._current = 0, None
            self._done = set()
            self._pending_observation = {}
        elif chunk == 1 and self._vmid == 0 and self.config.policy is Policy.ALIGNED:
            for c in self._triggers.get(AT_START, []):
                self._handle(c, AT_START)

    def _pre_forward(self, chunk: int, module: torch.nn.Module, args: Any) -> None:
        if self._vmid is None or _capturing_cuda_graph():
            return
        vmid = self._vmid
        expected = self.schedule.chunk_of(vmid)
        if chunk != expected:
            raise RuntimeError(
                f"nemo_fp8_align: forward {vmid} of step {self._step} on pipeline rank "
                f"{self.pp_rank} ran model chunk {chunk}, but the interleaved schedule "
                f"(PP={self.schedule.pp}, VP={self.schedule.vp}, M={self.schedule.microbatches}, "
                f"N={self.schedule.n}) runs chunk {expected} there. The aligner's schedule does "
                "not match the one running: check num_microbatches and "
                "microbatch_group_size_per_vp_stage.")
        if self.config.policy is Policy.ALIGNED:
            for c in self._triggers.get(vmid, []):
                self._handle(c, vmid)
            if chunk not in self._done:
                # Safety net (never taken when the schedule matches): correctness first, the
                # telemetry will show the misplaced slot.
                self._handle(chunk, vmid)
        elif chunk not in self._done:  # lazy: remember the cache state before first use
            self._pending_observation[chunk] = [self.backend.has_valid_transpose(w)
                                                for w in self.weights[chunk]]
        self._current = (chunk, vmid)
        self._vmid = vmid + 1 if vmid + 1 < self.schedule.total else None

    def _post_forward(self, chunk: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        before = self._pending_observation.pop(chunk, None)
        if before is None or self._current is None or self._current[0] != chunk:
            return
        after = [self.backend.has_valid_transpose(w) for w in self.weights[chunk]]
        built = sum(1 for b, a in zip(before, after) if a and not b)
        self._record(chunk, self._current[1], built, self.param_sync.finished(chunk), None)

    # ------------------------------------------------------------------ the work
    def _handle(self, chunk: int, vmid: int) -> None:
        if chunk in self._done:
            return
        start = self._clock()
        after_all_gather = self.param_sync.finish(chunk)
        built = 0
        if after_all_gather:
            built = self.backend.build_transposes(self.weights[chunk])
        else:
            # A transpose of bytes the all-gather has not delivered is a wrong gradient: leave
            # the build to first use (after DDP's own wait) and let the telemetry show it.
            logger.warning("nemo_fp8_align: step %d chunk %d: all-gather not complete at the "
                           "aligned slot; transposes left to first use", self._step, chunk)
        self._record(chunk, vmid, built, after_all_gather, self._clock() - start)

    def _record(self, chunk: int, vmid: int, built: int, after_all_gather: bool,
                seconds: Optional[float]) -> None:
        self._done.add(chunk)
        record = TransposeRecord(
            step=self._step, pp_rank=self.pp_rank, dp_rank=self.dp_rank, chunk=chunk,
            policy=self.config.policy.value, backend=self.backend.name, vmid=vmid,
            slot=self.schedule.slot_of(self.pp_rank, vmid),
            aligned_slot=self.schedule.aligned_slot(chunk), transposed=built,
            weights=len(self.weights[chunk]), after_all_gather=after_all_gather, seconds=seconds)
        self.records.append(record)
        if self.telemetry is not None:
            self.telemetry.write(record)
