"""Timing for benchmarks/pipeline_step_time_mps.py: CUDA-event marks, and the hooks that time
every forward_step / backward_step of megatron-core's schedule and every Transformer Engine
transpose build (and, for the slow variant, replace TE's transpose by the reference backend's
generic torch transpose, for every policy alike).

Each timed call gets two durations: its CUDA-event span (label ``forward``, ``backward``,
``transpose_c<chunk>``) and its host time (the same label prefixed ``host_``). With
``Marks.gpu_only`` on, a GPU sleep longer than any call's host time is queued before each call,
so its kernels are all queued before the GPU reaches them and the event span is the GPU's own
time, without waits for the host's launches (a calibration segment, never a timed one). Where
the host, not the GPU, paces a call (small chunks, launch-bound), the span without the sleep
is the host's time and the one with it is shorter: the planner's two-clock model reads both."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

__all__ = ["Marks", "instrument"]


class Marks:
    """Paired time marks: CUDA events on the GPU, the host clock on the CPU dry run."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pairs: List[tuple] = []  # (label, start mark, end mark, host ms)
        self.gpu_only = False  # queue a GPU sleep before every timed call (calibration)
        self.sleep_cycles = 0

    def backlog(self) -> None:
        """In a calibration segment: give the GPU ``sleep_cycles`` of work ahead of the host."""
        if self.gpu_only and self.cuda and self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)

    def calibrate_sleep(self, ms: float) -> None:
        """``sleep_cycles`` for a GPU sleep of about ``ms`` (timed once on this GPU)."""
        if not self.cuda:
            return
        probe = 1_000_000
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # warm
        a.record()
        torch.cuda._sleep(probe)
        b.record()
        b.synchronize()
        self.sleep_cycles = int(probe * ms / max(a.elapsed_time(b), 1e-3))

    def timed(self, label: str, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with its event span and its host time recorded."""
        self.backlog()
        h0, start = time.perf_counter(), self.now()
        out = fn(*args, **kwargs)
        self.pairs.append((label, start, self.now(), (time.perf_counter() - h0) * 1e3))
        return out

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def collect(self) -> Dict[str, List[float]]:
        """Durations (ms) by label since the last call (the caller has synchronised)."""
        out: Dict[str, List[float]] = {}
        for label, a, b, host_ms in self.pairs:
            out.setdefault(label, []).append(round(self.ms(a, b), 4))
            out.setdefault("host_" + label, []).append(round(host_ms, 4))
        self.pairs.clear()
        return out


def instrument(marks: Marks, chunk_of: Dict[int, int], slow: Dict[str, bool]) -> None:
    """CUDA events around the schedule's forward_step / backward_step (module globals, looked up
    at each call) and around every TE transpose build; the slow variant swaps the build."""
    from megatron.core.pipeline_parallel import schedules

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            return marks.timed(label, fn, *args, **kwargs)
        return wrapper

    schedules.forward_step = timed(schedules.forward_step, "forward")
    schedules.backward_step = timed(schedules.backward_step, "backward")
    if marks.cuda is False:
        return
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    from nemo_fp8_align.kernels import multi_transpose_
    fast = Float8TensorStorage._create_transpose

    def torch_transpose(self) -> None:  # the reference backend's generic torch transpose
        data = self._data
        if data is None:
            return
        data = data.contiguous().view(torch.uint8).reshape(-1, data.shape[-1])
        out = self._transpose
        if out is None or tuple(out.shape) != (data.shape[1], data.shape[0]):
            out = torch.empty((data.shape[1], data.shape[0]), dtype=torch.uint8, device=data.device)
        multi_transpose_([data], [out.view(torch.uint8)], use_triton=False)
        self._transpose, self._transpose_invalid = out, False

    def build(self) -> None:
        marks.timed(f"transpose_c{chunk_of.get(id(self), -1)}",
                    torch_transpose if slow["on"] else fast, self)

    Float8TensorStorage._create_transpose = build
    _time_columnwise(marks, chunk_of)


def _time_columnwise(marks: Marks, chunk_of: Dict[int, int]) -> None:
    """Blockwise FP8 weights (``Float8BlockwiseQTensor``): their post-all-gather work is TE's
    column-wise copy, timed under the same per-chunk label as a transpose (never swapped)."""
    try:
        from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
            Float8BlockwiseQTensorStorage)
    except ImportError:  # a TE without blockwise FP8
        return
    own = Float8BlockwiseQTensorStorage._create_columnwise

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return marks.timed(f"transpose_c{chunk_of.get(id(self), -1)}", own, self, *args, **kwargs)

    Float8BlockwiseQTensorStorage._create_columnwise = build
