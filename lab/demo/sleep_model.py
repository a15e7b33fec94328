"""Synthetic compute for step-time measurements on the CPU: every chunk forward and backward
*waits* a fixed time and every chunk's FP8 transposes cost a fixed time, so that four pipeline
ranks on two CPU cores produce the timeline of a GPU job instead of one distorted by CPU
contention.

:func:`attach_sleep_costs` puts the waits on a built :class:`~lab.demo.train.PipelineRun`
(the real megatron-core schedule, DDP with overlapped, aligned all-gathers and the
DistributedOptimizer stay as they are): a forward hook and a full backward hook per chunk (post
hooks, so timers registered later measure them), and a wrapper on the run's FP8 backend that
sleeps ``transpose`` seconds per chunk, split over the chunk's weights, whoever builds them (the
aligner at the aligned slot, or the FP8 linears at first use).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["SleepCosts", "SleepHandles", "attach_sleep_costs"]


@dataclass(frozen=True)
class SleepCosts:
    """Seconds per chunk forward, chunk backward and one chunk's transposes (delta)."""

    forward: float
    backward: float
    transpose: float

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "transpose"):
            if getattr(self, name) < 0:
                raise ValueError(f"SleepCosts.{name}={getattr(self, name)}: must be >= 0 seconds")


class SleepHandles:
    """Undo for :func:`attach_sleep_costs` (idempotent)."""

    def __init__(self, hooks: List[Any], patched: List[Tuple[Any, str, Dict[str, Any]]]) -> None:
        self._hooks, self._patched = hooks, patched

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for obj, name, before in reversed(self._patched):
            # Put back the instance attribute there was, or uncover the class's method.
            obj.__dict__.pop(name, None)
            obj.__dict__.update(before)
        self._patched = []


def _patch(obj: Any, name: str, value: Any, patched: List) -> None:
    before = {name: obj.__dict__[name]} if name in obj.__dict__ else {}
    setattr(obj, name, value)
    patched.append((obj, name, before))


def attach_sleep_costs(run: Any, costs: SleepCosts, *, prebuild: bool = False,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.perf_counter) -> SleepHandles:
    """Make ``run``'s chunks and FP8 backend cost ``costs``; returns the handles to undo it.

    A chunk's transposes take ``max(costs.transpose, the real build)``: the wrapper sleeps what
    the real (tiny, CPU) build left of the target, so CPU contention does not add to delta.
    With ``prebuild`` every FP8 weight is built at the start of the step, before the schedule
    runs (with DP=1 the parameters already hold this step's values there): the no-transpose
    baseline, whose build time the caller subtracts from the step.
    """
    hooks: List[Any] = []
    for chunk in run.chunks:
        inner = chunk.module
        hooks.append(inner.register_forward_hook(lambda m, a, o: sleep(costs.forward)))
        hooks.append(inner.register_full_backward_hook(lambda m, gi, go: sleep(costs.backward)))
    share: Dict[int, float] = {}
    for chunk in run.chunks:
        weights = chunk.module.fp8_weights()
        for w in weights:
            share[id(w)] = costs.transpose / len(weights)
    backend = run.backend
    original = backend.build_transposes

    def build_with_cost(weights: Any) -> int:
        target = sum(share.get(id(w), 0.0) for w in weights if not backend.has_valid_transpose(w))
        start = clock()
        built = original(weights)
        sleep(max(0.0, target - (clock() - start)))
        return built

    patched: List[Tuple[Any, str, Dict[str, Any]]] = []
    _patch(backend, "build_transposes", build_with_cost, patched)
    if prebuild:
        forward_backward = run.forward_backward

        def build_then_run(step: int) -> Any:
            run.backend.build_transposes(run.weights)  # looked up now: timers may wrap it
            return forward_backward(step)

        _patch(run, "forward_backward", build_then_run, patched)
    return SleepHandles(hooks, patched)
