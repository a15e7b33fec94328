"""What the installed megatron-core's own config classes can do, read from the classes (never
from a version table): the demo's input check and ``align_fp8_transposes`` ask here.

- ``microbatch_group_size_per_vp_stage`` (``TransformerConfig``, 0.10 on): before it, the
  interleaved schedule runs forwards in groups of PP and needs M a multiple of PP.
- ``overlap_param_gather`` (``DistributedDataParallelConfig``, 0.9 on): before it (0.7, 0.8),
  the parameter all-gather belongs to the DistributedOptimizer (``OptimizerConfig.
  overlap_param_gather``), chained bucket after bucket from ``zero_grad`` and its own forward
  pre-hook across all chunks, and the model chunks have no ``start_param_sync``: the plugin then
  holds the optimizer's chain (:mod:`~nemo_fp8_align.sync.mcore_optimizer_hold`), and refuses
  Transformer Engine FP8 parameters, which those versions' DDP never gathers into.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

__all__ = ["fp8_parameter_problem", "has_group_size", "installed_version", "interleaved_pp_problem",
           "missing_optimizer_problem", "nemo_optimizer_owned_problem", "optimizer_owns_gather",
           "pp_multiple_problem"]


def installed_version() -> str:
    """megatron-core's version string ("unknown" where the package metadata is missing)."""
    from importlib import metadata

    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except (ImportError, AttributeError):
        try:
            return metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            return "unknown"


def _fields(cls: type) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def has_group_size() -> bool:
    """Whether ``TransformerConfig`` has ``microbatch_group_size_per_vp_stage`` (0.10 on)."""
    from megatron.core.transformer import TransformerConfig

    return "microbatch_group_size_per_vp_stage" in _fields(TransformerConfig)


def optimizer_owns_gather() -> bool:
    """Whether the DistributedOptimizer owns the parameter all-gather (0.7, 0.8:
    ``DistributedDataParallelConfig`` has no ``overlap_param_gather``; it is
    ``OptimizerConfig.overlap_param_gather``, and the chunks have no ``start_param_sync``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return "overlap_param_gather" not in _fields(DistributedDataParallelConfig)


def missing_optimizer_problem() -> str:
    """What ``align_fp8_transposes`` says on 0.7/0.8 when it was not given the optimizer."""
    return (f"megatron-core {installed_version()}: the parameter all-gather belongs to the "
            "DistributedOptimizer (OptimizerConfig.overlap_param_gather; DistributedDataParallel"
            "Config has no overlap_param_gather and the chunks no start_param_sync), so the "
            "plugin holds the optimizer's all-gathers. Fix: align_fp8_transposes(model, "
            "optimizer=<what get_megatron_optimizer returned>, ...)")


def nemo_optimizer_owned_problem() -> str:
    """NeMo's megatron-core optimizer (``mcore_distributed_optim``) on 0.7/0.8: the plugin's
    NeMo path holds the DDP chunks' launches, which those versions do not have, and NeMo of that
    era (2.0.0rc0/rc1) with the optimizer's chain was never run with the plugin."""
    return (f"megatron-core {installed_version()} with NeMo's mcore_distributed_optim: the "
            "parameter all-gather belongs to the DistributedOptimizer (no per-chunk "
            "start_param_sync), and the plugin's NeMo path was not built or run for it. Fix: "
            "model.optim.name=distributed_fused_adam (Apex; the plugin's NeMo path for these "
            "containers), or megatron-core >= 0.9.0 (NeMo Framework 24.09 or later), or "
            "policy=off")


def fp8_parameter_problem(params: Sequence[Any]) -> Optional[str]:
    """On 0.7/0.8, why Transformer Engine FP8 parameters cannot be aligned (None: none here).

    Their DDP buffer is of the parameter's nominal dtype and ``ParamAndGradBuffer`` points each
    parameter at it with ``param.data = <buffer view>``; TE's ``Float8Tensor`` answers that
    assignment by casting the view into its own FP8 storage (``_set_data`` -> ``copy_``), so the
    optimizer's all-gather fills the buffer and never reaches the FP8 parameter. FP8 parameters
    in megatron-core's DDP start in 0.9 (``is_float8tensor`` buffers, ``fp8_param_gather``)."""
    te = [p for p in params if type(p).__module__.startswith("transformer_engine")]
    if not te:
        return None
    return (f"megatron-core {installed_version()}: {len(te)} FP8 parameter(s) are Transformer "
            f"Engine {type(te[0]).__name__}s, which this version's DistributedDataParallel copies "
            "into its buffer instead of aliasing it (FP8 parameters in megatron-core's DDP and "
            "DistributedOptimizer start in 0.9, with fp8_param_gather): the optimizer's "
            "all-gather never reaches them. Fix: megatron-core >= 0.9.0 with "
            "DistributedDataParallelConfig(fp8_param_gather=True), or Apex's DistributedFusedAdam "
            "(NeMo model.optim.name=distributed_fused_adam), or policy=off")


def interleaved_pp_problem(pp: int) -> Optional[str]:
    """megatron-core 0.7's ``initialize_model_parallel`` raises RuntimeError for interleaving
    with PP <= 2 (0.8 on allows PP = 2): that rule, read from its source and spelled for this
    version (None: it holds, or this version has no such rule)."""
    import inspect

    from megatron.core import parallel_state

    try:
        source = inspect.getsource(parallel_state.initialize_model_parallel)
    except (OSError, TypeError):
        return None
    if pp > 2 or "pipeline_model_parallel_size > 2" not in source:
        return None
    return (f"megatron-core {installed_version()} refuses the interleaved schedule with PP "
            f"{pp} (\"pipeline-model-parallel size should be greater than 2 with interleaved "
            "schedule\"); use PP 4 (and microbatches a multiple of it)")


def pp_multiple_problem(pp: int, microbatches: int) -> Optional[str]:
    """Before 0.10 (no ``microbatch_group_size_per_vp_stage``) megatron-core's interleaved
    schedule raises RuntimeError unless M is a multiple of PP: that rule, spelled for this
    version (None: it holds, or this version has N and its own rule)."""
    if has_group_size() or microbatches % pp == 0:
        return None
    fixed = microbatches - microbatches % pp + pp
    return (f"{microbatches} microbatches with PP {pp}: megatron-core {installed_version()} "
            "(before 0.10) needs the number of microbatches to be a multiple of the pipeline "
            f"size with interleaving; use {fixed}")
