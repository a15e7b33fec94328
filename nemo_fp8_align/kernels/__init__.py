"""FP8 transpose kernels."""

from nemo_fp8_align.kernels.transpose import multi_transpose_

__all__ = ["multi_transpose_"]
