"""``nemo-fp8-align plan``: what aligning the FP8 transposes gains a configuration, predicted by
the timeline model (:mod:`nemo_fp8_align.planner`), per placement, with an optional Gantt PNG."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.core.schedule import InterleavedSchedule, ScheduleError
from nemo_fp8_align.planner.costs import (GPUS, MODELS, OVERLAP_PENALTY_H200, Layout, ModelShape,
                                           PlanInputError, chunk_costs)
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.simulate import Costs, Timeline, simulate

__all__ = ["add_plan_parser", "plan_report", "run_plan"]

_MODELLED_ONLY = (Placement.BUBBLE, Placement.OVERLAP)


def add_plan_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("plan", help="predict the step time with lazy / aligned / modelled FP8 "
                       "transpose placements for a model and parallel layout")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="a preset; or give --layers --hidden --heads --ffn (and --kv-heads)")
    for name, help_ in (("--layers", "transformer layers"), ("--hidden", "hidden size"),
                        ("--heads", "attention heads"), ("--kv-heads", "KV heads (default: heads)"),
                        ("--ffn", "MLP hidden size")):
        p.add_argument(name, type=int, default=None, help=help_)
    p.add_argument("--gated-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="SwiGLU-style MLP with 3 matrices (presets know theirs)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (preset's by default)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--vp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None, help="default: 8 x PP x micro x DP")
    p.add_argument("--group-size", type=int, default=None,
                   help="microbatch_group_size_per_vp_stage N (default PP)")
    p.add_argument("--gpu", default="h200", help=f"one of {', '.join(sorted(GPUS))}")
    p.add_argument("--recipe", choices=["delayed", "tensorwise", "mxfp8"], default="delayed")
    p.add_argument("--tflops", type=float, default=None,
                   help="achieved forward+backward TFLOP/s per GPU (GPU default otherwise)")
    p.add_argument("--transpose-tbps", type=float, default=None,
                   help="FP8 transpose bandwidth, read+write TB/s (GPU default otherwise)")
    p.add_argument("--allgather-gbps", type=float, default=40.0,
                   help="data-parallel all-gather GB/s per GPU (default 40, assumed)")
    p.add_argument("--p2p-gbps", type=float, default=40.0,
                   help="pipeline send/receive GB/s (default 40, assumed)")
    p.add_argument("--overlap-penalty", type=float, default=OVERLAP_PENALTY_H200,
                   help="side-stream transposes cost this many times their own time "
                   f"(default {OVERLAP_PENALTY_H200:.2f}, measured on the H200)")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a Gantt PNG of lazy vs aligned")
    p.add_argument("--plot-window", choices=["auto", "full"], default="auto",
                   help="auto: a long step shows its warm-up, where the transposes are (default)")
    p.set_defaults(func=run_plan)


def _model(args: argparse.Namespace) -> ModelShape:
    explicit = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn")}
    if args.model is None:
        missing = [f"--{k}" for k, v in explicit.items() if v is None]
        if missing:
            raise PlanInputError(f"give --model ({', '.join(sorted(MODELS))}) or all of --layers "
                                 f"--hidden --heads --ffn (missing {' '.join(missing)})")
        model = ModelShape(args.layers, args.hidden, args.heads, args.kv_heads or args.heads,
                           args.ffn, bool(args.gated_mlp), args.seq or 2048)
    else:
        model = MODELS[args.model]
        overrides = {k: v for k, v in explicit.items() if v is not None}
        if args.kv_heads is not None:
            overrides["kv_heads"] = args.kv_heads
        if args.gated_mlp is not None:
            overrides["gated_mlp"] = args.gated_mlp
        model = replace(model, **overrides)
    if args.seq is not None:
        model = replace(model, seq=args.seq)
    return model


def _nothing_to_align(args: argparse.Namespace) -> Optional[str]:
    if args.gpu not in GPUS:
        raise PlanInputError(f"--gpu {args.gpu!r} is not known; use one of {', '.join(sorted(GPUS))}"
                             " (or the closest one with --tflops and --transpose-tbps)")
    needed, reason = GPUS[args.gpu].needs_transpose
    if not needed:
        return reason
    if args.recipe == "mxfp8":
        return ("MXFP8 quantises its columnwise copy from high precision with its own block "
                "scales; there is no byte transpose to build or align")
    return None


def plan_report(args: argparse.Namespace) -> Tuple[str, Dict[Placement, Timeline]]:
    """The text ``plan`` prints and the timelines behind it; raises PlanInputError / ScheduleError."""
    reason = _nothing_to_align(args)
    model = _model(args)
    global_batch = args.global_batch or 8 * args.pp * args.micro_batch * args.dp
    layout = Layout(args.tp, args.pp, args.vp, args.dp, args.micro_batch, global_batch)
    m = layout.microbatches()
    schedule = InterleavedSchedule(args.pp, args.vp, m, args.group_size)
    layout.layers_per_chunk(model)
    head = (f"{args.model or 'custom model'}: {model.layers} layers, hidden {model.hidden}, seq "
            f"{model.seq}; TP={args.tp} PP={args.pp} VP={args.vp} DP={args.dp} micro-batch "
            f"{args.micro_batch}, global batch {global_batch} -> M={m} (N={schedule.n}); {args.gpu}")
    if reason:
        return f"{head}\nnothing to align: {reason}.\n", {}
    costs, info = chunk_costs(model, layout, GPUS[args.gpu], tflops=args.tflops,
                              transpose_tbps=args.transpose_tbps,
                              allgather_gbps=args.allgather_gbps, p2p_gbps=args.p2p_gbps,
                              overlap_penalty=args.overlap_penalty)
    timelines = {p: simulate(schedule, p, costs) for p in Placement}
    lines = [head, _costs_line(costs, info, args), "", _table(timelines, schedule.pp),
             "", _recommendation(timelines)]
    return "\n".join(lines) + "\n", timelines


def _costs_line(c: Costs, info: Dict[str, float], args: argparse.Namespace) -> str:
    src = GPUS[args.gpu].source
    return (f"per chunk and microbatch: {info['layers_per_chunk']} layers, "
            f"{info['weight_bytes'] / 1e6:.0f} MB of FP8 weights per GPU; forward {c.forward * 1e3:.2f} ms, "
            f"backward {c.backward * 1e3:.2f} ms, transposes {c.transpose * 1e3:.3f} ms "
            f"({100 * c.transpose / c.forward:.1f}% of a forward), all-gather "
            f"{c.allgather * 1e3:.2f} ms, p2p {c.p2p * 1e3:.2f} ms\n"
            f"rates: {info['tflops']:.0f} TFLOP/s fwd+bwd and {info['transpose_tbps']:.2f} TB/s "
            f"transposes ({'given' if args.tflops or args.transpose_tbps else src}); "
            f"all-gather {args.allgather_gbps:g} GB/s and p2p {args.p2p_gbps:g} GB/s (assumed unless "
            "given); the optimizer step and gradient reduce-scatters are not modelled")


def _table(tls: Dict[Placement, Timeline], pp: int) -> str:
    base, lazy = tls[Placement.NONE], tls[Placement.LAZY]
    rows = [f"{'placement':<20}{'step ms':>10}{'extra ms':>10}{'transposes ms/rank':>20}"
            f"{'idle vs none ms/rank':>22}{'speedup vs lazy':>17}"]
    for p, tl in tls.items():
        own = sum(tl.busy(r) - base.busy(r) for r in range(pp)) / pp
        idle = sum(tl.idle(r) - base.idle(r) for r in range(pp)) / pp
        name = p.value + (" (modelled)" if p in _MODELLED_ONLY else "")
        rows.append(f"{name:<20}{tl.step_time * 1e3:>10.2f}{(tl.step_time - base.step_time) * 1e3:>10.3f}"
                    f"{own * 1e3:>20.3f}{idle * 1e3:>22.3f}{lazy.step_time / tl.step_time:>17.4f}")
    rows.append("(extra: step time the transposes add; idle vs none: the idle they induce per rank, "
                "negative where they filled idle time)")
    return "\n".join(rows)


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
            f"({100 * saved / lazy:.2f}%), {100 * share:.0f}% of the {extra * 1e3:.3f} ms the lazy "
            "transposes add.")
    if best in _MODELLED_ONLY and tls[best].step_time < aligned - 1e-9:
        text += (f" The modelled '{best.value}' placement (not implemented) would save "
                 f"{(lazy - tls[best].step_time) * 1e3:.3f} ms.")
    return text


def run_plan(args: argparse.Namespace) -> int:
    try:
        text, timelines = plan_report(args)
    except (PlanInputError, ScheduleError) as err:
        print(f"nemo-fp8-align plan: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.plot and timelines:
        from nemo_fp8_align.planner.gantt import plot_timelines, warmup_window

        lazy, aligned = timelines[Placement.LAZY], timelines[Placement.ALIGNED]
        window = None
        if args.plot_window == "auto" and warmup_window(lazy) < 0.6 * lazy.step_time:
            window = max(warmup_window(lazy), warmup_window(aligned))
        try:
            plot_timelines([lazy, aligned], ["lazy (today)", "aligned (this plugin)"], args.plot,
                           window=window)
        except ImportError as err:
            print(f"nemo-fp8-align plan: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(argv or [])])
    return args.func(args)
