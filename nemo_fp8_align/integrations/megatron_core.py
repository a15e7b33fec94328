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
from nemo_fp8_align.integrations.refusals import Setup, refuse_unsupported
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


def align_fp8_transposes(
    model: Sequence[torch.nn.Module], *, num_microbatches: Union[int, Callable[[], int]],
    backend: FP8TransposeBackend,
    weights_of: Callable[[torch.nn.Module], List[Any]], config: Any = None,
    align_config: AlignConfig = AlignConfig(), pp_rank: Optional[int] = None,
    dp_rank: Optional[int] = None, rebinding_loop: bool = False, pg_collection: Any = None,
) -> TransposeAligner:
    """Attach the aligned FP8-transpose engine to megatron-core DDP model chunks.

    Args:
        model: this rank's DDP-wrapped model chunks, in schedule order.
        num_microbatches: microbatches per training step (M); must be the value the schedule
            gets, or the aligner stops with an error at the first mismatching forward.
        backend: the FP8 backend owning the chunks' FP8 weights.
        weights_of: returns the FP8 weights of one chunk (e.g. its Float8Tensor parameters).
        config: the ``TransformerConfig`` the schedule reads; defaults to ``model[0].config``.
        align_config: policy and telemetry settings.
        pp_rank, dp_rank: default to the model's groups (below).
        rebinding_loop: the training loop binds ``config.param_sync_func`` itself, after this
            call and again after a load (Megatron-LM, Megatron-Bridge): hook the chunks'
            ``start_param_sync`` instead of the config (see
            :mod:`nemo_fp8_align.integrations.megatron_lm`).
        pg_collection: the ``ProcessGroupCollection`` the model and schedule were built with
            (megatron-core >= 0.14); None: the chunks' own DDP groups, else ``parallel_state``
            (:mod:`nemo_fp8_align.integrations.groups`).
    """
    from nemo_fp8_align.integrations.groups import resolve_ranks

    config = config if config is not None else model[0].config
    refuse_unsupported(Setup(config=config, chunks=model))
    check_telemetry_path(align_config.telemetry_path)
    ranks = resolve_ranks(model, pg_collection)
    pp_rank = ranks.pp_rank if pp_rank is None else pp_rank
    dp_rank = ranks.dp_rank if dp_rank is None else dp_rank
    m_now = num_microbatches() if callable(num_microbatches) else num_microbatches
    schedule = schedule_for(config, pp=ranks.pp_size,
                            vp=len(model), num_microbatches=m_now)
    aligner = TransposeAligner(
        model, schedule=schedule, pp_rank=pp_rank, dp_rank=dp_rank,
        param_sync=McoreParamSync(model), weights=[weights_of(chunk) for chunk in model],
        backend=backend, config=align_config,
        telemetry=telemetry_writer(align_config.telemetry_path),
        num_microbatches=num_microbatches if callable(num_microbatches) else None,
        dp_size=ranks.dp_size)
    aligner.attach(config, rebinding_loop=rebinding_loop)
    return aligner
