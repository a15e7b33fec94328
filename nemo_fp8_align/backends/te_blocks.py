"""Transformer Engine's block-scaled weights (blockwise FP8, MXFP8, NVFP4) in the TE backend.

Their post-all-gather work is never a byte transpose the plugin may do itself: the block scales
run along one axis, so the column-wise copy is TE's (``_create_columnwise``, the batched NVFP4 2D
transpose, both inside TE's ``post_all_gather_processing``) or megatron-core's (the MXFP8
re-quantization of ``reuse_grad_buf_for_mxfp8_param_ag``). The backend lists these weights, says
whether their column-wise copy is present, asks TE's own ``post_all_gather_processing`` to build
a missing one (TE >= 2.10), and in verify mode checks a 2D-blockwise copy byte for byte.

A column-wise copy's *presence* is all TE records: megatron-core (>= 0.16, TE >= 2.10) casts
with ``manual_post_all_gather_processing=True``, which leaves the old copy in place until the
post-processing rebuilds it. Whether it was rebuilt once per step, and where, is what the
build watch (:mod:`nemo_fp8_align.backends.te_watch`) observes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from nemo_fp8_align.support import COLUMNWISE, NVFP4_TRANSPOSE, TE_BLOCK_CLASSES

__all__ = ["block_kind", "block_classes", "columnwise_present", "build_columnwise",
           "columnwise_mismatch"]


def block_classes(api: Any) -> List[tuple]:
    """``(TE class, kind)`` for the block-scaled classes this TE has."""
    return [(getattr(api, name), kind) for name, kind in TE_BLOCK_CLASSES
            if getattr(api, name, None) is not None]


def block_kind(api: Any, weight: Any) -> Optional[str]:
    """The kind of a TE block-scaled weight (by ``type()``: no attribute hook runs), else None."""
    wtype = type(weight)
    for cls, kind in block_classes(api):
        if issubclass(wtype, cls):
            return kind
    return None


def columnwise_present(peek: Callable[..., Any], weight: Any) -> bool:
    """TE holds a column-wise copy (data and scales) of ``weight``."""
    return (peek(weight, "_columnwise_data", None) is not None
            and peek(weight, "_columnwise_scale_inv", None) is not None)


def build_columnwise(api: Any, weights: List[Any], kinds: List[str]) -> int:
    """Ask TE's ``post_all_gather_processing`` for the column-wise copies it builds (blockwise,
    NVFP4); MXFP8's is megatron-core's re-quantization, which only megatron-core can run.
    Returns how many were handed to TE."""
    mine = [w for w, k in zip(weights, kinds) if k in (COLUMNWISE, NVFP4_TRANSPOSE)]
    run = getattr(api, "post_all_gather_processing", None)
    if mine and run is not None:
        run(mine)
        return len(mine)
    return 0


def columnwise_mismatch(peek: Callable[..., Any], weight: Any, kind: str) -> Optional[str]:
    """Verify mode: a 2D-blockwise weight's column-wise data must be its row-wise bytes
    transposed and its column-wise scales the row-wise block scales transposed. NVFP4 and MXFP8
    copies are checked for presence only (their bytes are not a transpose of the row-wise ones)."""
    if not columnwise_present(peek, weight):
        return "column-wise copy missing"
    if kind != COLUMNWISE or not peek(weight, "_is_2D_scaled", False):
        return None
    data, col = peek(weight, "_rowwise_data"), peek(weight, "_columnwise_data")
    data = data.reshape(-1, data.shape[-1])
    if tuple(col.shape) != (data.shape[1], data.shape[0]):
        return f"column-wise shape {tuple(col.shape)} for data {tuple(data.shape)}"
    if not torch.equal(col.view(torch.uint8), data.view(torch.uint8).t()):
        return "column-wise bytes differ from the row-wise FP8 data transposed"
    rs, cs = peek(weight, "_rowwise_scale_inv"), peek(weight, "_columnwise_scale_inv")
    rows, cols = min(rs.shape[0], cs.shape[1]), min(rs.shape[1], cs.shape[0])
    if not torch.equal(cs[:cols, :rows], rs[:rows, :cols].t()):
        return "column-wise block scales differ from the row-wise scales transposed"
    return None
