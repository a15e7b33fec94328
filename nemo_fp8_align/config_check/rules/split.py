"""Startup-check rules on how the layers split over the pipeline: megatron-core's split (the same
in 0.12.3 and 0.16.1) under every split option (even, ``num_layers_in_first/last_pipeline_stage``,
``account_for_embedding/loss_in_pipeline_split``) and NeMo 2.3.3's own chunk assertion. A fix
changes the layout (PP, VP, the first/last split: :mod:`nemo_fp8_align.config_check.layout`),
never ``num_layers`` unless no layout fits (then the message says so), and not while the world
size changes: the layout is then found at the new world size.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.layout import (fixed_why, layout_fix, layout_overrides,
                                                smaller_micro_batch_layout)
from nemo_fp8_align.config_check.layout_string import layout_string_fix
from nemo_fp8_align.config_check.reader import ABSENT
from nemo_fp8_align.config_check.split_math import _FIRST, _LAST, divisors, layer_split_error

__all__ = ["divisors", "layer_split_error", "rule_layer_split", "rule_num_layers",
           "rule_split_option_values", "rule_split_options_exclusive"]

_EMB, _LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
#: The split's fix where the world size changes too: a sentence (no edit), so the fix line
#: sets the world first and its re-check finds the layout at the new world.
WORLD_FIRST = ("the layout that fits at the world size the world-size fix gives, which keeps "
               "the layers where one fits (the fix line is re-checked there)")
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
    change = None
    for key, value in ((_FIRST, first), (_LAST, last)):
        if value is not None and vp is not None and value % vp:
            change = _layout_change(ctx)
            ctx.model.add(key, value, f"a multiple of VP = {vp} ({key} with "
                          "virtual_pipeline_model_parallel_size: megatron-core builds every "
                          "model chunk of that stage with the same number of layers)",
                          -(-value // vp) * vp, fix=change)
    error = layer_split_error(layers, pp, vp, first, last, emb, loss, ctx.nemo)
    if error is None:
        return
    key, why = error
    change = _layout_change(ctx)
    if change is not None:
        blamed = {"vp": "virtual_pipeline_model_parallel_size", _LAST: _LAST}.get(key,
                                                                                "num_layers")
        ctx.model.add(blamed, ctx.model.get(blamed), why, fix=change)
        return
    _no_layout_fits(ctx, key, why, (layers, pp, vp, first, last, emb, loss))


def _layout_change(ctx: CheckContext) -> Optional[str]:
    """The nearest layout that fits, as overrides; None when no layout change fits."""
    change = layout_fix(ctx)
    return layout_overrides(ctx, change) if change else None


def _no_layout_fits(ctx: CheckContext, key: str, why: str, split: Tuple[Any, ...]) -> None:
    """The fallbacks: VP, the last stage's count, then the layer count (a model change, said)."""
    layers, pp, vp, first, last, emb, loss = split
    vp_fix = _vp_fix(*split, ctx.nemo) if key == "vp" else None
    if key == _LAST:
        ctx.model.add(_LAST, last, why, None)
        return
    if vp_fix is not None:
        ctx.model.add("virtual_pipeline_model_parallel_size", vp, why, vp_fix)
        return
    uneven = layout_string_fix(ctx)
    if uneven is not None:  # Megatron-LM: a layout string keeps the model and the batch
        ctx.model.add("num_layers", layers, f"{why}; {fixed_why(ctx)}, so the fix gives the split "
                      "as a pipeline layout string (stages of unequal size, by a layer), "
                      "which keeps the model and the batch", fix=_with_layout(ctx, uneven))
        return
    smaller_layout = smaller_micro_batch_layout(ctx)
    if smaller_layout is not None:  # the model kept: a smaller micro batch with a layout
        mbs, change = smaller_layout
        fix = " ".join([ctx.model.override("micro_batch_size", mbs, present=True),
                        layout_overrides(ctx, change)])
        ctx.model.add("num_layers", layers, f"{why}; {fixed_why(ctx)}, so the fix lowers "
                      f"micro_batch_size to {mbs} with the layout that then fits, which keeps "
                      "the model and the global batch (in more, smaller microbatches)",
                      fix=fix)
        return
    world, mp = ctx.world(), ctx.model_parallel()
    if world is not None and mp is not None and world % mp:
        # The world size rule changes the world (no layout fits this one); at the new world a
        # layout may fit with every layer kept (9 layers on 5 processes: none; on 4, PP 2 with
        # a first stage of 3 and VP 3). The line re-checks at the new world, where this rule
        # then finds that layout, or changes the layers only if none fits there either.
        ctx.model.add("num_layers", layers, f"{why}; no layout fits the world size as given, "
                      "which the world-size fix changes", fix=WORLD_FIRST)
        return
    fix = _num_layers_fix(*split, ctx.nemo)
    if fix is None and vp and emb != loss and ctx.nemo:
        # num_layers + 1 = k * PP * VP makes (num_layers // PP) % VP = VP - 1, always: NeMo
        # 2.3.3 rejects every layer count with exactly one account_for_* flag and VP >= 2.
        on, off = (_EMB, _LOSS) if emb else (_LOSS, _EMB)
        why += (f"; with only {on} set and VP >= 2 no num_layers passes both megatron-core's "
                f"split and NeMo's assertion: set {on}=False, or also {off}=True (then "
                "num_layers + 2 a multiple of PP * VP)")
        ctx.model.add(on, True, why, False)
        return
    if key == "vp":
        why = why.replace("a divisor of", f"layers where VP = {vp} divides", 1)
    why += (f"; {fixed_why(ctx)}, so the fix changes num_layers, which changes the model: "
            "or choose another PP / VP yourself")
    ctx.model.add("num_layers", layers, why, fix, fix=None if fix is not None
                  else "<a num_layers that splits evenly>")


def _with_layout(ctx: CheckContext, change: Dict[str, Any]) -> str:
    """The change as overrides, the layout string unquoted (Megatron-LM's spelling of the fix
    quotes it for the shell; only Megatron-LM mode has one)."""
    change = dict(change)
    layout = change.pop("pipeline_model_parallel_layout")
    rest = layout_overrides(ctx, change) if change else ""
    return " ".join(p for p in (f"model.pipeline_model_parallel_layout={layout}", rest) if p)


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
    """The layer count nearest ``layers``, fewer or more (more on a tie), that splits: the
    smallest change of the model (78 layers, not 98, where 80 do not split)."""
    span = min(4 * pp * (vp or 1), 5_000)  # a huge PP or VP must not become a huge list
    nearest = sorted(range(max(layers - span, 1), layers + span + 1),
                     key=lambda n: (abs(n - layers), -n))
    return _first_valid([n for n in nearest if n != layers],
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
