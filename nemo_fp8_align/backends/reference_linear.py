"""A linear layer computing with a :class:`ReferenceFP8Weight` the way an FP8 GEMM does.

Forward reads the FP8 ``data`` (``y = x W^T``); the backward data gradient reads the cached FP8
``transpose`` (``dx = dy (W^T)^T``, the TN GEMM Hopper requires); the weight gradient goes to the
high-precision DDP parameter. If the FP8 copy is stale at forward time it is built right there,
at first use: that is today's lazy behaviour, which the ``aligned`` policy pre-empts.

On the CPU the GEMMs run on the dequantised FP8 values. On CUDA GPUs with FP8 tensor cores
(sm_89+) they are real FP8 GEMMs (``torch._scaled_mm``, activations and output gradients cast
with per-tensor current scaling, e4m3 / e5m2): the data-gradient GEMM then *needs* the physical
transpose, as ``_scaled_mm`` accepts only row-major x column-major operands.
"""

from __future__ import annotations

import torch

from nemo_fp8_align.backends.reference import ReferenceBackend, ReferenceFP8Weight

__all__ = ["ReferenceFP8Linear"]


def _fp8_tensor_cores(x: torch.Tensor, w: ReferenceFP8Weight) -> bool:
    """A real FP8 GEMM: per-tensor weights on sm_89+ (block-scaled reference weights compute on
    their dequantized values everywhere: they model the layout work, not the GEMM)."""
    return (w.kind == "transpose" and x.is_cuda
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _cast(t: torch.Tensor, dtype: torch.dtype):
    """Per-tensor current scaling: ``(t * scale).to(dtype)`` and ``1 / scale``."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.detach().abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _scaled_mm(a: torch.Tensor, a_dtype: torch.dtype, b_fp8: torch.Tensor,
               b_scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with ``a`` cast to FP8 here and ``b`` already FP8 (column-major view)."""
    a2 = a.reshape(-1, a.shape[-1])
    a_fp8, a_scale_inv = _cast(a2, a_dtype)
    out = torch._scaled_mm(a_fp8, b_fp8, scale_a=a_scale_inv, scale_b=b_scale_inv.float(),
                           out_dtype=out_dtype)
    return out.reshape(*a.shape[:-1], b_fp8.shape[1])


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, source, fp8_weight: ReferenceFP8Weight, check: bool):  # noqa: D401
        ctx.save_for_backward(x)
        ctx.fp8_weight, ctx.check = fp8_weight, check
        if check:
            fp8_weight.check_provenance("forward")
        if _fp8_tensor_cores(x, fp8_weight):  # TN: data [out, in] row-major, its .t() is column-major
            return _scaled_mm(x, torch.float8_e4m3fn, fp8_weight.data.t(),
                              fp8_weight.scale_inv, x.dtype)
        return x @ fp8_weight.dequantized().t().to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w = ctx.fp8_weight
        if ctx.check and w.transpose_valid:
            w.check_provenance("backward")
        if _fp8_tensor_cores(dy, w):  # TN again: only the cached transpose [in, out] fits
            if not w.transpose_valid:
                w.dequantized_transpose()  # raises the stale-cache error
            dx = _scaled_mm(dy, torch.float8_e5m2, w.transpose.t(), w.scale_inv, dy.dtype)
        else:
            dx = dy @ w.dequantized_transpose().to(dy.dtype).t()
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw.to(w.source.dtype), None, None


class ReferenceFP8Linear(torch.nn.Module):
    """``y = x W^T`` through FP8 weights; no bias (GPT linears here run bias-free)."""

    def __init__(self, in_features: int, out_features: int, *, backend: ReferenceBackend,
                 name: str = "", init_std: float = 0.02,
                 weight_cls: type = ReferenceFP8Weight) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        torch.nn.init.normal_(self.weight, std=init_std)
        self.backend = backend
        dtype = getattr(weight_cls, "param_dtype", None)
        if dtype is not None:  # MXFP8: the DDP parameter holds the gathered BF16 values
            self.weight.data = self.weight.data.to(dtype)
        self.fp8_weight = weight_cls(self.weight, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not self.fp8_weight.transpose_valid:
            self.backend.build_transposes([self.fp8_weight])  # lazy: at first use
        elif not self.fp8_weight.data_valid:
            self.fp8_weight.quantize()  # inference needs no transpose
        return _FP8LinearFn.apply(x, self.weight, self.fp8_weight, self.backend.check_provenance)
