"""Multi-tensor 2-D transpose of 1-byte (FP8) tensors: ``out[i] = src[i].t()``.

One entry point, :func:`multi_transpose_`. On CUDA it launches the Triton multi-tensor kernel
(all tensors of a chunk in one launch) when Triton is importable and ``use_triton`` is set; on
the CPU, or without Triton, it falls back to one torch copy per tensor. Both paths are byte-exact.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

__all__ = ["multi_transpose_", "check_transpose_pairs"]

logger = logging.getLogger(__name__)
_warned_fallback = False


def check_transpose_pairs(sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the offending pair unless every ``outputs[i]`` can hold
    ``sources[i].t()``: same count, 2-D, one byte per element, same dtype and device,
    ``outputs[i]`` contiguous with the transposed shape."""
    if len(sources) != len(outputs):
        raise ValueError(f"multi_transpose_: {len(sources)} sources but {len(outputs)} outputs")
    for i, (src, out) in enumerate(zip(sources, outputs)):
        if src.device != sources[0].device:
            raise ValueError(f"multi_transpose_: source {i} is on {src.device}, source 0 on "
                             f"{sources[0].device}: one call transposes tensors of one device")
        if src.dim() != 2:
            raise ValueError(f"multi_transpose_: source {i} has shape {tuple(src.shape)}, expected 2-D")
        if src.element_size() != 1:
            raise ValueError(
                f"multi_transpose_: source {i} has dtype {src.dtype} ({src.element_size()} bytes), "
                "expected a 1-byte FP8 or uint8 dtype"
            )
        if out.dtype != src.dtype or out.device != src.device:
            raise ValueError(
                f"multi_transpose_: output {i} is {out.dtype} on {out.device}, "
                f"source is {src.dtype} on {src.device}"
            )
        if tuple(out.shape) != (src.shape[1], src.shape[0]) or not out.is_contiguous():
            raise ValueError(
                f"multi_transpose_: output {i} must be a contiguous {src.shape[1]}x{src.shape[0]} "
                f"tensor, got shape {tuple(out.shape)} (contiguous={out.is_contiguous()})"
            )


def multi_transpose_(
    sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *, use_triton: bool = True
) -> None:
    """Write ``sources[i].t()`` into ``outputs[i]`` for every i (in place on ``outputs``)."""
    check_transpose_pairs(sources, outputs)
    if not sources:
        return
    if use_triton and sources[0].is_cuda:
        from nemo_fp8_align.kernels import triton_transpose  # CUDA-only import

        if triton_transpose.available():
            triton_transpose.multi_transpose(sources, outputs)
            return
        _warn_torch_fallback(triton_transpose.unavailable_reason())
    for src, out in zip(sources, outputs):
        # Copy through uint8: torch's generic copy kernel handles every 1-byte dtype that way.
        out.view(torch.uint8).copy_(src.view(torch.uint8).t())


def _warn_torch_fallback(reason: object) -> None:
    # torch's generic transpose reaches ~8% of the H200's copy bandwidth: say so, once.
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        logger.warning("nemo_fp8_align: FP8 transposes on CUDA fall back to torch's generic copy "
                       "(about 10x slower than the Triton kernel): %s", reason)
