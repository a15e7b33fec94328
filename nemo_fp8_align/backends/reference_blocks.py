"""Plain-torch stand-ins for Transformer Engine's block-scaled weights, for the CPU runs.

They do what each recipe's post-all-gather work does to a weight, in plain torch, so the CPU demo
(``demo --recipe``) can run it through megatron-core's own post-processing path:

* :class:`ReferenceBlockwiseWeight` (``columnwise``, TE ``Float8BlockwiseQTensor`` with 2D
  blocks): FP8 e4m3 data with one scale per ``BLOCK x BLOCK`` block (TE: 128 x 128); its
  column-wise copy is the data's bytes transposed plus the scale grid transposed, as TE's
  ``_create_columnwise`` builds it.
* :class:`ReferenceNVFP4Weight` (``nvfp4-transpose``, TE ``NVFP4Tensor`` with 2D blocks): 4-bit
  E2M1 values packed two per byte, one scale per 16 x 16 block; its column-wise copy is not a
  byte transpose: the nibbles are unpacked, transposed and packed again (TE's
  ``nvfp4_data_transpose``), and the scale grid transposed. Scales are float32 here (TE: e4m3
  block scales under a float32 tensor scale): the layout work is the point, not the format.

Both keep the base class's interface (:class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight`:
``data``, ``transpose`` = the column-wise copy, validity flags, provenance digests), so the
linear layer, the backend and the checks are shared.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_fp8_align.support import COLUMNWISE, NVFP4_TRANSPOSE, REQUANTIZE
from nemo_fp8_align.backends.reference import FP8_E4M3_MAX, ReferenceFP8Weight, bytes_digest
from nemo_fp8_align.errors import StaleFP8Error

__all__ = ["ReferenceBlockwiseWeight", "ReferenceNVFP4Weight", "ReferenceMXFP8Weight",
           "REFERENCE_WEIGHTS"]

#: The E2M1 magnitudes (FP4): code 0-7, bit 3 is the sign.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _blocks(rows: int, cols: int, block: int, name: str) -> tuple:
    if rows % block or cols % block:
        raise ValueError(f"block-scaled reference weight {name!r}: shape ({rows}, {cols}) is not "
                         f"a multiple of its {block} x {block} blocks")
    return rows // block, cols // block


def _expand(scales: torch.Tensor, block: int) -> torch.Tensor:
    return scales.repeat_interleave(block, 0).repeat_interleave(block, 1)


def _block_amax(src: torch.Tensor, block: int) -> torch.Tensor:
    rb, cb = src.shape[0] // block, src.shape[1] // block
    return src.reshape(rb, block, cb, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)


class _BlockScaled(ReferenceFP8Weight):
    BLOCK = 16

    def __init__(self, source: torch.nn.Parameter, **kwargs) -> None:
        super().__init__(source, **kwargs)
        out_f, in_f = source.shape
        rb, cb = _blocks(out_f, in_f, self.BLOCK, self.name)
        self.scale_inv = torch.ones((rb, cb), dtype=torch.float32, device=source.device)
        self.columnwise_scale_inv = torch.ones((cb, rb), dtype=torch.float32, device=source.device)

    def _scales_mismatch(self) -> Optional[str]:
        if not torch.equal(self.columnwise_scale_inv, self.scale_inv.t()):
            return "column-wise block scales differ from the row-wise scales transposed"
        return None


class ReferenceBlockwiseWeight(_BlockScaled):
    """Blockwise FP8 (2D blocks): column-wise copy = bytes transposed + scale grid transposed."""

    kind = COLUMNWISE

    def _cast(self, src: torch.Tensor) -> None:
        scale = FP8_E4M3_MAX / _block_amax(src, self.BLOCK)
        q = (src * _expand(scale, self.BLOCK)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        self.data.copy_(q.to(torch.float8_e4m3fn))
        self.scale_inv.copy_(1.0 / scale)

    def finish_columnwise(self) -> None:
        self.columnwise_scale_inv.copy_(self.scale_inv.t())

    def columnwise_mismatch(self) -> Optional[str]:
        return super().columnwise_mismatch() or self._scales_mismatch()

    def dequantized(self) -> torch.Tensor:
        return self.data.float() * _expand(self.scale_inv, self.BLOCK)

    def dequantized_transpose(self) -> torch.Tensor:
        self.require_valid_transpose()
        return self.transpose.float() * _expand(self.columnwise_scale_inv, self.BLOCK)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[r, c] codes 0-15 -> [r, c/2] bytes (even column in the low nibble)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.uint8,
                      device=packed.device)
    out[:, 0::2], out[:, 1::2] = packed & 0xF, packed >> 4
    return out


def _decode(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1.to(codes.device)[(codes & 0x7).long()]
    return torch.where(codes >= 8, -mag, mag)


class ReferenceNVFP4Weight(_BlockScaled):
    """NVFP4 (2D 16 x 16 blocks, packed nibbles): the column-wise copy is built by unpacking,
    transposing and repacking, never by a byte transpose of the packed data."""

    kind = NVFP4_TRANSPOSE
    byte_transposed = False

    def __init__(self, source: torch.nn.Parameter, **kwargs) -> None:
        super().__init__(source, **kwargs)
        out_f, in_f = source.shape
        self.data = torch.zeros((out_f, in_f // 2), dtype=torch.uint8, device=source.device)
        self.transpose = torch.zeros((in_f, out_f // 2), dtype=torch.uint8, device=source.device)

    def _cast(self, src: torch.Tensor) -> None:
        scale = 6.0 / _block_amax(src, self.BLOCK)
        q = src * _expand(scale, self.BLOCK)
        grid = E2M1.to(src.device)
        idx = (q.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1).to(torch.uint8)
        codes = torch.where((q < 0) & (idx > 0), idx | 0x8, idx)
        self.data.copy_(_pack(codes))
        self.scale_inv.copy_(1.0 / scale)

    def build_columnwise(self) -> None:
        self.transpose.copy_(_pack(_unpack(self.data).t().contiguous()))
        self.columnwise_scale_inv.copy_(self.scale_inv.t())

    def columnwise_mismatch(self) -> Optional[str]:
        if not torch.equal(_unpack(self.transpose), _unpack(self.data).t()):
            return "column-wise FP4 values differ from the row-wise ones transposed"
        return self._scales_mismatch()

    def dequantized(self) -> torch.Tensor:
        return _decode(_unpack(self.data)) * _expand(self.scale_inv, self.BLOCK)

    def dequantized_transpose(self) -> torch.Tensor:
        self.require_valid_transpose()
        return _decode(_unpack(self.transpose)) * _expand(self.columnwise_scale_inv, self.BLOCK)


def _mx_cast(values: torch.Tensor) -> tuple:
    """MXFP8 along rows: one power-of-two scale per 32 consecutive values of a row."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(FP8_E4M3_MAX / amax)))
    q = (blocks * scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.reshape(rows, cols).to(torch.float8_e4m3fn), 1.0 / scale


class ReferenceMXFP8Weight(ReferenceFP8Weight):
    """MXFP8 with megatron-core's grad-buffer reuse: its DDP parameter is a BF16 view of the
    parameter buffer that megatron-core zeroes right after re-quantizing (as it zeroes the
    shared grad buffer), so the FP8 copies are built only from the values megatron-core hands
    over after the all-gather (:meth:`stage`), never from the parameter: row-wise (32-value
    blocks along rows) and column-wise (32-value blocks along columns, stored transposed) are
    both quantized from those values, the column-wise one is no transpose of the row-wise bytes.
    A copy read before megatron-core re-quantized it this step raises :class:`StaleFP8Error`."""

    kind = REQUANTIZE
    byte_transposed = False
    #: The DDP parameter's dtype: megatron-core gathers MXFP8 weights' values in BF16.
    param_dtype = torch.bfloat16

    def __init__(self, source: torch.nn.Parameter, **kwargs) -> None:
        super().__init__(source, **kwargs)
        out_f, in_f = source.shape
        _blocks(out_f, in_f, 32, self.name)
        self.scale_inv = torch.ones((out_f, in_f // 32), dtype=torch.float32, device=source.device)
        self.columnwise_scale_inv = torch.ones((in_f, out_f // 32), dtype=torch.float32,
                                               device=source.device)
        self._staged = None

    def stage(self, values: torch.Tensor) -> None:
        """megatron-core's ``copy_tensor_to_quantized_param(param, values)``: the gathered
        high-precision values, quantized by the next build."""
        self._staged = values.detach().reshape(self.source.shape).float().clone()

    def quantize(self) -> None:
        if self._staged is None:
            raise StaleFP8Error(
                f"MXFP8 weight {self.name!r}: read before megatron-core re-quantized it after "
                "this step's all-gather (its parameter holds no values to quantize from)")
        self.data, self.scale_inv = _mx_cast(self._staged)
        self.data_valid = True
        self.data_source = bytes_digest(self._staged)

    def build_columnwise(self) -> None:
        col, scale_inv = _mx_cast(self._staged.t().contiguous())
        self.transpose, self.columnwise_scale_inv = col, scale_inv
        self.transpose_source = self.data_source
        self._staged = None  # megatron-core zeroes the gathered values next

    def check_provenance(self, use: str) -> None:
        """The copies were built from the values gathered this step (the parameter itself is
        zeroed by then): ``data_valid`` is cleared by every optimizer step and set only by the
        re-quantization, whose values :meth:`stage` received."""
        if not self.data_valid:
            raise StaleFP8Error(f"MXFP8 weight {self.name!r}: {use} reads a copy not "
                                "re-quantized since the last optimizer step")

    def columnwise_mismatch(self) -> Optional[str]:
        return None if self.transpose_source == self.data_source else \
            "column-wise copy quantized from other values than the row-wise one"

    def dequantized(self) -> torch.Tensor:
        return (self.data.float().reshape(self.data.shape[0], -1, 32)
                * self.scale_inv.unsqueeze(-1)).reshape(self.data.shape)

    def dequantized_transpose(self) -> torch.Tensor:
        self.require_valid_transpose()
        t = self.transpose
        return (t.float().reshape(t.shape[0], -1, 32)
                * self.columnwise_scale_inv.unsqueeze(-1)).reshape(t.shape)


#: The demo's ``--recipe`` -> its reference weight class (delayed and tensorwise: per tensor).
REFERENCE_WEIGHTS = {"delayed": ReferenceFP8Weight, "tensorwise": ReferenceFP8Weight,
                     "blockwise": ReferenceBlockwiseWeight, "nvfp4": ReferenceNVFP4Weight,
                     "mxfp8": ReferenceMXFP8Weight}
