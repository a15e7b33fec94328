"""Startup-check rules on FP8 and the optimizer: the settings the plugin itself needs, and what
NeMo 2.3.3 / megatron-core 0.12.3 enforce on them. One function per rule, ``rule(ctx) -> None``.
"""

from __future__ import annotations

from typing import Any

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED
from nemo_fp8_align.config_check.recipes import SETTINGS, findings, judged_at

__all__ = ["APEX_OPTIM", "MCORE_OPTIM", "PER_TENSOR_RECIPES", "RECIPE_NODES",
           "SUPPORTED_OPTIMIZERS",
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
RECIPE_NODES = ("", "mcore_customization_config.")


def rule_transformer_engine(ctx: CheckContext) -> None:
    ctx.model.require_true("transformer_engine", "FP8 weights are Transformer Engine tensors")


def rule_fp8_enabled(ctx: CheckContext) -> None:
    ctx.model.require_true("fp8", "FP8 GEMMs are what need the transposed weights")


def rule_fp8_params(ctx: CheckContext) -> None:
    """Also megatron-core's 'fp8_param must be used together with fp8 mode'. Megatron-LM with
    megatron-core before 0.9 has no FP8 parameters for the plugin (rules/version.py says so:
    asking for the flag would be no fix)."""
    if not ctx.nemo and ctx.mcore is not None and not ctx.mcore.fp8_param_gather:
        return
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
    """The recipe rows of :mod:`nemo_fp8_align.config_check.recipes` (the table both modes
    share) on NeMo's keys, for the megatron-core checked against (NeMo 2.3.3 runs 0.12.3):
    per-tensor recipes are
    aligned; any other is "not supported by this plugin" with the plugin's off switch as the
    way out (a recipe change would change the training numerics, so it is never the fix); and
    the combinations megatron-core rejects. Megatron-LM mode runs the same rows on its flags
    (megatron_lm_rules)."""
    if not ctx.nemo:
        return
    for node in RECIPE_NODES:
        q = {name: _value(ctx, node + s.nemo) for name, s in SETTINGS.items()}
        # NeMo's switch (fp8_hybrid / fp8_e4m3 give the format); the plugin needs FP8 or FP4,
        # so the recipe is judged as if it were on (rule_fp8_enabled asks for it)
        q["fp8"] = _value(ctx, "fp8") or not q["fp4"]
        for f in findings(q, judged_at(ctx.mcore), megatron_lm=False):
            key = node + SETTINGS[f.setting].nemo
            found, why = ctx.model.get(key), _spelt(f.why, node)
            if f.fix[0] == "off":
                ctx.model.add(key, found, why, fix=f"none that keeps "
                              f"{SETTINGS[f.setting].nemo}={found}: turn the plugin off")
            elif f.fix[0] == "manual":
                ctx.model.add(key, found, why, fix=_spelt(f.fix[1], node))
            elif f.fix[0] == "drop":
                ctx.model.add(node + SETTINGS[f.fix[1]].nemo, found, why, False)
            else:
                target = node + SETTINGS[f.fix[1]].nemo
                ctx.model.add(key, found, why, fix=ctx.model.override(
                    target, f.fix[2], present=ctx.model.get(target) is not ABSENT))


def _value(ctx: CheckContext, key: str) -> Any:
    value = ctx.model.get(key)
    return None if value is ABSENT or value is UNRESOLVED else value


def _spelt(text: str, node: str) -> str:
    return text.format(**{name: node + s.nemo for name, s in SETTINGS.items()})


def rule_transpose_cache(ctx: CheckContext) -> None:
    for node in RECIPE_NODES:
        key = node + "disable_parameter_transpose_cache"
        if ctx.model.bool_or_default(key, False, "the transpose cache must stay on"):
            ctx.model.add(key, True, "False (with the cache off every microbatch re-transposes "
                          "and nothing is left to align)", False)


def rule_bf16_edge_layers(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 raises 'Delayed scaling does not support first / last layer in
    BF16' (first_last_layers_bf16 with the delayed recipe)."""
    on = ctx.model.bool_or_default("first_last_layers_bf16", False, "keep the first and last "
                                   "layers in BF16")
    recipes = [ctx.model.get(node + "fp8_recipe") for node in RECIPE_NODES]
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
    if ctx.mcore is not None and ctx.mcore.optimizer_owns_gather:  # no NeMo path for MCORE_OPTIM
        ctx.model.add("optim.name", name, f"{APEX_OPTIM} (a distributed optimizer that "
                      "all-gathers the FP8 parameters; the plugin's NeMo path with megatron-core "
                      f"{ctx.mcore.version} has no other)", fix=(
                          f"none with expert parallelism on megatron-core {ctx.mcore.version} "
                          "(NeMo refuses Apex's optimizer with EP > 1): megatron-core >= 0.9.0"
                          if experts else ctx.model.override("optim.name", APEX_OPTIM,
                                                             present=name is not ABSENT)))
        return
    ctx.model.add("optim.name", name, f"{APEX_OPTIM}, or {MCORE_OPTIM} with "
                  "optim.align_param_gather=True (a distributed optimizer that all-gathers "
                  "the FP8 parameters)", MCORE_OPTIM if experts else APEX_OPTIM)


def rule_overlap_param_sync(ctx: CheckContext) -> None:
    ctx.model.require_true("optim.overlap_param_sync",
                           "the param all-gathers the transposes are aligned with")


def rule_overlap_grad_sync(ctx: CheckContext) -> None:
    """NeMo raises 'Must use overlap_param_sync together with overlap_grad_sync'; Megatron-LM
    0.19.2's validate_args asserts the same in its own words."""
    why = ("NeMo requires it with overlap_param_sync" if ctx.nemo else "Megatron-LM asserts "
           "'Must use --overlap-param-gather with --overlap-grad-reduce'")
    ctx.model.require_true("optim.overlap_grad_sync", why)


def rule_align_param_gather(ctx: CheckContext) -> None:
    """Without it nobody binds ``config.param_sync_func``: the all-gathers then start from DDP's
    forward pre-hooks at each chunk's first use, and no schedule slot launches them."""
    if ctx.model.get("optim.name") == MCORE_OPTIM:
        ctx.model.require_true("optim.align_param_gather", (
            "with mcore_distributed_optim NeMo sets param_sync_func only when it is on"
            if ctx.nemo else "Megatron-LM's train() binds config.param_sync_func only when it "
            "is on, with --overlap-param-gather"))


def rule_apex_current_scaling(ctx: CheckContext) -> None:
    """NeMo 2.3.3's MegatronDistributedFusedAdam with FP8 parameters and current scaling stops
    at its first step ("'Float8CurrentScalingQuantizer' object has no attribute 'scale'"), with
    Transformer Engine 2.20.2 and with or without the plugin (docs/upstream.md)."""
    if ctx.model.get("optim.name") != APEX_OPTIM or (ctx.mcore is not None
                                                     and not ctx.mcore.fp8_recipe):
        return  # no tensorwise before 0.12 (rules/version.py)
    recipes = [ctx.model.get(node + "fp8_recipe") for node in RECIPE_NODES]
    recipe = next((r for r in reversed(recipes) if r is not ABSENT), "delayed")
    if recipe == "tensorwise":
        # the recipe is the user's (the training numerics): the fix is the optimizer, which
        # the plugin supports either way (its rule then asks for align_param_gather)
        ctx.model.add("optim.name", APEX_OPTIM, f"{MCORE_OPTIM} with fp8_recipe=tensorwise "
                      "(NeMo 2.3.3's distributed Adam fails at its first step on FP8 parameters "
                      "with current scaling: 'Float8CurrentScalingQuantizer' object has no "
                      f"attribute 'scale'), with optim.align_param_gather=True", MCORE_OPTIM)


def rule_gather_with_optimizer(ctx: CheckContext) -> None:
    """``optim.overlap_param_gather_with_optimizer_step`` (NeMo 2.3.3 passes it to megatron-core's
    ``OptimizerConfig``) is accepted: chunk 0's all-gather is then dispatched by the optimizer
    step and the plugin still builds its transposes at slot 0 (``nemo_fp8_align/adapters/mcore_ddp.py``). NeMo's own
    constraints with it (``overlap_param_sync``, VP > 1) are the plugin's too, reported by their
    rules; only a value that is not a boolean is reported here."""
    ctx.model.bool_or_default("optim.overlap_param_gather_with_optimizer_step", False,
                              "whether the optimizer step launches the first all-gather")
