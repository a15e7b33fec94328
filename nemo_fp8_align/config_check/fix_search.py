"""The command line's fix search: the fixer ``nemo-fp8-align check`` puts on the check's context
(:class:`~.context.CheckContext`), which turns each rule's fix request
(:class:`~.context.FixRequest`) into the fix the command prints and re-checks.

The rules judge and give the fix they can name without a search (a value to use, or the settings
that must change and the rule they must satisfy); the runtime's startup check stops there, and so
never loads what is here. Where a rule asks, the fixer searches the smallest change of the
parallel layout that fits (:mod:`.layout`: PP, VP, the first/last stage split, N, TP or CP where
they are the cause), a Megatron-LM layout string that keeps the model (:mod:`.layout_string`),
then a smaller micro batch, then the nearest global batch (:mod:`.batch_fix`), and the layer
count last (:mod:`.split_math`), each trade-off named in the message. Megatron-LM's own fixes
that search (the nearest world size that fits the batch, the nearest batch of a step-schedule
entry) are its methods too. One method per rule that asks, named as the request's ``rule``;
each returns whether it recorded a fix (False: the rule's own fix stands).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any, Dict, Mapping, Optional, Tuple

from nemo_fp8_align.config_check.batch_fix import (micro_batch_fix, nearest_batch,
                                                   nearest_microbatches)
from nemo_fp8_align.config_check.context import CheckContext, FixRequest
from nemo_fp8_align.config_check.layout import (fixed_why, layout_fix, layout_overrides,
                                                smaller_micro_batch_layout)
from nemo_fp8_align.config_check.layout_string import (kept_string_fix, layout_string_fix,
                                                       regrouped_string_fix)
from nemo_fp8_align.config_check.megatron_lm_rules import _int, step_schedule, vp_of
from nemo_fp8_align.config_check.reader import ABSENT, Violation
from nemo_fp8_align.config_check.rules.batch import node_multiple, schedule_fits
from nemo_fp8_align.config_check.rules.split import _EMB, _LAST, _LOSS
from nemo_fp8_align.config_check.split_math import num_layers_fix, vp_fix

__all__ = ["FIX_SEARCH", "FixSearch"]

#: The split's fix where the world size changes too: a sentence (no edit), so the fix line
#: sets the world first and its re-check finds the layout at the new world.
WORLD_FIRST = ("the layout that fits at the world size the world-size fix gives, which keeps "
               "the layers where one fits (the fix line is re-checked there)")
_VP = "virtual_pipeline_model_parallel_size"


class FixSearch:
    """The fixer of ``nemo-fp8-align check`` (:class:`~.context.Fixer`): one method per rule
    that asks for a search, and Megatron-LM's searched fixes."""

    def fix(self, ctx: CheckContext, request: FixRequest) -> bool:
        return getattr(self, request.rule)(ctx, request)

    # --- the rules' requests -----------------------------------------------------------------

    def virtual_pipeline_size(self, ctx: CheckContext, request: FixRequest) -> bool:
        """A layout string (or hybrid pattern) of one stage per rank kept at a smaller PP
        (:func:`~.layout_string.kept_string_fix`); where VP is unset or below 2 and the layout
        search picks a VP other than 2 (an even split: 12 layers at PP 4 get VP 3, one layer a
        chunk), that layout, not VP 2 and then a first stage of 6 layers that the split rule
        adds to make VP 2 fit. False: VP 2, the rule's own fix."""
        expected = f"an int >= 2 ({request.why})"
        kept = kept_string_fix(ctx)
        if kept is not None:
            ctx.model.add(_VP, ctx.model.get(_VP), expected, fix=layout_overrides(ctx, kept))
            return True
        value = ctx.model.get(_VP)
        if value is ABSENT or value is None or (type(value) is int and value < 2):
            change = layout_fix(ctx)
            if change and type(change.get(_VP)) is int and change[_VP] > 2:
                ctx.model.add(_VP, value, expected, fix=layout_overrides(ctx, change))
                return True
        return False

    def interleaved_pipeline_size(self, ctx: CheckContext, request: FixRequest) -> bool:
        """The nearest layout with a PP the version interleaves (the model, the batch and the
        nodes kept), else the rule it must satisfy."""
        pp, least = ctx.pp(), ctx.mcore.min_interleaved_pp
        change = layout_fix(ctx)
        if change and change.get("pipeline_model_parallel_size", pp) >= least:
            fix = layout_overrides(ctx, change)
        else:
            fix = (f"none found that keeps the model, the batch and the node count: a PP >= "
                   f"{least} that divides the layers and the world, or megatron-core >= 0.8.0")
        ctx.model.add("pipeline_model_parallel_size", pp, request.why, fix=fix)
        return True

    def stage_multiple(self, ctx: CheckContext, request: FixRequest) -> bool:
        """A first/last stage count that VP does not divide: the nearest layout that fits.
        False: the count rounded up to a multiple of VP, the rule's own fix."""
        change = _layout_change(ctx)
        if change is None:
            return False
        _record(ctx, replace(request.violation, fix=change))
        return True

    def layer_split(self, ctx: CheckContext, request: FixRequest) -> bool:
        """The nearest layout that splits the layers, else the fallbacks of
        :func:`_no_layout_fits` (the model changes last, and the message says so)."""
        change = _layout_change(ctx)
        values = request.values
        if change is not None:
            blamed = values["blamed"]
            ctx.model.add(blamed, ctx.model.get(blamed), request.why, fix=change)
        else:
            _no_layout_fits(ctx, values["key"], request.why, values["split"])
        return True

    def world_size(self, ctx: CheckContext, request: FixRequest) -> bool:
        """The layout that fits the world (a TP or CP where they are the cause, the trade-off
        named), else a smaller micro batch with a layout, else the node count."""
        why = request.why
        change = layout_fix(ctx)
        if change:
            cause = next((k for k in ("tensor_model_parallel_size", "context_parallel_size")
                          if k in change), None)
            if cause is not None:  # TP * CP divides no world of this size: name the trade-off
                short = "TP" if cause.startswith("tensor") else "CP"
                why += (f"; no pipeline size fits a world of this size with this {short}, so "
                        f"the fix changes {short}, which changes the memory per GPU")
            key = cause or ("pipeline_model_parallel_size" if "pipeline_model_parallel_size"
                            in change else next(iter(change)))
            ctx.model.add(key, ctx.model.get(key), why, fix=layout_overrides(ctx, change))
            return True
        smaller_layout = smaller_micro_batch_layout(ctx)
        if smaller_layout is not None:  # before the node count: the cluster and the batch kept
            mbs, change = smaller_layout
            fix = " ".join([ctx.model.override("micro_batch_size", mbs, present=True),
                            layout_overrides(ctx, change)])
            ctx.model.add("pipeline_model_parallel_size", ctx.pp(), f"{why}; {fixed_why(ctx)}, "
                          f"so the fix lowers micro_batch_size to {mbs} with the layout that "
                          "then fits, which keeps the node count and the global batch (in more, "
                          "smaller microbatches)", fix=fix)
            return True
        step, fixed = node_multiple(ctx.devices(), ctx.num_nodes(), ctx.model_parallel())
        ctx.trainer.add("num_nodes", ctx.trainer.get("num_nodes"), (
            f"{why}; {fixed_why(ctx)}, so the fix changes the node count (a multiple of {step}): "
            "or change TP or CP yourself"), fixed)
        return True

    def expert_world_size(self, ctx: CheckContext, request: FixRequest) -> bool:
        """The layout search holds EP and finds the PP it divides with: where it does, that
        layout is the fix and EP stays (an EP worked out at the given PP was changed
        needlessly: EP 8 -> 4 beside the PP 4 at which EP 8 fits). A layout string kept at a
        smaller PP is the VP rule's fix for it, so its PP is tried first (Bridge's DeepSeek-V3
        on 512 GPUs: PP 16 -> 8 keeps EP 64, which the line lowered to 32 beside it); a string
        of PP x VP stages is regrouped at another PP (the layout search moves no PP under a
        string: the proxy's 8 stages with EP 16 on 32 GPUs got EP 8 where PP 2 keeps EP 16).
        False: the largest EP that divides, the rule's own fix."""
        world, ep, etp = ctx.world(), ctx.ep(), ctx.etp()
        change = kept_string_fix(ctx) or regrouped_string_fix(ctx) or layout_fix(ctx)
        new_pp = (change or {}).get("pipeline_model_parallel_size")
        if type(new_pp) is int and world % (etp * ep * new_pp) == 0:
            ctx.model.add("expert_model_parallel_size", ep, f"{request.why}; the layout fix "
                          f"keeps EP (PP {new_pp})", fix=layout_overrides(ctx, change))
            return True
        return False

    def microbatches(self, ctx: CheckContext, request: FixRequest) -> bool:
        """The layout that makes M fit (N, PP, VP; where the global batch is not a multiple of
        micro batch * DP, the layout that changes DP), else :func:`_batch_fallback`."""
        error, found = request.why, request.values["found"]
        sizes = request.values["sizes"]
        _pp, _vp, dp, mbs, gbs, _n = sizes
        change = layout_fix(ctx)
        if change and gbs % (mbs * dp):  # the batch is right; the layout gives the wrong DP
            ctx.violations.append(Violation("model.global_batch_size", found, f"{error}; the "
                                            "fix changes the layout, and so DP",
                                            layout_overrides(ctx, change)))
        elif change:
            key = next(iter(change))
            ctx.model.add(key, ctx.model.get(key), f"{error}; global_batch_size = {found}",
                          fix=layout_overrides(ctx, change))
        else:
            _batch_fallback(ctx, error, found, sizes)
        return True

    # --- Megatron-LM's arguments ----------------------------------------------------------

    def nearest_world(self, args: Mapping[str, Any], world: int) -> Optional[int]:
        """The process count nearest ``world`` (fewer first on a tie) that TP * PP * CP and
        expert TP * EP * PP divide and with which the batch fits; None: none within 64
        model-parallel groups of it."""
        sizes = {d: _int(args.get(d)) or 1 for d in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size")}
        tp, pp, cp, ep = sizes.values()
        etp = _int(args.get("expert_tensor_parallel_size")) or tp
        mp = tp * pp * cp
        candidates = sorted((k * mp for k in range(1, world // mp + 64)),
                            key=lambda w: (abs(w - world), w))
        return next((w for w in candidates if w != world and w % (etp * ep * pp) == 0
                     and _batch_fits(args, w, mp)), None)

    def nearest_batch(self, pp: int, vp: int, batch: int, per: int, n: Optional[int]) -> int:
        """The batch nearest ``batch`` (a multiple of ``per``) whose M fits, as NeMo mode's
        fix (a step-schedule entry's)."""
        exact = Fraction(batch, per)  # a float loses the units of a batch above 2**53
        return (nearest_microbatches(pp, vp, exact, n) or max(round(exact), 1)) * per


#: The one fixer: the check command passes it to find_violations / megatron_lm_violations.
FIX_SEARCH = FixSearch()


def _record(ctx: CheckContext, violation: Violation) -> None:
    if violation not in ctx.violations:
        ctx.violations.append(violation)


# ---------------------------------------------------------------------------------------------
# The layer split


def _layout_change(ctx: CheckContext) -> Optional[str]:
    """The nearest layout that fits, as overrides; None when no layout change fits."""
    change = layout_fix(ctx)
    return layout_overrides(ctx, change) if change else None


def _no_layout_fits(ctx: CheckContext, key: str, why: str, split: Tuple[Any, ...]) -> None:
    """The fallbacks: VP, the last stage's count, then the layer count (a model change, said)."""
    layers, pp, vp, first, last, emb, loss = split
    vp_change = vp_fix(*split, ctx.nemo) if key == "vp" else None
    if key == _LAST:
        ctx.model.add(_LAST, last, why, None)
        return
    if vp_change is not None:
        ctx.model.add("virtual_pipeline_model_parallel_size", vp, why, vp_change)
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
    fix = num_layers_fix(*split, ctx.nemo)
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


# ---------------------------------------------------------------------------------------------
# The microbatches


def _batch_fallback(ctx: CheckContext, error: str, found: str, sizes: tuple) -> None:
    """No layout fits: a smaller micro batch where one does (the global batch, the recipe,
    kept), else the nearest global batch that fits, each trade-off named."""
    pp, vp, dp, mbs, gbs, n = sizes
    judged = ""
    if pp < 2 and _data_parallel_at(ctx, 2) is not None:
        # the plugin's own fix makes PP 2 (and VP 2): the batch is fixed for that layout, not
        # for PP 1, whose DP the line changes anyway
        pp, dp = 2, _data_parallel_at(ctx, 2)
        judged = f" (judged at PP 2, which the plugin needs: DP {dp})"
    interleaved = pp >= 2
    smaller = micro_batch_fix(pp, vp, dp, mbs, gbs, n, ctx.legacy()) if interleaved else None
    if smaller is None and _micro_batch_with_layout(ctx, error, found, mbs):
        return
    if smaller is not None:
        ctx.model.add("micro_batch_size", mbs, f"{error}; global_batch_size = {found}; "
                      f"{fixed_why(ctx)}, so the fix lowers micro_batch_size from {mbs} to "
                      f"{smaller}{judged}, which keeps the global batch (the training recipe) "
                      "in more, smaller microbatches", smaller)
        return
    micro, fixed = nearest_batch(pp, vp, dp, mbs, gbs, n, ctx.legacy())
    also = ("" if micro == mbs else f" with micro_batch_size {micro} (was {mbs}, which "
            "makes the batch's steps finer)")
    fix = " ".join(([ctx.model.override("micro_batch_size", micro, present=True)]
                    if micro != mbs else []) + [f"model.global_batch_size={fixed}"])
    ctx.violations.append(Violation(
        "model.global_batch_size", found, f"{error}; {fixed_why(ctx)}, and no smaller "
        f"micro_batch_size fits, so the fix changes the global batch from {gbs} to {fixed}"
        f"{also}{judged} (the nearest that fits, {abs(fixed - gbs)} samples per step "
        f"{'fewer' if fixed < gbs else 'more'}), which changes the training recipe: or train "
        "on fewer nodes", fix))


def _micro_batch_with_layout(ctx: CheckContext, error: str, found: str, mbs: int) -> bool:
    """A smaller micro batch together with another layout (the global batch kept), tried
    before the global batch changes (:func:`~..layout.smaller_micro_batch_layout`). Whether
    one was found (and recorded)."""
    smaller_layout = smaller_micro_batch_layout(ctx)
    if smaller_layout is None:
        return False
    smaller, change = smaller_layout
    fix = " ".join([ctx.model.override("micro_batch_size", smaller, present=True),
                    layout_overrides(ctx, change)]).strip()
    ctx.violations.append(Violation(
        "model.micro_batch_size", str(mbs), f"{error}; global_batch_size = {found}; "
        f"{fixed_why(ctx)}, so the fix lowers micro_batch_size from {mbs} to {smaller} with the "
        "layout that then fits, which keeps the global batch (the training recipe) in "
        "more, smaller microbatches", fix))
    return True


def _data_parallel_at(ctx: CheckContext, pp: int) -> Optional[int]:
    """DP with pipeline size ``pp`` (the world's when known, else the caller's)."""
    world, tp, cp = ctx.world(), ctx.tp(), ctx.cp()
    if world is None or tp is None or cp is None:
        return ctx.given_data_parallel()
    return world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None


# ---------------------------------------------------------------------------------------------
# Megatron-LM's world size


def _batch_fits(args: Mapping[str, Any], world: int, mp: int) -> bool:
    """Whether the global batch (every step-schedule entry) fits ``world`` processes."""
    mbs = _int(args.get("micro_batch_size")) or 1
    pp = _int(args.get("pipeline_model_parallel_size"))
    vp, n = vp_of(args), _int(args.get("microbatch_group_size_per_vp_stage"))
    entries = step_schedule(args)
    batches = ([b for _, b, _ in entries] if isinstance(entries, list)
               else [_int(args.get("global_batch_size"))])
    per = mbs * (world // mp)
    for batch in batches:
        if batch is None:
            continue  # M = 1 then (Megatron-LM's default): the schedule rule reports it
        if batch % per or (type(vp) is int and vp > 1 and pp and pp > 1
                           and not schedule_fits(pp, vp, batch // per, n)):
            return False
    return True
