"""Startup-check rules on the world size, the data-parallel size and the microbatches. One
function per rule, ``rule(ctx) -> None``.

The data-parallel size is ``trainer.devices * trainer.num_nodes / (TP * PP * CP)`` (what
megatron-core's ``initialize_model_parallel`` computes), or the caller's value
(``--data-parallel-size``); when both are known they must agree. Without either, the microbatch
rules do not run (the CLI says so on its OK line).
"""

from __future__ import annotations

from math import gcd
from typing import Optional

from omegaconf import DictConfig

from nemo_fp8_align.config_check.batch_fix import (micro_batch_fix, nearest_batch,
                                                   schedule_error)
from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.layout import (fixed_why, layout_fix, layout_overrides,
                                                smaller_micro_batch_layout)
from nemo_fp8_align.config_check.layout_string import kept_string_fix, regrouped_string_fix
from nemo_fp8_align.config_check.reader import ABSENT, Violation, show_value
from nemo_fp8_align.config_check.rules.parallel import expert_parallel_fix

__all__ = ["rule_batch_sizes", "rule_data_parallel_agrees", "rule_data_parallel_value",
           "rule_expert_world_size", "rule_fixed_microbatches", "rule_group_size",
           "rule_microbatches", "rule_telemetry_path", "rule_trainer_devices",
           "rule_world_size"]


def rule_trainer_devices(ctx: CheckContext) -> None:
    """trainer.devices: what Lightning accepts (an int >= 1, -1 or "auto" for all, a list of
    device ids); trainer.num_nodes: an int >= 1 (Lightning's default 1)."""
    if ctx.trainer is None:
        return
    devices = ctx.trainer.get("devices")
    unknown_ok = devices is ABSENT or devices == -1 or devices == "auto" or devices == "-1"
    if not unknown_ok and ctx.devices() is None:
        ctx.trainer.add("devices", devices, "an int >= 1 (the GPUs per node, e.g. 8), -1 or "
                        "'auto' (all of them), or a list of device ids", 8)
    ctx.trainer.int_at_least("num_nodes", 1, "nodes in the job", default=1)


def rule_world_size(ctx: CheckContext) -> None:
    """megatron-core raises 'world_size (W) is not divisible by TP*PP*CP'. The fix changes the
    pipeline size (the devices per node are the hardware's, the node count the user's); only
    when no PP fits does it change the node count, and says so."""
    devices, nodes, mp = ctx.devices(), ctx.num_nodes(), ctx.model_parallel()
    if devices is None or nodes is None or mp is None or (devices * nodes) % mp == 0:
        return
    why = (f"trainer.devices * trainer.num_nodes = {devices} * {nodes} = {devices * nodes} GPUs "
           f"to be a multiple of tensor_model_parallel_size * pipeline_model_parallel_size * "
           f"context_parallel_size = {ctx.tp()} * {ctx.pp()} * {ctx.cp()} = {mp} (megatron-core "
           f"raises 'world_size ({devices * nodes}) is not divisible by {mp}')")
    change = layout_fix(ctx)
    if change:
        cause = next((k for k in ("tensor_model_parallel_size", "context_parallel_size")
                      if k in change), None)
        if cause is not None:  # TP * CP divides no world of this size: name the trade-off
            short = "TP" if cause.startswith("tensor") else "CP"
            why += (f"; no pipeline size fits a world of this size with this {short}, so the "
                    f"fix changes {short}, which changes the memory per GPU")
        key = cause or ("pipeline_model_parallel_size" if "pipeline_model_parallel_size"
                        in change else next(iter(change)))
        ctx.model.add(key, ctx.model.get(key), why, fix=layout_overrides(ctx, change))
        return
    smaller_layout = smaller_micro_batch_layout(ctx)
    if smaller_layout is not None:  # before the node count: the cluster and the batch kept
        mbs, change = smaller_layout
        fix = " ".join([ctx.model.override("micro_batch_size", mbs, present=True),
                        layout_overrides(ctx, change)])
        ctx.model.add("pipeline_model_parallel_size", ctx.pp(), f"{why}; {fixed_why(ctx)}, so "
                      f"the fix lowers micro_batch_size to {mbs} with the layout that then "
                      "fits, which keeps the node count and the global batch (in more, "
                      "smaller microbatches)", fix=fix)
        return
    step = mp // gcd(devices, mp)  # num_nodes must be a multiple of this
    fixed = -(-nodes // step) * step
    ctx.trainer.add("num_nodes", ctx.trainer.get("num_nodes"), (
        f"{why}; {fixed_why(ctx)}, so the fix changes the node count (a multiple of {step}): or "
        "change TP or CP yourself"), fixed)


def rule_expert_world_size(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 raises unless expert TP * EP * PP divides the world size."""
    world, ep, etp, pp = ctx.world(), ctx.ep(), ctx.etp(), ctx.pp()
    if world is None or ep is None or etp is None or pp is None or ep == 1:
        return
    if world % (etp * ep * pp) == 0:
        return
    why = (f"expert TP * EP * PP = {etp} * {ep} * {pp} to divide the world size {world} "
           "(megatron-core raises 'decoder world_size ... is not divisible by "
           "expert_tensor_model_pipeline_parallel size')")
    # The layout search holds EP and finds the PP it divides with: where it does, that layout
    # is the fix and EP stays (an EP worked out at the given PP was changed needlessly: EP 8
    # -> 4 beside the PP 4 at which EP 8 fits). A layout string kept at a smaller PP is the VP
    # rule's fix for it, so its PP is tried first (Bridge's DeepSeek-V3 on 512 GPUs: PP 16 ->
    # 8 keeps EP 64, which the line lowered to 32 beside it); a string of PP x VP stages is
    # regrouped at another PP (the layout search moves no PP under a string: the proxy's 8
    # stages with EP 16 on 32 GPUs got EP 8 where PP 2 keeps EP 16)
    change = kept_string_fix(ctx) or regrouped_string_fix(ctx) or layout_fix(ctx)
    new_pp = (change or {}).get("pipeline_model_parallel_size")
    if type(new_pp) is int and world % (etp * ep * new_pp) == 0:
        ctx.model.add("expert_model_parallel_size", ep, f"{why}; the layout fix keeps EP "
                      f"(PP {new_pp})", fix=layout_overrides(ctx, change))
        return
    ctx.model.add("expert_model_parallel_size", ep, why, expert_parallel_fix(ctx))


def rule_data_parallel_value(ctx: CheckContext) -> None:
    """The caller's data-parallel size: None, or an int >= 1."""
    value = ctx.data_parallel_size
    if value is None or ctx.given_data_parallel() is not None:
        return
    ctx.violations.append(Violation(
        ctx.data_parallel_name, show_value(value), "an int >= 1 (data-parallel replicas)",
        f"{ctx.data_parallel_name} 1, or leave it out to derive it from trainer.devices * "
        "trainer.num_nodes / (TP * PP * CP)"))


def rule_data_parallel_agrees(ctx: CheckContext) -> None:
    """A given data-parallel size must be the one the trainer's world size gives."""
    given, derived = ctx.given_data_parallel(), ctx.trainer_data_parallel()
    if given is None or derived is None or given == derived:
        return
    devices, mp = ctx.devices(), ctx.model_parallel()
    nodes_needed = given * mp / devices
    fix = (f"trainer.num_nodes={int(nodes_needed)}" if nodes_needed == int(nodes_needed)
           else f"{ctx.data_parallel_name} {derived}")
    ctx.violations.append(Violation(
        ctx.data_parallel_name, str(given),
        f"{derived}, the data-parallel size of the trainer: devices * num_nodes / (TP * PP * CP)"
        f" = {devices} * {ctx.num_nodes()} / {mp} = {derived}; the microbatch checks use "
        f"{given}", f"{fix}, or leave {ctx.data_parallel_name} out"))


def rule_telemetry_path(ctx: CheckContext) -> None:
    """With PP >= 2 there are always several ranks: a telemetry path without ``{rank}`` would
    have all of them append to one file (the writer replaces ``{rank}`` by the global rank)."""
    key = "fp8_transpose_align.telemetry_path"
    if not isinstance(ctx.model.get("fp8_transpose_align"), DictConfig):
        return  # absent, or not a mapping (reported with the plugin block)
    path = ctx.model.get(key)
    if not isinstance(path, str) or "{rank}" in path:
        return  # absent, null, or a wrong type (reported with the plugin block)
    stem, dot, suffix = path.rpartition(".") if "." in path.rpartition("/")[2] else (path, "", "")
    ctx.model.add(key, path, "a path containing {rank}: every rank writes its own file, and "
                  "without it all ranks append to one", f"{stem}.rank{{rank}}{dot}{suffix}")


def rule_batch_sizes(ctx: CheckContext) -> None:
    mbs = ctx.model.int_at_least("micro_batch_size", 1, "samples per microbatch")
    gbs = ctx.model.get("global_batch_size")
    if type(gbs) is int and gbs >= 1:
        return
    # A suggestion that also fits the schedule: PP microbatches of micro_batch_size * DP.
    pp, dp = ctx.pp(), ctx.data_parallel()
    fix = (mbs or 1) * (dp or 1) * max(pp or 1, 1)
    if isinstance(gbs, str) and gbs.strip().isdigit() and int(gbs) >= 1:
        fix = int(gbs)
    ctx.model.add("global_batch_size", gbs, "an int >= 1 (samples per optimizer step)", fix)


def rule_group_size(ctx: CheckContext) -> None:
    if ctx.legacy():
        return  # no N before 0.10: rules/version.py reports a given one
    ctx.model.optional_int("microbatch_group_size_per_vp_stage", 1,
                           "N, microbatches per group; null means PP")


def rule_fixed_microbatches(ctx: CheckContext) -> None:
    """The aligned slots are computed for one M; a batch-size ramp-up changes M mid-run."""
    value = ctx.model.get("rampup_batch_size")
    if value is not ABSENT and value is not None:
        ctx.model.add("rampup_batch_size", value,
                      "null (a batch-size ramp-up changes the microbatch count M during "
                      "training; the aligned slots assume one M)", None)


def rule_microbatches(ctx: CheckContext) -> None:
    """M = global_batch_size / (micro_batch_size * DP) must be whole (megatron-core's
    microbatch calculator; checked whatever PP and VP are) and fit the interleaved schedule
    (PP <= N <= M, not 0 < M mod N < PP), which :class:`InterleavedSchedule` decides. The fix
    changes the layout (N, PP, VP); where no layout fits, a smaller micro batch, and only then
    the nearest global batch (:mod:`..batch_fix`), each said so."""
    pp, vp, dp = ctx.pp(), ctx.vp(), ctx.data_parallel()
    mbs, gbs = ctx.model.peek_int("micro_batch_size"), ctx.model.peek_int("global_batch_size")
    raw_n = ctx.model.get("microbatch_group_size_per_vp_stage")
    # before 0.10 there is no N (its rule in rules/version.py reports a given one)
    n = None if raw_n is ABSENT or raw_n is None or ctx.legacy() else raw_n
    if (pp is None or dp is None or mbs is None or gbs is None
            or (n is not None and not (type(n) is int and n >= 1))):
        return
    per_microbatch = mbs * dp
    m = gbs // per_microbatch
    if gbs % per_microbatch:
        error = (f"a multiple of micro_batch_size * DP = {mbs} * {dp} = {per_microbatch}, DP "
                 "being trainer.devices * trainer.num_nodes / (TP * PP * CP) "
                 "(megatron-core's microbatch calculator requires it)")
    elif pp >= 2 and vp is not None:
        error = schedule_error(pp, vp, m, n, ctx.legacy())
        if error is None:
            return
        if ctx.legacy():  # the version's own rule, spelled for it
            error = (f"megatron-core {ctx.mcore.version}: {error} (M = global_batch_size / "
                     "(micro_batch_size * DP), PP = pipeline_model_parallel_size; megatron-core "
                     "raises RuntimeError 'number of microbatches is not divisible by "
                     "pipeline-model-parallel-size when using interleaved schedule')")
        else:
            error += (f" (M = global_batch_size / (micro_batch_size * DP), N = "
                      "microbatch_group_size_per_vp_stage, PP = pipeline_model_parallel_size)")
    else:
        return  # the schedule needs a valid PP and VP: reported by their rules
    found = f"{gbs} (M = {gbs} / ({mbs} * DP {dp}) = {gbs / per_microbatch:g})"
    change = layout_fix(ctx)
    if change and gbs % per_microbatch:  # the batch is right; the layout gives the wrong DP
        ctx.violations.append(Violation("model.global_batch_size", found, f"{error}; the fix "
                                        "changes the layout, and so DP",
                                        layout_overrides(ctx, change)))
        return
    if change:
        key = next(iter(change))
        ctx.model.add(key, ctx.model.get(key), f"{error}; global_batch_size = {found}",
                      fix=layout_overrides(ctx, change))
        return
    _batch_fallback(ctx, error, found, (pp, vp, dp, mbs, gbs, n))


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
