"""What the installed megatron-core's own config classes can do, read from the classes: the
demo's input check and ``align_fp8_transposes`` ask here (``check`` asks :func:`rules_for`, the
same facts for a version named by number, pinned to the classes by tests).

- ``microbatch_group_size_per_vp_stage`` (``TransformerConfig``, 0.10 on): before it, the
  interleaved schedule runs forwards in groups of PP and needs M a multiple of PP.
- ``overlap_param_gather`` (``DistributedDataParallelConfig``, 0.9 on): before it (0.7, 0.8),
  the parameter all-gather belongs to the DistributedOptimizer (``OptimizerConfig.
  overlap_param_gather``), chained bucket after bucket from ``zero_grad`` and its own forward
  pre-hook across all chunks, and the model chunks have no ``start_param_sync``: the plugin then
  holds the optimizer's chain (:mod:`~nemo_fp8_align.adapters.mcore_optimizer`), and refuses
  Transformer Engine FP8 parameters, which those versions' DDP never gathers into.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

__all__ = ["FP8_PARAMS_WHY", "NEWEST", "OLDEST", "VersionRules", "fp8_parameter_problem",
           "has_group_size", "has_optimizer_instances",
           "importable_rules", "importable_version", "installed_rules",
           "installed_version", "interleaved_pp_problem", "missing_optimizer_problem",
           "nemo_optimizer_owned_problem", "optimizer_owns_gather", "parse_version",
           "pp_multiple_problem", "rules_for"]

#: The megatron-core lines whose rules are known (``check --megatron-core`` accepts these).
OLDEST, NEWEST = (0, 7), (0, 19)


@dataclasses.dataclass(frozen=True)
class VersionRules:
    """What one megatron-core version's own classes allow, as far as the plugin's checks read.

    Each field names the class attribute it is read from by :func:`installed_rules`.
    """

    version: str
    #: ``ModelParallelConfig.microbatch_group_size_per_vp_stage`` (0.10 on); before it the
    #: interleaved schedule runs forwards in groups of PP and needs M a multiple of PP.
    group_size: bool
    #: ``DistributedDataParallelConfig`` without ``overlap_param_gather`` (0.7, 0.8).
    optimizer_owns_gather: bool
    #: the least PP ``initialize_model_parallel`` accepts with interleaving (0.7: 3).
    min_interleaved_pp: int
    #: ``TransformerConfig``'s first-stage layer count: ``first_pipeline_num_layers`` (0.9,
    #: 0.10), ``num_layers_in_first_pipeline_stage`` (0.11 on), None before 0.9.
    first_stage_field: Optional[str]
    #: ``TransformerConfig.account_for_embedding_in_pipeline_split`` (0.11 on).
    split_accounting: bool
    #: ``TransformerConfig.fp8_recipe`` (0.12 on; before it delayed scaling only).
    fp8_recipe: bool
    #: ``TransformerConfig.pipeline_model_parallel_layout`` (0.13 on).
    layout_string: bool
    #: ``DistributedDataParallelConfig.fp8_param_gather`` (0.9 on): TE FP8 parameters in DDP.
    fp8_param_gather: bool
    #: ``OptimizerConfig.overlap_param_gather_with_optimizer_step`` (0.9 on).
    optimizer_step_gather: bool

    @property
    def legacy_order(self) -> bool:
        """The pre-0.10 interleaved order (:class:`~nemo_fp8_align.core.schedule.
        InterleavedSchedule`'s ``legacy_order``): no N, M a multiple of PP."""
        return not self.group_size

    def interleaved_pp_rule(self, pp: int) -> Optional[str]:
        """megatron-core 0.7's ``initialize_model_parallel`` raises RuntimeError for
        interleaving with PP <= 2 (0.8 on allows PP = 2), spelled for this version (None: it
        holds, or this version has no such rule)."""
        if pp >= self.min_interleaved_pp:
            return None
        return (f"megatron-core {self.version} refuses the interleaved schedule with PP {pp} "
                "(\"pipeline-model-parallel size should be greater than 2 with interleaved "
                "schedule\")")

    def interleaved_pp_problem(self, pp: int) -> Optional[str]:
        """:meth:`interleaved_pp_rule` with the demo's fix."""
        rule = self.interleaved_pp_rule(pp)
        if rule is None:
            return None
        return (f"{rule}; use PP {max(self.min_interleaved_pp, 4)} (and microbatches a "
                "multiple of it)")

    def pp_multiple_problem(self, pp: int, microbatches: int) -> Optional[str]:
        """Before 0.10 megatron-core's interleaved schedule raises RuntimeError unless M is a
        multiple of PP, spelled for this version (None: it holds, or this version has N)."""
        if self.group_size or microbatches % pp == 0:
            return None
        fixed = microbatches - microbatches % pp + pp
        return (f"{microbatches} microbatches with PP {pp}: megatron-core {self.version} "
                "(before 0.10) needs the number of microbatches to be a multiple of the "
                f"pipeline size with interleaving; use {fixed}")

    def lacks(self, what: str) -> str:
        """"megatron-core X has no WHAT": the start of a sentence about a missing option."""
        return f"megatron-core {self.version} has no {what}"


def parse_version(text: str) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of "X.Y" or "X.Y.Z" (anything after the numbers, such as rc1,
    ignored); None when ``text`` does not start with two dot-separated numbers."""
    found = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def rules_for(version: str) -> VersionRules:
    """The rules of megatron-core ``version`` ("0.9.0"), without importing it: the thresholds
    below are where each attribute of :class:`VersionRules` appears in megatron-core's classes
    (tests/test_mcore_versions.py compares them with :func:`installed_rules` on every line)."""
    parsed = parse_version(version)
    if parsed is None:
        raise ValueError(f"megatron-core version {version!r}: expected X.Y or X.Y.Z")
    line = parsed[:2]
    first = (None if line < (0, 9) else "first_pipeline_num_layers" if line < (0, 11)
             else "num_layers_in_first_pipeline_stage")
    return VersionRules(version=version, group_size=line >= (0, 10),
                        optimizer_owns_gather=line < (0, 9),
                        min_interleaved_pp=3 if line == (0, 7) else 2,
                        first_stage_field=first, split_accounting=line >= (0, 11),
                        fp8_recipe=line >= (0, 12), layout_string=line >= (0, 13),
                        fp8_param_gather=line >= (0, 9), optimizer_step_gather=line >= (0, 9))


def installed_rules() -> VersionRules:
    """The rules of the importable megatron-core, read from its own classes and source."""
    import megatron.core
    from megatron.core.transformer import TransformerConfig

    fields = _fields(TransformerConfig)
    first = next((f for f in ("num_layers_in_first_pipeline_stage", "first_pipeline_num_layers")
                  if f in fields), None)
    from megatron.core.distributed import DistributedDataParallelConfig

    return VersionRules(
        version=installed_version(), group_size=has_group_size(),
        optimizer_owns_gather=optimizer_owns_gather(),
        min_interleaved_pp=3 if _pp_above_two_rule() else 2, first_stage_field=first,
        split_accounting="account_for_embedding_in_pipeline_split" in fields,
        fp8_recipe="fp8_recipe" in fields,
        layout_string="pipeline_model_parallel_layout" in fields,
        fp8_param_gather="fp8_param_gather" in _fields(DistributedDataParallelConfig),
        # read from the file: 0.7's megatron.core.optimizer imports Apex, absent on a CPU box
        optimizer_step_gather="overlap_param_gather_with_optimizer_step:" in (
            Path(megatron.core.__file__).parent.joinpath("optimizer", "optimizer_config")
            .with_suffix(".py").read_text()))


def importable_version() -> Optional[str]:
    """The version of the megatron-core ``import megatron.core`` would load, read without
    importing it (no torch): its ``package_info`` module's source on ``sys.path`` (so a
    megatron/core tree put first on PYTHONPATH counts, as it does for the import), else the
    installed distribution's metadata; None when there is neither."""
    import ast
    from importlib import machinery, metadata

    spec = machinery.PathFinder.find_spec("megatron", sys.path)
    for place in (spec.submodule_search_locations or []) if spec is not None else []:
        info = Path(place, "core", "package_info").with_suffix(".py")
        if info.is_file():
            values = {}
            for node in ast.parse(info.read_text()).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    values.update({t.id: node.value.value for t in node.targets
                                   if isinstance(t, ast.Name)})
            if all(k in values for k in ("MAJOR", "MINOR", "PATCH")):
                return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}"
            break
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def importable_rules() -> Optional[VersionRules]:
    """:func:`rules_for` the :func:`importable_version` (no import), None where megatron-core
    is absent or outside the known versions (the newest rules then apply): what the startup
    checks at attach (NeMo's model, Megatron-LM's arguments) judge by, as ``check`` does."""
    version = importable_version()
    parsed = None if version is None else parse_version(version)
    if parsed is None or not OLDEST <= parsed[:2] <= NEWEST:
        return None
    return rules_for(version)


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


def has_optimizer_instances() -> bool:
    """Whether ``DistributedDataParallelConfig`` has ``num_distributed_optimizer_instances``
    (0.10 on): the data-parallel ranks split into several distributed-optimizer instances."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return "num_distributed_optimizer_instances" in _fields(DistributedDataParallelConfig)


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


def nemo_optimizer_owned_problem(version: Optional[str] = None) -> str:
    """NeMo's megatron-core optimizer (``mcore_distributed_optim``) on 0.7/0.8: the plugin's
    NeMo path holds the DDP chunks' launches, which those versions do not have, and NeMo of that
    era (2.0.0rc0/rc1) with the optimizer's chain was never run with the plugin. ``version``:
    the one to name (default: the installed one; ``check --megatron-core`` names another)."""
    return (f"megatron-core {version or installed_version()} with NeMo's "
            "mcore_distributed_optim: the parameter all-gather belongs to the "
            "DistributedOptimizer (no per-chunk start_param_sync), and the plugin's NeMo path "
            "was not built or run for it. Fix: model.optim.name=distributed_fused_adam (Apex; "
            "the plugin's NeMo path for these containers), or megatron-core >= 0.9.0 (NeMo "
            "Framework 24.09 or later), or policy=off")


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
            f"Engine {type(te[0]).__name__}s, {FP8_PARAMS_WHY}. Fix: megatron-core >= 0.9.0 with "
            "DistributedDataParallelConfig(fp8_param_gather=True), or Apex's DistributedFusedAdam "
            "(NeMo model.optim.name=distributed_fused_adam), or policy=off")


#: Why TE FP8 parameters are refused with megatron-core's optimizer before 0.9 (the engine's
#: refusal above and ``check``'s say it in the same words).
FP8_PARAMS_WHY = ("which megatron-core's DistributedDataParallel before 0.9 copies into its "
                  "buffer instead of aliasing it (FP8 parameters in megatron-core's DDP and "
                  "DistributedOptimizer start in 0.9, with fp8_param_gather): the optimizer's "
                  "all-gather never reaches them")


def _pp_above_two_rule() -> bool:
    """Whether the installed ``initialize_model_parallel`` has 0.7's "PP > 2 with interleaving"
    rule, read from its source."""
    import inspect

    from megatron.core import parallel_state

    try:
        source = inspect.getsource(parallel_state.initialize_model_parallel)
    except (OSError, TypeError):
        return False
    return "pipeline_model_parallel_size > 2" in source


def interleaved_pp_problem(pp: int) -> Optional[str]:
    """:meth:`VersionRules.interleaved_pp_problem` of the installed version."""
    return installed_rules().interleaved_pp_problem(pp)


def pp_multiple_problem(pp: int, microbatches: int) -> Optional[str]:
    """:meth:`VersionRules.pp_multiple_problem` of the installed version."""
    return installed_rules().pp_multiple_problem(pp, microbatches)
