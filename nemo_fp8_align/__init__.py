"""nemo_fp8_align: build FP8 weight transposes at the same interleaved-pipeline slot on every
pipeline rank, together with the distributed optimizer's parameter all-gather."""

from nemo_fp8_align.config import AlignConfig, Policy

__version__ = "0.1.0"
__all__ = ["AlignConfig", "Policy", "__version__"]
