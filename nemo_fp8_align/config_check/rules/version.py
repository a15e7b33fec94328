"""Startup-check rules of the megatron-core version checked against (``check --megatron-core
X.Y``, by default the importable one): what that version itself forbids, and the options it
does not have, which are reported and never suggested as a fix. The facts are
:class:`~nemo_fp8_align.mcore_versions.VersionRules` (the demo's rules too); the
pre-0.10 schedule rule (M a multiple of PP) runs in :func:`.batch.rule_microbatches` and the
layout search (:mod:`..layout`), which also keep within the version's options. Without a
version (megatron-core not installed and none named) nothing here runs.
"""

from __future__ import annotations

from typing import Any

from nemo_fp8_align.config_check.context import CheckContext, FixRequest
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED
from nemo_fp8_align.config_check.rules.fp8 import APEX_OPTIM, MCORE_OPTIM, RECIPE_NODES
from nemo_fp8_align.mcore_versions import FP8_PARAMS_WHY, nemo_optimizer_owned_problem

__all__ = ["rule_interleaved_pipeline_size", "rule_version_optimizer", "rule_version_options"]


def _given(value: Any) -> bool:
    return value is not ABSENT and value is not None and value is not UNRESOLVED


def rule_interleaved_pipeline_size(ctx: CheckContext) -> None:
    """megatron-core 0.7.0's ``initialize_model_parallel``: interleaving needs PP > 2. The
    command line's fix is the nearest layout with such a PP (the model, the batch and the nodes
    kept); without the search, the rule it must satisfy."""
    pp, vp = ctx.pp(), ctx.vp()
    if ctx.mcore is None or pp is None or pp < 2 or vp is None:
        return
    rule = ctx.mcore.interleaved_pp_rule(pp)
    if rule is None:
        return
    least = ctx.mcore.min_interleaved_pp
    why = f"PP >= {least} with virtual_pipeline_model_parallel_size={vp}: {rule}"
    ctx.request_fix(FixRequest("interleaved_pipeline_size", ctx.model.violation(
        "pipeline_model_parallel_size", pp, why, fix=(
            f"a PP >= {least} that divides the layers and the world ({ctx.search_command()} "
            "proposes a layout that fits), or megatron-core >= 0.8.0")), why))


def rule_version_options(ctx: CheckContext) -> None:
    """Options the version does not have, where the config sets them: N (0.10 on), the
    first/last stage layer counts (NeMo's key 0.11 on, Megatron-LM's flag 0.9 on), the
    accounting flags (0.11 on), ``fp8_recipe`` (0.12 on), a layout string (0.13 on), the
    optimizer step's all-gather (0.9 on), and, with megatron-core's optimizer before 0.9,
    Transformer Engine FP8 parameters (the engine refuses them there)."""
    rules = ctx.mcore
    if rules is None:
        return
    m = ctx.model
    if rules.legacy_order and _given(m.get("microbatch_group_size_per_vp_stage")):
        m.add("microbatch_group_size_per_vp_stage", m.get("microbatch_group_size_per_vp_stage"),
              f"no value: {rules.lacks('microbatch_group_size_per_vp_stage')} (0.10 on); its "
              "interleaved schedule runs forwards in groups of PP", None)
    if not ctx.has_stage_split():
        named = (f"; megatron-core {rules.version} calls it {rules.first_stage_field}, a name "
                 "the check does not read" if rules.first_stage_field and ctx.nemo else "")
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if _given(m.get(key)):
                m.add(key, m.get(key), f"no value: {rules.lacks(key)} (the layers split evenly "
                      f"over the pipeline){named}", None)
    if not rules.split_accounting:
        for key in ("account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split"):
            if m.get(key) is True:
                m.add(key, True, f"False: {rules.lacks(key)} (0.11 on)", False)
    if not rules.fp8_recipe:
        for key in (node + "fp8_recipe" for node in RECIPE_NODES):
            value = m.get(key)
            if _given(value) and value != "delayed":
                m.add(key, value, f"delayed: {rules.lacks('fp8_recipe')} (0.12 on), only delayed "
                      "scaling", fix=f"none on megatron-core {rules.version} that keeps the "
                      f"{value} recipe: megatron-core >= 0.12.0, or delayed scaling (other "
                      "numerics)")
    if not rules.layout_string and not ctx.nemo and _given(
            m.get("pipeline_model_parallel_layout")):
        m.add("pipeline_model_parallel_layout", m.get("pipeline_model_parallel_layout"),
              f"no layout string: {rules.lacks('pipeline_model_parallel_layout')} (0.13 on)",
              fix="by hand: the model chunks with --num-layers-per-virtual-pipeline-stage and "
              "an even split (drop --pipeline-model-parallel-layout)")
    key = "optim.overlap_param_gather_with_optimizer_step"
    if not rules.optimizer_step_gather and m.get(key) is True:
        m.add(key, True, f"False: {rules.lacks('overlap_param_gather_with_optimizer_step')} "
              "(0.9 on; before it the DistributedOptimizer chains the all-gathers itself)", False)
    if rules.optimizer_owns_gather and not ctx.nemo:
        m.add("fp8_params", m.get("fp8_params"), f"FP8 parameters the plugin can align, which "
              f"megatron-core {rules.version}'s optimizer cannot give: Transformer Engine FP8 "
              f"parameters, {FP8_PARAMS_WHY}", fix=f"none on megatron-core {rules.version}: "
              "megatron-core >= 0.9.0 (with --fp8-param-gather)")


def rule_version_optimizer(ctx: CheckContext) -> None:
    """NeMo's ``mcore_distributed_optim`` on 0.7/0.8: refused as the plugin's NeMo path
    refuses it (the optimizer owns the all-gather); Apex's optimizer is the fix."""
    rules = ctx.mcore
    if rules is None or not rules.optimizer_owns_gather or not ctx.nemo:
        return
    name = ctx.model.get("optim.name")
    if name == MCORE_OPTIM:
        ctx.model.add("optim.name", name, nemo_optimizer_owned_problem(rules.version), APEX_OPTIM)
