"""Run megatron-core's schedule, DDP and DistributedOptimizer on the CPU over gloo.

megatron-core assumes CUDA in a handful of places that do not affect what this project tests
(where tensors live, stream syncs, type-string checks). :func:`enable_cpu_compat` redirects
exactly those to the CPU, for the CPU demo, the CPU smoke run and the tests. It refuses to run
when CUDA is available: on a GPU nothing here may change behaviour. Verified on megatron-core
0.12.3 and 0.16.1 with torch 2.13 (CPU build) and 0.19.2 with torch 2.13 (CUDA build, no GPU);
0.7.0 to 0.11.0 with the CPU build (0.7.0 with the Apex stand-ins below).
"""

from __future__ import annotations

import contextlib
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


def _multi_tensor_applier(op: Callable[..., Any], noop_flag: Any, tensor_lists: Any,
                          *args: Any) -> Any:
    return op(noop_flag, tensor_lists, *args)


def _l2norm(noop_flag: Any, tensor_lists: Any, per_tensor: bool = False) -> Any:
    norms = [t.detach().float().norm(2) for t in tensor_lists[0]]
    total = torch.stack(norms).norm(2) if norms else torch.zeros(())
    return total.reshape(1), (torch.stack(norms) if per_tensor and norms else None)


def _scale(noop_flag: Any, tensor_lists: Any, scale: float) -> None:
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)


def _apex_stand_ins() -> dict:
    """megatron-core 0.7.0's optimizer imports Apex unconditionally (``apex.optimizers.
    FusedAdam``, ``apex.multi_tensor_apply``, ``amp_C``); Apex is a CUDA build. On the CPU they
    are served by what megatron-core 0.8 on falls back to without Apex: torch's AdamW (Apex's
    FusedAdam in its default AdamW mode) and SGD, and the two multi-tensor kernels (the L2 norm
    for gradient clipping, the scaled copy) in plain torch."""
    import types

    apex = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam, optimizers.FusedSGD = torch.optim.AdamW, torch.optim.SGD
    applier = types.ModuleType("apex.multi_tensor_apply")
    applier.multi_tensor_applier = _multi_tensor_applier
    amp_c = types.ModuleType("amp_C")
    amp_c.multi_tensor_l2norm, amp_c.multi_tensor_scale = _l2norm, _scale
    apex.optimizers, apex.multi_tensor_apply = optimizers, applier
    return {"apex": apex, "apex.optimizers": optimizers, "apex.multi_tensor_apply": applier,
            "amp_C": amp_c}


def _needs_apex_stand_ins() -> bool:
    import importlib.util
    import os

    if importlib.util.find_spec("apex") is not None:
        return False
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(spec.submodule_search_locations[0], "optimizer", "__init__.py")
    try:
        with open(path, encoding="utf-8") as f:
            return "\nfrom apex.optimizers import" in f.read()  # unguarded: 0.7.0
    except OSError:
        return False


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
        self._added: List[Tuple[dict, str]] = []
        self._mode = _CudaToCpuMode()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _patch_absent(self, namespace: dict, name: str, value: Any) -> None:
        """Add ``name`` to a dict namespace that lacks it; :meth:`undo` removes it again."""
        if name in namespace:
            return
        namespace[name] = value
        self._added.append((namespace, name))

    def apply(self) -> "CpuCompat":
        self._patch(torch.cuda, "current_device", lambda: "cpu")
        self._patch(torch.cuda, "synchronize", lambda *a, **k: None)
        self._patch(torch.cuda, "current_stream", lambda *a, **k: _HostStream())
        self._patch(torch.cuda, "default_stream", lambda *a, **k: _HostStream())  # 0.10-0.12
        # num_distributed_optimizer_instances > 1: DDP gives its bucket groups a side stream for
        # the inter-instance gradient all-reduce and enters it around that collective.
        self._patch(torch.cuda, "Stream", lambda *a, **k: _HostStream())
        self._patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        self._patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        self._patch(torch.Tensor, "type", _tensor_type_as_cuda(torch.Tensor.type))
        if _needs_apex_stand_ins():
            import sys

            for name, module in _apex_stand_ins().items():
                self._patch_absent(sys.modules, name, module)
        for module_name in ("megatron.core.optimizer.distrib_optimizer",):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if hasattr(module, "quantize_param_shard"):
                self._patch(module, "quantize_param_shard", _skip_empty(module.quantize_param_shard))
            if getattr(module, "HAVE_APEX_OR_TE", True) is False and not hasattr(module, "Adam"):
                # 0.8.0 checks isinstance(optimizer, Adam) with no Adam bound without Apex/TE;
                # get_megatron_optimizer then built torch's AdamW (its own fallback).
                self._patch_absent(vars(module), "Adam", torch.optim.AdamW)
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
        for namespace, name in reversed(self._added):
            namespace.pop(name, None)
        self._added.clear()


def enable_cpu_compat() -> CpuCompat:
    """Activate the CPU redirections for this process; returns the handle to undo them."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "lab.demo.cpu_redirects is for CPU-only runs and refuses to patch CUDA calls on "
            "a machine with a GPU: run the demo without --cpu-compat on GPUs.")
    return CpuCompat().apply()
