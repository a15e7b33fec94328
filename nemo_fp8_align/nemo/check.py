"""Startup check of a NeMo 1.x GPT config for the aligned FP8-transpose plugin.

Run it before any model is built: it reads an OmegaConf config only (no NeMo, no megatron-core
import) and reports *every* setting that stops the plugin from working at once, each with the
Hydra override that fixes it (DESIGN.md §5)::

    from nemo_fp8_align.nemo.check import check_config
    check_config(cfg)          # cfg: the full training config (with ``model:``) or its model node

What is checked, with the NeMo 2.3.3 / megatron-core 0.12.3 key each rule reads:

- ``model.fp8_transpose_align``: the plugin's own block, validated against the structured config
  built from :class:`~nemo_fp8_align.config.AlignConfig` (a misspelt key gets "did you mean").
  When it says ``enabled: false`` or ``policy: off`` the plugin is inactive and nothing else is
  checked (errors inside the block itself are still reported). A missing block means
  AlignConfig's defaults: active.
- pipeline: ``pipeline_model_parallel_size`` >= 2 and ``virtual_pipeline_model_parallel_size``
  >= 2. NeMo passes the latter to megatron-core unchanged as the number of model chunks per
  pipeline rank (1 is turned into None: no interleaving); NeMo also asserts
  ``(num_layers // PP) % VP == 0``, and refuses VP without ``megatron_amp_O2=True``.
- FP8: ``transformer_engine``, ``fp8``, ``fp8_params`` all True; ``fp8_hybrid`` or
  ``fp8_e4m3`` True (MegatronGPTModel raises "fp8_format ... is not set" otherwise);
  ``fp8_recipe`` (a TransformerConfig field that NeMo copies from the model node, default
  "delayed") per-tensor: ``delayed`` or ``tensorwise``; ``disable_parameter_transpose_cache``
  (also a TransformerConfig field copied from the model node) not True. Both are also read
  from ``model.mcore_customization_config``, which NeMo applies last.
- optimizer: ``optim.name`` ``distributed_fused_adam`` (Apex), or ``mcore_distributed_optim``
  with ``optim.align_param_gather=True`` (else NeMo sets no ``param_sync_func``);
  ``optim.overlap_param_sync=True`` (NeMo's name for DDP ``overlap_param_gather`` on the mcore
  path) and ``optim.overlap_grad_sync=True`` (NeMo requires it with overlap_param_sync).
- microbatches, when the data-parallel size is known (from ``trainer.devices * trainer.num_nodes
  / (TP * PP * CP)``, or passed in): M = global_batch_size / (micro_batch_size * DP) must fit
  megatron-core's interleaved schedule (:class:`~nemo_fp8_align.engine.schedule.InterleavedSchedule`
  decides, with N = ``microbatch_group_size_per_vp_stage`` if set). Without a ``trainer:`` block
  and without ``data_parallel_size`` these checks are skipped.

Missing keys and values of the wrong type (``fp8: "yes"``) are violations too.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.engine.schedule import InterleavedSchedule, ScheduleError
from nemo_fp8_align.nemo.config_reader import (ABSENT, UNRESOLVED, Reader, Violation, hydra_value,
                                               show_value, split_config)
from nemo_fp8_align.nemo.structured import BLOCK_KEY, block_fields, block_schema

__all__ = ["FP8AlignConfigError", "Violation", "align_config_from", "check_config",
           "data_parallel_size_of", "find_violations", "PER_TENSOR_RECIPES", "SUPPORTED_OPTIMIZERS"]

#: fp8_recipe values whose FP8 weights carry one scale per tensor (byte transpose is valid).
PER_TENSOR_RECIPES = ("delayed", "tensorwise")
#: optim.name values the plugin supports (DESIGN.md §3a, §3b).
SUPPORTED_OPTIMIZERS = ("distributed_fused_adam", "mcore_distributed_optim")
_APEX_OPTIM, _MCORE_OPTIM = SUPPORTED_OPTIMIZERS


class FP8AlignConfigError(ValueError):
    """The config has settings that stop the aligned FP8-transpose plugin from working."""

    def __init__(self, violations: Iterable[Violation]) -> None:
        self.violations: List[Violation] = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(
            f"{len(self.violations)} setting(s) stop the aligned FP8-transpose plugin "
            f"(model.{BLOCK_KEY}) from working:\n{lines}\n"
            f"Apply the fixes above, or turn the plugin off with "
            f"model.{BLOCK_KEY}.enabled=False.")


# ---------------------------------------------------------------------------------------------
# Public API


def check_config(cfg: Union[DictConfig, Mapping], *, data_parallel_size: Optional[int] = None
                 ) -> None:
    """Raise :class:`FP8AlignConfigError` listing every violation; return None when valid.

    When ``model.fp8_transpose_align`` says ``enabled: false`` or ``policy: off`` the plugin is
    inactive and only errors inside that block itself are reported.

    Args:
        cfg: the full training config (``trainer:``, ``model:``, ...) or just its model node.
        data_parallel_size: DP for the microbatch checks; derived from ``trainer:`` when None.
    """
    violations = find_violations(cfg, data_parallel_size=data_parallel_size)
    if violations:
        raise FP8AlignConfigError(violations)


def find_violations(cfg: Union[DictConfig, Mapping], *,
                    data_parallel_size: Optional[int] = None) -> List[Violation]:
    """Every violation in ``cfg``, in a stable order (see the module docstring).

    Empty when the config is valid, and when the plugin block says ``enabled: false`` or
    ``policy: off`` (plugin inactive; errors inside the block itself are still listed).
    """
    model, trainer = split_config(cfg)
    reader = Reader(model, "model.")
    block_violations, align = _read_block(reader)
    if not align.active:
        return block_violations + reader.violations
    pp = reader.int_at_least("pipeline_model_parallel_size", 2, "pipeline ranks; the plugin "
                             "aligns transposes across them")
    vp = reader.int_at_least("virtual_pipeline_model_parallel_size", 2, "model chunks per "
                             "pipeline rank; 1 or null turns interleaving off")
    _check_layers_per_chunk(reader, pp, vp)
    _check_fp8(reader)
    _check_optimizer(reader)
    _check_fixed_microbatches(reader)
    trainer_reader = Reader(trainer if trainer is not None else OmegaConf.create({}),
                             "trainer.")
    if pp is not None and vp is not None:
        dp = data_parallel_size
        if dp is None and trainer is not None:
            dp = _data_parallel_size(reader, trainer_reader, pp)
        if dp is not None:
            _check_microbatches(reader, pp, vp, dp)
    return block_violations + reader.violations + trainer_reader.violations


def data_parallel_size_of(cfg: Union[DictConfig, Mapping]) -> Optional[int]:
    """DP = trainer.devices * trainer.num_nodes / (TP * PP * CP), or None when not derivable
    (no ``trainer:`` block, ``devices: auto``, a size that does not divide, ...)."""
    model, trainer = split_config(cfg)
    if trainer is None:
        return None
    reader = Reader(model, "model.")
    pp = reader.get("pipeline_model_parallel_size")
    pp = 1 if pp is ABSENT else pp
    if type(pp) is not int or pp < 1:
        return None
    return _data_parallel_size(reader, Reader(trainer, "trainer."), pp)


def align_config_from(cfg: Union[DictConfig, Mapping]) -> AlignConfig:
    """The plugin's :class:`AlignConfig` from ``model.fp8_transpose_align`` (defaults if absent).

    Raises :class:`FP8AlignConfigError` when the block has unknown keys or invalid values.
    """
    model, _ = split_config(cfg)
    reader = Reader(model, "model.")
    violations, align = _read_block(reader)
    violations += reader.violations  # an unresolvable block
    if violations:
        raise FP8AlignConfigError(violations)
    return align


# ---------------------------------------------------------------------------------------------
# The plugin's own block


def _read_block(reader: Reader) -> Tuple[List[Violation], AlignConfig]:
    """(violations, AlignConfig) of ``model.fp8_transpose_align``; invalid values -> defaults."""
    sub = Reader(OmegaConf.create({}), f"{reader.prefix}{BLOCK_KEY}.")
    block = reader.get(BLOCK_KEY)
    if block is ABSENT or block is None or block is UNRESOLVED:
        return sub.violations, AlignConfig()
    fields = block_fields()
    if not isinstance(block, DictConfig):
        sub.violations.append(Violation(
            reader.prefix + BLOCK_KEY, show_value(block), "a mapping with keys " + ", ".join(fields),
            f"~{reader.prefix}{BLOCK_KEY}"))
        return sub.violations, AlignConfig()
    sub.node = block
    schema = block_schema()
    values = {}
    for key in map(str, block.keys()):
        value = sub.get(key)
        if value is ABSENT or value is UNRESOLVED:
            continue
        try:  # the structured config rejects unknown keys and unconvertible values
            OmegaConf.merge(schema, {key: value})
        except ConfigKeyError:
            _unknown_block_key(sub, key, value, fields)
            continue
        except ValidationError:
            pass
        if _block_value_ok(sub, key, value, fields[key], getattr(schema, key)):
            values[key] = value
    return sub.violations, AlignConfig(**values)


def _unknown_block_key(sub: Reader, key: str, value: Any, fields: Mapping[str, Any]) -> None:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "known keys: " + ", ".join(fields)
    fix = (f"~{sub.prefix}{key} {sub.prefix}{close[0]}={hydra_value(value)}" if close
           else f"~{sub.prefix}{key}")
    sub.add(key, value, f"no such key in the plugin block; {hint}", fix=fix)


def _block_value_ok(sub: Reader, key: str, value: Any, tp: Any, default: Any) -> bool:
    if key == "policy":
        choices = [p.value for p in Policy]
        if isinstance(value, str) and value in choices:
            return True
        sub.add(key, value, "one of: " + ", ".join(choices), default)
        return False
    allowed = tuple(a for a in (typing.get_args(tp) or (tp,)) if isinstance(a, type))
    # OmegaConf would coerce "yes" or 1 to a bool; the plugin wants exactly the declared type.
    if isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool)):
        return True
    names = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
    sub.add(key, value, f"a value of type {names}", default)
    return False


# ---------------------------------------------------------------------------------------------
# NeMo model settings


def _check_layers_per_chunk(reader: Reader, pp: Optional[int], vp: Optional[int]) -> None:
    layers = reader.get("num_layers")
    if pp is None or vp is None or type(layers) is not int:
        return
    if (reader.get("account_for_embedding_in_pipeline_split") is True
            and reader.get("account_for_loss_in_pipeline_split") is True):
        return  # NeMo skips its assertion in this case too
    per_rank = layers // pp
    if per_rank % vp == 0:
        return
    divisors = [d for d in range(2, per_rank + 1) if per_rank % d == 0]
    if divisors:
        fix = min(divisors, key=lambda d: (abs(d - vp), d))
        reader.add("virtual_pipeline_model_parallel_size", vp,
                   f"a divisor of num_layers // PP = {layers} // {pp} = {per_rank} (NeMo "
                   "asserts the same number of layers in every model chunk)", fix)
    else:
        reader.add("num_layers", layers, f"at least 2 * PP = {2 * pp} layers, so that each "
                   "pipeline rank holds one layer per model chunk", pp * vp)


def _check_fp8(reader: Reader) -> None:
    reader.require_true("transformer_engine", "FP8 weights are Transformer Engine tensors")
    reader.require_true("fp8", "FP8 GEMMs are what need the transposed weights")
    reader.require_true("fp8_params", "FP8 weights are what the plugin transposes")
    reader.require_true("megatron_amp_O2", "NeMo builds interleaved pipelines only with O2")
    hybrid = reader.bool_or_default("fp8_hybrid", False, "FP8 format E4M3/E5M2")
    e4m3 = reader.bool_or_default("fp8_e4m3", False, "FP8 format E4M3 only")
    if hybrid is False and e4m3 is False:
        reader.add("fp8_hybrid", reader.get("fp8_hybrid"), "True, or fp8_e4m3=True (NeMo "
                   "raises 'fp8 enabled but fp8_format (fp8_e4m3 | fp8_hybrid) is not set')", True)
    for prefix in ("", "mcore_customization_config."):
        _check_recipe(reader, prefix + "fp8_recipe")
        cache_off = reader.bool_or_default(prefix + "disable_parameter_transpose_cache", False,
                                           "the transpose cache must stay on")
        if cache_off:
            reader.add(prefix + "disable_parameter_transpose_cache", True,
                       "False (with the cache off every microbatch re-transposes and nothing "
                       "is left to align)", False)


def _check_recipe(reader: Reader, key: str) -> None:
    recipe = reader.get(key)
    if recipe is ABSENT or recipe in PER_TENSOR_RECIPES:
        return  # absent: megatron-core's default, "delayed"
    reader.add(key, recipe, "a per-tensor FP8 recipe, one of: " + ", ".join(PER_TENSOR_RECIPES)
               + " (MXFP8 / blockwise FP8 cannot be byte-transposed)", PER_TENSOR_RECIPES[0])


def _check_optimizer(reader: Reader) -> None:
    name = reader.get("optim.name")
    if name not in SUPPORTED_OPTIMIZERS:
        reader.add("optim.name", name, f"{_APEX_OPTIM}, or {_MCORE_OPTIM} with "
                   "optim.align_param_gather=True (a distributed optimizer that all-gathers "
                   "the FP8 parameters)", _APEX_OPTIM)
    reader.require_true("optim.overlap_param_sync",
                        "the param all-gathers the transposes are aligned with")
    reader.require_true("optim.overlap_grad_sync", "NeMo requires it with overlap_param_sync")
    if name == _MCORE_OPTIM:
        reader.require_true("optim.align_param_gather", "with mcore_distributed_optim NeMo sets "
                            "param_sync_func only when it is on")


# ---------------------------------------------------------------------------------------------
# Microbatches


def _data_parallel_size(model: Reader, trainer: Reader, pp: int) -> Optional[int]:
    """DP = devices * num_nodes / (TP * PP * CP); None when the trainer does not say."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes")
    nodes = 1 if nodes is ABSENT else nodes
    if type(devices) is not int or devices < 1 or type(nodes) is not int or nodes < 1:
        return None  # "auto", -1, a device list: world size unknown before launch
    tp = model.get("tensor_model_parallel_size")
    cp = model.get("context_parallel_size")
    tp = 1 if tp is ABSENT else tp
    cp = 1 if cp is ABSENT else cp
    if type(tp) is not int or type(cp) is not int or tp < 1 or cp < 1:
        return None
    model_parallel = tp * pp * cp
    world = devices * nodes
    if world % model_parallel:
        fixed = next(d for d in range(devices, devices + model_parallel + 1)
                     if d * nodes % model_parallel == 0)
        trainer.add("devices", devices, f"devices * num_nodes = {world} to be a multiple of "
                    f"TP * PP * CP = {model_parallel}", fixed)
        return None
    return world // model_parallel


def _check_fixed_microbatches(reader: Reader) -> None:
    # The aligned slots are computed for one M; a batch-size ramp-up changes M mid-run, and the
    # aligner would stop at the first forward whose chunk no longer matches its schedule.
    value = reader.get("rampup_batch_size")
    if value is not ABSENT and value is not None:
        reader.add("rampup_batch_size", value,
                   "null (a batch-size ramp-up changes the microbatch count M during training; "
                   "the aligned slots assume one M)", None)


def _check_microbatches(reader: Reader, pp: int, vp: int, dp: int) -> None:
    mbs = reader.int_at_least("micro_batch_size", 1, "samples per microbatch")
    gbs = reader.int_at_least("global_batch_size", 1, "samples per optimizer step")
    n_ok, n = reader.optional_int("microbatch_group_size_per_vp_stage", pp,
                                  "N, microbatches per group; null means PP")
    if mbs is None or gbs is None or not n_ok:
        return
    per_microbatch = mbs * dp
    if gbs % per_microbatch == 0:
        m = gbs // per_microbatch
        error = _schedule_error(pp, vp, m, n)
        if error is None:
            return
        if n is not None and _schedule_error(pp, vp, m, None) is None:
            reader.add("microbatch_group_size_per_vp_stage", n, error, pp)
            return
    else:
        m = gbs // per_microbatch
        error = (f"a multiple of micro_batch_size * DP = {mbs} * {dp} = {per_microbatch} "
                 "(megatron-core's microbatch calculator requires it)")
    found = f"{gbs} (M = {gbs} / ({mbs} * DP {dp}) = {gbs / per_microbatch:g})"
    reader.violations.append(Violation(
        reader.prefix + "global_batch_size", found, error,
        reader.override("global_batch_size", _valid_gbs(pp, vp, m, n, per_microbatch), True)))


def _schedule_error(pp: int, vp: int, m: int, n: Optional[int]) -> Optional[str]:
    try:
        InterleavedSchedule(pp=pp, vp=vp, microbatches=m, group_size=n)
    except ScheduleError as err:
        return str(err)
    return None


def _valid_gbs(pp: int, vp: int, m: int, n: Optional[int], per_microbatch: int) -> int:
    """The smallest global batch size above the current M that the schedule accepts."""
    group = pp if n is None else n
    for candidate in range(max(m + 1, pp), max(m, group) + 2 * group + 1):
        if _schedule_error(pp, vp, candidate, n) is None:
            return candidate * per_microbatch
    return group * per_microbatch  # unreachable: M = a multiple of N >= N always fits
