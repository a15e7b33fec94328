"""Run Megatron-LM's own training loop (``megatron.training``, megatron-core 0.19) on the CPU over
gloo, for ``demo --loop megatron-lm`` and its tests only.

On top of :mod:`lab.demo.cpu_redirects` (megatron-core's CUDA-only calls), the loop
assumes CUDA in more places that do not touch what the demo checks: it asserts
``torch.cuda.is_available()``, makes CUDA streams and events for its timers and DDP wrapping,
reads CUDA memory statistics for its log, seeds and snapshots the CUDA RNG, warms up fused
kernels with ``torch.compile``, and compiles its C++ dataset helpers (the demo brings its own
dataset). Each of those is redirected to a host stand-in here; nothing else changes. Like the
base module it refuses to run where CUDA is really available.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, List, Tuple

import torch

from lab.demo.cpu_redirects import enable_cpu_compat

__all__ = ["enable_megatron_lm_cpu_compat"]


class _HostEvent:
    """``torch.cuda.Event`` on the CPU: every op is synchronous, so it is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _HostStream(_HostEvent):
    """``torch.cuda.Stream`` on the CPU (its ``wait_*`` and ``record_event`` do nothing)."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def is_capturing(self) -> bool:
        return False


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class MegatronLMCpuCompat:
    """Handle of the active redirections; :meth:`undo` restores everything (idempotent)."""

    def __init__(self) -> None:
        self._base = enable_cpu_compat()  # refuses on a GPU machine
        self._patches: List[Tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _patch_module(self, module_name: str, name: str, value: Callable[..., Any]) -> None:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            self._patch(module, name, value)

    def apply(self) -> "MegatronLMCpuCompat":
        cuda = torch.cuda
        self._patch(cuda, "is_available", lambda: True)  # initialize_megatron asserts it
        self._patch(cuda, "Stream", _HostStream)
        self._patch(cuda, "Event", _HostEvent)
        self._patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        self._patch(cuda, "set_stream", _nothing)
        self._patch(cuda, "is_current_stream_capturing", lambda: False)
        # torch's optimizers ask the accelerator's stream whether a graph is being captured.
        self._patch(torch.accelerator, "current_stream", lambda *a, **k: _HostStream())
        self._patch(cuda, "empty_cache", _nothing)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved"):
            self._patch(cuda, name, _zero)
        self._patch(cuda, "reset_peak_memory_stats", _nothing)
        self._patch(cuda, "memory_stats", lambda *a, **k: {})
        # The data loader pins batches for a GPU copy (it believes one exists: see above).
        self._patch(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
        # The rerun state machine snapshots the CUDA RNG each step (restored only on a rerun).
        self._patch(cuda, "get_rng_state", lambda *a, **k: torch.zeros(1, dtype=torch.uint8))
        self._patch(cuda, "set_rng_state", _nothing)
        # The dataset index helpers are C++ compiled at start; the demo's dataset needs none.
        self._patch_module("megatron.core.datasets.utils", "compile_helpers", _nothing)
        # Fused-kernel warm-up through torch.compile: no CUDA kernels to warm up here.
        self._patch_module("megatron.training.training", "set_jit_fusion_options", _nothing)
        return self

    def undo(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        self._base.undo()


def enable_megatron_lm_cpu_compat() -> MegatronLMCpuCompat:
    """Activate the redirections for this process (refused where CUDA is available)."""
    return MegatronLMCpuCompat().apply()
