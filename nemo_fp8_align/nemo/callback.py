"""Old path of :mod:`nemo_fp8_align.integrations.nemo.callback` (0.1.0 configs name it)."""

from nemo_fp8_align.integrations.nemo.callback import (  # noqa: F401
    FP8TransposeAlignment, callbacks_factory, pl_callbacks_factory)

__all__ = ["FP8TransposeAlignment", "callbacks_factory", "pl_callbacks_factory"]
