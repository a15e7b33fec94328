"""``nemo-fp8-align plan``: what aligning the FP8 transposes gains a configuration, predicted by
the timeline model (:mod:`nemo_fp8_align.planner`), per placement, with an optional Gantt PNG."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.core.schedule import InterleavedSchedule, ScheduleError
from nemo_fp8_align.cli.plan_inputs import CONFIG_KEYS, DEFAULTS, PlanInputs, flag, resolve
from nemo_fp8_align.cli.plan_measured import add_measured_arguments, apply_measured
from nemo_fp8_align.planner.costs import (GPUS, MODELS, OVERLAP_PENALTY_H200, Layout,
                                           PlanInputError, chunk_costs)
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.recipes import RECIPES, PostProcessing, post_processing
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
        p.add_argument(name, type=int, default=None, help=help_)
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
        p.add_argument(name, type=int, default=None, help=help_)
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
    p.set_defaults(func=run_plan)


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
        m = layout.microbatches()
        schedule = InterleavedSchedule(x.pp, x.vp, m, x.group_size)
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
    from nemo_fp8_align.cli.report_input import plot_path_problem

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
        import json

        print(json.dumps(_rounded(summary), sort_keys=True, indent=2))
    else:
        print(text, end="")
    if args.plot and timelines:
        from nemo_fp8_align.planner.gantt import plot_plan

        try:
            plot_plan(timelines[Placement.LAZY], timelines[Placement.ALIGNED], args.plot,
                      full=args.plot_window == "full")
        except (ImportError, OSError, ValueError) as err:
            print(f"nemo-fp8-align plan: error: --plot {args.plot}: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(argv or [])])
    return args.func(args)
