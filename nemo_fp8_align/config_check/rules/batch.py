"""Startup-check rules on the world size, the data-parallel size and the microbatches. One
function per rule, ``rule(ctx) -> None``.

The data-parallel size is ``trainer.devices * trainer.num_nodes / (TP * PP * CP)`` (what
megatron-core's ``initialize_model_parallel`` computes), or the caller's value
(``--data-parallel-size``); when both are known they must agree. Without either, the microbatch
rules do not run (the CLI says so on its OK line).

The world size, the expert world size and the microbatches are violations with fix requests
(:class:`~..context.FixRequest`): the command line's fixer searches the layout that fits, then
a smaller micro batch, then the global batch (:mod:`..fix_search`). Without it (the runtime's
startup check) each gives the fix it can name without a search: the node count that fits, the
expert-parallel size that divides, or the settings that make M fit and the command that
proposes them. :func:`schedule_error` is the microbatch rule's verdict (the layout search asks
it too).
"""

from __future__ import annotations

from math import gcd
from typing import Optional, Tuple

from omegaconf import DictConfig

from nemo_fp8_align.config_check.context import CheckContext, FixRequest
from nemo_fp8_align.config_check.reader import ABSENT, Violation, show_value
from nemo_fp8_align.config_check.rules.parallel import expert_parallel_fix
from nemo_fp8_align.core.schedule import InterleavedSchedule, ScheduleError

__all__ = ["node_multiple", "rule_batch_sizes", "rule_data_parallel_agrees",
           "rule_data_parallel_value", "rule_expert_world_size", "rule_fixed_microbatches",
           "rule_group_size", "rule_microbatches", "rule_telemetry_path", "rule_trainer_devices",
           "rule_world_size", "schedule_error", "schedule_fits"]


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
    """megatron-core raises 'world_size (W) is not divisible by TP*PP*CP'. The command line's fix
    changes the pipeline size (the devices per node are the hardware's, the node count the
    user's); only when no PP fits does it change the node count, and says so. Without the search
    the fix is the node count (the layout kept), and the message names the command that
    proposes a layout for these GPUs."""
    devices, nodes, mp = ctx.devices(), ctx.num_nodes(), ctx.model_parallel()
    if devices is None or nodes is None or mp is None or (devices * nodes) % mp == 0:
        return
    why = (f"trainer.devices * trainer.num_nodes = {devices} * {nodes} = {devices * nodes} GPUs "
           f"to be a multiple of tensor_model_parallel_size * pipeline_model_parallel_size * "
           f"context_parallel_size = {ctx.tp()} * {ctx.pp()} * {ctx.cp()} = {mp} (megatron-core "
           f"raises 'world_size ({devices * nodes}) is not divisible by {mp}')")
    step, fixed = node_multiple(devices, nodes, mp)
    unsearched = ctx.trainer.violation("num_nodes", ctx.trainer.get("num_nodes"), (
        f"{why}; the fix changes the node count (a multiple of {step}), which keeps the layout: "
        f"or keep the GPUs and change PP, TP or CP ({ctx.search_command()} proposes a layout "
        "that fits them)"), fixed)
    ctx.request_fix(FixRequest("world_size", unsearched, why))


def node_multiple(devices: int, nodes: int, model_parallel: int) -> Tuple[int, int]:
    """(step, node count): the node count must be a multiple of ``step`` for TP * PP * CP to
    divide the GPUs; the node count is the nearest such at or above ``nodes``."""
    step = model_parallel // gcd(devices, model_parallel)
    return step, -(-nodes // step) * step


def rule_expert_world_size(ctx: CheckContext) -> None:
    """megatron-core 0.12.3 raises unless expert TP * EP * PP divides the world size. The fix
    without the search is the largest EP that divides; the command line's keeps EP where a
    layout fits with it."""
    world, ep, etp, pp = ctx.world(), ctx.ep(), ctx.etp(), ctx.pp()
    if world is None or ep is None or etp is None or pp is None or ep == 1:
        return
    if world % (etp * ep * pp) == 0:
        return
    why = (f"expert TP * EP * PP = {etp} * {ep} * {pp} to divide the world size {world} "
           "(megatron-core raises 'decoder world_size ... is not divisible by "
           "expert_tensor_model_pipeline_parallel size')")
    ctx.request_fix(FixRequest("expert_world_size", ctx.model.violation(
        "expert_model_parallel_size", ep, why, expert_parallel_fix(ctx)), why))


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
    (PP <= N <= M, not 0 < M mod N < PP), which :class:`InterleavedSchedule` decides. The
    command line's fix changes the layout (N, PP, VP); where no layout fits, a smaller micro
    batch, and only then the nearest global batch (:mod:`..batch_fix`), each said so. Without
    the search the fix names what may change and the command that proposes it."""
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
        fits = "the global batch is a multiple of micro_batch_size * DP and M fits"
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
        fits = "M fits"
    else:
        return  # the schedule needs a valid PP and VP: reported by their rules
    found = f"{gbs} (M = {gbs} / ({mbs} * DP {dp}) = {gbs / per_microbatch:g})"
    unsearched = Violation("model.global_batch_size", found, error, (
        f"a group size N, PP, VP or a smaller micro batch with which {fits}: "
        f"{ctx.search_command()} proposes the nearest, the global batch kept where one fits"))
    ctx.request_fix(FixRequest("microbatches", unsearched, error, {
        "found": found, "sizes": (pp, vp, dp, mbs, gbs, n)}))


def schedule_error(pp: int, vp: Optional[int], m: int, n: Optional[int],
                   legacy: bool = False) -> Optional[str]:
    """Why M microbatches do not fit megatron-core's interleaved schedule (PP <= N <= M, not
    0 < M mod N < PP; ``legacy``, before 0.10: no N, M a multiple of PP), as the schedule says
    it; None when they fit. The rule does not depend on VP; an unknown VP is checked as 2."""
    try:
        InterleavedSchedule(pp=pp, vp=vp or 2, microbatches=m,
                            group_size=None if legacy else n, legacy_order=legacy)
    except ScheduleError as err:
        return str(err)
    return None


def schedule_fits(pp: int, vp: Optional[int], m: int, n: Optional[int],
                  legacy: bool = False) -> bool:
    """Whether M microbatches fit the schedule (:func:`schedule_error` says none, M >= 1)."""
    return m >= 1 and schedule_error(pp, vp, m, n, legacy) is None
