"""A plain-torch FP8 weight with a transpose cache, and its backend.

megatron-core's DDP and DistributedOptimizer accept only high-precision or Transformer Engine
parameters, so the DDP parameter stays high precision and this object builds the FP8 copy from
it (per-tensor current scaling: cast, scale, transpose) once per step, after the chunk's
all-gather has finished. Every policy builds it the same way, so results stay bit-identical
between ``aligned``, ``lazy`` and ``off``: only *when* the build runs differs.

It runs anywhere torch has ``float8_e4m3fn``: the CPU runs, the tests and the benchmarks use it.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from nemo_fp8_align.kernels import multi_transpose_

__all__ = ["ReferenceFP8Weight", "ReferenceBackend", "FP8_E4M3_MAX"]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


class ReferenceFP8Weight:
    """FP8 (e4m3) copy of a 2-D high-precision parameter, plus its cached transpose.

    ``data`` is ``[out, in]`` as the forward GEMM reads it; ``transpose`` is ``[in, out]``
    contiguous, as the backward data-gradient GEMM needs it on Hopper (TN layout only).
    Both are valid from :meth:`quantize` / a backend build until :meth:`invalidate`, which the
    training loop calls whenever the source parameter receives new values (after the
    optimizer step).
    """

    def __init__(self, source: torch.nn.Parameter, *, name: str = "") -> None:
        if source.dim() != 2:
            raise ValueError(f"ReferenceFP8Weight {name!r}: source must be 2-D, got {tuple(source.shape)}")
        self.source = source
        self.name = name
        out_f, in_f = source.shape
        self.data = torch.empty((out_f, in_f), dtype=torch.float8_e4m3fn, device=source.device)
        self.transpose = torch.empty((in_f, out_f), dtype=torch.float8_e4m3fn, device=source.device)
        self.scale_inv = torch.ones((), dtype=torch.float32, device=source.device)
        self.data_valid = False
        self.transpose_valid = False
        #: Transposes built over the object's life: tests read it to prove "exactly once".
        self.transposes_built = 0

    def invalidate(self) -> None:
        """Mark the FP8 copy and its transpose stale (the source parameter changed)."""
        self.data_valid = False
        self.transpose_valid = False

    @torch.no_grad()
    def quantize(self) -> None:
        """Cast the current source values to FP8 with a per-tensor scale from their amax."""
        src = self.source.detach().float()
        amax = src.abs().max().clamp(min=1e-12)
        scale = FP8_E4M3_MAX / amax
        self.data.copy_((src * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))
        self.scale_inv.copy_(1.0 / scale)
        self.data_valid = True
        self.transpose_valid = False

    def dequantized(self) -> torch.Tensor:
        """``data`` as float32 ``[out, in]``."""
        return self.data.float() * self.scale_inv

    def dequantized_transpose(self) -> torch.Tensor:
        """``transpose`` as float32 ``[in, out]``; raises if the cache is stale."""
        if not self.transpose_valid:
            raise RuntimeError(
                f"FP8 weight {self.name!r}: transpose cache used while stale. Something "
                "invalidated it between its build and this backward (DESIGN.md invariant 4)."
            )
        return self.transpose.float() * self.scale_inv


class ReferenceBackend:
    """:class:`~nemo_fp8_align.fp8.protocol.FP8TransposeBackend` for :class:`ReferenceFP8Weight`."""

    name = "reference"

    def __init__(self, *, use_triton_kernel: bool = True) -> None:
        self.use_triton_kernel = use_triton_kernel

    def transpose_needed(self) -> Tuple[bool, str]:
        return True, "reference FP8 weights always keep a transpose for the backward GEMM"

    def has_valid_transpose(self, weight: ReferenceFP8Weight) -> bool:
        return weight.transpose_valid

    def build_transposes(self, weights: Sequence[ReferenceFP8Weight]) -> int:
        stale = [w for w in weights if not w.transpose_valid]
        for w in stale:
            if not w.data_valid:
                w.quantize()
        # One batched call for the whole chunk: one kernel launch on CUDA.
        multi_transpose_([w.data for w in stale], [w.transpose for w in stale],
                         use_triton=self.use_triton_kernel)
        for w in stale:
            w.transpose_valid = True
            w.transposes_built += 1
        return len(stale)
