"""The one assembler: every entry point builds its rank's aligner here.

NeMo's mixin, callback and autoload (through the NeMo session), ``align_fp8_transposes``,
Megatron-LM's ``attach`` / ``post_wrap_hook()`` and the Megatron-Bridge callback each say what
they know (the chunks, the schedule's config, M, the backend, the optimizer, who closes the
step) and :func:`assemble` does the rest, in one order, inside one agreement of the model's
ranks (a check failing on one rank raises on every rank, and no rank is left attached):

1. the entry point's own startup check and the telemetry path;
2. the ranks and the schedule megatron-core runs for this config;
3. the adapter of the distributed optimizer that owns the all-gather (:func:`pick_adapter`:
   megatron-core DDP chunks, megatron-core 0.7/0.8's optimizer chain, or Apex's
   ``DistributedFusedAdam``);
4. the FP8 weights, as that adapter takes them: its path's refusals (the setups of
   :mod:`~nemo_fp8_align.support`, and the recipes its optimizer cannot post-process), less the
   weights with no post-all-gather work (``Adapter.weights_to_align``);
5. the :class:`~nemo_fp8_align.core.aligner.TransposeAligner`, attached.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from nemo_fp8_align import mcore_versions
from nemo_fp8_align.adapters.apex import ApexAdapter
from nemo_fp8_align.adapters import groups
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter
from nemo_fp8_align.adapters.mcore_optimizer import McoreOptimizerAdapter
from nemo_fp8_align.backends.protocol import FP8TransposeBackend
from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core.adapter import Adapter
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.step_end import agreed
from nemo_fp8_align.core.telemetry import TelemetryWriter
from nemo_fp8_align.errors import UnsupportedSetupError

__all__ = ["DERIVED", "assemble", "check_telemetry_path", "default_backend", "pick_adapter",
           "schedule_for", "telemetry_writer"]

#: ``error_group`` default: every rank of the model (:func:`~.adapters.groups.model_group`).
DERIVED: Any = object()


def assemble(chunks: Sequence[torch.nn.Module], *,
             num_microbatches: Union[int, Callable[[], int]], config: Any = None,
             backend: Optional[FP8TransposeBackend] = None,
             weights_of: Optional[Callable[[torch.nn.Module], List[Any]]] = None,
             align_config: AlignConfig = AlignConfig(), optimizer: Any = None,
             apex_optimizer: Any = None, owns_step_end: bool = True, pg_collection: Any = None,
             with_context_parallel: bool = False, pp_rank: Optional[int] = None,
             dp_rank: Optional[int] = None, error_group: Any = DERIVED,
             label: str = "attaching nemo_fp8_align",
             telemetry_key: str = "AlignConfig.telemetry_path",
             startup_check: Optional[Callable[[], None]] = None) -> TransposeAligner:
    """Build this rank's aligner and attach it; every rank of the model calls it at the same
    point. Returns the aligner (``aligner.attached`` False: the plugin is inactive here).

    Args:
        chunks: this rank's model chunks in schedule order (DDP-wrapped on megatron-core).
        num_microbatches: M, or a function asked at each step's start.
        config: the ``TransformerConfig`` the schedule reads (None: ``chunks[0].config``).
        backend, weights_of: the FP8 backend and how to find a chunk's FP8 weights (None:
            Transformer Engine's backend built from ``align_config``, and its ``weights_of``).
        optimizer: what megatron-core's ``get_megatron_optimizer`` returned; read on 0.7/0.8
            only, where its DistributedOptimizer owns the all-gather (on >= 0.9 the DDP chunks
            own it).
        apex_optimizer: Apex's ``DistributedFusedAdam`` where it owns the all-gather (NeMo's
            ``distributed_fused_adam``).
        owns_step_end: the adapter reports the step end (False: the caller calls
            ``aligner.on_step_end()``, as NeMo's session does).
        pg_collection, with_context_parallel, pp_rank, dp_rank: where the ranks come from
            (:func:`~nemo_fp8_align.adapters.groups.resolve_ranks`).
        error_group: the ranks that stop together on an error.
        label, telemetry_key: how this rank and the telemetry setting are named in errors.
        startup_check: the entry point's own check of its host's settings (Megatron-LM's
            arguments), run first inside the agreement.
    """
    group = groups.model_group(chunks, pg_collection) if error_group is DERIVED else error_group
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    aligner: Optional[TransposeAligner] = None
    try:
        with agreed(label=f"rank {rank} ({label})", group=group):
            if startup_check is not None:
                startup_check()
            config = config if config is not None else chunks[0].config
            check_telemetry_path(align_config.telemetry_path, key=telemetry_key)
            if backend is None:  # an inactive plugin imports nothing
                backend = default_backend(align_config) if align_config.active \
                    else _InactiveBackend()
            weights_of = weights_of or backend.weights_of
            ranks = groups.resolve_ranks(chunks, pg_collection,
                                         with_context_parallel=with_context_parallel)
            m_now = num_microbatches() if callable(num_microbatches) else num_microbatches
            schedule = schedule_for(config, pp=ranks.pp_size, vp=len(chunks),
                                    num_microbatches=m_now)
            adapter = pick_adapter(chunks, config, optimizer=optimizer,
                                   apex_optimizer=apex_optimizer, owns_step_end=owns_step_end)
            # policy=off is the fix every refusal names: nothing is refused then
            weights = adapter.weights_to_align([list(weights_of(c)) for c in chunks],
                                               backend=backend, config=config) \
                if align_config.active else [[] for _ in chunks]
            aligner = TransposeAligner(
                chunks, schedule=schedule,
                pp_rank=ranks.pp_rank if pp_rank is None else pp_rank,
                dp_rank=ranks.dp_rank if dp_rank is None else dp_rank, dp_size=ranks.dp_size,
                adapter=adapter, weights=weights, backend=backend, config=align_config,
                telemetry=telemetry_writer(align_config.telemetry_path),
                num_microbatches=num_microbatches if callable(num_microbatches) else None,
                error_group=group)
            aligner.attach()
    except BaseException:
        if aligner is not None:
            aligner.detach()
        raise
    return aligner


def pick_adapter(chunks: Sequence[torch.nn.Module], config: Any, *, optimizer: Any,
                 apex_optimizer: Any, owns_step_end: bool) -> Adapter:
    """The adapter of whichever distributed optimizer owns the parameter all-gather: Apex's
    ``DistributedFusedAdam`` where given, megatron-core 0.7/0.8's optimizer chain, else
    megatron-core's DDP chunks. What each path refuses is its own
    (``Adapter.weights_to_align``)."""
    if apex_optimizer is not None:
        return ApexAdapter(apex_optimizer, chunks)
    if _optimizer_owned(optimizer):
        return McoreOptimizerAdapter(chunks, optimizer, owns_step_end=owns_step_end)
    return McoreDDPAdapter(chunks, config, owns_step_end=owns_step_end)


def _optimizer_owned(optimizer: Any) -> bool:
    """Whether this megatron-core's DistributedOptimizer owns the all-gather (0.7/0.8); there
    the optimizer must be given."""
    if not mcore_versions.optimizer_owns_gather():
        return False
    if optimizer is None:
        raise UnsupportedSetupError(mcore_versions.missing_optimizer_problem())
    return True


def schedule_for(config: Any, *, pp: int, vp: int, num_microbatches: int) -> InterleavedSchedule:
    """The schedule megatron-core runs for this ``TransformerConfig``.

    megatron-core >= 0.10 orders forwards in groups of ``microbatch_group_size_per_vp_stage``
    (None: PP); older versions have no such field and use the pre-0.10 order.
    """
    legacy = not hasattr(config, "microbatch_group_size_per_vp_stage")
    return InterleavedSchedule(pp, vp, num_microbatches,
                               getattr(config, "microbatch_group_size_per_vp_stage", None),
                               legacy_order=legacy)


def check_telemetry_path(path: Optional[str], key: str = "AlignConfig.telemetry_path") -> None:
    """Fail at startup, on the rank that cannot, when ``path`` is unusable: several ranks but
    no ``{rank}`` (all would append to one file, lines interleaved), or this rank's file not
    writable (which the lazily opened writer would otherwise report at step 1)."""
    if not path:
        return
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and "{rank}" not in path:
        raise ValueError(f"{key}={path!r} has no {{rank}} but {world} ranks would append to it. "
                         f"Fix: {key}=<dir>/fp8_align.rank{{rank}}.jsonl")
    resolved = telemetry_writer(path).path
    why = _unwritable(resolved)  # asked without creating it: a refused attach leaves no file
    if why is not None:
        raise ValueError(
            f"{key}={path!r}: cannot write {resolved!r} on this rank ({why}). "
            f"Fix: a directory that exists and is writable on every node, e.g. "
            f"{key}=/results/fp8_align.rank{{rank}}.jsonl, or {key}=null.")


def _unwritable(path: str) -> Optional[str]:
    """Why this process could not append to ``path`` (None: it could), asked of the file or,
    where it does not exist yet, of its directory."""
    if os.path.isdir(path):
        return "a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "not writable"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return "No such file or directory"
    return None if os.access(directory, os.W_OK | os.X_OK) else "the directory is not writable"


def telemetry_writer(path: Optional[str]) -> Optional[TelemetryWriter]:
    """A writer for ``path`` with ``{rank}`` replaced by the global rank; None without a path."""
    if not path:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return TelemetryWriter(path.replace("{rank}", str(rank)))


def default_backend(align_config: AlignConfig) -> FP8TransposeBackend:
    """Transformer Engine's backend as ``align_config`` asks for it (``use_triton_kernel``,
    ``te_kernel_writes_transpose``); an ImportError with the install hint without TE."""
    from nemo_fp8_align.backends.te import make_backend  # TE imports on use only

    return make_backend(align_config)


class _InactiveBackend:
    """The plugin is off (``align_config``): nothing is transposed, nothing imported."""

    name = "inactive"

    def weights_of(self, chunk: Any) -> List[Any]:
        return []

    def transpose_needed(self) -> tuple:
        return False, "the plugin is off"
