"""Timing for benchmarks/pipeline_step_time_mps.py: CUDA-event marks, and the hooks that time
every forward_step / backward_step of megatron-core's schedule and every Transformer Engine
transpose build (and, for the slow variant, replace TE's transpose by the reference backend's
generic torch transpose, for every policy alike)."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

__all__ = ["Marks", "instrument"]


class Marks:
    """Paired time marks: CUDA events on the GPU, the host clock on the CPU dry run."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.open, self.pairs = cuda, {}, []

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
        for label, a, b in self.pairs:
            out.setdefault(label, []).append(round(self.ms(a, b), 4))
        self.pairs.clear()
        return out


def instrument(marks: Marks, chunk_of: Dict[int, int], slow: Dict[str, bool]) -> None:
    """CUDA events around the schedule's forward_step / backward_step (module globals, looked up
    at each call) and around every TE transpose build; the slow variant swaps the build."""
    from megatron.core.pipeline_parallel import schedules

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            start = marks.now()
            out = fn(*args, **kwargs)
            marks.pairs.append((label, start, marks.now()))
            return out
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
        start = marks.now()
        (torch_transpose if slow["on"] else fast)(self)
        marks.pairs.append((f"transpose_c{chunk_of.get(id(self), -1)}", start, marks.now()))

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
        start = marks.now()
        out = own(self, *args, **kwargs)
        marks.pairs.append((f"transpose_c{chunk_of.get(id(self), -1)}", start, marks.now()))
        return out

    Float8BlockwiseQTensorStorage._create_columnwise = build
