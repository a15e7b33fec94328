"""Startup-check rules on FP8 and the optimizer: the settings the plugin itself needs, and what
NeMo 2.3.3 / megatron-core 0.12.3 enforce on them. One function per rule, ``rule(ctx) -> None``.
"""

from __future__ import annotations

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT

__all__ = ["APEX_OPTIM", "MCORE_OPTIM", "PER_TENSOR_RECIPES", "SUPPORTED_OPTIMIZERS",
           "rule_align_param_gather", "rule_apex_current_scaling", "rule_gather_with_optimizer", "rule_bf16_edge_layers", "rule_fp8_format",
           "rule_fp8_params", "rule_fp8_recipe", "rule_fp8_enabled", "rule_optimizer_name",
           "rule_overlap_grad_sync", "rule_overlap_param_sync", "rule_transformer_engine",
           "rule_transpose_cache"]

#: fp8_recipe values whose FP8 weights carry one scale per tensor (byte transpose is valid).
PER_TENSOR_RECIPES = ("delayed", "tensorwise")
#: optim.name values the plugin supports: Apex's and megatron-core's distributed optimizers.
SUPPORTED_OPTIMIZERS = ("distributed_fused_adam", "mcore_distributed_optim")
APEX_OPTIM, MCORE_OPTIM = SUPPORTED_OPTIMIZERS
#: Where NeMo reads TransformerConfig fields from: the model node, then (applied last) this.
_RECIPE_NODES = ("", "mcore_customization_config.")


def rule_transformer_engine(ctx: CheckContext) -> None:
    ctx.model.require_true("transformer_engine", "FP8 weights are Transformer Engine tensors")


def rule_fp8_enabled(ctx: CheckContext) -> None:
    ctx.model.require_true("fp8", "FP8 GEMMs are what need the transposed weights")


def rule_fp8_params(ctx: CheckContext) -> None:
    """Also megatron-core's 'fp8_param must be used together with fp8 mode'."""
    ctx.model.require_true("fp8_params", "FP8 weights are what the plugin transposes")


def rule_fp8_format(ctx: CheckContext) -> None:
    """MegatronGPTModel raises 'fp8 enabled but fp8_format (fp8_e4m3 | fp8_hybrid) is not set'."""
    hybrid = ctx.model.bool_or_default("fp8_hybrid", False, "FP8 format E4M3/E5M2")
    e4m3 = ctx.model.bool_or_default("fp8_e4m3", False, "FP8 format E4M3 only")
    if hybrid is False and e4m3 is False:
        ctx.model.add("fp8_hybrid", ctx.model.get("fp8_hybrid"), "True, or fp8_e4m3=True (NeMo "
                      "raises 'fp8 enabled but fp8_format (fp8_e4m3 | fp8_hybrid) is not set')",
                      True)


def rule_fp8_recipe(ctx: CheckContext) -> None:
    """A per-tensor recipe (absent: megatron-core's default, delayed). Any other recipe is not
    supported by this plugin; changing it would change the training numerics, so it is never
    offered as a fix: the way out is training without the plugin (megatron-core 0.12.3 also
    raises 'MXFP8 currently does not support fp8_param')."""
    for node in _RECIPE_NODES:
        key = node + "fp8_recipe"
        recipe = ctx.model.get(key)
        if recipe is ABSENT or recipe in PER_TENSOR_RECIPES:
            continue
        ctx.model.add(key, recipe, "a per-tensor FP8 recipe, one of: "
                      + ", ".join(PER_TENSOR_RECIPES) + f"; fp8_recipe={recipe} is not "
                      "supported by this plugin", fix=f"none that keeps fp8_recipe={recipe}: "
                      "turn the plugin off, or choose a per-tensor recipe yourself (a change "
                      "of the training numerics)")


def rule_transpose_cache(ctx: CheckContext) -> None:
    for node in _RECIPE_NODES:
        key = node + "disable_parameter_transpose_cache"
        if ctx.model.bool_or_default(key, False, "the transpose cache must stay on"):
            ctx.model.add(key, True, "False (with the cache off every microbatch re-transposes "
                          "and nothing is left to align)", False)


def rule_bf16_edge_layers(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 raises 'Delayed scaling does not support first / last layer in
    BF16' (first_last_layers_bf16 with the delayed recipe)."""
    on = ctx.model.bool_or_default("first_last_layers_bf16", False, "keep the first and last "
                                   "layers in BF16")
    recipes = [ctx.model.get(node + "fp8_recipe") for node in _RECIPE_NODES]
    recipe = next((r for r in reversed(recipes) if r is not ABSENT), "delayed")
    if on and recipe == "delayed":
        ctx.model.add("first_last_layers_bf16", True, "False with the delayed FP8 recipe "
                      "(megatron-core raises 'Delayed scaling does not support first / last "
                      "layer in BF16'), or fp8_recipe=tensorwise", False)


def rule_optimizer_name(ctx: CheckContext) -> None:
    name = ctx.model.get("optim.name")
    if name in SUPPORTED_OPTIMIZERS:
        return
    experts = ctx.ep() is not None and ctx.ep() > 1  # NeMo refuses Apex's with EP > 1
    ctx.model.add("optim.name", name, f"{APEX_OPTIM}, or {MCORE_OPTIM} with "
                  "optim.align_param_gather=True (a distributed optimizer that all-gathers "
                  "the FP8 parameters)", MCORE_OPTIM if experts else APEX_OPTIM)


def rule_overlap_param_sync(ctx: CheckContext) -> None:
    ctx.model.require_true("optim.overlap_param_sync",
                           "the param all-gathers the transposes are aligned with")


def rule_overlap_grad_sync(ctx: CheckContext) -> None:
    """NeMo raises 'Must use overlap_param_sync together with overlap_grad_sync'."""
    ctx.model.require_true("optim.overlap_grad_sync", "NeMo requires it with overlap_param_sync")


def rule_align_param_gather(ctx: CheckContext) -> None:
    if ctx.model.get("optim.name") == MCORE_OPTIM:
        ctx.model.require_true("optim.align_param_gather", "with mcore_distributed_optim NeMo "
                               "sets param_sync_func only when it is on")


def rule_apex_current_scaling(ctx: CheckContext) -> None:
    """NeMo 2.3.3's MegatronDistributedFusedAdam with FP8 parameters and current scaling stops
    at its first step ("'Float8CurrentScalingQuantizer' object has no attribute 'scale'"), with
    Transformer Engine 2.20.2 and with or without the plugin (docs/upstream.md)."""
    if ctx.model.get("optim.name") != APEX_OPTIM:
        return
    recipes = [ctx.model.get(node + "fp8_recipe") for node in _RECIPE_NODES]
    recipe = next((r for r in reversed(recipes) if r is not ABSENT), "delayed")
    if recipe == "tensorwise":
        ctx.model.add("fp8_recipe", recipe, "delayed with optim.name=distributed_fused_adam "
                      "(NeMo 2.3.3's distributed Adam fails at its first step on FP8 parameters "
                      "with current scaling: 'Float8CurrentScalingQuantizer' object has no "
                      f"attribute 'scale'), or optim.name={MCORE_OPTIM} with "
                      "optim.align_param_gather=True", "delayed")


def rule_gather_with_optimizer(ctx: CheckContext) -> None:
    """``optim.overlap_param_gather_with_optimizer_step`` (NeMo 2.3.3 passes it to megatron-core's
    ``OptimizerConfig``) is accepted: chunk 0's all-gather is then dispatched by the optimizer
    step and the plugin still builds its transposes at slot 0 (``nemo_fp8_align/sync/mcore.py``). NeMo's own
    constraints with it (``overlap_param_sync``, VP > 1) are the plugin's too, reported by their
    rules; only a value that is not a boolean is reported here."""
    ctx.model.bool_or_default("optim.overlap_param_gather_with_optimizer_step", False,
                              "whether the optimizer step launches the first all-gather")
