"""Which optional stack each command needs, and the one line that names the extra to install.

The package itself needs only torch; each command checks its optional imports before doing any
work and, when one is missing, says in one line which ``pip install 'nemo_fp8_align[EXTRA]'``
brings it (the extras are defined in pyproject.toml).
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Sequence, Tuple

__all__ = ["CHECK_NEEDS", "missing_dependency"]

#: (import name, distribution name, extra) that ``nemo-fp8-align check`` needs.
CHECK_NEEDS: Tuple[Tuple[str, str, str], ...] = (
    ("omegaconf", "omegaconf", "hydra"),
    ("hydra", "hydra-core", "hydra"),
)


def missing_dependency(command: str, needs: Sequence[Tuple[str, str, str]]) -> Optional[str]:
    """None when every module in ``needs`` imports; else one line naming the first missing
    distribution and the extra that installs it."""
    for module, distribution, extra in needs:
        if not _importable(module):
            return (f"'{command}' needs {distribution}, which is not installed: "
                    f"pip install 'nemo_fp8_align[{extra}]'")
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, a broken __spec__
        return False
