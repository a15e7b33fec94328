"""Idle time on the real interleaved schedule, measured on the CPU, against the timeline model.

megatron-core's interleaved 1F1B schedule, DDP with overlapped and aligned param all-gathers and
the DistributedOptimizer run on gloo exactly as in the demo (``PipelineRun``, timed by
``pipeline_step_time._measure``), but every chunk forward and backward *waits* a fixed time and
a chunk's transposes cost ``delta`` (``lab.demo.sleep_model``), so four ranks on two
CPU cores give a GPU-like timeline. Per configuration, in one process group:

* ``none``: no transpose cost (the baseline), plugin off;
* ``off``: transposes cost delta (the largest), plugin off (built at first use);
* ``lazy`` / ``aligned`` for every delta.

For every run it reports step time min/median/max (the slowest rank per step), per-rank idle
(step - compute - transposes), the transpose-induced extra step time and the share ``aligned``
removes; and the timeline model's prediction of the same differences from the measured forward,
backward and transpose durations (:mod:`nemo_fp8_align.planner`)::

    .venv/bin/python benchmarks/pipeline_idle_cpu.py --nice -20   # the full sweep (~35 min)
    .venv/bin/python benchmarks/pipeline_idle_cpu.py --shapes 2:4 --deltas 0.2 --steps 2 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_step_time import _checks, _measure  # noqa: E402  (the same timing code)

from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.model import DemoModelConfig  # noqa: E402
from lab.demo.sleep_model import SleepCosts, attach_sleep_costs  # noqa: E402
from lab.demo.train import DemoOptions, distributed  # noqa: E402
from nemo_fp8_align.core.schedule import InterleavedSchedule  # noqa: E402
from nemo_fp8_align.planner import Costs, Placement, simulate  # noqa: E402

TINY = DemoModelConfig(vocab_size=32, hidden_size=16, num_heads=2, seq_length=8, layers_per_chunk=1)


def _runs(deltas: List[float]) -> List[Tuple[str, Policy, float]]:
    """(label, policy, delta as a fraction of a forward), in the order they run."""
    runs = [("off", Policy.OFF, max(deltas)), ("none", Policy.OFF, 0.0)]
    for d in deltas:
        runs += [("lazy", Policy.LAZY, d), ("aligned", Policy.ALIGNED, d)]
    return runs


def _worker(rank: int, args: argparse.Namespace, vp: int, m: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    if args.nice:
        os.nice(args.nice)  # wake promptly from the sleeps on a loaded machine (root for < 0)
    base = DemoOptions(pp=args.pp, vp=vp, dp=1, microbatches=m, micro_batch_size=1, model=TINY,
                       device="cpu", eval_after_each_step=False)
    runs = _runs(args.deltas)
    results = [{"label": label, "policy": policy.value, "delta": delta, "problems": [],
                "ranks": [{"pp_rank": r, "step_ms": [], "busy_ms": [], "transpose_ms": []}
                          for r in range(args.pp)]} for label, policy, delta in runs]
    per_round = -(-args.steps // args.rounds)
    with distributed(rank, args.pp, base):
        # Rounds: every run gets steps in every round, so a load change on the shared machine
        # hits all of them alike.
        for _ in range(args.rounds):
            for (label, policy, delta), res in zip(runs, results):
                costs = SleepCosts(args.forward_ms / 1e3, args.backward_ms / 1e3,
                                   delta * args.forward_ms / 1e3)
                if getattr(args, "gc_off", False):  # no collector pauses inside the timed steps
                    gc.enable()
                    gc.collect()
                    gc.disable()
                mine = _measure(dataclasses.replace(base, policy=policy), args.warmup, per_round,
                                prepare=lambda run, c=costs, n=label == "none": _prepare(run, c, n))
                gathered: List[Any] = [None] * args.pp
                dist.all_gather_object(gathered, mine)
                ranks = sorted(gathered, key=lambda r: r["pp_rank"])
                if policy is not Policy.OFF:
                    res["problems"] += _checks(policy, ranks)
                for acc, r in zip(res["ranks"], ranks):
                    for key in ("step_ms", "busy_ms", "transpose_ms"):
                        acc[key] += r[key]
    gc.enable()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f)


def _prepare(run: Any, costs: SleepCosts, prebuild: bool) -> None:
    if hasattr(run.backend, "check_provenance"):
        run.backend.check_provenance = False  # a digest per GEMM read: a test aid, not timed work
    attach_sleep_costs(run, costs, prebuild=prebuild)


def _spawn(args: argparse.Namespace, vp: int, m: int) -> List[Dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        torch.multiprocessing.start_processes(_worker, args=(args, vp, m, out), nprocs=args.pp,
                                              join=True, start_method="spawn")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


# ------------------------------------------------------------------------------- analysis
def _steps(run: Dict[str, Any]) -> List[float]:
    """Per step, the slowest rank's step time (ms); for ``none`` without the transposes it
    built before the schedule started."""
    off_schedule = run["label"] == "none"
    return [max(r["step_ms"][i] - (r["transpose_ms"][i] if off_schedule else 0.0)
                for r in run["ranks"]) for i in range(len(run["ranks"][0]["step_ms"]))]


def _idle(run: Dict[str, Any]) -> List[float]:
    """Median idle ms per rank: step - compute - transposes. The aligner's (and ``none``'s)
    builds run outside the chunk forwards the busy timer brackets; the lazy ones inside them."""
    out = []
    for r in run["ranks"]:
        outside = (r["transpose_ms"] if run["label"] in ("aligned", "none")
                   else [0.0] * len(r["step_ms"]))
        out.append(statistics.median(s - b - t for s, b, t in zip(r["step_ms"], r["busy_ms"], outside)))
    return out


def _model_costs(none: Dict[str, Any], run: Dict[str, Any], vp: int, m: int,
                 args: argparse.Namespace) -> Costs:
    """Measured per-op durations: the sleeps plus the real per-op host time (from ``none``'s
    busy time, split evenly between forward and backward), and the run's own transposes."""
    per_op_pair = statistics.median(statistics.median(r["busy_ms"]) for r in none["ranks"]) / (m * vp)
    extra = per_op_pair - args.forward_ms - args.backward_ms
    delta = statistics.median(statistics.median(r["transpose_ms"]) for r in run["ranks"]) / vp
    return Costs(forward=(args.forward_ms + extra / 2) / 1e3,
                 backward=(args.backward_ms + extra / 2) / 1e3, transpose=delta / 1e3)


def _q1(xs: List[float]) -> float:
    """Lower quartile: contention on a shared machine only ever adds time, so the quiet steps
    estimate the uncontended timeline (reported beside the median, not instead of it)."""
    return statistics.quantiles(xs, n=4)[0]


def _analyse(args: argparse.Namespace, vp: int, m: int, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    sched = InterleavedSchedule(args.pp, vp, m)
    none = next(r for r in runs if r["label"] == "none")
    none_ms = statistics.median(_steps(none))
    none_q1 = _q1(_steps(none))
    model_none = simulate(sched, Placement.NONE, _model_costs(none, none, vp, m, args)).step_time
    rows = []
    for run in runs:
        steps = _steps(run)
        placement = Placement.LAZY if run["label"] in ("off", "lazy") else Placement(run["label"])
        predicted = (simulate(sched, placement, _model_costs(none, run, vp, m, args)).step_time
                     - model_none) * 1e3
        rows.append({"label": run["label"], "delta": run["delta"], "min": min(steps),
                     "median": statistics.median(steps), "max": max(steps),
                     "q1": _q1(steps), "extra": statistics.median(steps) - none_ms,
                     "extra_q1": _q1(steps) - none_q1, "predicted": predicted,
                     "idle": _idle(run), "problems": run["problems"],
                     "transpose_ms": statistics.median(
                         statistics.median(r["transpose_ms"]) for r in run["ranks"])})
    q = statistics.quantiles(_steps(none), n=4)
    return {"pp": args.pp, "vp": vp, "m": m, "rows": rows, "noise_iqr_ms": q[2] - q[0],
            "model_none_ms": model_none * 1e3, "measured_none_ms": none_ms}


def _by(cfg: Dict[str, Any], label: str, delta: float, key: str) -> float:
    return next(r[key] for r in cfg["rows"] if r["label"] == label and r["delta"] == delta)


def _saving_line(cfg: Dict[str, Any], delta: float) -> str:
    """What aligning saves (lazy - aligned, no baseline needed) and the share it removes, from
    the medians and from the lower quartiles."""
    predicted = _by(cfg, "lazy", delta, "predicted") - _by(cfg, "aligned", delta, "predicted")
    parts = []
    for stat, extra_key, name in (("median", "extra", "median"), ("q1", "extra_q1", "lower quartile")):
        saved = _by(cfg, "lazy", delta, stat) - _by(cfg, "aligned", delta, stat)
        extra = _by(cfg, "lazy", delta, extra_key)
        err = f"{100 * (predicted - saved) / saved:+.0f}%" if saved > 0 else "n/a"
        share = f"{100 * saved / extra:.0f}%" if extra > 0 else "n/a"
        parts.append(f"{name}: saves {saved:.1f} ms (model error {err}), removes {share} of "
                     f"the {extra:.1f} ms lazy adds")
    return (f"- delta {100 * delta:g}%: model: aligned saves {predicted:.1f} ms, removes "
            f"{100 * predicted / _by(cfg, 'lazy', delta, 'predicted'):.0f}% ((PP-1)/PP = "
            f"{100 * (cfg['pp'] - 1) / cfg['pp']:.0f}%); measured " + "; ".join(parts))


def _report(args: argparse.Namespace, configs: List[Dict[str, Any]], wall_s: float) -> str:
    lines = ["# Idle time on the interleaved schedule, measured on the CPU vs the timeline model", "",
             f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; "
             f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores (shared); torch {torch.__version__}",
             f"- engine: megatron-core interleaved 1F1B + DDP (overlap_param_gather, align_param_gather) + "
             f"DistributedOptimizer, gloo, PP={args.pp}, DP=1, N=PP; a tiny GPT whose chunk forward "
             f"waits {args.forward_ms:g} ms and backward {args.backward_ms:g} ms "
             "(`lab/demo/sleep_model.py`); a chunk's transposes wait delta, whoever builds them",
             f"- {args.rounds} rounds in which every run takes {args.warmup} warm-up + "
             f"{-(-args.steps // args.rounds)} timed steps in turn; step = the slowest rank's "
             f"step (forward/backward + optimizer step); sweep wall time {wall_s / 60:.1f} min",
             f"- command: `{' '.join(getattr(args, 'argv', sys.argv))}`; load average (1 min) before / after: "
             f"{args.load_before:.1f} / {os.getloadavg()[0]:.1f}",
             "- extra = median step - median step of `none`; predicted = the timeline model's step "
             "difference from the same measured forward/backward/transpose durations "
             "(compute includes the real per-op host time measured in `none`)", ""]
    for cfg in configs:
        lines += [f"## PP={cfg['pp']} VP={cfg['vp']} M={cfg['m']}", "",
                  f"`none` step: measured {cfg['measured_none_ms']:.1f} ms (IQR {cfg['noise_iqr_ms']:.2f} ms), "
                  f"model {cfg['model_none_ms']:.1f} ms (the model leaves out the optimizer step and "
                  "host time between ops)", "",
                  "| run | delta (% fwd) | transposes ms/chunk | step ms min / q1 / med / max "
                  "| extra ms med / q1 | predicted ms | error med / q1 | idle ms per rank (median) "
                  "| checks |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in cfg["rows"]:
            err = " / ".join(f"{100 * (r['predicted'] - e) / e:+.0f}%" if r["label"] != "none"
                             and abs(e) > 1e-9 else "-" for e in (r["extra"], r["extra_q1"]))
            idle = " ".join(f"r{i}:{x:.1f}" for i, x in enumerate(r["idle"]))
            lines.append(f"| {r['label']} | {100 * r['delta']:.0f} | {r['transpose_ms'] / cfg['vp']:.2f} | "
                         f"{r['min']:.1f} / {r['q1']:.1f} / {r['median']:.1f} / {r['max']:.1f} | "
                         f"{r['extra']:.1f} / {r['extra_q1']:.1f} | {r['predicted']:.1f} | {err} | {idle} | "
                         f"{'OK' if not r['problems'] else '; '.join(r['problems'][:2])} |")
        lines.append("")
        lines += [_saving_line(cfg, d) for d in args.deltas]
        lines.append("")
    return "\n".join(lines) + "\n"


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--shapes", nargs="+", default=["2:4", "2:12", "3:4", "3:8"],
                   help="VP:M pairs (model chunks per rank : microbatches per step)")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.01, 0.05, 0.2],
                   help="a chunk's transposes as a fraction of its forward")
    p.add_argument("--forward-ms", type=float, default=40.0)
    p.add_argument("--backward-ms", type=float, default=80.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per run per round")
    p.add_argument("--rounds", type=int, default=4,
                   help="the runs take turns, steps/rounds timed steps each per round")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness increment for the ranks (negative needs root): on a shared, "
                   "loaded machine, lets the sleeping ranks wake on time")
    p.add_argument("--gc-off", action="store_true",
                   help="collect garbage before each run and keep the collector off while it runs")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="pipeline_idle_cpu")
    p.add_argument("--from-raw", metavar="PATH", default=None,
                   help="analyse a saved <name>.raw.json instead of measuring")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes {args.shapes}: each must be VP:M, e.g. 2:4")
    for vp, m in args.shapes:
        InterleavedSchedule(args.pp, vp, m)  # a bad shape fails here, with the reason
    return args


def main(argv: List[str]) -> None:
    args = _parse(argv)
    start = time.time()
    args.load_before = os.getloadavg()[0]
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, f"{args.name}.raw.json")
    if args.from_raw:  # re-analyse a finished sweep without measuring again
        with open(args.from_raw, encoding="utf-8") as f:
            saved = json.load(f)
        raw = [(s["vp"], s["m"], s["runs"]) for s in saved["shapes"]]
        args.load_before, wall, args.argv = saved["load_before"], saved["wall_s"], saved["argv"]
    else:
        raw = []
        for vp, m in args.shapes:
            print(f"PP={args.pp} VP={vp} M={m} ...", flush=True)
            raw.append((vp, m, _spawn(args, vp, m)))
            wall = time.time() - start
            with open(raw_path, "w", encoding="utf-8") as f:  # kept as it grows
                json.dump({"argv": sys.argv, "load_before": args.load_before, "wall_s": wall,
                           "shapes": [{"vp": v, "m": mm, "runs": r} for v, mm, r in raw]}, f)
    configs = [_analyse(args, vp, m, runs) for vp, m, runs in raw]
    report = _report(args, configs, wall)
    print(report)
    with open(os.path.join(args.out, f"{args.name}.md"), "w", encoding="utf-8") as f:
        f.write(report)


if __name__ == "__main__":
    main(sys.argv[1:])
