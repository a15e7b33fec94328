"""The post-all-gather work of each quantized-weight recipe, named by kind.

After a chunk's parameter all-gather, every FP8 / FP4 recipe megatron-core trains with leaves
work that each rank does at its own first use of the chunk unless it is placed (DESIGN 5c):

=================  ===============================  ============================================
kind               recipe (TE tensor)               the work, and whose code does it
=================  ===============================  ============================================
transpose          delayed, tensorwise              byte transpose of the FP8 data (TE's
                   (``Float8Tensor``)               ``_create_transpose``; the plugin's backend)
columnwise         blockwise (``Float8Blockwise     the column-wise copy: byte transpose of the
                   QTensor``, 2D weight blocks)     data and of the block scales (TE's
                                                    ``_create_columnwise``)
requantize         mxfp8 with megatron-core's       the gathered BF16 re-quantized into the MXFP8
                   ``reuse_grad_buf_for_mxfp8_      parameter (megatron-core's
                   param_ag`` (``MXFP8Tensor``)     ``_post_param_sync``)
nvfp4-transpose    nvfp4 (``NVFP4Tensor``)          the NVFP4 2D transpose of the packed 4-bit
                                                    data and its scales (TE >= 2.14, batched)
=================  ===============================  ============================================

Only ``transpose`` is ever done by the plugin's own code; the others are done by TE's or
megatron-core's code, which the aligned finish calls at the aligned slot
(:mod:`nemo_fp8_align.integrations.recipe_support` says on which megatron-core versions).
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["TRANSPOSE", "COLUMNWISE", "REQUANTIZE", "NVFP4_TRANSPOSE", "KINDS", "TE_BLOCK_CLASSES",
           "RECIPE_KIND", "chunk_kind", "kind_of"]

TRANSPOSE = "transpose"
COLUMNWISE = "columnwise"
REQUANTIZE = "requantize"
NVFP4_TRANSPOSE = "nvfp4-transpose"
KINDS = (TRANSPOSE, COLUMNWISE, REQUANTIZE, NVFP4_TRANSPOSE)

#: TE's block-scaled tensor classes (attribute names of the TE API surface) and their kind.
TE_BLOCK_CLASSES = (("Float8BlockwiseQTensor", COLUMNWISE), ("NVFP4Tensor", NVFP4_TRANSPOSE),
                    ("MXFP8Tensor", REQUANTIZE))

#: megatron-core's ``fp8_recipe`` / ``fp4_recipe`` name -> the kind of its weights' work.
RECIPE_KIND = {"delayed": TRANSPOSE, "tensorwise": TRANSPOSE, "blockwise": COLUMNWISE,
               "mxfp8": REQUANTIZE, "nvfp4": NVFP4_TRANSPOSE}


def kind_of(backend: object, weight: object) -> str:
    """The kind of ``weight``'s post-all-gather work: the backend's ``kind_of`` where it has
    one, else ``transpose`` (a backend of per-tensor FP8 weights only)."""
    ask = getattr(backend, "kind_of", None)
    return ask(weight) if ask is not None else TRANSPOSE


def chunk_kind(kinds: Iterable[Optional[str]]) -> str:
    """A chunk's kinds in one telemetry value: one kind, or several joined with ``+`` (a chunk
    mixing recipes); ``transpose`` for a chunk without quantized weights (and old records)."""
    found = sorted({k for k in kinds if k})
    return "+".join(found) if found else TRANSPOSE
