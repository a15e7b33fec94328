"""Startup-check rules on how the layers split over the pipeline: megatron-core's split (the same
in 0.12.3 and 0.16.1) under every split option (even, ``num_layers_in_first/last_pipeline_stage``,
``account_for_embedding/loss_in_pipeline_split``) and NeMo 2.3.3's own chunk assertion
(:func:`layer_split_error`, the verdict, which the layout search also asks).

A split that fails is a violation and a fix request (:class:`~..context.FixRequest`): the fix
that keeps the model is a search over the parallel layout, which only the command line's fixer
runs (:mod:`..fix_search`: PP, VP, the first/last split, never ``num_layers`` unless no layout
fits, and not while the world size changes). Without it (the runtime's startup check) the fix
names the settings that make the split hold and the command that proposes a layout.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from nemo_fp8_align.config_check.context import CheckContext, FixRequest
from nemo_fp8_align.config_check.reader import ABSENT

__all__ = ["divisors", "layer_split_error", "rule_layer_split",
           "rule_num_layers", "rule_split_option_values", "rule_split_options_exclusive"]

_FIRST, _LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
_EMB, _LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"


# ---------------------------------------------------------------------------------------------
# Layer splits


def rule_num_layers(ctx: CheckContext) -> None:
    """NeMo reads cfg.num_layers unconditionally. A missing or unusable count is the model's to
    give: the fix never invents one (PP * VP would pass the check and build another model)."""
    layers = ctx.model.get("num_layers")
    if type(layers) is int and layers >= 1:
        return
    fix: Any = "<the model's layer count>"
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
    if layout is not ABSENT and layout is not None and ctx.nemo:
        ctx.model.add("pipeline_model_parallel_layout", layout,
                      "no such setting in NeMo 2.3.3 (megatron-core 0.12.3's TransformerConfig "
                      "has no pipeline_model_parallel_layout, so NeMo drops it and splits the "
                      f"layers evenly; use {_FIRST} / {_LAST})",
                      fix="~model.pipeline_model_parallel_layout")


def rule_split_options_exclusive(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 and 0.16.1 raise when uneven first/last stages are combined with an
    account_for_* flag."""
    split = _split(ctx)
    if split is None or ctx.layout_string():
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
    if split is None or ctx.layout_string():
        return  # Megatron-LM's layout string gives the split (megatron_lm_rules checks it)
    layers, pp, vp, first, last, emb, loss = split
    if (first is not None or last is not None) and (emb or loss):
        return  # rule_split_options_exclusive
    for key, value in ((_FIRST, first), (_LAST, last)):
        if value is not None and vp is not None and value % vp:
            # without the search: the count rounded up to a multiple of VP
            ctx.request_fix(FixRequest("stage_multiple", ctx.model.violation(
                key, value, f"a multiple of VP = {vp} ({key} with "
                "virtual_pipeline_model_parallel_size: megatron-core builds every model chunk of "
                "that stage with the same number of layers)", -(-value // vp) * vp)))
    error = layer_split_error(layers, pp, vp, first, last, emb, loss, ctx.nemo)
    if error is None:
        return
    key, why = error
    blamed = {"vp": "virtual_pipeline_model_parallel_size", _LAST: _LAST}.get(key, "num_layers")
    if key == _LAST:  # no middle stage: without the search, the last stage's count dropped
        unsearched = ctx.model.violation(_LAST, last, why, None)
    else:
        unsearched = ctx.model.violation(blamed, ctx.model.get(blamed), why, fix=(
            "PP, VP or the first/last stage's layer counts such that every pipeline stage, and "
            f"every model chunk on it, holds the same number of layers: {ctx.search_command()} "
            "proposes a layout that fits, the model and the batch kept"))
    ctx.request_fix(FixRequest("layer_split", unsearched, why,
                               {"key": key, "blamed": blamed, "split": split}))


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


def layer_split_error(layers: int, pp: int, vp: Optional[int], first: Optional[int],
                      last: Optional[int], emb: bool, loss: bool, nemo: bool = True
                      ) -> Optional[Tuple[str, str]]:
    """(key to blame, why) for the first split rule that fails, or None when NeMo 2.3.3 and
    megatron-core accept the split (``nemo=False``: megatron-core alone, as under Megatron-LM).
    First/last counts not divisible by VP are left to the caller."""
    chunks = vp or 1
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle = layers - (first or 0) - (last or 0)
        if middle_stages <= 0:
            return _LAST, (f"null: with pipeline_model_parallel_size (PP) = {pp} and "
                           f"{_FIRST} / {_LAST} both set no middle pipeline stage is left, and "
                           "NeMo 2.3.3 divides the remaining layers by the middle stage count "
                           "(ZeroDivisionError)")
        if middle <= 0 or middle % (middle_stages * chunks):
            return "num_layers", (
                f"num_layers - {_FIRST} - {_LAST} = {layers} - {first or 0} - {last or 0} = "
                f"{middle} > 0 and a multiple of the middle stages (PP {pp} - "
                f"{pp - middle_stages}) = {middle_stages}"
                + (f" * virtual_pipeline_model_parallel_size (VP) {vp}" if vp else "")
                + " (megatron-core and NeMo: every middle stage, and every chunk on it, holds "
                "the same number)")
    else:
        total = layers + emb + loss
        counted = " + 1 (embedding)" * emb + " + 1 (loss)" * loss
        if total % pp:
            return "num_layers", (f"num_layers{counted} = {total} divisible by "
                                  f"pipeline_model_parallel_size (PP) = {pp} (megatron-core "
                                  "asserts it)")
        if vp and (total // pp) % vp:
            return "vp", (f"a divisor of the layers per pipeline rank, num_layers{counted} "
                          f"// pipeline_model_parallel_size (PP) = {total} // {pp} = "
                          f"{total // pp} (megatron-core and NeMo: every model chunk holds the "
                          "same number of layers)")
    if nemo and vp and not (emb and loss) and (layers // pp) % vp:
        return "vp", (f"a divisor of num_layers // pipeline_model_parallel_size (PP) = "
                      f"{layers} // {pp} = {layers // pp}: NeMo "
                      "2.3.3 asserts it ('the number of model chunks is the same across all "
                      "pipeline stages') unless both account_for_* flags are set")
    return None


def divisors(n: int) -> List[int]:
    small = [d for d in range(1, min(int(n ** 0.5), 10_000) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
