"""The plugin's own host time per chunk per microbatch: hooks, bookkeeping, telemetry (CPU).

One rank's :class:`~nemo_fp8_align.core.aligner.TransposeAligner`, attached through its public
API to model chunks that do nothing (``torch.nn.Identity``), with a backend whose builds only
flip a flag and an all-gather that is always complete, so what is timed is the plugin alone.
A step calls the schedule's pre-loop launches, every forward in megatron-core's order and the
step-end hook, exactly as the schedule would; the same loop runs with the aligner detached,
and the difference divided by the step's M x VP forwards is the cost per chunk per
microbatch. Target: <= 20 us. ::

    .venv/bin/python benchmarks/hook_cost.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter
from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.aligner import TransposeAligner
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.telemetry import TelemetryWriter

TARGET_US = 20.0


class _Weight:
    def __init__(self) -> None:
        self.valid = False


class _FlagBackend:
    """Builds nothing: a transpose is a flag, so only the plugin's own work is timed."""

    name = "flag"

    def transpose_needed(self) -> Tuple[bool, str]:
        return True, "benchmark"

    def has_valid_transpose(self, w: _Weight) -> bool:
        return w.valid

    def build_transposes(self, weights: Sequence[_Weight]) -> int:
        stale = [w for w in weights if not w.valid]
        for w in stale:
            w.valid = True
        return len(stale)


class _Gathered(McoreDDPAdapter):
    """megatron-core's adapter (the launch wrappers and step end being timed) over chunks whose
    all-gather is always complete."""

    def finish(self, chunk: int) -> bool:
        return True

    def finished(self, chunk: int) -> bool:
        return True


class _Chunk(torch.nn.Identity):
    """A chunk with a DDP chunk's launch and step-end methods (what the aligner's hold wraps)."""

    bucket_groups: List[Any] = []  # no buckets: the adapter's checks pass, wait() is a no-op

    def start_param_sync(self, *unused: Any, force_sync: bool = False,
                         force_dispatch: bool = False) -> None:
        pass

    def finish_grad_sync(self) -> None:
        pass


def _step(s: InterleavedSchedule, rank: int, chunks: List[torch.nn.Module], config: Any,
          weights: List[List[_Weight]], x: torch.Tensor) -> float:
    """One training step's plugin-visible events; returns its host time in seconds."""
    for ws in weights:  # the optimizer step: new values, stale FP8 copies
        for w in ws:
            w.valid = False
    launches = {s.param_sync_launch_vmid(rank, c): c for c in range(2, s.vp)}
    start = time.perf_counter()
    config.param_sync_func[0]()
    config.param_sync_func[1]()
    for v in range(s.total):
        if v in launches:
            config.param_sync_func[launches[v]]()
        chunk = s.chunk_of(v)
        if not weights[chunk][0].valid:  # what a lazy FP8 linear does at first use
            _FlagBackend().build_transposes(weights[chunk])
        chunks[chunk](x)
    config.finalize_model_grads_func()  # megatron-core's: chunk 0's finish_grad_sync first
    return time.perf_counter() - start


def _measure(s: InterleavedSchedule, rank: int, policy: Optional[Policy], telemetry: bool,
             steps: int) -> List[float]:
    chunks = [_Chunk() for _ in range(s.vp)]
    weights = [[_Weight() for _ in range(8)] for _ in range(s.vp)]
    config = SimpleNamespace(param_sync_func=[c.start_param_sync for c in chunks],
                             finalize_model_grads_func=chunks[0].finish_grad_sync)
    with tempfile.TemporaryDirectory() as tmp:
        aligner = None
        if policy is not None:
            writer = TelemetryWriter(os.path.join(tmp, "t.jsonl")) if telemetry else None
            aligner = TransposeAligner(chunks, schedule=s, pp_rank=rank, dp_rank=0,
                                       adapter=_Gathered(chunks, config), weights=weights,
                                       backend=_FlagBackend(), config=AlignConfig(policy=policy),
                                       telemetry=writer)
            aligner.attach()
        x = torch.zeros(1)
        with torch.enable_grad():
            times = [_step(s, rank, chunks, config, weights, x) for _ in range(steps)]
        if aligner is not None:
            aligner.detach()
    return times[steps // 10:]  # drop the first tenth: warm-up


def _per_forward_us(times: List[float], base: List[float], forwards: int) -> Tuple[float, float]:
    """(min, median) of the per-step difference to the detached loop, per forward, in us."""
    b_min, b_med = min(base), statistics.median(base)
    return ((min(times) - b_min) / forwards * 1e6, (statistics.median(times) - b_med) / forwards * 1e6)


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None, help="directory for hook_cost_cpu.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    s = InterleavedSchedule(args.pp, args.vp, args.microbatches)
    rows: List[Dict[str, Any]] = []
    for rank in (0, args.pp - 1):
        base = _measure(s, rank, None, False, args.steps)
        for policy in (Policy.ALIGNED, Policy.LAZY):
            for telemetry in (False, True):
                lo, med = _per_forward_us(_measure(s, rank, policy, telemetry, args.steps), base,
                                          s.total)
                rows.append({"rank": rank, "policy": policy.value, "telemetry": telemetry,
                             "min": lo, "median": med})
    worst = max(r["median"] for r in rows)
    lines = ["# Plugin host time per chunk per microbatch (CPU)", "",
             f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; "
             f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores (shared, load average "
             f"{os.getloadavg()[0]:.1f}); torch {torch.__version__}, python {platform.python_version()}",
             f"- schedule: PP={args.pp} VP={args.vp} M={args.microbatches} (M x VP = {s.total} forwards "
             f"per step), 8 FP8 weights per chunk; {args.steps} steps, the first tenth dropped",
             "- what: the aligner's hooks + step bookkeeping + telemetry records (JSON lines to a "
             "file), with transposes that cost nothing and chunks that compute nothing; minus the "
             "same loop with the aligner detached; divided by the forwards per step",
             f"- command: `{' '.join(sys.argv)}`", "",
             "| pp rank | policy | telemetry | us per chunk per microbatch, min / median |",
             "|---|---|---|---|"]
    lines += [f"| {r['rank']} | {r['policy']} | {'file' if r['telemetry'] else 'off'} | "
              f"{r['min']:.2f} / {r['median']:.2f} |" for r in rows]
    lines += ["", f"Worst median {worst:.2f} us against the {TARGET_US:.0f} us target: "
              f"{'within' if worst <= TARGET_US else 'OVER'} target."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hook_cost_cpu.md"), "w", encoding="utf-8") as f:
            f.write(report)


if __name__ == "__main__":
    main(sys.argv[1:])
