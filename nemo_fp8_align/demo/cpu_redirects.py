"""Run megatron-core's schedule, DDP and DistributedOptimizer on the CPU over gloo.

megatron-core assumes CUDA in a handful of places that do not affect what this project tests
(where tensors live, stream syncs, type-string checks). :func:`enable_cpu_compat` redirects
exactly those to the CPU, for the CPU demo, the CPU smoke run and the tests. It refuses to run
when CUDA is available: on a GPU nothing here may change behaviour. Verified on megatron-core
0.12.3 and 0.16.1 with torch 2.13 (CPU build) and 0.19.2 with torch 2.13 (CUDA build, no GPU).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable_cpu_compat", "CpuCompat"]


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):  # torch.cuda.current_device() style ordinal
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` / ``device=<ordinal>`` of factory calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _tensor_type_as_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    # megatron-core compares Tensor.type() with 'torch.cuda.FloatTensor' etc. to pick the
    # main-param path; report CPU tensors under their CUDA names for that check only.
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") \
                and not result.startswith("torch.cuda."):
            return "torch.cuda." + result[len("torch."):]
        return result
    return type_


def _skip_empty(original: Callable[..., Any]) -> Callable[..., Any]:
    # megatron-core 0.12.x calls quantize_param_shard([] , ...) even without FP8 params, and
    # without Transformer Engine that call raises: an empty list has nothing to quantize.
    def quantize_param_shard(model_params: Any, *args: Any, **kwargs: Any) -> Any:
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)
    return quantize_param_shard


def _init_without_apex_check(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    # megatron-core 0.9's DistributedOptimizer asserts Apex or TE in its constructor, though the
    # class has torch-Adam branches (HAVE_APEX_OR_TE False) for everything after it, as later
    # versions use on the CPU: the check is lifted for the constructor only.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        module.HAVE_APEX_OR_TE = True
        try:
            original(self, *args, **kwargs)
        finally:
            module.HAVE_APEX_OR_TE = False
    return __init__


class _HostStream:
    """Stands in for ``torch.cuda.current_stream()`` on the CPU, where every op is synchronous:
    megatron-core 0.19's ``start_grad_sync`` asks for the current stream unconditionally (to wait
    for CUDA-graph replay events, which a CPU run never records)."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuCompat:
    """Handle of the active redirections; :meth:`undo` restores everything (idempotent)."""

    def __init__(self) -> None:
        self._patches: List[Tuple[Any, str, Any]] = []
        self._mode = _CudaToCpuMode()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def apply(self) -> "CpuCompat":
        self._patch(torch.cuda, "current_device", lambda: "cpu")
        self._patch(torch.cuda, "synchronize", lambda *a, **k: None)
        self._patch(torch.cuda, "current_stream", lambda *a, **k: _HostStream())
        self._patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        self._patch(torch.Tensor, "type", _tensor_type_as_cuda(torch.Tensor.type))
        for module_name in ("megatron.core.optimizer.distrib_optimizer",):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if hasattr(module, "quantize_param_shard"):
                self._patch(module, "quantize_param_shard", _skip_empty(module.quantize_param_shard))
            cls = module.DistributedOptimizer
            if getattr(module, "HAVE_APEX_OR_TE", True) is False \
                    and "HAVE_APEX_OR_TE" in inspect.getsource(cls.__init__):
                self._patch(cls, "__init__", _init_without_apex_check(module, cls.__init__))
        self._mode.__enter__()
        return self

    def undo(self) -> None:
        if not self._patches:
            return
        self._mode.__exit__(None, None, None)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def enable_cpu_compat() -> CpuCompat:
    """Activate the CPU redirections for this process; returns the handle to undo them."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "nemo_fp8_align.demo.cpu_redirects is for CPU-only runs and refuses to patch CUDA calls on "
            "a machine with a GPU: run the demo without --cpu-compat on GPUs.")
    return CpuCompat().apply()
