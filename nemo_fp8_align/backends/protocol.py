"""What the engine needs from an FP8 backend: build a chunk's transposes, batched.

A backend owns one kind of FP8 weight (Transformer Engine ``Float8Tensor`` parameters, or the
plain-torch :class:`~nemo_fp8_align.backends.reference.ReferenceFP8Weight`). The engine never touches
a weight's bytes itself: it asks the backend, once per chunk per step, to build the transposes of
that chunk's weights, and asks whether a weight's transpose is currently valid (for telemetry and
for the ``lazy`` policy, which only observes).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Tuple, runtime_checkable

__all__ = ["FP8TransposeBackend"]


@runtime_checkable
class FP8TransposeBackend(Protocol):
    """Builds transpose caches for a batch of FP8 weights of one kind."""

    #: Short name used in logs and telemetry, e.g. ``"reference"`` or ``"te-2.20"``.
    name: str

    def transpose_needed(self) -> Tuple[bool, str]:
        """``(True, reason)`` when the backward GEMM needs a physical transpose here.

        ``False`` (with the reason) on GPUs whose FP8 GEMMs accept non-TN layouts, and for
        recipes whose weights must never be byte-transposed (MXFP8, blockwise): the engine is
        then a no-op and logs the reason once.
        """
        ...

    def has_valid_transpose(self, weight: Any) -> bool:
        """Whether ``weight``'s transpose cache currently holds this step's bytes."""
        ...

    def build_transposes(self, weights: Sequence[Any]) -> int:
        """Build the transpose of every weight in ``weights`` whose cache is not valid.

        Called once per chunk per training step, only after the chunk's parameter all-gather
        has finished. Returns how many transposes were built (0 when all were already valid,
        e.g. because megatron-core's post-all-gather processing ran first).
        """
        ...

    def rebuild_transposes(self, weights: Sequence[Any]) -> int:
        """Build every weight's transpose from its current bytes, whether or not it is flagged
        valid: after an all-gather that nothing post-processed (megatron-core < 0.18's forced
        synchronous all-gather), a transpose can be flagged valid and hold the old weights.
        Returns how many were built."""
        ...

    def transpose_mismatch(self, weight: Any) -> Optional[str]:
        """Verify mode: ``None`` when ``weight``'s cached transpose holds exactly the transpose
        of its current FP8 data, else what differs (reads every byte: not for every step)."""
        ...
