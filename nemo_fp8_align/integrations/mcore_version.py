"""What the installed megatron-core's own config classes can do, read from the classes (never
from a version table): the demo's input check and ``align_fp8_transposes`` ask here.

- ``microbatch_group_size_per_vp_stage`` (``TransformerConfig``, 0.10 on): before it, the
  interleaved schedule runs forwards in groups of PP and needs M a multiple of PP.
- ``overlap_param_gather`` (``DistributedDataParallelConfig``, 0.9 on): before it (0.7, 0.8),
  the parameter all-gather belongs to the DistributedOptimizer (``OptimizerConfig.
  overlap_param_gather``), chained bucket after bucket from its own forward pre-hook across all
  chunks, and the model chunks have no ``start_param_sync``: nothing per chunk that the plugin
  could hold at a schedule slot, so those versions are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["gather_problem", "has_group_size", "installed_version", "pp_multiple_problem"]


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


def gather_problem() -> Optional[str]:
    """Why the plugin cannot hold this megatron-core's parameter all-gathers (None: it can)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if "overlap_param_gather" in _fields(DistributedDataParallelConfig):
        return None
    return (f"megatron-core {installed_version()}: DistributedDataParallelConfig has no "
            "overlap_param_gather; this version's parameter all-gather belongs to the "
            "DistributedOptimizer (OptimizerConfig.overlap_param_gather), chained bucket after "
            "bucket from its own forward pre-hook, with no per-chunk start_param_sync that the "
            "schedule launches and the plugin could hold. Fix: megatron-core >= 0.9.0 "
            "(pip install 'megatron-core>=0.9.0'; NeMo Framework 24.09 or later), or do not "
            "attach the plugin (policy=off)")


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
