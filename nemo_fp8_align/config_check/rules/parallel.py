"""Startup-check rules on model parallelism: sizes, trainer precision, expert parallelism (the
layer split is in :mod:`nemo_fp8_align.config_check.rules.split`). Each rule is one function ``rule(ctx) -> None`` that records its
violations on ``ctx``; where NeMo 2.3.3 or megatron-core 0.12.3 / 0.16.1 enforce it is said in
the rule's docstring and in its message.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from nemo_fp8_align.config_check.context import CheckContext, FixRequest
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED, Reader
from nemo_fp8_align.config_check.rules.split import divisors, layer_split_error

__all__ = ["divisors", "expert_parallel_fix", "layer_split_error", "rule_cpu_offloading",
           "rule_expert_parallel", "rule_megatron_amp_o2",
           "rule_other_parallel_sizes", "rule_pipeline_size", "rule_precision",
           "rule_virtual_pipeline_size"]

#: trainer.precision values NeMo's Float16Module (megatron_amp_O2) accepts.
_HALF_PRECISIONS: Tuple[Any, ...] = (16, "16", "16-mixed", "bf16", "bf16-mixed")
#: ...and the full-precision ones NeMo parses (rejected under megatron_amp_O2).
_FULL_PRECISIONS: Tuple[Any, ...] = (32, "32", "32-true")


def rule_pipeline_size(ctx: CheckContext) -> None:
    """The plugin aligns transposes across pipeline ranks: PP >= 2."""
    ctx.model.int_at_least("pipeline_model_parallel_size", 2,
                           "pipeline ranks; the plugin aligns transposes across them")


def rule_virtual_pipeline_size(ctx: CheckContext) -> None:
    """Interleaving: VP >= 2 (NeMo turns 1 into None, no interleaving); the fix without the
    search is VP 2. The command line's fixer may give a layout instead: a Megatron-LM layout
    string (or hybrid pattern) of one stage per rank kept at a smaller PP, or the VP above 2 the
    layout search picks (:mod:`..fix_search`)."""
    why = "model chunks per pipeline rank; 1 or null turns interleaving off"
    if ctx.searched(FixRequest("virtual_pipeline_size", None, why)):
        return
    ctx.model.int_at_least("virtual_pipeline_model_parallel_size", 2, why)


def rule_cpu_offloading(ctx: CheckContext) -> None:
    """megatron-core's TransformerConfig (0.12.3 to 0.19.2) raises with CPU offloading and
    PP > 1. The plugin needs PP >= 2, so the only fix that keeps it is CPU offloading off."""
    pp = ctx.pp()
    if ctx.model.get("cpu_offloading") is True and pp is not None and pp > 1:
        ctx.model.add("cpu_offloading", True, f"False with pipeline_model_parallel_size = {pp} "
                      "(megatron-core raises 'Currently there is no support for Pipeline "
                      "parallelism with CPU offloading'; the plugin needs PP >= 2)", False)


def rule_other_parallel_sizes(ctx: CheckContext) -> None:
    """TP, CP, EP: ints >= 1 when set (NeMo's default 1); expert TP: null (= TP) or >= 1."""
    for key, what in (("tensor_model_parallel_size", "tensor-parallel ranks"),
                      ("context_parallel_size", "context-parallel ranks"),
                      ("expert_model_parallel_size", "expert-parallel ranks")):
        ctx.model.int_at_least(key, 1, f"{what}; NeMo's default is 1", default=1)
    ctx.model.optional_int("expert_tensor_parallel_size", 1,
                           "expert tensor-parallel ranks; null means TP")


def rule_megatron_amp_o2(ctx: CheckContext) -> None:
    """MegatronGPTModel raises without O2 for VP (and for expert parallelism)."""
    ctx.model.require_true("megatron_amp_O2", "NeMo builds interleaved pipelines only with O2")


def rule_precision(ctx: CheckContext) -> None:
    """trainer.precision (and model.precision, which NeMo fills from it when null) must be one
    NeMo parses, and a half precision: O2's Float16Module rejects 32."""
    readers: List[Tuple[Optional[Reader], str]] = [(ctx.trainer, "trainer"), (ctx.model, "model")]
    for reader, owner in readers:
        if reader is None:
            continue
        value = reader.get("precision")
        if owner == "model" and (value is ABSENT or value is None):
            continue  # NeMo copies trainer.precision into it
        if _one_of(value, _HALF_PRECISIONS) or value is UNRESOLVED:
            continue
        if value is ABSENT:
            why = "Lightning's default is 32-true, which O2's Float16Module rejects"
        elif _one_of(value, _FULL_PRECISIONS):
            why = ("megatron_amp_O2, which interleaving needs, wraps the model in Float16Module, "
                   "which supports only 16 and bf16")
        else:
            why = "NeMo raises 'Could not parse the precision' for anything else"
        reader.add("precision", value, "one of 16, 16-mixed, bf16, bf16-mixed (" + why + ")",
                   "bf16-mixed")


def _one_of(value: Any, choices: Tuple[Any, ...]) -> bool:
    return any(type(value) is type(c) and value == c for c in choices)


# ---------------------------------------------------------------------------------------------
# Expert parallelism


def expert_parallel_fix(ctx: CheckContext) -> int:
    """The largest EP below the current one that both EP rules accept: a divisor of
    num_moe_experts (when set) with expert TP * EP * PP dividing the world size (when known).
    One answer for both rules, so their fixes never chase each other (6 -> 4 -> 3 -> 2)."""
    ep, etp, pp, world = ctx.ep() or 1, ctx.etp(), ctx.pp(), ctx.world()
    experts = ctx.model.get("num_moe_experts")
    fits = [d for d in range(ep, 0, -1)
            if (not (type(experts) is int and experts >= 1) or experts % d == 0)
            and (world is None or etp is None or pp is None or world % (etp * d * pp) == 0)]
    return fits[0] if fits else 1


def rule_expert_parallel(ctx: CheckContext) -> None:
    """With expert_model_parallel_size > 1: NeMo 2.3.3 rejects the Apex distributed optimizer;
    megatron-core needs num_moe_experts, a multiple of EP (MoELayer asserts it), and sequence
    parallelism when TP > 1 (ModelParallelConfig raises)."""
    ep, tp = ctx.ep(), ctx.tp()
    if ep is None or ep == 1:
        return
    name = ctx.model.get("optim.name")
    if name == "distributed_fused_adam":
        ctx.model.add("optim.name", name, "mcore_distributed_optim with "
                      f"expert_model_parallel_size = {ep} (NeMo raises 'Expert parallelism is "
                      "currently not supporting Apex distributed optimizer')",
                      "mcore_distributed_optim")
    experts = ctx.model.get("num_moe_experts")
    if not (type(experts) is int and experts >= 1):
        # The expert count is the model's; with none, expert parallelism is what is wrong.
        ctx.model.add("expert_model_parallel_size", ep, "1 when num_moe_experts is not set "
                      f"(found {experts!r}; megatron-core raises 'num_moe_experts must be non "
                      "None to use expert-parallel'); a MoE model sets num_moe_experts, a "
                      "multiple of EP", 1)
    elif experts % ep:
        ctx.model.add("expert_model_parallel_size", ep, f"a divisor of num_moe_experts = "
                      f"{experts} (megatron-core's MoELayer asserts it)", expert_parallel_fix(ctx))
    if tp is not None and tp > 1 and ctx.model.get("sequence_parallel") is not True:
        ctx.model.add("sequence_parallel", ctx.model.get("sequence_parallel"),
                      f"True with expert parallelism and TP = {tp} (megatron-core raises 'When "
                      "using expert parallelism and tensor parallelism, sequence parallelism "
                      "must be used')", True)
