"""A watch on every Transformer Engine transpose build and cache reset, and a probe of each
weight's transpose at its chunk's first use in a step: the evidence the GPU runs judge
(validation/real_stack_*.py, ``python -m lab.demo --loop megatron-lm --device cuda``).

``Float8TensorStorage._create_transpose`` (the one function every TE 2.x path uses to fill a
Float8Tensor's transpose: TE's ``post_all_gather_processing``, the lazy ``update_usage`` at first
use, the plugin's backend) and ``Float8Tensor._reset_caches`` / ``remove_caches`` are wrapped,
and every call on a watched weight is logged with a monotonic time stamp, the step and the phase
(forward/backward or optimizer step). A forward pre-hook on each model chunk, registered after
the plugin's, reads whether each weight's transpose is valid when the chunk is first used in a
step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Sequence

import torch


class TransposeWatch:
    """Logs every TE transpose build and cache reset of the watched weights (see module doc)."""

    def __init__(self) -> None:
        self.names: Dict[int, str] = {}
        self.chunk_of: Dict[int, int] = {}
        self.step = -1
        self.phase = "setup"
        self.events: List[Dict[str, Any]] = []
        self._undo: List[Callable[[], None]] = []

    def watch(self, chunk: int, weights: Sequence[Any], prefix: str) -> None:
        for i, w in enumerate(weights):
            self.names[id(w)] = f"{prefix}c{chunk}w{i}"
            self.chunk_of[id(w)] = chunk

    def install(self) -> "TransposeWatch":
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
        try:
            from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
                Float8TensorStorage as build_owner)
        except ImportError:  # older 2.x layout
            from transformer_engine.pytorch.tensor._internal.float8_tensor_base import (
                Float8TensorBase as build_owner)
        self._wrap(build_owner, "_create_transpose", "build")
        self._wrap(Float8Tensor, "_reset_caches", "reset")
        self._wrap(Float8Tensor, "remove_caches", "reset")
        try:  # blockwise FP8 (TE >= 2.x storage layout): its column-wise copy is the "transpose"
            from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
                Float8BlockwiseQTensorStorage)
        except ImportError:
            Float8BlockwiseQTensorStorage = None
        if Float8BlockwiseQTensorStorage is not None:
            self._wrap(Float8BlockwiseQTensorStorage, "_create_columnwise", "build")
        return self

    def _wrap(self, cls: Any, name: str, kind: str) -> None:
        original = cls.__dict__[name]
        watch = self

        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            key, event = id(tensor), None
            if key in watch.names:
                event = {"kind": kind, "weight": watch.names[key], "chunk": watch.chunk_of[key],
                         "step": watch.step, "phase": watch.phase, "t": time.monotonic()}
                watch.events.append(event)
            out = original(tensor, *args, **kwargs)
            if event is not None and kind == "build":  # where the transpose (blockwise: the
                # column-wise copy) lives: CUDA graphs replay a fixed address
                t = getattr(tensor, "_transpose", getattr(tensor, "_columnwise_data", None))
                event["ptr"] = None if t is None else t.data_ptr()
            return out

        setattr(cls, name, wrapper)
        self._undo.append(lambda: setattr(cls, name, original))

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class FirstUseProbe:
    """At each chunk's first forward of a step: is every weight's transpose valid?"""

    def __init__(self, chunks: Sequence[torch.nn.Module], weights: Sequence[Sequence[Any]],
                 backend: Any) -> None:
        self.step = -1
        self.seen: set = set()
        self.valid: Dict[int, Dict[int, List[bool]]] = defaultdict(dict)  # step -> chunk -> flags
        self.times: Dict[int, Dict[int, float]] = defaultdict(dict)
        self._handles = [m.register_forward_pre_hook(self._hook(c, weights[c], backend))
                         for c, m in enumerate(chunks)]

    def start_step(self, step: int) -> None:
        self.step, self.seen = step, set()

    def _hook(self, chunk: int, weights: Sequence[Any], backend: Any) -> Callable:
        def hook(module: Any, args: Any) -> None:
            if self.step < 0 or chunk in self.seen or not torch.is_grad_enabled():
                return
            self.seen.add(chunk)
            self.valid[self.step][chunk] = [backend.has_valid_transpose(w) for w in weights]
            self.times[self.step][chunk] = time.monotonic()
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
