"""A plain-torch FP8 weight with a transpose cache, and its backend.

megatron-core's DDP and DistributedOptimizer accept only high-precision or Transformer Engine
parameters, so the DDP parameter stays high precision and this object builds the FP8 copy from
it (per-tensor current scaling: cast, scale, transpose) once per step, after the chunk's
all-gather has finished. Every policy builds it the same way, so results stay bit-identical
between ``aligned``, ``lazy`` and ``off``: only *when* the build runs differs.

It runs anywhere torch has ``float8_e4m3fn``: the CPU runs, the tests and the benchmarks use it.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence, Tuple

import torch

from nemo_fp8_align.kernels import multi_transpose_
from nemo_fp8_align.errors import StaleFP8Error

__all__ = ["ReferenceFP8Weight", "ReferenceBackend", "StaleFP8Error", "FP8_E4M3_MAX"]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0


def bytes_digest(t: torch.Tensor) -> bytes:
    """A digest of ``t``'s bytes: the evidence of which parameter values an FP8 copy holds."""
    raw = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


class ReferenceFP8Weight:
    """FP8 (e4m3) copy of a 2-D high-precision parameter, plus its cached transpose.

    ``kind`` names its post-all-gather work (:mod:`~nemo_fp8_align.support`); the
    block-scaled reference weights of :mod:`~nemo_fp8_align.backends.reference_blocks` derive
    from this class.

    ``data`` is ``[out, in]`` as the forward GEMM reads it; ``transpose`` is ``[in, out]``
    contiguous, as the backward data-gradient GEMM needs it on Hopper (TN layout only).
    Both are valid from :meth:`quantize` / a backend build until :meth:`data_changed`, which the
    training loop calls whenever the source parameter receives new values (after the
    optimizer step).

    ``manual_post_processing``: behave as a Transformer Engine ``Float8Tensor`` whose FP8 data
    megatron-core (>= 0.16, TE >= 2.10) casts with ``manual_post_all_gather_processing=True``:
    new data leaves the transpose *flagged valid* (and stale) until a build from the current
    bytes (:meth:`ReferenceBackend.rebuild_transposes`, megatron-core's post-all-gather
    processing for TE) replaces it. A backward that reads it before then reads old weights.
    """

    kind = "transpose"
    #: The column-wise copy is ``data``'s bytes transposed (one batched kernel for the chunk);
    #: False: :meth:`build_columnwise` builds it (NVFP4's nibble repacking).
    byte_transposed = True

    def __init__(self, source: torch.nn.Parameter, *, name: str = "",
                 manual_post_processing: bool = False) -> None:
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
        self.manual_post_processing = manual_post_processing
        #: Transposes built over the object's life: tests read it to prove "exactly once".
        self.transposes_built = 0
        #: Digest of the source bytes ``data`` was cast from, and ``transpose`` was built from:
        #: evidence kept apart from the engine under test (see :meth:`check_provenance`).
        self.data_source: Optional[bytes] = None
        self.transpose_source: Optional[bytes] = None

    def invalidate(self) -> None:
        """Mark the FP8 copy and its transpose stale."""
        self.data_valid = False
        self.transpose_valid = False

    def data_changed(self) -> None:
        """The source parameter changed: the FP8 data is stale, and so is the transpose, which
        stays flagged valid under ``manual_post_processing`` (as TE's does)."""
        self.data_valid = False
        if not self.manual_post_processing:
            self.transpose_valid = False

    @torch.no_grad()
    def quantize(self) -> None:
        """Cast the current source values to FP8 with a per-tensor scale from their amax."""
        # One snapshot feeds both the cast and its digest: an asynchronous all-gather (gloo's
        # worker thread) may write the parameter during this call, and a digest read after
        # the cast would then vouch for bytes the copy was not cast from (the likely cause of a
        # CI run where a stale transpose passed the GEMM's check and only the losses differed).
        snapshot = self.source.detach().clone()
        self._cast(snapshot.float())
        self.data_valid = True
        if not self.manual_post_processing:
            self.transpose_valid = False
        self.data_source = bytes_digest(snapshot)

    def _cast(self, src: torch.Tensor) -> None:
        amax = src.abs().max().clamp(min=1e-12)
        scale = FP8_E4M3_MAX / amax
        self.data.copy_((src * scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))
        self.scale_inv.copy_(1.0 / scale)

    def finish_columnwise(self) -> None:
        """After the byte transpose of ``data``: whatever else the column-wise copy needs
        (block scales transposed, for blockwise); nothing for a per-tensor scale."""

    def build_columnwise(self) -> None:
        """The column-wise copy of a weight that is not ``byte_transposed``."""
        raise NotImplementedError(type(self).__name__)

    def columnwise_mismatch(self) -> Optional[str]:
        """``None`` when ``transpose`` holds ``data`` transposed (bytes, and scales where
        there are several)."""
        if not torch.equal(self.transpose.view(torch.uint8), self.data.view(torch.uint8).t()):
            return "transpose bytes differ from the FP8 data transposed"
        return None

    def check_provenance(self, use: str) -> None:
        """Raise :class:`StaleFP8Error` unless what ``use`` reads was built from the source
        parameter's current bytes. Within a training step the parameter changes only when its
        all-gather delivers this step's values, so a copy built before that delivery (a
        transpose taken before the all-gather finished) fails here: the wrong gradient it
        would cause becomes an error. ``use`` is ``"forward"`` (reads ``data``) or
        ``"backward"`` (reads ``transpose``)."""
        built_from = self.transpose_source if use == "backward" else self.data_source
        if built_from != bytes_digest(self.source):
            what = "transpose" if use == "backward" else "FP8 data"
            raise StaleFP8Error(
                f"FP8 weight {self.name!r}: the {what} read by the {use} GEMM was built from "
                "parameter bytes that are not the current ones (built before this step's "
                "all-gather delivered them, or never rebuilt after it)")

    def dequantized(self) -> torch.Tensor:
        """``data`` as float32 ``[out, in]``."""
        return self.data.float() * self.scale_inv

    def dequantized_transpose(self) -> torch.Tensor:
        """``transpose`` as float32 ``[in, out]``; raises if the cache is stale."""
        self.require_valid_transpose()
        return self.transpose.float() * self.scale_inv

    def require_valid_transpose(self) -> None:
        """Raise unless the transpose cache is valid (a stale one read by a backward)."""
        if not self.transpose_valid:
            raise RuntimeError(
                f"FP8 weight {self.name!r}: transpose cache used while stale. Something "
                "invalidated it between its build and this backward (a transpose must stay "
                "valid from its build to the step's last backward)."
            )


class ReferenceBackend:
    """:class:`~nemo_fp8_align.backends.protocol.FP8TransposeBackend` for :class:`ReferenceFP8Weight`."""

    name = "reference"

    def __init__(self, *, use_triton_kernel: bool = True, check_provenance: bool = True) -> None:
        self.use_triton_kernel = use_triton_kernel
        #: Let the GEMMs check, per microbatch, that the FP8 copies they read match the
        #: parameter's bytes (a digest per read: for tests and CPU runs, off for timing).
        self.check_provenance = check_provenance

    def transpose_needed(self) -> Tuple[bool, str]:
        return True, "reference FP8 weights always keep a transpose for the backward GEMM"

    def has_valid_transpose(self, weight: ReferenceFP8Weight) -> bool:
        return weight.transpose_valid

    def kind_of(self, weight: ReferenceFP8Weight) -> str:
        return weight.kind

    def transpose_mismatch(self, weight: ReferenceFP8Weight) -> Optional[str]:
        if not weight.transpose_valid:
            return "transpose cache invalid"
        why = weight.columnwise_mismatch()
        if why is not None:
            return why
        if weight.transpose_source != bytes_digest(weight.source):
            return "built from parameter bytes that are not the current ones"
        return None

    def rebuild_transposes(self, weights: Sequence[ReferenceFP8Weight]) -> int:
        """Cast and transpose every weight from its source's current bytes, flagged valid or not."""
        for w in weights:
            w.invalidate()
        return self.build_transposes(weights)

    def build_transposes(self, weights: Sequence[ReferenceFP8Weight]) -> int:
        stale = [w for w in weights if not w.transpose_valid]
        for w in stale:
            if not w.data_valid:
                w.quantize()
        # One batched call for the whole chunk: one kernel launch on CUDA.
        flat = [w for w in stale if w.byte_transposed]
        multi_transpose_([w.data for w in flat], [w.transpose for w in flat],
                         use_triton=self.use_triton_kernel)
        for w in stale:
            w.finish_columnwise() if w.byte_transposed else w.build_columnwise()
            w.transpose_valid = True
            w.transposes_built += 1
            w.transpose_source = w.data_source
        return len(stale)
