"""A linear layer computing with a :class:`ReferenceFP8Weight` the way an FP8 GEMM does.

Forward reads the FP8 ``data`` (``y = x W^T``); the backward data gradient reads the cached FP8
``transpose`` (``dx = dy (W^T)^T``, the TN GEMM Hopper requires); the weight gradient goes to the
high-precision DDP parameter. If the FP8 copy is stale at forward time it is built right there,
at first use: that is today's lazy behaviour, which the ``aligned`` policy pre-empts.
"""

from __future__ import annotations

import torch

from nemo_fp8_align.fp8.reference import ReferenceBackend, ReferenceFP8Weight

__all__ = ["ReferenceFP8Linear"]


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, source, fp8_weight: ReferenceFP8Weight):  # noqa: D401 - autograd API
        ctx.save_for_backward(x)
        ctx.fp8_weight = fp8_weight
        return x @ fp8_weight.dequantized().t().to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w_t = ctx.fp8_weight.dequantized_transpose().to(dy.dtype)
        dx = dy @ w_t.t()
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw.to(ctx.fp8_weight.source.dtype), None


class ReferenceFP8Linear(torch.nn.Module):
    """``y = x W^T`` through FP8 weights; no bias (GPT linears here run bias-free)."""

    def __init__(self, in_features: int, out_features: int, *, backend: ReferenceBackend,
                 name: str = "", init_std: float = 0.02) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        torch.nn.init.normal_(self.weight, std=init_std)
        self.backend = backend
        self.fp8_weight = ReferenceFP8Weight(self.weight, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not self.fp8_weight.transpose_valid:
            self.backend.build_transposes([self.fp8_weight])  # lazy: at first use
        elif not self.fp8_weight.data_valid:
            self.fp8_weight.quantize()  # inference needs no transpose
        return _FP8LinearFn.apply(x, self.weight, self.fp8_weight)
