"""nemo_fp8_align: build FP8 weight transposes at the same interleaved-pipeline slot on every
pipeline rank, together with the distributed optimizer's parameter all-gather.

The public names, grouped; each is loaded on first use, so ``import nemo_fp8_align`` imports
neither megatron-core, NeMo, Lightning nor Transformer Engine::

    from nemo_fp8_align import align_fp8_transposes, AlignConfig, TEBackend  # megatron-core loops
    from nemo_fp8_align import FP8TransposeAlignment                          # NeMo: a callback
    from nemo_fp8_align import FP8TransposeAlignMixin                         # NeMo: a model mixin

The layout: ``core/`` (schedule, aligner, claims, telemetry and its judge), ``sync/`` (finishing
a chunk's all-gather: megatron-core DDP, Apex), ``backends/`` (Transformer Engine, reference FP8),
``kernels/``, ``integrations/`` (megatron-core entry point, NeMo), ``config_check/`` (the startup
check), ``planner/`` (the timeline model), ``cli/`` and ``demo/`` (the CPU run).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from nemo_fp8_align.config import AlignConfig, Policy

__version__ = "0.1.0"

_LAZY: Dict[str, str] = {
    # entry points
    "align_fp8_transposes": "integrations.megatron_core",
    "FP8TransposeAlignment": "integrations.nemo.callback",
    "FP8TransposeAlignMixin": "integrations.nemo.mixin",
    "FP8Weights": "integrations.nemo.build",
    # engine and backends
    "TransposeAligner": "core.aligner",
    "InterleavedSchedule": "core.schedule",
    "FP8TransposeBackend": "backends.protocol",
    "TEBackend": "backends.te",
    "ReferenceBackend": "backends.reference",
    "ReferenceFP8Weight": "backends.reference",
    "McoreParamSync": "sync.mcore",
    "ApexParamSync": "sync.apex",
    # the startup check
    "check_config": "config_check.check",
    "find_violations": "config_check.check",
    "Violation": "config_check.check",
    "FP8AlignConfigError": "config_check.check",
    # exceptions
    "ConfigLoadError": "errors",
    "CudaGraphCaptureError": "errors",
    "DemoRankError": "errors",
    "PlanInputError": "errors",
    "ScheduleError": "errors",
    "ScheduleRebindError": "errors",
    "SharedEmbeddingBucketError": "errors",
    "StaleFP8Error": "errors",
    "StepMismatchError": "errors",
    "TelemetryError": "errors",
    "TransposeVerifyError": "errors",
    "UnsupportedSetupError": "errors",
}

__all__ = ["AlignConfig", "Policy", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
