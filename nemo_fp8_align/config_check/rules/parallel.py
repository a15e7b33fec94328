"""Startup-check rules on model parallelism: sizes, how the layers split over the pipeline, trainer
precision, expert parallelism. Each rule is one function ``rule(ctx) -> None`` that records its
violations on ``ctx``; where NeMo 2.3.3 or megatron-core 0.12.3 / 0.16.1 enforce it is said in
the rule's docstring and in its message.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED, Reader

__all__ = ["divisors", "layer_split_error", "rule_expert_parallel", "rule_layer_split",
           "rule_megatron_amp_o2", "rule_num_layers", "rule_other_parallel_sizes",
           "rule_pipeline_size", "rule_precision", "rule_split_option_values",
           "rule_split_options_exclusive", "rule_virtual_pipeline_size"]

_FIRST, _LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
_EMB, _LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
#: trainer.precision values NeMo's Float16Module (megatron_amp_O2) accepts.
_HALF_PRECISIONS: Tuple[Any, ...] = (16, "16", "16-mixed", "bf16", "bf16-mixed")
#: ...and the full-precision ones NeMo parses (rejected under megatron_amp_O2).
_FULL_PRECISIONS: Tuple[Any, ...] = (32, "32", "32-true")


def rule_pipeline_size(ctx: CheckContext) -> None:
    """The plugin aligns transposes across pipeline ranks: PP >= 2."""
    ctx.model.int_at_least("pipeline_model_parallel_size", 2,
                           "pipeline ranks; the plugin aligns transposes across them")


def rule_virtual_pipeline_size(ctx: CheckContext) -> None:
    """Interleaving: VP >= 2 (NeMo turns 1 into None, no interleaving)."""
    ctx.model.int_at_least("virtual_pipeline_model_parallel_size", 2,
                           "model chunks per pipeline rank; 1 or null turns interleaving off")


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
# Layer splits


def rule_num_layers(ctx: CheckContext) -> None:
    """NeMo reads cfg.num_layers unconditionally."""
    layers = ctx.model.get("num_layers")
    if type(layers) is int and layers >= 1:
        return
    pp, vp = ctx.pp(), ctx.vp()
    fix = pp * vp if pp and vp else "<the model's layer count>"
    if isinstance(layers, str) and layers.strip().isdigit() and int(layers) >= 1:
        fix = int(layers)  # right number, wrong type
    ctx.model.add("num_layers", layers, "an int >= 1 (transformer layers)", fix)


def rule_split_option_values(ctx: CheckContext) -> None:
    """first/last stage layer counts: null or > 0 (megatron-core raises 'must be larger than
    0'); the account_for_* flags: bools; pipeline_model_parallel_layout: not read by NeMo
    2.3.3 (megatron-core 0.12.3 has no such field, so NeMo would split evenly)."""
    for key in (_FIRST, _LAST):
        ctx.model.optional_int(key, 1, "layers on that pipeline stage; megatron-core raises for "
                               "0 or less")
    for key in (_EMB, _LOSS):
        ctx.model.bool_or_default(key, False, "count the stage as one layer in the split")
    layout = ctx.model.get("pipeline_model_parallel_layout")
    if layout is not ABSENT and layout is not None:
        ctx.model.add("pipeline_model_parallel_layout", layout,
                      "no such setting in NeMo 2.3.3 (megatron-core 0.12.3's TransformerConfig "
                      "has no pipeline_model_parallel_layout, so NeMo drops it and splits the "
                      f"layers evenly; use {_FIRST} / {_LAST})",
                      fix="~model.pipeline_model_parallel_layout")


def rule_split_options_exclusive(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 and 0.16.1 raise when uneven first/last stages are combined with an
    account_for_* flag."""
    split = _split(ctx)
    if split is None:
        return
    _layers, _pp, _vp, first, last, emb, loss = split
    if (first is not None or last is not None) and (emb or loss):
        key = _FIRST if first is not None else _LAST
        ctx.model.add(key, first if first is not None else last,
                      f"null when {_EMB} or {_LOSS} is True (megatron-core raises: the two "
                      "ways of splitting the pipeline cannot be combined)", None)


def rule_layer_split(ctx: CheckContext) -> None:
    """megatron-core's split (TransformerConfig.__post_init__ and get_num_layers_to_build, the
    same in 0.12.3 and 0.16.1) and NeMo 2.3.3's own checks (MegatronBaseModel asserts
    (num_layers // PP) % VP == 0 unless both account_for_* flags are set; its
    build_transformer_config divides by the middle stage count)."""
    split = _split(ctx)
    if split is None:
        return
    layers, pp, vp, first, last, emb, loss = split
    if (first is not None or last is not None) and (emb or loss):
        return  # rule_split_options_exclusive
    for key, value in ((_FIRST, first), (_LAST, last)):
        if value is not None and vp is not None and value % vp:
            ctx.model.add(key, value, f"a multiple of VP = {vp} (megatron-core: every model "
                          "chunk of that stage holds the same number of layers)",
                          -(-value // vp) * vp)
    error = layer_split_error(layers, pp, vp, first, last, emb, loss)
    if error is None:
        return
    key, why = error
    vp_fix = _vp_fix(layers, pp, vp, first, last, emb, loss) if key == "vp" else None
    if key == _LAST:
        ctx.model.add(_LAST, last, why, None)
    elif vp_fix is not None:
        ctx.model.add("virtual_pipeline_model_parallel_size", vp, why, vp_fix)
    else:  # no VP fits these layers: the layer count is what to change
        fix = _num_layers_fix(layers, pp, vp, first, last, emb, loss)
        if fix is None and vp and emb != loss:
            # num_layers + 1 = k * PP * VP makes (num_layers // PP) % VP = VP - 1, always: NeMo
            # 2.3.3 rejects every layer count with exactly one account_for_* flag and VP >= 2.
            on, off = (_EMB, _LOSS) if emb else (_LOSS, _EMB)
            why += (f"; with only {on} set and VP >= 2 no num_layers passes both megatron-core's "
                    "split and NeMo's assertion")
            fix = (f"++model.{off}=True (then num_layers + 2 a multiple of PP * VP), or "
                   f"model.{on}=False")
        if key == "vp":
            why = why.replace("a divisor of", f"layers where VP = {vp} divides", 1)
        if fix is None:
            fix = "<a num_layers that splits evenly>"
        ctx.model.add("num_layers", layers, why, fix,
                      fix=fix if isinstance(fix, str) and fix.startswith("++") else None)


def layer_split_error(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                      last: Optional[int], emb: bool, loss: bool) -> Optional[Tuple[str, str]]:
    """(key to blame, why) for the first split rule that fails, or None when NeMo 2.3.3 and
    megatron-core accept the split. First/last counts not divisible by VP are left to the
    caller."""
    chunks = vp or 1
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = layers - (first or 0) - (last or 0)
        if middle_stages <= 0:
            return _LAST, (f"null: with PP = {pp} no middle pipeline stage is left, and NeMo "
                           "2.3.3 divides the remaining layers by the middle stage count "
                           "(ZeroDivisionError)")
        if middle <= 0 or middle % (middle_stages * chunks):
            return "num_layers", (
                f"num_layers - first - last = {middle} > 0 and a multiple of the middle stages"
                f" {middle_stages}" + (f" * VP {vp}" if vp else "") + " (megatron-core and "
                "NeMo: every middle stage, and every chunk on it, holds the same number)")
    else:
        total = layers + emb + loss
        counted = " + 1 (embedding)" * emb + " + 1 (loss)" * loss
        if total % pp:
            return "num_layers", (f"num_layers{counted} = {total} divisible by PP = {pp} "
                                  "(megatron-core asserts it)")
        if vp and (total // pp) % vp:
            return "vp", (f"a divisor of the layers per pipeline rank, {total} // PP {pp} = "
                          f"{total // pp} (megatron-core and NeMo: every model chunk holds the "
                          "same number of layers)")
    if vp and not (emb and loss) and (layers // pp) % vp:
        return "vp", (f"a divisor of num_layers // PP = {layers} // {pp} = {layers // pp}: NeMo "
                      "2.3.3 asserts it ('the number of model chunks is the same across all "
                      "pipeline stages') unless both account_for_* flags are set")
    return None


def _split(ctx: CheckContext) -> Optional[Tuple[Any, ...]]:
    """(layers, pp, vp, first, last, emb, loss) when all are valid (else None: reported by
    the rules that own them)."""
    layers, pp = ctx.model.peek_int("num_layers"), ctx.pp()
    raw_vp = ctx.model.get("virtual_pipeline_model_parallel_size")
    vp = ctx.vp()
    if layers is None or pp is None or (raw_vp not in (ABSENT, None, 1) and vp is None):
        return None
    values: List[Any] = []
    for key in (_FIRST, _LAST):
        value = ctx.model.get(key)
        value = None if value is ABSENT else value
        if value is not None and not (type(value) is int and value >= 1):
            return None
        values.append(value)
    for key in (_EMB, _LOSS):
        value = ctx.model.get(key)
        value = False if value is ABSENT else value
        if not isinstance(value, bool):
            return None
        values.append(value)
    return (layers, pp, vp, *values)


def _num_layers_fix(layers: int, pp: int, vp: Optional[int], *rest: Any) -> Any:
    return _first_valid(range(layers + 1, layers + 1 + 4 * pp * (vp or 1)),
                        lambda n: layer_split_error(n, pp, vp, *rest) is None, None)


def _vp_fix(layers: int, pp: int, vp: Optional[int], *rest: Any) -> Optional[int]:
    """The VP >= 2 nearest the current one that splits these layers, or None."""
    per_rank = max(layers // pp, 1)
    candidates = sorted(divisors(per_rank), key=lambda d: (abs(d - (vp or 2)), d))
    found = _first_valid([d for d in candidates if d >= 2],
                         lambda d: layer_split_error(layers, pp, d, *rest) is None, None)
    return found


def _first_valid(candidates: Any, ok: Callable[[Any], bool], otherwise: Any) -> Any:
    for count, candidate in enumerate(candidates):
        if count >= 10_000:
            break  # huge sizes: do not search forever for a suggestion
        if ok(candidate):
            return candidate
    return otherwise


def divisors(n: int) -> List[int]:
    small = [d for d in range(1, min(int(n ** 0.5), 10_000) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# ---------------------------------------------------------------------------------------------
# Expert parallelism


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
        ctx.model.add("num_moe_experts", experts, f"an int >= 1, a multiple of EP = {ep} "
                      "(megatron-core raises 'num_moe_experts must be non None to use "
                      "expert-parallel')", ep)
    elif experts % ep:
        fix = max(d for d in divisors(experts) if d <= ep)
        ctx.model.add("expert_model_parallel_size", ep, f"a divisor of num_moe_experts = "
                      f"{experts} (megatron-core's MoELayer asserts it)", fix)
    if tp is not None and tp > 1 and ctx.model.get("sequence_parallel") is not True:
        ctx.model.add("sequence_parallel", ctx.model.get("sequence_parallel"),
                      f"True with expert parallelism and TP = {tp} (megatron-core raises 'When "
                      "using expert parallelism and tensor parallelism, sequence parallelism "
                      "must be used')", True)
