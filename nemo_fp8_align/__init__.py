"""nemo_fp8_align: build FP8 weight transposes at the same interleaved-pipeline slot on every
pipeline rank, together with the distributed optimizer's parameter all-gather.

The public names are what a training script calls or catches, and only those::

    from nemo_fp8_align import align_fp8_transposes, AlignConfig, TEBackend  # megatron-core loops
    from nemo_fp8_align import FP8TransposeAlignment                          # NeMo: a callback
    from nemo_fp8_align import FP8TransposeAlignMixin                         # NeMo: a model mixin
    from nemo_fp8_align import check_config                                   # the startup check

The configuration and the errors are imported with the package (both need nothing but the
standard library); the entry points, the backend and the startup check on first use, so
``import nemo_fp8_align`` imports neither torch, megatron-core, NeMo, Lightning, Transformer
Engine nor OmegaConf. Everything else is imported from its module (``nemo_fp8_align.core``,
``.adapters``, ``.backends``, ``.integrations``, ...; docs/layout.md).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.errors import (CudaGraphCaptureError, ScheduleError, ScheduleRebindError,
                                   SharedEmbeddingBucketError, StepMismatchError,
                                   TransposeVerifyError, UnsupportedSetupError)

__version__ = "0.1.0"

#: The public names loaded on first use, and their modules.
_ON_FIRST_USE: Dict[str, str] = {
    "align_fp8_transposes": "integrations.megatron_core",
    "FP8TransposeAlignment": "integrations.nemo.callback",
    "FP8TransposeAlignMixin": "integrations.nemo.mixin",
    "TEBackend": "backends.te",
    "check_config": "config_check.check",
    "FP8AlignConfigError": "config_check.check",
}

__all__ = [
    # entry points
    "align_fp8_transposes", "FP8TransposeAlignment", "FP8TransposeAlignMixin",
    # configuration and backend
    "AlignConfig", "Policy", "TEBackend",
    # the startup check
    "check_config", "FP8AlignConfigError",
    # errors a training run may raise
    "CudaGraphCaptureError", "ScheduleError", "ScheduleRebindError",
    "SharedEmbeddingBucketError", "StepMismatchError", "TransposeVerifyError",
    "UnsupportedSetupError",
]


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
