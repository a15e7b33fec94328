"""Old path of :mod:`nemo_fp8_align.integrations.nemo.mixin` (0.1.0 configs name it)."""

from nemo_fp8_align.integrations.nemo.mixin import FP8TransposeAlignMixin, FP8Weights  # noqa: F401

__all__ = ["FP8TransposeAlignMixin", "FP8Weights"]
