"""Evidence of where transposes were built, gathered apart from the engine under test.

The aligner's telemetry reports what the aligner believes it did. This module records what
happened, with hooks of its own: when each model chunk's forward computation started and ended
(pre/post hooks on the inner module, which run after the aligner's and DDP's pre-hooks), and
when the FP8 backend built each weight's transpose (a wrapper of its ``build_transposes``,
whoever calls it: the aligner at a slot, or the linear layer at first use). The judge then
places every build between the forwards the rank really ran, and takes each chunk's aligned
slot T_c from the observed forward order, not from the project's schedule model.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Dict, List, Sequence

import torch

__all__ = ["EvidenceLog", "evidence_problems"]


class EvidenceLog:
    """Per-rank log of forward computations and transpose builds, tagged with the demo's step.

    ``step`` is set by the training loop before each step (-1 outside training steps: builds
    and forwards then are not logged).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], weights_of_chunk: Sequence[Sequence[Any]],
                 backend: Any) -> None:
        self.step = -1
        self.forwards: List[List[Any]] = []  # [step, chunk, t_start, t_end]
        self.builds: List[List[Any]] = []  # [step, chunk, t]
        self._chunk_of_weight = {id(w): c for c, ws in enumerate(weights_of_chunk) for w in ws}
        self._handles = []
        for c, module in enumerate(chunks):
            self._handles.append(module.register_forward_pre_hook(self._started(c)))
            self._handles.append(module.register_forward_hook(self._ended))
        self._backend, self._build = backend, backend.build_transposes
        backend.build_transposes = self._logged_build

    def _started(self, chunk: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self.step >= 0 and torch.is_grad_enabled():
                self.forwards.append([self.step, chunk, time.monotonic(), None])
        return hook

    def _ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.step >= 0 and torch.is_grad_enabled():
            self.forwards[-1][3] = time.monotonic()

    def _logged_build(self, weights: Sequence[Any]) -> int:
        stale = [w for w in weights if not self._backend.has_valid_transpose(w)]
        built = self._build(weights)
        if self.step >= 0:
            t = time.monotonic()
            self.builds.extend([self.step, self._chunk_of_weight[id(w)], t] for w in stale)
        return built

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._backend.build_transposes = self._build

    def as_dict(self) -> Dict[str, Any]:
        return {"forwards": self.forwards, "builds": self.builds}


def _first_forward(forwards: List[List[Any]], chunk: int) -> int:
    return next(i for i, f in enumerate(forwards) if f[1] == chunk)


def evidence_problems(log: Dict[str, Any], *, pp_rank: int, policy: str,
                      lazy_steps: Sequence[int] = ()) -> List[str]:
    """Where this rank's builds really happened, against where the policy puts them.

    ``aligned``: chunk c's transposes are built between this rank's forwards, after exactly
    ``max(T_c - r, 0)`` of them (before the first forward for chunk 0), i.e. at schedule slot
    T_c on every rank. ``lazy``: inside the rank's first forward of chunk c (slot T_c + r).
    ``lazy_steps`` are judged as ``lazy`` whatever the policy (steps without launches).
    """
    problems: List[str] = []
    steps = sorted({f[0] for f in log["forwards"]})
    for step in steps:
        step_policy = "lazy" if step in lazy_steps else policy
        fwd = [f for f in log["forwards"] if f[0] == step]
        starts, ends = [f[2] for f in fwd], [f[3] for f in fwd]
        for chunk in sorted({f[1] for f in fwd}):
            t_c = _first_forward(fwd, chunk)
            times = [b[2] for b in log["builds"] if b[0] == step and b[1] == chunk]
            where = f"step {step} pp rank {pp_rank} chunk {chunk}"
            if not times:
                problems.append(f"{where}: no transpose was built")
                continue
            for t in (min(times), max(times)):
                started = bisect.bisect_right(starts, t)
                ended = bisect.bisect_right(ends, t)
                if step_policy == "aligned":
                    want = 0 if chunk == 0 else max(t_c - pp_rank, 0)
                    if started != ended or ended != want:
                        problems.append(
                            f"{where}: built after {ended} forwards ({started - ended} running), "
                            f"aligned slot {t_c} means after {want} with none running")
                elif started != t_c + 1 or ended != t_c:
                    problems.append(f"{where}: built after {ended} forwards, lazy means inside "
                                    f"forward {t_c} (the chunk's first)")
    return problems
