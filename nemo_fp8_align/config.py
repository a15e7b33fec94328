"""The plugin's one typed configuration, with its one set of defaults.

The same dataclass is the Hydra structured config of the ``model.fp8_transpose_align`` block
(``nemo_fp8_align.config_check.structured``), the demo's options and the Lightning callback's arguments,
so a default never drifts between call sites.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["AlignConfig", "Policy"]


class Policy(str, enum.Enum):
    """Where a chunk's FP8 transposes are built in a training step."""

    #: At the chunk's aligned schedule slot, the same slot on every pipeline rank (the fix).
    ALIGNED = "aligned"
    #: Left to each rank's first use of the chunk (today's behaviour), but observed and
    #: reported: the baseline for A/B runs.
    LAZY = "lazy"
    #: Plugin not attached at all.
    OFF = "off"


@dataclass(frozen=True)
class AlignConfig:
    """Settings of the aligned FP8-transpose plugin.

    Attributes:
        enabled: master switch; ``False`` behaves exactly like ``policy=off``.
        policy: see :class:`Policy`.
        telemetry_path: write one JSON line per (step, pp_rank, dp_rank, chunk) here; ``None``
            keeps telemetry in memory only. ``{rank}`` in the path is replaced by the global rank
            so ranks never interleave lines in one file.
        use_triton_kernel: on CUDA, build a chunk's transposes with the multi-tensor Triton
            kernel (one launch per chunk) instead of one torch copy per weight. Ignored on CPU.
        te_kernel_writes_transpose: let the Triton kernel write straight into Transformer
            Engine's ``Float8Tensor._transpose`` buffers. Off by default: TE's own transpose
            is nearly as fast (docs/runs.md), so TE's API builds TE transposes.
        verify_every_n_steps: verify mode. Every this many training steps, each FP8 weight's
            cached transpose is compared byte for byte with its current FP8 data at the chunk's
            first use; a mismatch raises, naming the step, chunk and weight. ``0`` (the
            default) turns it off: it costs a read of every weight.
    """

    enabled: bool = True
    policy: Policy = Policy.ALIGNED
    telemetry_path: Optional[str] = None
    use_triton_kernel: bool = True
    te_kernel_writes_transpose: bool = False
    verify_every_n_steps: int = 0

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise a string policy once, here, so every reader sees the enum.
        if not isinstance(self.policy, Policy):
            try:
                object.__setattr__(self, "policy", Policy(str(self.policy)))
            except ValueError:
                choices = ", ".join(p.value for p in Policy)
                raise ValueError(
                    f"fp8_transpose_align.policy={self.policy!r} is not a policy. "
                    f"Use one of: {choices} (e.g. fp8_transpose_align.policy=aligned)."
                ) from None
        n = self.verify_every_n_steps
        if type(n) is not int or n < 0:
            raise ValueError(
                f"fp8_transpose_align.verify_every_n_steps={n!r}: expected an integer >= 0 "
                "(0 turns verify mode off, e.g. fp8_transpose_align.verify_every_n_steps=100).")

    @property
    def active(self) -> bool:
        """Whether the plugin attaches at all."""
        return self.enabled and self.policy is not Policy.OFF
