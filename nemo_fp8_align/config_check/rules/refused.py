"""Settings megatron-core has and the plugin refuses at attach (the table in
``nemo_fp8_align/integrations/refusals.py``), read from NeMo's model config, which NeMo passes
through to ``TransformerConfig``."""

from __future__ import annotations

from nemo_fp8_align.config_check.context import CheckContext

__all__ = ["rule_combined_1f1b", "rule_whole_step_graphs"]


def rule_combined_1f1b(ctx: CheckContext) -> None:
    """``overlap_moe_expert_parallel_comm`` (megatron-core >= 0.16 read): the combined 1F1B
    schedule never calls the model chunk, so the plugin's hooks never run."""
    key = "overlap_moe_expert_parallel_comm"
    if ctx.model.bool_or_default(key, False, "whether the combined 1F1B schedule runs"):
        ctx.model.add(key, True, "False (the combined 1F1B schedule runs the layers through its "
                      "own schedule plan: the model chunk's forward hooks, which the plugin "
                      "counts and aligns by, never run)", False)


def rule_whole_step_graphs(ctx: CheckContext) -> None:
    """Whole-step CUDA graphs: ``cuda_graph_impl=full_iteration`` (megatron-core >= 0.18) or
    ``full_iteration`` in ``cuda_graph_scope`` (<= 0.17): replays run no Python hook."""
    if ctx.model.get("cuda_graph_impl") == "full_iteration":
        ctx.model.add("cuda_graph_impl", "full_iteration", "local or transformer_engine "
                      "(per-layer graphs; a whole-step replay runs none of the plugin's hooks)",
                      "transformer_engine")
    scope = ctx.model.get("cuda_graph_scope")
    names = list(scope) if hasattr(scope, "__iter__") and not isinstance(scope, str) else [scope]
    if "full_iteration" in names:
        ctx.model.add("cuda_graph_scope", scope, "a per-layer scope without full_iteration (a "
                      "whole-step replay runs none of the plugin's hooks)", "full")
