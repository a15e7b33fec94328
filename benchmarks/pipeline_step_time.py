"""Step time of an interleaved pipeline with ``off``, ``lazy`` and ``aligned`` FP8 transposes.

The multi-GPU measurement of issue 5: megatron-core's interleaved schedule, DDP with overlapped
and aligned param all-gathers, the DistributedOptimizer, and reference FP8 weights whose GEMMs
are real FP8 GEMMs on the GPU (``torch._scaled_mm``; not Transformer Engine). The three policies
run side by side in one job (same process groups, same data), each after its own warm-up:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 benchmarks/pipeline_step_time.py \
        --pp 4 --vp 2 --microbatches 16 --steps 50 --warmup 5

Per policy it reports the step time (CUDA events, min/median/max over steps), each rank's busy
time (CUDA events around every chunk forward and backward) and idle time (step - busy), the
transposes' own GPU time per step, and checks from the telemetry that every FP8 weight was
transposed exactly once per step and, under ``aligned``, at the same slot on every pipeline rank.
Results go to ``--out`` as markdown and JSON.

``--device cpu --spawn N`` runs the same code on gloo (timings then come from the host clock):
the tests use it to keep this script working where no GPU is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

# lab/ (the demo's model and loop) is read from the checkout this script sits in.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.model import DemoModelConfig  # noqa: E402
from lab.demo.train import DemoOptions, PipelineRun, distributed  # noqa: E402
from nemo_fp8_align.core.telemetry import record_problems  # noqa: E402


class Stopwatch:
    """Paired timestamps: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pairs: List[tuple] = []

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start: Any, end: Any) -> None:
        self.pairs.append((start, end))

    def total_ms(self) -> float:
        """Sum of the recorded intervals (synchronises the GPU); clears them."""
        if self.cuda:
            torch.cuda.synchronize()
            total = sum(s.elapsed_time(e) for s, e in self.pairs)
        else:
            total = sum((e - s) * 1e3 for s, e in self.pairs)
        self.pairs.clear()
        return total


def _time_busy(run: PipelineRun, watch: Stopwatch) -> List[Any]:
    """Hooks timing every chunk forward and backward on this rank; returns their handles."""
    handles, open_marks = [], {}
    for chunk in run.chunks:
        inner = chunk.module
        handles.append(inner.register_forward_pre_hook(
            lambda m, a: open_marks.__setitem__((id(m), "f"), watch.mark())))
        handles.append(inner.register_forward_hook(
            lambda m, a, o: watch.add(open_marks.pop((id(m), "f")), watch.mark())))
        handles.append(inner.register_full_backward_pre_hook(
            lambda m, g: open_marks.__setitem__((id(m), "b"), watch.mark())))
        handles.append(inner.register_full_backward_hook(
            lambda m, gi, go: watch.add(open_marks.pop((id(m), "b")), watch.mark())))
    return handles


def _time_transposes(run: PipelineRun, watch: Stopwatch) -> None:
    # Benchmark-only instance wrapper: the aligner and the lazy linears both call this backend.
    build: Callable[..., int] = run.backend.build_transposes

    def timed_build(weights: Any) -> int:
        start = watch.mark()
        built = build(weights)
        watch.add(start, watch.mark())
        return built

    run.backend.build_transposes = timed_build  # type: ignore[method-assign]


def _measure(opts: DemoOptions, warmup: int, steps: int,
             prepare: Optional[Callable[[PipelineRun], Any]] = None) -> Dict[str, Any]:
    cuda = opts.device == "cuda"
    run = PipelineRun(opts, telemetry_path=None)
    if prepare is not None:  # e.g. pipeline_idle_cpu.py's synthetic sleep costs
        prepare(run)
    busy, trans, step_watch = Stopwatch(cuda), Stopwatch(cuda), Stopwatch(cuda)
    handles = _time_busy(run, busy)
    _time_transposes(run, trans)
    step_ms, busy_ms, trans_ms, builds = [], [], [], []
    for step in range(warmup + steps):
        dist.barrier()
        before = [w.transposes_built for w in run.weights]
        start = step_watch.mark()
        run.forward_backward(step)
        run.optimizer_step()
        step_watch.add(start, step_watch.mark())
        times = step_watch.total_ms(), busy.total_ms(), trans.total_ms()
        if step >= warmup:
            step_ms.append(times[0])
            busy_ms.append(times[1])
            trans_ms.append(times[2])
            builds.append(sorted({w.transposes_built - b for w, b in zip(run.weights, before)}))
    for handle in handles:
        handle.remove()
    records = [r for r in run.aligner.records if r.step >= warmup]
    run.close()
    return {"pp_rank": run.pp_rank, "dp_rank": run.dp_rank, "step_ms": step_ms,
            "busy_ms": busy_ms, "transpose_ms": trans_ms, "builds_per_weight": builds,
            "slots": sorted({(r.chunk, r.slot, r.aligned_slot) for r in records}),
            "records": [dataclasses.asdict(r) for r in records]}


def _stats(xs: List[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def _checks(policy: Policy, ranks: List[Dict[str, Any]]) -> List[str]:
    problems = []
    for r in ranks:
        if any(b != [1] for b in r["builds_per_weight"]):
            problems.append(f"pp {r['pp_rank']} dp {r['dp_rank']}: transposes per weight per "
                            f"step {r['builds_per_weight'][:3]}..., expected exactly 1")
    problems.extend(record_problems([rec for r in ranks for rec in r["records"]],
                                    policy=policy.value))
    return problems


def _report(args: argparse.Namespace, results: Dict[str, List[Dict[str, Any]]]) -> str:
    base = statistics.median(results["off"][0]["step_ms"]) if "off" in results else None
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    lines = ["# Pipeline step time: off / lazy / aligned FP8 transposes",
             "", f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
             f"- device: {gpu} x {args.world_size} ({args.device}); torch {torch.__version__}",
             f"- shape: PP={args.pp} VP={args.vp} DP={args.dp} M={args.microbatches} "
             f"mbs={args.micro_batch_size} seq={args.seq} hidden={args.hidden} "
             f"layers/chunk={args.layers_per_chunk}; {args.warmup} warm-up + {args.steps} steps",
             "- FP8 weights: reference FP8 weights, GEMMs via torch._scaled_mm on sm_89+ "
             "(not Transformer Engine)",
             f"- command: `{' '.join(sys.argv)}`", "",
             "| policy | step ms min/med/max (rank 0) | vs off | idle ms median per pp rank "
             "| transposes ms median per pp rank | checks |", "|---|---|---|---|---|---|"]
    for policy, ranks in results.items():
        med = statistics.median(ranks[0]["step_ms"])
        ratio = f"{med / base:.3f}" if base else "-"
        idle = " ".join(f"r{r['pp_rank']}:{statistics.median(s - b for s, b in zip(r['step_ms'], r['busy_ms'])):.2f}"
                        for r in ranks if r["dp_rank"] == 0)
        trans = " ".join(f"r{r['pp_rank']}:{statistics.median(r['transpose_ms']):.3f}"
                         for r in ranks if r["dp_rank"] == 0)
        problems = _checks(Policy(policy), ranks)
        lines.append(f"| {policy} | {_stats(ranks[0]['step_ms'])} | {ratio} | {idle} | {trans} | "
                     f"{'OK' if not problems else '; '.join(problems)} |")
    return "\n".join(lines) + "\n"


def _worker(rank: int, args: argparse.Namespace) -> None:
    model = DemoModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
                            seq_length=args.seq, layers_per_chunk=args.layers_per_chunk)
    base = DemoOptions(pp=args.pp, vp=args.vp, dp=args.dp, microbatches=args.microbatches,
                       micro_batch_size=args.micro_batch_size, model=model, device=args.device,
                       eval_after_each_step=False)
    results: Dict[str, List[Dict[str, Any]]] = {}
    with distributed(rank, args.world_size, base):
        for policy in args.policies:
            opts = dataclasses.replace(base, policy=Policy(policy))
            mine = _measure(opts, args.warmup, args.steps)
            gathered: List[Any] = [None] * args.world_size
            dist.all_gather_object(gathered, mine)
            results[policy] = sorted(gathered, key=lambda r: (r["dp_rank"], r["pp_rank"]))
            if opts.device == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        report = _report(args, results)
        print(report)
        with open(os.path.join(args.out, f"{args.name}.md"), "w", encoding="utf-8") as f:
            f.write(report)
        with open(os.path.join(args.out, f"{args.name}.json"), "w", encoding="utf-8") as f:
            json.dump(results, f)


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--layers-per-chunk", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--policies", nargs="+", default=["off", "lazy", "aligned"],
                   choices=[x.value for x in Policy])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--spawn", type=int, default=0,
                   help="spawn this many local ranks instead of running under torchrun")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="pipeline_step_time")
    args = p.parse_args(argv)
    args.world_size = args.spawn or int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size != args.pp * args.dp:
        p.error(f"world size {args.world_size} != pp {args.pp} x dp {args.dp}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU; use --device cpu --spawn N for a CPU (gloo) run")
    return args


def main(argv: List[str]) -> None:
    args = _parse(argv)
    if args.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        torch.multiprocessing.start_processes(_worker, args=(args,), nprocs=args.spawn,
                                              join=True, start_method="spawn")
    else:
        _worker(int(os.environ["RANK"]), args)


if __name__ == "__main__":
    main(sys.argv[1:])
