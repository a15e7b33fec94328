"""Hydra-style overrides applied to an OmegaConf config built in Python, for re-checking a fix
the startup check proposed on such a config (the command-line tests compose YAML files with
Hydra itself instead)."""

from __future__ import annotations

import shlex
from typing import Any, Iterable, Union

from omegaconf import OmegaConf

__all__ = ["applied", "present"]

_NOWHERE = object()


def _node(cfg: Any) -> Any:
    """The node the check reads: the launcher config's training node, else the config."""
    return cfg.training if "training" in cfg and "model" not in cfg else cfg


def present(cfg: Any, key: str) -> bool:
    return OmegaConf.select(_node(cfg), key, default=_NOWHERE,
                            throw_on_resolution_failure=False) is not _NOWHERE


def applied(cfg: Any, overrides: Union[str, Iterable[str]]) -> Any:
    """A copy of ``cfg`` with ``overrides`` (one shell-quoted string, or a list) applied:
    ``~key`` deletes, ``[+]key=value`` sets (a ``"..."`` value is a string, as Hydra reads it)."""
    text = overrides if isinstance(overrides, str) else " ".join(map(shlex.quote, overrides))
    tree = OmegaConf.create(OmegaConf.to_container(cfg))
    node = _node(tree)
    for token in shlex.split(text):
        if token.startswith("~"):
            parent, _, leaf = token[1:].rpartition(".")
            del (OmegaConf.select(node, parent) if parent else node)[leaf]
            continue
        key, _, value = token.lstrip("+").partition("=")
        if value.startswith('"') and value.endswith('"'):
            parsed: Any = value[1:-1]
        else:
            parsed = OmegaConf.create(f"v: {value}").v
        OmegaConf.update(node, key, parsed, force_add=True)
    return tree
