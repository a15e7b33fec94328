"""Building a NeMo ``MegatronGPTModel``'s aligner: the startup check of its config, the telemetry
path, which FP8 weights the model holds, where its chunks are, and :func:`build_aligner`, which
hands them to the one assembler (:func:`~nemo_fp8_align.assemble.assemble`).

Functions of the model and the config: the mixin and the callback run the startup check with
them, the session (:mod:`.session`) calls :func:`build_aligner` at attach.

FP8 weights: ``model.fp8_params=True`` means Transformer Engine ``Float8Tensor`` parameters
(:attr:`FP8Weights.TE`, backend ``nemo_fp8_align.backends.te``). Where TE is absent (the CPU
smoke run), :attr:`FP8Weights.REFERENCE` builds on the
:class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` copies the chunks' layers compute
with (``module.fp8_weight``); the TE-only config keys are then not required by the startup check.
Optimizer: ``optim.name=distributed_fused_adam`` gives
:class:`~nemo_fp8_align.adapters.apex.ApexAdapter`, ``mcore_distributed_optim``
:class:`~nemo_fp8_align.adapters.mcore_ddp.McoreDDPAdapter` (picked by
:func:`~nemo_fp8_align.assemble.assemble`).
"""

from __future__ import annotations

import enum
from typing import Any, List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align.config import AlignConfig

__all__ = ["FP8Weights", "build_aligner", "check_telemetry_path", "detect_weights",
           "model_chunks", "reference_weights_of", "refuse_owned_gather", "startup_check"]

#: Config keys that only make sense with Transformer Engine FP8 weights; not required when the
#: model uses reference FP8 shadows (TE absent).
_TE_ONLY_KEYS = ("model.transformer_engine", "model.fp8", "model.fp8_params", "model.fp8_hybrid",
                 "model.fp8_e4m3")


class FP8Weights(str, enum.Enum):
    """Which FP8 weights the aligner transposes."""

    #: Transformer Engine ``Float8Tensor`` parameters (``model.fp8_params=True``).
    TE = "te"
    #: Plain-torch reference FP8 weights held by the chunks' layers as ``fp8_weight`` (no TE).
    REFERENCE = "reference"


def reference_weights_of(module: torch.nn.Module) -> List[Any]:
    """The :class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight` objects ``module``'s
    layers compute with (held as ``fp8_weight``), in module order, each once, named by their
    layer."""
    from nemo_fp8_align.backends.reference import ReferenceFP8Weight

    found: List[Any] = []
    seen = set()
    for name, layer in module.named_modules():
        weight = layer.__dict__.get("fp8_weight")
        if isinstance(weight, ReferenceFP8Weight) and id(weight) not in seen:
            seen.add(id(weight))
            weight.name = name or weight.name
            found.append(weight)
    return found


def detect_weights(chunks: Sequence[torch.nn.Module]) -> FP8Weights:
    """REFERENCE when the chunks' layers hold reference FP8 weights (the CPU layers), else TE."""
    has_reference = any(reference_weights_of(chunk) for chunk in chunks)
    return FP8Weights.REFERENCE if has_reference else FP8Weights.TE


def startup_check(cfg: Any, trainer: Any = None, *,
                  weights: FP8Weights = FP8Weights.TE) -> AlignConfig:
    """Check the model config; return the plugin's :class:`AlignConfig`.

    Raises :class:`~nemo_fp8_align.config_check.check.FP8AlignConfigError` listing every violation.
    ``trainer`` (when given) supplies the data-parallel size for the microbatch rules.
    """
    from nemo_fp8_align.config_check.check import (FP8AlignConfigError, align_config_from,
                                                   find_violations, plugin_off_override)

    from nemo_fp8_align.mcore_versions import importable_rules

    # judged by the megatron-core NeMo runs on (its own schedule rules and options)
    violations = find_violations(cfg, data_parallel_size=_data_parallel_size(cfg, trainer),
                                 mcore=importable_rules())
    if weights is FP8Weights.REFERENCE:
        violations = [v for v in violations if v.key not in _TE_ONLY_KEYS]
    if violations:
        raise FP8AlignConfigError(violations, off=plugin_off_override(cfg))
    return align_config_from(cfg)


def check_telemetry_path(path: Optional[str]) -> None:
    """:func:`nemo_fp8_align.assemble.check_telemetry_path`, naming the NeMo
    setting; every rank calls it (Lightning's setup), and a path that fails on one rank raises
    on every rank (:func:`~nemo_fp8_align.core.step_end.agreed`)."""
    from nemo_fp8_align.assemble import check_telemetry_path as check
    from nemo_fp8_align.core.step_end import agreed

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with agreed(label=f"rank {rank} (checking model.fp8_transpose_align.telemetry_path)"):
        check(path, key="model.fp8_transpose_align.telemetry_path")


def _data_parallel_size(cfg: Any, trainer: Any) -> Optional[int]:
    world = getattr(trainer, "world_size", None)
    if not isinstance(world, int) or world < 1:
        return None
    model_parallel = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "context_parallel_size"):
        value = cfg.get(key, 1)
        model_parallel *= value if isinstance(value, int) and value > 0 else 1
    return world // model_parallel if world % model_parallel == 0 else None


def model_chunks(model: Any) -> List[torch.nn.Module]:
    """The modules NeMo's schedule calls: ``model.model`` as a list (one per virtual stage)."""
    chunks = model.model
    return list(chunks) if isinstance(chunks, (list, tuple, torch.nn.ModuleList)) else [chunks]


def build_aligner(model: Any, config: AlignConfig, *, weights: FP8Weights = FP8Weights.TE,
                  entry: str = "mixin") -> Any:
    """The rank's :class:`TransposeAligner` for a set-up NeMo GPT model, attached (inactive:
    ``attached`` False); every rank calls it at the same point (one agreement).

    Call after the optimizer exists and before the first optimizer step (Apex's pre-forward
    hooks are still disarmed then, so collecting parameters touches none). The step end is the
    adapter's where its optimizer has one: with ``mcore_distributed_optim`` NeMo runs
    megatron-core's ``finalize_model_grads`` (chunk 0's ``finish_grad_sync``), as every
    megatron-core loop does. Apex's ``DistributedFusedAdam`` has no call NeMo makes once per
    step, so on that path the session reports it after ``fwd_bwd_step``.
    """
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_model_config

    from nemo_fp8_align.assemble import assemble

    chunks = model_chunks(model)
    mcore_optimizer = getattr(model, "use_mcore_dist_optim", False)
    refuse_owned_gather(model)
    backend, weights_of = _backend_and_weights_of(config, weights)
    # The chunks' own DDP groups where megatron-core keeps them (>= 0.14), else parallel_state.
    return assemble(chunks, num_microbatches=get_num_microbatches(),
                    config=get_model_config(chunks[0]), backend=backend, weights_of=weights_of,
                    align_config=config,
                    apex_optimizer=None if mcore_optimizer else model._optimizer,
                    owns_step_end=mcore_optimizer, with_context_parallel=True, error_group=None,
                    label=f"attaching nemo_fp8_align, {entry}",
                    telemetry_key="model.fp8_transpose_align.telemetry_path")


def refuse_owned_gather(model: Any) -> None:
    """NeMo's ``mcore_distributed_optim`` holds the DDP chunks' launches; on megatron-core
    0.7/0.8, whose DistributedOptimizer owns the all-gather, it is refused with the version and
    the fixes."""
    from nemo_fp8_align.mcore_versions import nemo_optimizer_owned_problem, optimizer_owns_gather

    if getattr(model, "use_mcore_dist_optim", False) and optimizer_owns_gather():
        from nemo_fp8_align.errors import UnsupportedSetupError

        raise UnsupportedSetupError(nemo_optimizer_owned_problem())


def _backend_and_weights_of(config: AlignConfig, weights: FP8Weights) -> Tuple[Any, Any]:
    if weights is FP8Weights.REFERENCE:
        from nemo_fp8_align.backends.reference import ReferenceBackend

        return ReferenceBackend(use_triton_kernel=config.use_triton_kernel), reference_weights_of
    backend = _te_backend(config)
    # By type() only: isinstance() on a parameter could fire an armed Apex hook.
    return backend, backend.weights_of


def _te_backend(config: AlignConfig) -> Any:
    """The Transformer Engine backend (:mod:`nemo_fp8_align.backends.te`)."""
    from nemo_fp8_align.backends import te as te_backend

    try:
        return te_backend.make_backend(config)
    except ImportError as err:
        raise RuntimeError(
            "model.fp8_params=True: the plugin transposes Transformer Engine FP8 weights, but "
            f"{err} Or turn the plugin off with model.fp8_transpose_align.enabled=False.") from err
