#!/usr/bin/env python3
"""Benchmark of FP8 weight transposes on one GPU (not a test).

For each weight set (one chunk's FP8 weights: GPT-3-175B TP=8 layer shapes x 1, 2, 4 layers per
chunk, and Llama-70B TP=8 shapes), measured with CUDA events, in the same run:

* ``copy``         -- the copy ceiling: the same number of bytes moved by one ``dst.copy_(src)``;
* ``torch``        -- torch's generic path, ``out.copy_(w.t())`` per weight;
* ``triton-1``     -- our Triton kernel launched once per weight;
* ``triton-multi`` -- our Triton multi-tensor kernel, the whole set in one launch.

Bandwidth counts bytes read plus bytes written (2 x the FP8 bytes). Every method's output is
checked byte for byte against ``w.t()`` before it is timed.

Usage (on a CUDA machine)::

    python benchmarks/bench_transpose.py [--sweep] [--reps 50] [--out benchmarks/results/transpose_h200.md]

``--sweep`` first times several tile / warp configurations on the GPT-3 1-layer set and uses the
fastest for the table. On a machine without CUDA (or without Triton) it exits with a message.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
from typing import Callable, Dict, List, Sequence, Tuple

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

GPT3_175B_TP8 = [(4608, 12288), (12288, 1536), (6144, 12288), (12288, 6144)]
LLAMA70B_TP8 = [(1280, 8192), (8192, 1024), (3584, 8192), (8192, 3584)]

SWEEP = [
    (256, 256, 8, 1, 1, 0), (256, 256, 8, 1, 1, 1), (256, 256, 8, 1, 1, 2), (256, 256, 4, 1, 1, 0),
    (128, 256, 8, 1, 1, 0), (256, 128, 8, 1, 1, 0), (128, 128, 4, 1, 1, 0), (128, 128, 4, 1, 1, 4),
    (128, 256, 4, 1, 1, 2), (256, 256, 8, 2, 1, 0), (64, 128, 4, 0, 1, 0), (64, 128, 4, 0, 1, 4),
]


def _time(fn: Callable[[], None], reps: int, warmup: int = 5) -> List[float]:
    """Per-call milliseconds, one CUDA event pair per repetition."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _weight_set(shapes: Sequence[Tuple[int, int]], layers: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(1234)
    srcs, outs = [], []
    for _ in range(layers):
        for m, n in shapes:
            w = torch.randint(0, 256, (m, n), dtype=torch.uint8, device="cuda", generator=g)
            srcs.append(w.view(dtype))
            outs.append(torch.empty((n, m), dtype=torch.uint8, device="cuda").view(dtype))
    return srcs, outs


def _check(srcs, outs, name: str) -> None:
    for i, (s, o) in enumerate(zip(srcs, outs)):
        if not torch.equal(o.view(torch.uint8), s.view(torch.uint8).t()):
            raise SystemExit(f"{name}: output {i} ({tuple(s.shape)}) differs from w.t()")


def _stats(ms: List[float], nbytes: int) -> Dict[str, float]:
    med = statistics.median(ms)
    return {"min": min(ms), "med": med, "max": max(ms), "tbps": nbytes / (med * 1e-3) / 1e12}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="pick the fastest tile config first")
    ap.add_argument("--config", default=None,
                    help="block_m,block_n,num_warps,packed[,split[,persistent]] (e.g. 256,256,8,1,1,0)")
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--out", default=None, help="markdown report path")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_transpose: no CUDA device here; this benchmark needs a GPU (e.g. the H200 "
              "device machine). Nothing measured.", file=sys.stderr)
        return 2
    from nemo_fp8_align.kernels import triton_transpose as tt

    if not tt.available():
        print(f"bench_transpose: Triton kernel unavailable: {tt.unavailable_reason()}", file=sys.stderr)
        return 2
    import triton

    dtype = torch.float8_e4m3fn
    lines: List[str] = []

    def out(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    cfg = tt.DEFAULT_CONFIG
    if args.config:
        cfg = tt.KernelConfig(*(int(x) for x in args.config.split(",")))
    layers = [int(x) for x in args.layers.split(",")]
    props = torch.cuda.get_device_properties(0)
    cmd = "python " + " ".join([os.path.relpath(__file__, os.getcwd())] + (argv if argv is not None else sys.argv[1:]))
    out("# FP8 transpose benchmark")
    out()
    out(f"- date (UTC): {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M:%S')}")
    out(f"- GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    out(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"python {platform.python_version()}")
    out(f"- command: `{cmd}`")
    out(f"- timing: CUDA events, {args.reps} repetitions after 5 warm-ups; min/median/max per call in "
        "microseconds; TB/s = (bytes read + bytes written) / median; `% copy` = TB/s relative to the "
        "copy ceiling measured on the same bytes in the same run")
    out()

    if args.sweep:
        srcs, outs = _weight_set(GPT3_175B_TP8, 1, dtype)
        nbytes = 2 * sum(s.numel() for s in srcs)
        src_flat = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst_flat = torch.empty_like(src_flat)
        copy = _stats(_time(lambda: dst_flat.copy_(src_flat), args.reps), nbytes)
        out("## Tile sweep (GPT-3-175B TP=8, 1 layer, multi-tensor launch)")
        out()
        out(f"copy ceiling on these bytes: {copy['tbps']:.2f} TB/s")
        out()
        out("| block_m | block_n | warps | packed | split | persistent | median us | TB/s | % copy |")
        out("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        best = None
        for c in SWEEP:
            kc = tt.KernelConfig(*c)
            try:
                for o in outs:
                    o.view(torch.uint8).zero_()
                tt.multi_transpose(srcs, outs, kc)
                _check(srcs, outs, f"sweep {c}")
                st = _stats(_time(lambda: tt.multi_transpose(srcs, outs, kc), args.reps), nbytes)
            except Exception as exc:  # a config that does not compile is reported, not fatal
                out(f"| {kc[0]} | {kc[1]} | {kc[2]} | {kc[3]} | {kc[4]} | {kc[5]} | failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:80]} | | |")
                continue
            out(f"| {kc[0]} | {kc[1]} | {kc[2]} | {kc[3]} | {kc[4]} | {kc[5]} | {st['med'] * 1e3:.1f} | {st['tbps']:.2f} | "
                f"{100 * st['tbps'] / copy['tbps']:.1f} |")
            if best is None or st["med"] < best[1]:
                best = (kc, st["med"])
        if best is not None and not args.config:
            cfg = best[0]
        out()
        del srcs, outs, src_flat, dst_flat
        torch.cuda.empty_cache()

    out(f"Kernel config used below: block_m={cfg.block_m}, block_n={cfg.block_n}, "
        f"num_warps={cfg.num_warps}, packed={cfg.packed}, split={cfg.split}, persistent={cfg.persistent}")
    out()
    out("| weight set | tensors | MB (FP8) | method | min us | median us | max us | TB/s | % copy | x torch |")
    out("|:--|---:|---:|:--|---:|---:|---:|---:|---:|---:|")
    summary = []
    for label, shapes in (("GPT-3-175B TP8", GPT3_175B_TP8), ("Llama-70B TP8", LLAMA70B_TP8)):
        for nl in layers:
            srcs, outs = _weight_set(shapes, nl, dtype)
            n_el = sum(s.numel() for s in srcs)
            nbytes = 2 * n_el
            src_flat = torch.randint(0, 256, (n_el,), dtype=torch.uint8, device="cuda")
            dst_flat = torch.empty_like(src_flat)
            outs_u8 = [o.view(torch.uint8) for o in outs]
            srcs_u8 = [s.view(torch.uint8) for s in srcs]

            def torch_generic():
                for s, o in zip(srcs_u8, outs_u8):
                    o.copy_(s.t())

            def per_tensor():
                for s, o in zip(srcs, outs):
                    tt.transpose_one(s, o, cfg)

            def multi():
                tt.multi_transpose(srcs, outs, cfg)

            methods = [("copy", lambda: dst_flat.copy_(src_flat)), ("torch", torch_generic),
                       ("triton-1", per_tensor), ("triton-multi", multi)]
            res = {}
            for name, fn in methods:
                if name != "copy":
                    for o in outs_u8:
                        o.zero_()
                    fn()
                    torch.cuda.synchronize()
                    _check(srcs, outs, name)
                res[name] = _stats(_time(fn, args.reps), nbytes)
            set_label = f"{label} x{nl}"
            for name, _ in methods:
                st = res[name]
                out(f"| {set_label} | {len(srcs)} | {n_el / 1e6:.1f} | {name} | {st['min'] * 1e3:.1f} | "
                    f"{st['med'] * 1e3:.1f} | {st['max'] * 1e3:.1f} | {st['tbps']:.2f} | "
                    f"{100 * st['tbps'] / res['copy']['tbps']:.1f} | "
                    f"{res['torch']['med'] / st['med']:.2f} |")
            # Host cost of one multi-tensor call (launch data cached), no synchronisation.
            import time
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                multi()
            host_us = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            out(f"| {set_label} | | | host time per triton-multi call | | {host_us:.1f} | | | | |")
            summary.append((set_label, 100 * res["triton-multi"]["tbps"] / res["copy"]["tbps"],
                            res["torch"]["med"] / res["triton-multi"]["med"]))
            del srcs, outs, src_flat, dst_flat, srcs_u8, outs_u8
            torch.cuda.empty_cache()
    out()
    out("Multi-tensor kernel, % of the copy ceiling (and speed-up over torch's generic transpose):")
    for set_label, pct, speedup in summary:
        out(f"- {set_label}: {pct:.1f}% ({speedup:.1f}x torch)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
