"""How the aligner completes one model chunk's parameter all-gather (implemented in ``sync/``)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["ChunkParamSync"]


class ChunkParamSync(Protocol):
    """How the aligner completes one model chunk's parameter all-gather.

    An implementation may also have ``wait(chunk)``: wait for the in-flight all-gather alone,
    before ``finish`` runs any post-processing (megatron-core >= 0.16 builds the FP8 transposes
    there), so that the aligner times the wait apart from the build.
    """

    def finish(self, chunk: int) -> bool:
        """Wait for ``chunk``'s in-flight all-gather (issuing no new collective); return
        whether the chunk's parameters now hold this step's values."""
        ...

    def finished(self, chunk: int) -> bool:
        """Observe, without waiting, whether ``chunk``'s all-gather has completed."""
        ...
