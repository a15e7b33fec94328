"""Per-chunk durations measured on a real run, in place of those :mod:`~nemo_fp8_align.planner.costs`
derives from model sizes and rates: the planner calibrated to a machine.

Each measured duration is one value (every rank and chunk alike) or one per (rank, chunk),
rank-major (``r0c0, r0c1, ..., r1c0, ...``), as a profile of a few steps gives them: a first
stage's chunk 0 carries the embedding, the last stage's last chunk the output layer and loss.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Callable, Dict, Mapping, Optional, Sequence

from nemo_fp8_align.errors import PlanInputError
from nemo_fp8_align.planner.timeline import HOST_TIMES, ChunkCosts, Costs

__all__ = ["PER_CHUNK", "SHARED_GPU_SLOWDOWN", "measured_costs"]

#: The durations that may differ per (rank, chunk); p2p is one value for the step. The host
#: times (all three or none) switch the planner to two clocks per rank
#: (:mod:`nemo_fp8_align.planner.two_clocks`): forward, backward and transpose are then GPU times.
PER_CHUNK = ("forward", "backward", "transpose", "host_wait", *HOST_TIMES)
#: Transposes built at the same slot by every rank of one GPU split by CUDA MPS take this much
#: longer than staggered (lazy) ones: aligned / lazy median per-chunk time of the generic torch
#: transpose in the calibration's fit run (megatron-core 0.19.2, PP=4, H200:
#: 4.1841 / 3.7013 ms); see benchmarks/results/planner_calibration.md.
SHARED_GPU_SLOWDOWN = 4.1841 / 3.7013

#: Values that cannot be zero: every chunk computes something.
_POSITIVE = ("forward", "backward", "forward_host", "backward_host")


def _check(name: str, values: Sequence[float], cells: int, label: Callable[[str], str]) -> None:
    if len(values) not in (1, cells):
        raise PlanInputError(f"{label(name)}: {len(values)} values; give one (every rank and "
                             f"chunk) or PP x VP = {cells}, rank-major (r0c0, r0c1, ..., r1c0, ...)")
    for v in values:
        if not math.isfinite(v) or v < 0 or (v == 0 and name in _POSITIVE):
            need = "> 0" if name in _POSITIVE else ">= 0"
            raise PlanInputError(f"{label(name)} {v:g}: must be {need} and finite (milliseconds "
                                 "measured per chunk and microbatch)")


def measured_costs(base: Costs, pp: int, vp: int, measured_ms: Mapping[str, Sequence[float]], *,
                   p2p_ms: Optional[float] = None, shared_gpu_slowdown: float = 1.0,
                   label: Callable[[str], str] = str) -> Costs:
    """``base`` with the measured durations (milliseconds, keys of :data:`PER_CHUNK`) put in;
    durations not given keep ``base``'s. ``label`` names a key in errors (the CLI's flag)."""
    cells = pp * vp
    for name, values in measured_ms.items():
        if name not in PER_CHUNK:
            raise ValueError(f"measured_costs: unknown duration {name!r}; one of {PER_CHUNK}")
        _check(name, values, cells, label)
    hosts = [n for n in HOST_TIMES if n in measured_ms]
    if hosts and len(hosts) < len(HOST_TIMES):
        missing = " ".join(label(n) for n in HOST_TIMES if n not in hosts)
        raise PlanInputError(f"{' '.join(label(n) for n in hosts)} without {missing}: the "
                             "two-clock model needs the host time of every call (forward, "
                             "backward, the transposes); give all three, or none for one clock")
    if p2p_ms is not None:
        _check("p2p", [p2p_ms], 1, label)
    if not (math.isfinite(shared_gpu_slowdown) and shared_gpu_slowdown >= 1):
        raise PlanInputError(f"{label('shared_gpu_slowdown')} {shared_gpu_slowdown:g}: must be "
                             ">= 1 (contention does not make transposes faster)")
    table: Dict[str, Sequence[Optional[float]]] = {
        name: [v / 1e3 for v in measured_ms[name]] * (cells if len(measured_ms[name]) == 1 else 1)
        if name in measured_ms else [getattr(base, name)] * cells for name in PER_CHUNK}
    rows = tuple(tuple(ChunkCosts(**{n: table[n][r * vp + c] for n in PER_CHUNK})
                       for c in range(vp)) for r in range(pp))
    # the uniform fields: the medians (what a one-set view, e.g. the Gantt's zoom, reads)
    uniform = {n: None if None in table[n] else statistics.median(table[n]) for n in PER_CHUNK}
    return replace(base, **uniform, per_chunk=rows, shared_gpu_slowdown=shared_gpu_slowdown,
                   **({} if p2p_ms is None else {"p2p": p2p_ms / 1e3}))
