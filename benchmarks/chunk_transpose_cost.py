"""One GPU: what one model chunk's FP8 transposes cost next to the chunk's own compute.

The single-GPU piece of the multi-GPU measurement (issue 5): for the demo GPT's chunk at the
benchmark's size, it times with CUDA events (min/median/max over repetitions)
- one microbatch's forward + backward through the chunk (real FP8 GEMMs via torch._scaled_mm),
- building the chunk's FP8 weights' transposes: the multi-tensor Triton kernel and torch's
  generic copy (the baseline measured in the same run),
and prints delta (one chunk's transposes) against the compute, with the bound docs/design.md
(section 1) gives for what aligning saves per step: lazy up to about PP x VP x delta of idle, aligned about
VP x delta, so at most (PP - 1) x VP x delta. That bound is a model, not a measurement: the
pipeline itself needs several GPUs (benchmarks/pipeline_step_time.py).

    python benchmarks/chunk_transpose_cost.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import datetime, timezone
from typing import Callable, List

import torch

# lab/ (the demo's model and loop) is read from the checkout this script sits in.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
from lab.demo.model import DemoModelConfig, GPTChunk  # noqa: E402
from nemo_fp8_align.backends.reference import ReferenceBackend  # noqa: E402


def _time(fn: Callable[[], None], reps: int, warmup: int = 3) -> List[float]:
    """Per-call microseconds, synchronising after each call: what one call costs a training loop
    (host side included), unlike bench_transpose.py's back-to-back kernel timing."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3)  # us
    return out


def _fmt(xs: List[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--layers-per-chunk", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("chunk_transpose_cost: needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    cfg = DemoModelConfig(hidden_size=args.hidden, num_heads=args.heads, seq_length=args.seq,
                          layers_per_chunk=args.layers_per_chunk)
    triton_backend, torch_backend = ReferenceBackend(), ReferenceBackend(use_triton_kernel=False)
    with torch.device("cuda"):
        chunk = GPTChunk(cfg, config=None, stage=1, vp_stage=0, pre_process=False,
                         post_process=False, backend=triton_backend)
        x = torch.randn(args.seq, args.micro_batch_size, args.hidden, requires_grad=True)
    weights = chunk.fp8_weights()
    nbytes = sum(w.data.numel() for w in weights)

    def fwd_bwd() -> None:
        chunk.set_input_tensor(x)
        out = chunk(None, None)
        out.backward(torch.ones_like(out))

    def rebuild(backend: ReferenceBackend) -> Callable[[], None]:
        def run() -> None:
            for w in weights:  # transposes only: keep the FP8 data, drop the cached transpose
                w.transpose_valid = False
            backend.build_transposes(weights)
        return run

    with torch.autocast("cuda", dtype=torch.bfloat16):
        compute = _time(fwd_bwd, args.reps)
    kernel = _time(rebuild(triton_backend), args.reps)
    generic = _time(rebuild(torch_backend), args.reps)
    delta, comp = statistics.median(kernel), statistics.median(compute)
    lines = [
        "# One chunk's FP8 transposes vs the chunk's compute (one GPU)", "",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
        f"- chunk: {args.layers_per_chunk} layers, hidden {args.hidden}, seq {args.seq}, "
        f"micro-batch {args.micro_batch_size}; {len(weights)} FP8 weights, {nbytes / 1e6:.1f} MB",
        f"- command: `{' '.join(['python', 'benchmarks/chunk_transpose_cost.py'] + argv)}`", "",
        "| what | min / median / max us |", "|---|---|",
        f"| one microbatch forward+backward (FP8 GEMMs, bf16 autocast) | {_fmt(compute)} |",
        f"| chunk transposes, Triton multi-tensor (delta) | {_fmt(kernel)} |",
        f"| chunk transposes, torch generic copy | {_fmt(generic)} |", "",
        f"delta / one microbatch's compute = {delta / comp:.3f}; torch / Triton = "
        f"{statistics.median(generic) / delta:.1f}x.", "",
        "Model bound on what aligning saves per step, (PP-1) x VP x delta (not measured):",
        *(f"- PP={pp} VP=2: {(pp - 1) * 2 * delta / 1e3:.2f} ms (Triton), "
          f"{(pp - 1) * 2 * statistics.median(generic) / 1e3:.2f} ms (torch generic)"
          for pp in (4, 8)),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "chunk_transpose_cost_h200.md"), "w", encoding="utf-8") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
