"""``nemo-fp8-align plan``: what aligning the FP8 transposes gains a configuration, predicted by
the timeline model (:mod:`nemo_fp8_align.planner`), per placement, with an optional Gantt PNG.

Its inputs: a NeMo or launcher config (read by the startup check's reader), a preset or explicit
sizes, then flags; what none of them gives takes a default, and the plan says which. Measured
durations (per-chunk forward, backward, transposes and host wait, one value or one per rank and
chunk; the p2p transfer; ranks that share one GPU) replace what the planner derives from sizes
and rates (:mod:`nemo_fp8_align.planner.measured`). Every bad value is one
:class:`PlanInputError` line naming the flag (or key), the value, the fix; exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_fp8_align.cli.check_load import load_config
from nemo_fp8_align.cli.common import (CHECK_NEEDS, missing_dependency, one_line_usage_errors,
                                      plot_path_problem)
from nemo_fp8_align.core.schedule import InterleavedSchedule, ScheduleError
from nemo_fp8_align.errors import ConfigLoadError, PlanInputError
from nemo_fp8_align.planner.costs import (GPUS, MODELS, OVERLAP_PENALTY_H200, Layout, ModelShape,
                                           chunk_costs)
from nemo_fp8_align.planner.gantt import plot_plan
from nemo_fp8_align.planner.measured import PER_CHUNK, SHARED_GPU_SLOWDOWN, measured_costs
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.post_processing import RECIPES, PostProcessing, post_processing
from nemo_fp8_align.planner.simulate import Costs, Timeline, simulate
from nemo_fp8_align.planner.two_clocks import TWO_CLOCK_PLACEMENTS

__all__ = ["add_plan_parser", "plan_report", "run_plan"]

_MODELLED_ONLY = (Placement.BUBBLE, Placement.OVERLAP)


def add_plan_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "plan", help="predict the step time with lazy / aligned / modelled FP8 transpose "
        "placements for a model and parallel layout",
        description="Predict, with the timeline model of megatron-core's interleaved 1F1B step, "
        "what aligning the FP8 weight transposes saves a model and parallel layout. Sizes come "
        "from a NeMo or NeMo-Framework-Launcher CONFIG.yaml (with Hydra overrides), a --model "
        "preset or explicit flags (flags win); the output names every default it used.")
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="NeMo training YAML (NeMo 1.x layout or launcher); read as check reads it")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                   help="Hydra overrides of CONFIG.yaml: a.b=c, +a.b=c, ++a.b=c")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="a preset; or give --layers --hidden --heads --ffn (and --kv-heads)")
    for name, help_ in (("--layers", "transformer layers"), ("--hidden", "hidden size"),
                        ("--heads", "attention heads"),
                        ("--kv-heads", "KV heads, num_query_groups (default: heads)"),
                        ("--ffn", "MLP hidden size"),
                        ("--seq", "sequence length (preset's or config's by default)"),
                        ("--experts", "MoE experts per layer (num_moe_experts; default: dense)"),
                        ("--topk", "MoE experts per token (moe_router_topk, default 2)"),
                        ("--moe-ffn", "an expert's MLP hidden size (default: --ffn)")):
        p.add_argument(name, type=whole_number, default=None, help=help_)
    p.add_argument("--gated-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="SwiGLU-style MLP with 3 matrices (presets and configs know theirs)")
    for name, help_ in (("--tp", "tensor-parallel size (default 8)"),
                        ("--pp", "pipeline-parallel size, >= 2 (default 8)"),
                        ("--vp", "model chunks per pipeline rank, >= 2 (default 2)"),
                        ("--dp", "data-parallel size (default 1; from a config: devices x "
                                 "nodes / (TP x PP x CP))"),
                        ("--cp", "context-parallel size (default 1)"),
                        ("--ep", "expert-parallel size (default 1)"),
                        ("--expert-tp", "expert tensor-parallel size (default: TP)"),
                        ("--micro-batch", "micro-batch size (default 1)"),
                        ("--global-batch", "global batch (default: 8 x PP x micro x DP)"),
                        ("--group-size", "microbatch_group_size_per_vp_stage N (default PP)")):
        p.add_argument(name, type=whole_number, default=None, help=help_)
    p.add_argument("--overlap-p2p-comm", dest="overlap_p2p", default=None,
                   action=argparse.BooleanOptionalAction,
                   help="megatron-core overlap_p2p_comm (default on: Megatron-LM's with "
                   "interleaving; a NeMo config without the key: off)")
    p.add_argument("--batch-p2p-comm", dest="batch_p2p", default=None,
                   action=argparse.BooleanOptionalAction,
                   help="megatron-core batch_p2p_comm (default off; a NeMo config without the "
                   "key: on); timed as unbatched blocking calls")
    p.add_argument("--gpu", default="h200", help=f"one of {', '.join(sorted(GPUS))} (any case)")
    p.add_argument("--recipe", choices=RECIPES, default=None,
                   help="quantized-weight recipe (default: the config's fp8_recipe / fp4_recipe, "
                   "else delayed); each has its own post-all-gather work and bytes")
    p.add_argument("--reuse-grad-buf-for-mxfp8-param-ag", dest="reuse_grad_buf", default=None,
                   action=argparse.BooleanOptionalAction,
                   help="mxfp8: megatron-core re-quantizes the gathered BF16 after the gather "
                   "(default on, Megatron-Bridge's Blackwell recipe; off: nothing to align)")
    p.add_argument("--tflops", type=float, default=None,
                   help="achieved forward+backward TFLOP/s per GPU (GPU default otherwise)")
    p.add_argument("--transpose-tbps", type=float, default=None,
                   help="bandwidth of the recipe's post-all-gather work (a transpose for "
                   "per-tensor FP8), read+write TB/s (GPU default otherwise)")
    p.add_argument("--allgather-gbps", type=float, default=40.0,
                   help="data-parallel all-gather GB/s per GPU (default 40, assumed)")
    p.add_argument("--p2p-gbps", type=float, default=40.0,
                   help="pipeline send/receive GB/s (default 40, assumed)")
    p.add_argument("--overlap-penalty", type=float, default=OVERLAP_PENALTY_H200,
                   help="side-stream transposes cost this many times their own time "
                   f"(default {OVERLAP_PENALTY_H200:.2f}, measured on the H200)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write a Gantt picture (.png/.svg/.pdf) of lazy vs aligned")
    p.add_argument("--plot-window", choices=["auto", "full"], default="auto",
                   help="auto: a long step shows its warm-up, where the transposes are (default)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="json: one object with saving_ms (lazy - aligned per step) and each "
                   "placement's predicted step time")
    add_measured_arguments(p)
    one_line_usage_errors(p)
    p.set_defaults(func=run_plan)


def whole_number(text: str) -> int:
    """An integer flag's value, in digits: ``1e20`` or ``1.5`` is refused with the fix (argparse
    said only "invalid int value")."""
    try:
        return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give it in digits "
                                     "(e.g. 96, not 9.6e1 or 1e20)")


def _work(x: PlanInputs) -> Tuple[Optional[PostProcessing], Optional[str]]:
    """The recipe's post-all-gather work on this GPU, or why there is nothing to align."""
    if x.fp8 is False and x.recipe != "nvfp4":
        return None, ("the config trains without FP8 (model.fp8=False): no FP8 weight, no "
                      "transpose (add the override model.fp8=True to plan it with FP8)")
    if x.fp8_params is False and x.recipe != "nvfp4":
        return None, ("the config keeps its weights in high precision (model.fp8_params=False): "
                      "nothing is gathered in FP8 or processed after the gather (add the "
                      "override model.fp8_params=True to plan FP8 parameters)")
    needed = GPUS[x.gpu].needs_transpose[0]
    work, reason = post_processing(x.recipe, x.gpu, needed,
                                   reuse_grad_buf=x.reuse_grad_buf is not False)
    return work, reason or None


def _head(x: PlanInputs, model, global_batch: int, m: int, n: int) -> str:
    moe = (f", MoE {model.experts} experts top-{model.topk} EP={x.ep} ETP={x.expert_tp or x.tp}"
           if model.experts else "")
    lines = [f"{x.source}: {_count(model.layers, 'layer')}, hidden {model.hidden}, seq {model.seq}{moe}; "
             f"TP={x.tp} PP={x.pp} VP={x.vp} DP={x.dp} CP={x.cp} micro-batch {x.micro_batch}, "
             f"global batch {global_batch} -> M={m} (N={n}); {x.gpu}"]
    p2p = (f"p2p: overlap_p2p_comm={x.overlap_p2p} batch_p2p_comm={x.batch_p2p}"
           + (" (Megatron-LM's default with interleaving; NeMo 1.x configs use "
              "--no-overlap-p2p-comm --batch-p2p-comm)" if {"overlap_p2p", "batch_p2p"} <=
              set(x.defaulted) else ""))
    lines.append(p2p)
    shown = [d for d in x.defaulted if d not in ("overlap_p2p", "batch_p2p")]
    if shown:
        lines.append("defaults used (not given): " + " ".join(
            f"{name.upper().replace('_', '-')}{x.values[name]}" if name in ("tp", "pp", "vp",
                                                                             "dp", "cp", "ep")
            else f"{flag(name)} {x.values[name]}" for name in shown)
            + _refit_note(x, model.layers))
    return "\n".join(lines)


def _refit_note(x: PlanInputs, layers: int) -> str:
    moved = [n.upper() for n in ("pp", "vp") if n in x.defaulted and x.values[n] != DEFAULTS[n]]
    return (f" ({' and '.join(moved)}: the nearest to PP{DEFAULTS['pp']} VP{DEFAULTS['vp']} that "
            f"divide the {layers} layers)" if moved else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def percent(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole`` with two significant digits below 0.01%, so a
    saving is never shown as 0.00%."""
    share = 100 * part / whole
    return f"{share:.2f}%" if share == 0 or abs(share) >= 0.01 else f"{share:.2g}%"


def plan_report(args: argparse.Namespace) -> Tuple[str, Dict[Placement, Timeline]]:
    """The text ``plan`` prints and the timelines behind it; raises PlanInputError / ScheduleError."""
    text, timelines, _ = plan_result(args)
    return text, timelines


def plan_result(args: argparse.Namespace) -> Tuple[str, Dict[Placement, Timeline], Dict]:
    """:func:`plan_report`'s text and timelines, and the summary ``--format json`` prints."""
    x = resolve(args)
    summary: Dict = {"source": x.source, "recipe": x.recipe, "gpu": x.gpu}
    model = x.model
    global_batch = x.global_batch or 8 * x.pp * x.micro_batch * x.dp
    layout = Layout(x.tp, x.pp, x.vp, x.dp, x.micro_batch, global_batch, cp=x.cp, ep=x.ep,
                    etp=x.expert_tp)
    work, reason = _work(x)
    try:
        m = _microbatches(x, layout)
        schedule = _schedule(x, m, layout)
        layout.layers_per_chunk(model)
        _check_context_parallel(model.seq, x.cp)
    except (PlanInputError, ScheduleError):
        if not reason:
            raise
        return f"{x.source}: nothing to align: {reason}.\n", {}, _nothing(summary, reason)
    head = _head(x, model, global_batch, m, schedule.n)
    if reason:
        return f"{head}\nnothing to align: {reason}.\n", {}, _nothing(summary, reason)
    costs, info = chunk_costs(model, layout, GPUS[x.gpu], tflops=x.tflops,
                              transpose_tbps=x.transpose_tbps,
                              allgather_gbps=x.allgather_gbps, p2p_gbps=x.p2p_gbps,
                              overlap_penalty=x.overlap_penalty, work=work)
    costs, measured = apply_measured(args, costs, x.pp, x.vp)
    # two clocks (host times measured) model none / lazy / aligned only
    placements = TWO_CLOCK_PLACEMENTS if costs.two_clocks else tuple(Placement)
    timelines = {p: simulate(schedule, p, costs, overlap_p2p=x.overlap_p2p) for p in placements}
    lines = [head, _costs_line(costs, info, x, work)] + ([measured] if measured else []) + [
        "", _table(timelines, schedule.pp), "", _recommendation(timelines), _TRUST]
    summary.update(_summary(timelines, costs, work, info, m))
    return "\n".join(lines) + "\n", timelines, summary


def _microbatches(x: PlanInputs, layout: Layout) -> int:
    """M, the microbatches per step, inside what plan models; a global batch that does not
    divide is named with the nearest that fits."""
    per, batch = layout.micro_batch * layout.dp, layout.global_batch
    try:
        m = layout.microbatches()
    except PlanInputError as err:
        raise PlanInputError(f"{err}{_nearest_note(x, per, batch)}") from None
    if m > MAX_MICROBATCHES:
        raise PlanInputError(
            f"--global-batch {batch}: M = global batch / (micro-batch x DP) = {batch} / {per} = "
            f"{m} microbatches per step, outside the range plan models, 1 to {MAX_MICROBATCHES} "
            f"(pass a --global-batch of at most {MAX_MICROBATCHES * per}, or a larger "
            "--micro-batch or --dp)")
    return m


def _schedule(x: PlanInputs, m: int, layout: Layout) -> InterleavedSchedule:
    try:
        return InterleavedSchedule(x.pp, x.vp, m, x.group_size)
    except ScheduleError as err:
        per = layout.micro_batch * layout.dp
        raise ScheduleError(f"{err}{_nearest_note(x, per, layout.global_batch)}") from None


def _fits(pp: int, vp: int, m: int, n: Optional[int]) -> bool:
    try:
        InterleavedSchedule(pp, vp, m, n)
    except ScheduleError:
        return False
    return True


def nearest_global_batch(pp: int, vp: int, n: Optional[int], per: int, batch: int
                         ) -> Optional[int]:
    """The global batch nearest ``batch`` whose M (``batch / per``, ``per`` = micro-batch x DP)
    the schedule accepts, within what plan models; a tie goes up (no samples dropped). Integer
    arithmetic only: ``batch / per`` in floats rounds huge batches (2**53 and up) to another
    count. None when no M near fits (an N below PP, PP or VP below 2)."""
    if pp < 2 or vp < 2:
        return None
    low = batch // per
    span = 2 * max(pp, n or pp) + 2  # valid counts recur every group of max(N, PP)
    fits = [k for k in range(max(low - span, 1), min(low + span, MAX_MICROBATCHES) + 1)
            if _fits(pp, vp, k, n)]
    if not fits:
        return None
    return min(fits, key=lambda k: (abs(k * per - batch), -k)) * per


def _nearest_note(x: PlanInputs, per: int, batch: int) -> str:
    best = nearest_global_batch(x.pp, x.vp, x.group_size, per, batch)
    return "" if best is None else (f"; the nearest global batch that fits: --global-batch "
                                    f"{best} (M={best // per})")


def _rounded(value):
    """Floats to 6 decimals (nanoseconds in ms): no last-digit noise from one CPU to another."""
    if isinstance(value, float):
        return round(value, 6) + 0.0
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return [_rounded(v) for v in value] if isinstance(value, list) else value


def _nothing(summary: Dict, reason: str) -> Dict:
    return dict(summary, nothing_to_align=reason, saving_ms=0.0, step_ms=None,
                policy_step_ms=None)


def _summary(tls: Dict[Placement, Timeline], costs: Costs, work: PostProcessing,
             info: Dict, m: int) -> Dict:
    step = {p.value: tl.step_time * 1e3 for p, tl in tls.items()}
    return {"nothing_to_align": None, "microbatches": m,
            "saving_ms": step["lazy"] - step["aligned"],
            "lazy_extra_ms": step["lazy"] - step["none"], "step_ms": step,
            # the plugin's policies: off leaves megatron-core / TE building at first use (lazy)
            "policy_step_ms": {"off": step["lazy"], "lazy": step["lazy"],
                               "aligned": step["aligned"]},
            "modelled_only": [p.value for p in _MODELLED_ONLY if p in tls],
            "two_clocks": costs.two_clocks,
            "post_processing": {"kind": work.kind, "what": work.what,
                                "bytes_per_weight": work.bytes_per_weight,
                                "bytes_per_chunk": work.bytes_per_weight * info["weight_bytes"],
                                "tbps": info["transpose_tbps"], "rate_source": info["rate_source"]},
            "per_chunk_ms": {"forward": costs.forward * 1e3, "backward": costs.backward * 1e3,
                             "post_processing": costs.transpose * 1e3,
                             "host_wait": costs.host_wait * 1e3,
                             "allgather": costs.allgather * 1e3, "p2p": costs.p2p * 1e3},
            "per_rank_chunk": costs.per_chunk is not None,
            "shared_gpu_slowdown": costs.shared_gpu_slowdown}


def _check_context_parallel(seq: int, cp: int) -> None:
    """Megatron-LM 0.19.2 asserts 'seq-length should be a multiple of 2 * context-parallel-size'
    (megatron-core's get_batch_on_this_cp_rank splits each sequence into 2 x CP pieces)."""
    if cp > 1 and seq % (2 * cp):
        fits = [c for c in range(2, seq // 2 + 1) if seq % (2 * c) == 0]
        near = min(fits, key=lambda c: (abs(c - cp), c), default=None)
        hint = f"--cp {near}" if near else "--cp 1"
        raise PlanInputError(
            f"--cp {cp}: the sequence length {seq} is not a multiple of 2 x CP = {2 * cp} "
            f"(megatron-core splits each sequence into 2 x CP pieces; Megatron-LM refuses it); "
            f"use {hint}, or a sequence length that is a multiple of {2 * cp}")


def _costs_line(c: Costs, info: Dict, args: PlanInputs, work: PostProcessing) -> str:
    if work.kind != "transpose":
        return _work_line(c, info, args, work)
    src = GPUS[args.gpu].source
    return (f"per chunk and microbatch: {_count(info['layers_per_chunk'], 'layer')}, "
            f"{info['weight_bytes'] / 1e6:.0f} MB of FP8 weights per GPU; forward {c.forward * 1e3:.2f} ms, "
            f"backward {c.backward * 1e3:.2f} ms, transposes {c.transpose * 1e3:.3f} ms "
            f"({100 * c.transpose / c.forward:.1f}% of a forward), all-gather "
            f"{c.allgather * 1e3:.2f} ms, p2p {c.p2p * 1e3:.2f} ms\n"
            f"rates: {info['tflops']:.0f} TFLOP/s fwd+bwd and {info['transpose_tbps']:.2f} TB/s "
            f"transposes ({'given' if args.tflops or args.transpose_tbps else src}); "
            f"all-gather {args.allgather_gbps:g} GB/s and p2p {args.p2p_gbps:g} GB/s (assumed unless "
            "given); the optimizer step and gradient reduce-scatters are not modelled")


def _work_line(c: Costs, info: Dict, args: PlanInputs, work: PostProcessing) -> str:
    n, gpu_src, rate_src = info["weight_bytes"], GPUS[args.gpu].source, info["rate_source"]
    notes = []
    if args.recipe == "mxfp8" and args.reuse_grad_buf is None:
        notes.append("reuse_grad_buf_for_mxfp8_param_ag on (Megatron-Bridge's Blackwell default; "
                     "--no-reuse-grad-buf-for-mxfp8-param-ag: nothing to align)")
    if args.recipe == "nvfp4" and not args.tflops:
        notes.append("compute at the FP8 rate (NVFP4 GEMMs may be faster: pass --tflops)")
    return (f"per chunk and microbatch: {_count(info['layers_per_chunk'], 'layer')}, "
            f"{n / 1e6:.0f} M weights per GPU; forward {c.forward * 1e3:.2f} ms, backward "
            f"{c.backward * 1e3:.2f} ms, all-gather {c.allgather * 1e3:.2f} ms, p2p "
            f"{c.p2p * 1e3:.2f} ms\n"
            f"post-all-gather work ({args.recipe}: {work.kind}): {work.what}; "
            f"{work.bytes_per_weight * n / 1e6:.0f} MB moved per chunk, "
            f"{c.transpose * 1e3:.3f} ms ({100 * c.transpose / c.forward:.1f}% of a forward)"
            + "".join(f"; {x}" for x in notes) + "\n"
            f"rates: {info['tflops']:.0f} TFLOP/s fwd+bwd"
            + ("" if rate_src == gpu_src else f" ({'given' if args.tflops else gpu_src})")
            + f" and {info['transpose_tbps']:.2f} TB/s {work.kind} ({rate_src}); all-gather "
            f"{args.allgather_gbps:g} GB/s and p2p {args.p2p_gbps:g} GB/s (assumed unless given); "
            "the optimizer step and gradient reduce-scatters are not modelled")


def _ms3(seconds: float) -> float:
    """Milliseconds at the table's 3 decimals; a difference that rounds to zero prints 0.000,
    not -0.000 (the sums differ by rounding from one Python/CPU to another)."""
    return round(seconds * 1e3, 3) + 0.0


def _table(tls: Dict[Placement, Timeline], pp: int) -> str:
    base, lazy = tls[Placement.NONE], tls[Placement.LAZY]
    rows = [f"{'placement':<20}{'step ms':>10}{'extra ms':>10}{'transposes ms/rank':>20}"
            f"{'idle vs none ms/rank':>22}{'speedup vs lazy':>17}"]
    for p, tl in tls.items():
        own = sum(tl.busy(r) - base.busy(r) for r in range(pp)) / pp
        idle = sum(tl.idle(r) - base.idle(r) for r in range(pp)) / pp
        name = p.value + (" (modelled)" if p in _MODELLED_ONLY else "")
        extra = _ms3(tl.step_time - base.step_time)
        rows.append(f"{name:<20}{tl.step_time * 1e3:>10.2f}{extra:>10.3f}"
                    f"{_ms3(own):>20.3f}{_ms3(idle):>22.3f}{lazy.step_time / tl.step_time:>17.4f}")
    rows.append("(extra: step time the transposes add; idle vs none: the idle they induce per rank, "
                "negative where they filled idle time)")
    return "\n".join(rows)


#: What the calibration rounds (benchmarks/results/planner_calibration.md) support, printed
#: under every recommendation so that nobody reads a prediction as a measurement.
_TRUST = ("How far to trust it: compared with measurements only on one GPU split by CUDA MPS, "
          "fed each run's own durations (docs/planner.md, 'How well it predicts'): a generic "
          "transpose's saving came out from about 20% low to 50% high, TE's transpose's saving (a "
          "few ms, under 1% of a step) was not predicted; never compared on one GPU per rank.")


def _recommendation(tls: Dict[Placement, Timeline]) -> str:
    base, lazy, aligned = (tls[p].step_time for p in (Placement.NONE, Placement.LAZY,
                                                      Placement.ALIGNED))
    extra, saved = lazy - base, lazy - aligned
    if extra <= 0:
        return "Recommendation: the transposes cost this configuration no step time; nothing to gain."
    share = saved / extra
    best = min(tls, key=lambda p: tls[p].step_time if p is not Placement.NONE else float("inf"))
    verdict = ("turn it on" if saved / lazy >= 0.002 else "harmless but the gain is below 0.2%")
    text = (f"Recommendation: {verdict}: aligned saves {saved * 1e3:.3f} ms per step "
            f"({percent(saved, lazy)}), {100 * share:.0f}% of the {extra * 1e3:.3f} ms the lazy "
            "transposes add.")
    if best in _MODELLED_ONLY and tls[best].step_time < aligned - 1e-9:
        text += (f" The modelled '{best.value}' placement (not implemented) would save "
                 f"{(lazy - tls[best].step_time) * 1e3:.3f} ms.")
    return text


def _config_keys_named(args: argparse.Namespace, message: str) -> str:
    """The config keys behind the flags ``message`` names, for values the CONFIG.yaml gave (not
    the command line): a user who passed no --global-batch must learn where 32 came from."""
    if not getattr(args, "config", None):
        return ""
    keys = [f"{flag(name)} is model.{key}" for name, key in CONFIG_KEYS.items()
            if re.search(re.escape(flag(name)) + r"\b(?!-)", message)
            and getattr(args, name, None) is None]
    return f" ({'; '.join(keys)} in {args.config})" if keys else ""


def run_plan(args: argparse.Namespace) -> int:
    try:
        problem = plot_path_problem(args.plot)
        if problem:
            raise PlanInputError(problem)
        text, timelines, summary = plan_result(args)
    except (PlanInputError, ScheduleError) as err:
        print(f"nemo-fp8-align plan: error: {err}{_config_keys_named(args, str(err))}",
              file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(_rounded(summary), sort_keys=True, indent=2))
    else:
        print(text, end="")
    if args.plot and timelines:
        try:
            plot_plan(timelines[Placement.LAZY], timelines[Placement.ALIGNED], args.plot,
                      full=args.plot_window == "full")
        except (ImportError, OSError, ValueError) as err:
            print(f"nemo-fp8-align plan: error: --plot {args.plot}: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


# ---------------------------------------------------------------------------------------------
# Inputs: a config, a preset or explicit sizes, then flags; the rest from DEFAULTS


#: Parallel layout and p2p defaults. p2p: Megatron-LM's with interleaving (overlap on, which
#: megatron-core requires batch off); NeMo 1.x YAMLs without the keys mean overlap off, batch on.
DEFAULTS: Dict[str, Any] = {"tp": 8, "pp": 8, "vp": 2, "dp": 1, "cp": 1, "ep": 1,
                            "micro_batch": 1, "overlap_p2p": True, "batch_p2p": False}
NEMO_P2P = {"overlap_p2p": False, "batch_p2p": True}
_INT_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "tp", "pp", "vp", "dp", "cp",
              "ep", "expert_tp", "experts", "topk", "moe_ffn", "micro_batch", "global_batch",
              "group_size")
_FLOAT_FLAGS = ("tflops", "transpose_tbps", "allgather_gbps", "p2p_gbps", "overlap_penalty")
#: flag -> the model.* key of a NeMo config it reads
CONFIG_KEYS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_query_groups", "ffn": "ffn_hidden_size", "seq": "encoder_seq_length",
               "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
               "ep": "expert_model_parallel_size", "expert_tp": "expert_tensor_parallel_size",
               "experts": "num_moe_experts", "topk": "moe_router_topk",
               "moe_ffn": "moe_ffn_hidden_size", "micro_batch": "micro_batch_size",
               "global_batch": "global_batch_size",
               "group_size": "microbatch_group_size_per_vp_stage",
               "overlap_p2p": "overlap_p2p_comm", "batch_p2p": "batch_p2p_comm"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class PlanInputs:
    """Everything the plan needs, and where each value came from."""

    values: Dict[str, Any]
    model: ModelShape
    source: str  # preset name, config path or "custom model"
    defaulted: List[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


#: The largest value plan models, per integer setting: beyond any model or cluster trained
#: today, and small enough that the timeline stays finite and readable (10**20 layers printed
#: a table of 20-digit numbers). M, the microbatches per step, is bounded by MAX_MICROBATCHES.
LIMITS = {"layers": 4096, "hidden": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16,
          "ffn": 1 << 22, "seq": 1 << 24, "tp": 1024, "pp": 1024, "vp": 1024, "dp": 1 << 20,
          "cp": 1024, "ep": 1 << 16, "expert_tp": 1024, "experts": 1 << 16, "topk": 1 << 16,
          "moe_ffn": 1 << 22, "micro_batch": 1 << 16, "global_batch": 1 << 40,
          "group_size": 1 << 16}
#: Microbatches per step the timeline simulates at most (its time grows faster than M: about
#: 12 s for M = 1024 at PP 8 on one CPU core; 10**20 never ended, or overflowed).
MAX_MICROBATCHES = 4096
#: The range plan models, per float setting (rates and the penalty factor).
FLOAT_LIMITS = {"tflops": 1e6, "transpose_tbps": 1e4, "allgather_gbps": 1e6, "p2p_gbps": 1e6,
                "overlap_penalty": 100.0}


def _out_of_range(name: str, value: int) -> Optional[str]:
    """Why an integer setting's value is outside what plan models (None when inside)."""
    if value < 1:
        return f"{value}: must be an integer >= 1"
    if value > LIMITS[name]:
        return (f"{value}: outside the range plan models, 1 to {LIMITS[name]} (pass a value "
                "in that range)")
    return None


def _check_numbers(args: argparse.Namespace) -> None:
    for name in _INT_FLAGS:
        value = getattr(args, name, None)
        why = None if value is None else _out_of_range(name, value)
        if why:
            raise PlanInputError(f"{flag(name)} {why}")
    for name in _FLOAT_FLAGS:
        value = getattr(args, name, None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise PlanInputError(f"{flag(name)} {value}: must be > 0 and finite")
        if value is not None and value > FLOAT_LIMITS[name]:
            raise PlanInputError(f"{flag(name)} {value:g}: outside the range plan models, above "
                                 f"0 up to {FLOAT_LIMITS[name]:g} (pass a value in that range)")


def _from_config(path: str, overrides: List[str]) -> Dict[str, Any]:
    """The sizes a NeMo (or launcher: under ``training:``) config gives, by flag name, read as
    ``check`` reads them: NeMo's and the launcher's resolvers (``${multiply:4, ${.hidden_size}}``)
    and ``${training.*}`` resolve; ``fp8``, ``fp8_recipe``, ``fp4`` / ``fp4_recipe`` and
    ``reuse_grad_buf_for_mxfp8_param_ag`` come along (``fp8``, ``recipe``, ``reuse_grad_buf``)."""
    missing = missing_dependency("plan CONFIG.yaml", CHECK_NEEDS)
    if missing is not None:  # before anything imports OmegaConf or Hydra
        raise PlanInputError(f"{missing} (or plan with --model or the size flags)")
    # config_check imports OmegaConf: here, after the check above, so that a plan from --model or
    # the size flags runs without the hydra extra installed
    from nemo_fp8_align.config_check.resolvers import upstream_resolvers

    try:
        cfg = load_config(Path(path), overrides)
    except ConfigLoadError as err:
        raise PlanInputError(str(err).splitlines()[0]) from None
    with upstream_resolvers():
        return _read_config(path, cfg)


def _read_config(path: str, cfg: Any) -> Dict[str, Any]:
    # OmegaConf, through config_check: only a plan from a CONFIG.yaml needs it (_from_config)
    from nemo_fp8_align.config_check.check import config_nodes
    from nemo_fp8_align.config_check.context import CheckContext
    from nemo_fp8_align.config_check.reader import ABSENT, Reader

    prefix = "training." if "model" not in cfg and "training" in cfg else ""
    model_node, trainer_node, problems = config_nodes(cfg)
    if model_node is None or ("model" not in cfg and not prefix):
        raise PlanInputError(f"{path}: no model: block, not a NeMo training config")
    model = Reader(model_node, prefix + "model.")
    trainer = None if trainer_node is None else Reader(trainer_node, prefix + "trainer.")
    ctx = CheckContext(model, trainer)
    # the startup check's own gate (read-only): T5 / BART, BERT, Mamba are not GPT models
    from nemo_fp8_align.config_check.rules.model import other_model_refused

    if other_model_refused(ctx):
        found = ctx.model.violations[-1]
        raise PlanInputError(f"{path}: {found.found}: not planned; plan models {found.expected}"
                             " (plan a GPT config, or pass --model or the size flags alone)")
    out: Dict[str, Any] = {}
    for name, key in CONFIG_KEYS.items():
        value = model.get(key)
        if value is ABSENT or value is None:
            continue
        if name in ("overlap_p2p", "batch_p2p"):
            if not isinstance(value, bool):
                raise PlanInputError(f"{prefix}model.{key}={value!r}: expected true or false")
        elif type(value) is not int or value < 1:
            raise PlanInputError(f"{prefix}model.{key}={value!r}: expected an integer >= 1")
        elif value > LIMITS[name]:
            raise PlanInputError(f"{prefix}model.{key}={value}: outside the range plan models, "
                                 f"1 to {LIMITS[name]} (override it with a value in that range)")
        out[name] = value
    out.update(_config_fp8(model, prefix))
    if model.violations:
        raise PlanInputError(str(model.violations[0]))
    if out.get("vp") == 1:
        out["vp"] = None
    gated = model.get("activation")
    if isinstance(gated, str):
        out["gated_mlp"] = gated.lower() in ("swiglu", "geglu", "reglu", "fast-swiglu")
    dp = ctx.trainer_data_parallel()
    world, mp = ctx.world(), ctx.model_parallel()
    if dp is None and world is not None and mp is not None:
        # raised by resolve() only without --dp: the flag replaces the config's world
        devices = f"{prefix}trainer.devices x {prefix}trainer.num_nodes"
        if world < mp:
            out["_world_problem"] = (
                f"{devices} = {world} GPU{'s' if world != 1 else ''}, fewer than TP x PP x CP = "
                f"{mp} (megatron-core refuses it): set {devices} to a multiple of {mp} (e.g. the "
                f"override {prefix}trainer.devices={mp}), or pass --dp 1 to plan one model "
                f"replica on {mp} GPUs")
        else:
            out["_world_problem"] = (
                f"{devices} = {world} GPUs is not divisible by TP x PP x CP = {mp} (megatron-core"
                f" refuses it): change the node count or the layout, or pass --dp N to plan N "
                f"data-parallel ranks (e.g. --dp {world // mp})")
    if dp is not None:
        out["dp"] = dp
    for name, value in NEMO_P2P.items():
        out.setdefault(name, value)  # NeMo's own defaults for a config without the keys
    return out


def _config_fp8(model: Any, prefix: str) -> Dict[str, Any]:
    """``fp8`` (False: the config trains without FP8), ``recipe`` (NeMo copies
    ``mcore_customization_config`` last, so its ``fp8_recipe`` wins; an ``fp4`` format with
    ``fp4_recipe``, megatron-core's NVFP4 keys, wins over both) and ``reuse_grad_buf`` of a
    config's model node."""
    from nemo_fp8_align.config_check.reader import ABSENT  # OmegaConf: see _read_config

    out: Dict[str, Any] = {}
    for key, name in (("fp8", "fp8"), ("fp8_params", "fp8_params"),
                      ("reuse_grad_buf_for_mxfp8_param_ag", "reuse_grad_buf")):
        value = model.get(key)
        if value is ABSENT or value is None:
            continue
        if not isinstance(value, bool):
            raise PlanInputError(f"{prefix}model.{key}={value!r}: expected true or false")
        out[name] = value
    for key in ("fp8_recipe", "mcore_customization_config.fp8_recipe"):
        recipe = model.get(key)
        if recipe is ABSENT or recipe is None:
            continue
        if recipe not in RECIPES:
            raise PlanInputError(f"{prefix}model.{key}={recipe!r}: not an FP8 recipe plan knows; "
                                 f"one of {', '.join(RECIPES)} (or pass --recipe)")
        out["recipe"] = recipe
    fp4 = model.get("fp4")
    if fp4 not in (ABSENT, None, False):
        recipe = model.get("fp4_recipe")
        recipe = "nvfp4" if recipe in (ABSENT, None) else recipe
        if recipe != "nvfp4":
            raise PlanInputError(f"{prefix}model.fp4_recipe={recipe!r}: plan knows the FP4 "
                                 "recipe nvfp4 only (or pass --recipe)")
        out["recipe"] = recipe
    return out


def _model(v: Dict[str, Any], preset: Optional[str]) -> ModelShape:
    sizes = {k: v.get(k) for k in ("layers", "hidden", "heads", "ffn")}
    if preset is None:
        missing = [flag(k) for k, x in sizes.items() if x is None]
        if missing:
            raise PlanInputError(f"give a CONFIG.yaml, --model ({', '.join(sorted(MODELS))}) or all "
                                 f"of --layers --hidden --heads --ffn (missing {' '.join(missing)})")
        base = ModelShape(sizes["layers"], sizes["hidden"], sizes["heads"],
                          v.get("kv_heads") or sizes["heads"], sizes["ffn"],
                          bool(v.get("gated_mlp")), v.get("seq") or 2048)
    else:
        base = MODELS[preset]
    changes = {k: x for k, x in sizes.items() if x is not None}
    for name, attr in (("kv_heads", "kv_heads"), ("gated_mlp", "gated_mlp"), ("seq", "seq"),
                       ("experts", "experts"), ("topk", "topk"), ("moe_ffn", "moe_ffn")):
        if v.get(name) is not None:
            changes[attr] = v[name]
    model = replace(base, **changes)
    if model.heads % model.kv_heads:
        raise PlanInputError(f"--kv-heads {model.kv_heads}: must divide the {model.heads} attention "
                             "heads (each KV head serves a group of query heads)")
    if model.hidden % model.heads:
        raise PlanInputError(f"--hidden {model.hidden}: must be divisible by the {model.heads} heads")
    if model.experts and model.topk > model.experts:
        raise PlanInputError(f"--topk {model.topk}: more than the {model.experts} experts")
    return model


def _fit_default_layout(v: Dict[str, Any], layers: int, defaulted: List[str]) -> None:
    """PP and VP that were not given default to the pair nearest PP8 VP2 whose product divides
    the layer count (the 126 layers of Llama 3 405B: PP9 VP2): a default never makes the plan
    fail. A PP or VP that was given is kept (its error names it)."""
    free = [name for name in ("pp", "vp") if name in defaulted]
    if not free or layers % (v["pp"] * v["vp"]) == 0:
        return
    pps = range(2, layers + 1) if "pp" in free else [v["pp"]]
    vps = range(2, layers + 1) if "vp" in free else [v["vp"]]
    fits = [(abs(pp - DEFAULTS["pp"]), abs(vp - DEFAULTS["vp"]), -pp, pp, vp)
            for pp in pps for vp in vps if layers % (pp * vp) == 0]
    if not fits and len(free) == 2:
        raise PlanInputError(
            f"{layers} layers: no PP >= 2 and VP >= 2 whose product divides them (the interleaved "
            "schedule gives every chunk the same layers); pass a layer count that has such a split")
    if not fits:
        fixed, other = ("pp", "vp") if "vp" in free else ("vp", "pp")
        raise PlanInputError(
            f"{flag(fixed)} {v[fixed]}: no {other.upper()} >= 2 makes PP x VP divide the {layers} "
            f"layers (every chunk gets the same layers); pass another {flag(fixed)}")
    v["pp"], v["vp"] = min(fits)[3:]


def resolve(args: argparse.Namespace) -> PlanInputs:
    """Config, then preset, then flags; the rest from :data:`DEFAULTS` (named in ``defaulted``)."""
    _check_numbers(args)
    if args.gpu.lower() not in GPUS:
        raise PlanInputError(f"--gpu {args.gpu!r} is not known; use one of {', '.join(sorted(GPUS))}"
                             " (or the closest one with --tflops and --transpose-tbps)")
    v: Dict[str, Any] = dict.fromkeys((*_INT_FLAGS, "gated_mlp", "overlap_p2p", "batch_p2p",
                                       "fp8", "fp8_params", "recipe", "reuse_grad_buf"))
    v.update(_from_config(args.config, args.overrides) if args.config else {})
    world_problem = v.pop("_world_problem", None)
    if world_problem and args.dp is None:
        raise PlanInputError(world_problem)
    if args.overrides and not args.config:
        raise PlanInputError(f"override {args.overrides[0]!r} without a CONFIG.yaml: pass the "
                             "config first (plan CONFIG.yaml key=value ...) or use the flags")
    for name in (*_INT_FLAGS, "gated_mlp", "overlap_p2p", "batch_p2p", "reuse_grad_buf"):
        if getattr(args, name, None) is not None:
            v[name] = getattr(args, name)
    defaulted = []
    for name, value in DEFAULTS.items():
        if v.get(name) is None:
            v[name], _ = value, defaulted.append(name)
    if v["overlap_p2p"] and v["batch_p2p"]:
        raise PlanInputError("--overlap-p2p-comm with --batch-p2p-comm: megatron-core allows one "
                             "of them (pass --no-batch-p2p-comm or --no-overlap-p2p-comm)")
    v["gpu"] = args.gpu.lower()
    for name in _FLOAT_FLAGS:
        v[name] = getattr(args, name)
    v["recipe"] = args.recipe or v["recipe"] or "delayed"  # the flag, the config, megatron-core's
    model = _model(v, args.model)
    _fit_default_layout(v, model.layers, defaulted)
    if model.kv_heads % v["tp"] and v["tp"] % model.kv_heads:
        raise PlanInputError(f"--tp {v['tp']}: the {model.kv_heads} KV heads must be divisible by "
                             "TP (or TP by them)")
    return PlanInputs(v, model, args.model or args.config or "custom model", defaulted)


# ---------------------------------------------------------------------------------------------
# Measured durations (calibration): they replace the derived ones


_HELP = {
    "forward": "one chunk's forward per microbatch",
    "backward": "one chunk's backward per microbatch",
    "transpose": "one chunk's post-all-gather work (transposes) per step, built alone (lazy)",
    "host_wait": "host work at a chunk's first forward of a step during which the GPU idles "
                 "(that forward minus the chunk's median forward, where no transposes run in it)",
    "forward_host": "the host's time for one forward call (launching it); with the two other "
                    "host times it switches to two clocks per rank, and --measured-forward-ms, "
                    "-backward-ms, -transpose-ms are then the GPU's own times (for launch-bound "
                    "runs: small chunks)",
    "backward_host": "the host's time for one backward call (two clocks)",
    "transpose_host": "the host's time to build one chunk's transposes (two clocks)",
}


def measured_flag(name: str) -> str:
    if name == "shared_gpu_slowdown":
        return "--shared-gpu-slowdown"
    return f"--measured-{name.replace('_', '-')}-ms"


def add_measured_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "measured durations (calibration)",
        "milliseconds from a profile of your own run; each per-chunk one is a single value or "
        "PP x VP comma-separated values, rank-major (r0c0,r0c1,...,r1c0,...); they replace the "
        "durations derived from the sizes and rates")
    for name in PER_CHUNK:
        g.add_argument(measured_flag(name), dest=f"measured_{name}", default=None, metavar="MS",
                       help=_HELP[name])
    g.add_argument("--measured-p2p-ms", dest="measured_p2p", type=float, default=None,
                   metavar="MS", help="one activation or gradient transfer between stages")
    g.add_argument("--ranks-share-gpu", action="store_true",
                   help="the pipeline ranks share one GPU (CUDA MPS): transposes that every rank "
                   "builds at the same slot contend for its memory (--shared-gpu-slowdown)")
    g.add_argument("--shared-gpu-slowdown", type=float, default=None, metavar="X",
                   help=f"with --ranks-share-gpu: aligned transposes take X times the measured "
                   f"(staggered) ones (default {SHARED_GPU_SLOWDOWN:.3f}, measured on an H200 "
                   "split by MPS)")


def _values(name: str, text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise PlanInputError(f"{measured_flag(name)} {text!r}: expected milliseconds, one number "
                             "or comma-separated numbers (e.g. 4.5 or 4.7,4.3,4.4,4.6)") from None
    return values


def given(args: argparse.Namespace) -> Dict[str, List[float]]:
    return {name: _values(name, getattr(args, f"measured_{name}")) for name in PER_CHUNK
            if getattr(args, f"measured_{name}", None) is not None}


def apply_measured(args: argparse.Namespace, costs: Costs, pp: int, vp: int
                   ) -> Tuple[Costs, Optional[str]]:
    """``costs`` with the measured durations in, and a line saying what was measured."""
    measured, p2p = given(args), args.measured_p2p
    slowdown = args.shared_gpu_slowdown
    if slowdown is not None and not args.ranks_share_gpu:
        raise PlanInputError(f"--shared-gpu-slowdown {slowdown:g} without --ranks-share-gpu: "
                             "add --ranks-share-gpu (the slowdown applies only when the ranks "
                             "share one GPU)")
    if p2p is not None and not math.isfinite(p2p):
        raise PlanInputError(f"--measured-p2p-ms {p2p}: must be >= 0 and finite")
    share = SHARED_GPU_SLOWDOWN if slowdown is None else slowdown
    if not measured and p2p is None and not args.ranks_share_gpu:
        return costs, None
    out = measured_costs(costs, pp, vp, measured, p2p_ms=p2p,
                         shared_gpu_slowdown=share if args.ranks_share_gpu else 1.0,
                         label=measured_flag)
    named = [measured_flag(n) for n in measured] + (["--measured-p2p-ms"] if p2p is not None
                                                    else [])
    line = ("measured (replacing the derived durations): " + (" ".join(named) or "none")
            + (f"; ranks share one GPU: aligned transposes x{share:.3f}"
               if args.ranks_share_gpu else "")
            + ("; two clocks per rank (host and GPU times)" if out.two_clocks else ""))
    return out, line


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(argv or [])])
    return args.func(args)
