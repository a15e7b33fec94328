"""One entry point for megatron-core training loops (Megatron-LM style, Megatron-Bridge, NeMo 2).

Call it after the DDP-wrapped model chunks exist and ``config.param_sync_func`` has been set to
``[chunk.start_param_sync for chunk in model]`` (which megatron-core's training loops do when
``overlap_param_gather`` and ``align_param_gather`` are on)::

    aligner = align_fp8_transposes(model, num_microbatches=M, backend=TEBackend())
    ...  # train: forward_backward_func(...) as usual
    aligner.detach()
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.recipes import (kinds_of, mcore_features,
                                                        refuse_recipes, weights_with_work)
from nemo_fp8_align.refusals import Setup, refuse_unsupported
from nemo_fp8_align.sync.mcore import McoreParamSync
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.telemetry import TelemetryWriter
from nemo_fp8_align.backends.protocol import FP8TransposeBackend

__all__ = ["align_fp8_transposes", "check_telemetry_path", "schedule_for", "telemetry_writer"]


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
    try:
        with open(resolved, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise ValueError(
            f"{key}={path!r}: cannot write {resolved!r} on this rank ({err.strerror or err}). "
            f"Fix: a directory that exists and is writable on every node, e.g. "
            f"{key}=/results/fp8_align.rank{{rank}}.jsonl, or {key}=null.") from None


def telemetry_writer(path: Optional[str]) -> Optional[TelemetryWriter]:
    """A writer for ``path`` with ``{rank}`` replaced by the global rank; None without a path."""
    if not path:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return TelemetryWriter(path.replace("{rank}", str(rank)))


def default_backend(align_config: AlignConfig) -> FP8TransposeBackend:
    """Transformer Engine's backend as ``align_config`` asks for it (``use_triton_kernel``,
    ``te_kernel_writes_transpose``); an ImportError with the install hint without TE."""
    from nemo_fp8_align.backends.te import make_backend

    return make_backend(align_config)


_DERIVED: Any = object()


def align_fp8_transposes(
    model: Sequence[torch.nn.Module], *, num_microbatches: Union[int, Callable[[], int]],
    backend: Optional[FP8TransposeBackend] = None,
    weights_of: Optional[Callable[[torch.nn.Module], List[Any]]] = None, config: Any = None,
    align_config: AlignConfig = AlignConfig(), pp_rank: Optional[int] = None,
    dp_rank: Optional[int] = None, pg_collection: Any = None, error_group: Any = _DERIVED,
    optimizer: Any = None,
) -> TransposeAligner:
    """Attach the aligned FP8-transpose engine to megatron-core DDP model chunks.

    Every rank of the model calls it at the same point: its startup checks end in one
    agreement, so a check failing on one rank (an unwritable telemetry path, say) raises on
    every rank, and no rank is left attached.

    Args:
        model: this rank's DDP-wrapped model chunks, in schedule order.
        num_microbatches: microbatches per training step (M); must be the value the schedule
            gets, or the aligner stops with an error at the first mismatching forward.
        backend: the FP8 backend owning the chunks' FP8 weights (None: Transformer Engine's,
            built from ``align_config``).
        weights_of: returns the FP8 weights of one chunk (None: the backend's ``weights_of``).
        config: the ``TransformerConfig`` the schedule reads; defaults to ``model[0].config``.
        align_config: policy and telemetry settings.
        pp_rank, dp_rank: default to the model's groups (below).
        pg_collection: the ``ProcessGroupCollection`` the model and schedule were built with
            (megatron-core >= 0.14); None: the chunks' own DDP groups, else ``parallel_state``
            (:mod:`nemo_fp8_align.integrations.groups`).
        error_group: the ranks that stop together when one finds an error (default: every rank
            of the model, :func:`~nemo_fp8_align.integrations.groups.model_group`).
        optimizer: what ``get_megatron_optimizer`` returned. Needed on megatron-core 0.7/0.8,
            whose DistributedOptimizer owns the parameter all-gather (not read on >= 0.9, where
            the DDP chunks own it).

    The engine hears the schedule through the chunks (:class:`~nemo_fp8_align.sync.mcore_hold.
    McoreChunkHold`): each chunk's ``start_param_sync`` and chunk 0's ``finish_grad_sync``, so a
    loop may bind ``config.param_sync_func = [chunk.start_param_sync for chunk in model]`` before
    or after this call, and re-bind it (Megatron-LM's ``train()``, Megatron-Bridge, NeMo). On
    megatron-core 0.7/0.8 it hears the optimizer's all-gather chain instead (:class:`~nemo_fp8_
    align.sync.mcore_optimizer_hold.McoreOptimizerHold`), launched by ``optimizer.zero_grad()``.
    """
    from nemo_fp8_align.core.step_end import agreed
    from nemo_fp8_align.integrations.groups import model_group, resolve_ranks
    from nemo_fp8_align.sync.mcore_hold import McoreChunkHold
    from nemo_fp8_align.sync.mcore_optimizer import McoreOptimizerParamSync
    from nemo_fp8_align.sync.mcore_optimizer_hold import McoreOptimizerHold

    group = model_group(model, pg_collection) if error_group is _DERIVED else error_group
    aligner: Optional[TransposeAligner] = None
    try:
        with agreed(label=f"rank {_global_rank()} (attaching nemo_fp8_align)", group=group):
            config = config if config is not None else model[0].config
            refuse_unsupported(Setup(config=config, chunks=model))
            check_telemetry_path(align_config.telemetry_path)
            owned = _optimizer_owned(optimizer)
            if backend is None:  # an inactive plugin imports nothing
                backend = default_backend(align_config) if align_config.active \
                    else _InactiveBackend()
            weights_of = weights_of or backend.weights_of
            ranks = resolve_ranks(model, pg_collection)
            m_now = num_microbatches() if callable(num_microbatches) else num_microbatches
            schedule = schedule_for(config, pp=ranks.pp_size, vp=len(model),
                                    num_microbatches=m_now)
            weights = [weights_with_work(chunk, list(weights_of(chunk)), backend)
                       for chunk in model]
            refuse_recipes(list(kinds_of(weights, backend)), mcore_features())
            if owned:
                _refuse_fp8_parameters(weights)
            param_sync = McoreOptimizerParamSync(optimizer) if owned else McoreParamSync(model)
            aligner = TransposeAligner(
                model, schedule=schedule,
                pp_rank=ranks.pp_rank if pp_rank is None else pp_rank,
                dp_rank=ranks.dp_rank if dp_rank is None else dp_rank,
                param_sync=param_sync, weights=weights, backend=backend, config=align_config,
                telemetry=telemetry_writer(align_config.telemetry_path),
                num_microbatches=num_microbatches if callable(num_microbatches) else None,
                error_group=group, dp_size=ranks.dp_size)
            aligner.attach(McoreOptimizerHold(model, param_sync) if owned else McoreChunkHold(
                model, config, forced_sync=(param_sync, weights, backend)))
    except BaseException:
        if aligner is not None:
            aligner.detach()
        raise
    return aligner


def _optimizer_owned(optimizer: Any) -> bool:
    """Whether this megatron-core's DistributedOptimizer owns the all-gather (0.7/0.8); there
    the optimizer must be given."""
    from nemo_fp8_align.errors import UnsupportedSetupError
    from nemo_fp8_align import mcore_versions as mcore_version

    if not mcore_version.optimizer_owns_gather():
        return False
    if optimizer is None:
        raise UnsupportedSetupError(mcore_version.missing_optimizer_problem())
    return True


def _refuse_fp8_parameters(weights: Sequence[Sequence[Any]]) -> None:
    """0.7/0.8: Transformer Engine FP8 parameters never receive the all-gather (refused)."""
    from nemo_fp8_align.errors import UnsupportedSetupError
    from nemo_fp8_align.mcore_versions import fp8_parameter_problem
    from nemo_fp8_align.sync.forced_sync import param_of

    problem = fp8_parameter_problem([param_of(w) for chunk in weights for w in chunk])
    if problem is not None:
        raise UnsupportedSetupError(problem)


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class _InactiveBackend:
    """The plugin is off (``align_config``): nothing is transposed, nothing imported."""

    name = "inactive"

    def weights_of(self, chunk: Any) -> List[Any]:
        return []

    def transpose_needed(self) -> tuple:
        return False, "the plugin is off"
