"""What each quantized-weight recipe does to a chunk's weights after their all-gather, how many
bytes that moves, and which GPUs run it (read in megatron-core 0.19.2 and TE 2.20-2.21).

Bytes are per weight element, read + written, as modelled here (a kernel may move more):

* per-tensor FP8 (``delayed``, ``tensorwise``): TE's ``_create_transpose``, a byte transpose
  (read 1, write 1), only where FP8 GEMMs need the TN layout (Hopper; not datacenter Blackwell);
* ``blockwise`` (2D 128 x 128 blocks, fp32 scales): ``_create_columnwise``, a byte transpose of
  the data plus its scales (read 1 + 4/16384, write the same), on every GPU;
* ``mxfp8`` with ``reuse_grad_buf_for_mxfp8_param_ag``: megatron-core re-quantizes the gathered
  BF16 into the MXFP8 parameter (read 2; write rowwise and columnwise FP8, 2, and their E8M0
  scales, 2/32) and zeroes the BF16 buffer (write 2); without it, nothing runs after the gather;
* ``nvfp4``: a 2D transpose of the 4-bit data (read 1/2, write 1/2) and of its FP8 scales, one
  per 16 elements (read 1/16, write 1/16).

The all-gather moves the gathered format: FP8 (1 byte, plus block scales), BF16 for MXFP8 with
grad-buffer reuse (2), NVFP4 (1/2 + 1/16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from nemo_fp8_align.errors import PlanInputError
from nemo_fp8_align.support import RECIPE_KIND, TRANSPOSE

__all__ = ["RECIPES", "PER_TENSOR", "PostProcessing", "post_processing"]

#: The recipes megatron-core trains with, from the one recipe table (:mod:`nemo_fp8_align.support`).
RECIPES = tuple(RECIPE_KIND)
PER_TENSOR = tuple(recipe for recipe, kind in RECIPE_KIND.items() if kind == TRANSPOSE)
_BLACKWELL_ONLY = {"mxfp8": "MXFP8 needs datacenter Blackwell (Transformer Engine: sm_100 to "
                            "below sm_120)",
                   "nvfp4": "NVFP4 needs Blackwell (Transformer Engine: sm_100 or newer)"}


@dataclass(frozen=True)
class PostProcessing:
    """A recipe's post-all-gather work on one GPU kind."""

    recipe: str
    kind: str  #: transpose, columnwise, requantize, nvfp4-transpose (the telemetry's names)
    bytes_per_weight: float  #: read + written per weight element
    gathered_bytes_per_weight: float  #: what the all-gather moves per weight element
    what: str  #: in words, for the plan's output


_WORK = {
    "transpose": PostProcessing("per-tensor", "transpose", 2.0, 1.0,
                                "FP8 byte transpose (read 1 B, write 1 B per weight)"),
    "blockwise": PostProcessing("blockwise", "columnwise", 2.0 + 8 / 16384, 1.0 + 4 / 16384,
                                "columnwise copy: byte transpose of the FP8 data and of its "
                                "128x128-block fp32 scales"),
    "mxfp8": PostProcessing("mxfp8", "requantize", 6.0 + 2 / 32, 2.0,
                            "re-quantize the gathered BF16 into rowwise and columnwise MXFP8 "
                            "(read 2 B, write 2 B + scales) and zero the BF16 buffer (2 B)"),
    "nvfp4": PostProcessing("nvfp4", "nvfp4-transpose", 1.0 + 2 / 16, 0.5 + 1 / 16,
                            "2D transpose of the 4-bit data and its FP8 scales (1/16 B per weight)"),
}


def post_processing(recipe: str, gpu: str, gemm_needs_tn: bool, *,
                    reuse_grad_buf: bool = True) -> Tuple[Optional[PostProcessing], str]:
    """``(work, "")``, or ``(None, why nothing runs after the gather)``; raises
    :class:`PlanInputError` where the GPU cannot run the recipe at all."""
    if recipe not in RECIPES:
        raise PlanInputError(f"--recipe {recipe!r}: one of {', '.join(RECIPES)}")
    if recipe in _BLACKWELL_ONLY and gemm_needs_tn:
        raise PlanInputError(f"--recipe {recipe} --gpu {gpu}: {_BLACKWELL_ONLY[recipe]}; plan it "
                             "with --gpu b200 or --gpu gb200, or a per-tensor or blockwise recipe")
    if recipe in PER_TENSOR:
        if not gemm_needs_tn:
            return None, ("datacenter Blackwell (sm_100) FP8 GEMMs accept non-TN layouts: no "
                          "transpose is built for per-tensor FP8")
        return _WORK["transpose"], ""
    if recipe == "mxfp8" and not reuse_grad_buf:
        return None, ("MXFP8 without reuse_grad_buf_for_mxfp8_param_ag: megatron-core gathers "
                      "the MXFP8 data itself and nothing runs after the all-gather")
    return _WORK[recipe], ""
