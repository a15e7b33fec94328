"""The OmegaConf resolvers that NeMo and NeMo-Framework-Launcher configs use, for reading them.

NeMo registers ``multiply`` and ``sum`` when ``nemo.core`` is imported (``${sum:${.num_layers},-1}``
in ``megatron_gpt_config.yaml``); the launcher's ``main.py`` registers ``multiply``,
``divide_ceil`` and ``divide_floor`` (``${multiply:4, ${.hidden_size}}`` in its training YAMLs).
The startup check imports neither, so :func:`upstream_resolvers` registers the ones that are not
registered yet, for as long as the check reads, and removes exactly those afterwards: a resolver
that NeMo, the launcher or the user registered is never replaced. ``gpu_name`` (NeMo, needs a
GPU) is left out: a key that uses it is reported as unresolvable if the check reads it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

from omegaconf import OmegaConf

__all__ = ["RESOLVERS", "upstream_resolvers"]


def _multiply(x: Any, y: Any) -> Any:
    return x * y


def _sum(x: Any, y: Any) -> Any:
    return x + y


def _divide_ceil(x: Any, y: Any) -> int:
    return int(math.ceil(x / y))


def _divide_floor(x: Any, y: Any) -> int:
    return int(math.floor(x / y))


#: name -> function, with the semantics of NeMo 2.3.3 and the launcher.
RESOLVERS: Dict[str, Callable[..., Any]] = {
    "multiply": _multiply,
    "sum": _sum,
    "divide_ceil": _divide_ceil,
    "divide_floor": _divide_floor,
}


@contextmanager
def upstream_resolvers() -> Iterator[List[str]]:
    """Register the missing :data:`RESOLVERS` for the ``with`` block; yields their names."""
    added = [name for name in RESOLVERS if not OmegaConf.has_resolver(name)]
    for name in added:
        OmegaConf.register_new_resolver(name, RESOLVERS[name])
    try:
        yield added
    finally:
        for name in added:
            OmegaConf.clear_resolver(name)
