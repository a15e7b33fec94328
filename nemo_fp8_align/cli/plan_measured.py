"""``plan``'s measured durations: per-chunk forward, backward, transposes and host wait (one
value, or one per rank and chunk), the p2p transfer, and ranks that share one GPU. They replace
what the planner derives from sizes and rates (:mod:`nemo_fp8_align.planner.measured`)."""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Tuple

from nemo_fp8_align.errors import PlanInputError
from nemo_fp8_align.planner.measured import PER_CHUNK, SHARED_GPU_SLOWDOWN, measured_costs
from nemo_fp8_align.planner.timeline import Costs

__all__ = ["add_measured_arguments", "apply_measured", "measured_flag"]

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
