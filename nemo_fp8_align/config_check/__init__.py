"""NeMo 1.x integration: the startup config check, the Hydra structured config of the plugin's
``model.fp8_transpose_align`` block, and the ``nemo-fp8-align check`` command.

Import-light on purpose: nothing here imports NeMo or megatron-core, and the names below are
loaded on first use (``from nemo_fp8_align.config_check import check_config`` imports only OmegaConf).
The rules (:mod:`.rules`) are the plugin's preconditions, which the runtime's startup check runs;
the fix search (:mod:`.fix_search`: the layout solver, layout strings, batch and split fixes) is
the command line's, passed to the rules as their fixer, and never loaded at runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FP8AlignConfigError", "Violation", "align_config_from", "check_config",
           "find_violations", "register_configs"]

_WHERE = {
    "FP8AlignConfigError": "check",
    "Violation": "check",
    "align_config_from": "check",
    "check_config": "check",
    "find_violations": "check",
    "register_configs": "structured",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
