"""Which kind of YAML the command line checks, and what its overrides mean there.

Three kinds, told apart from the file itself:

* ``nemo``: a NeMo training config (``trainer:``, ``model:``); NeMo reads no ``training:``
  node, so a ``training.``-prefixed override is refused (it would create a node nobody reads).
* ``launcher-training``: a NeMo-Framework-Launcher training YAML (``run:``, ``trainer:``,
  ``model:``: ``conf/training/<model>/<size>.yaml``). The launcher composes it under
  ``training:``, so ``training.model.x=1`` and ``model.x=1`` both mean the same key here;
  where the user writes the prefix, fixes are printed with it.
* ``launcher-main``: the launcher's ``conf/config.yaml`` (its defaults list names a ``training``
  group). The check reads its ``training=<model>/<size>`` choice from ``conf/training/`` and
  ``training.``-prefixed overrides; an unprefixed ``model.*`` / ``trainer.*`` override is
  refused (the launcher would not read it: it creates a top-level node); other overrides (the
  launcher's own settings: ``stages``, ``cluster``, ...) are listed as not read by the check.
  Fixes are printed with the ``training.`` prefix, the form that command line accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_fp8_align.errors import ConfigLoadError

__all__ = ["Source", "plan_source", "TRAINING_KEYS"]

#: Top-level keys of a training config (what ``training.`` prefixes in the launcher).
TRAINING_KEYS = ("model", "trainer", "exp_manager", "run", "hydra")


@dataclass
class Source:
    """What to compose for one command line.

    Attributes:
        kind: ``nemo``, ``launcher-training`` or ``launcher-main``.
        path: the YAML Hydra composes (the training YAML in ``launcher-main``).
        overrides: the command line's overrides, as they apply to ``path``.
        prefix: how fixes are written on this command line (``training.`` or '').
        unread: overrides the check does not read (the launcher's own settings).
        choice: the ``training`` group choice (``launcher-main`` only).
    """

    kind: str
    path: Path
    overrides: List[str] = field(default_factory=list)
    prefix: str = ""
    unread: List[str] = field(default_factory=list)
    choice: Optional[str] = None


def _split(override: str) -> tuple:
    """(sign, key, rest) of ``+a.b=c`` -> ('+', 'a.b', '=c')."""
    sign = "++" if override.startswith("++") else override[:1] if override[:1] in "+~" else ""
    body = override[len(sign):]
    key, eq, value = body.partition("=")
    return sign, key, eq + value


def _training_choice(raw: Any) -> Optional[str]:
    defaults = raw.get("defaults") if isinstance(raw, DictConfig) else None
    if not isinstance(defaults, ListConfig):
        return None
    for entry in defaults:
        if isinstance(entry, DictConfig) and "training" in entry:
            return str(entry["training"])
    return None


def kind_of(raw: Any) -> str:
    if _training_choice(raw) is not None:
        return "launcher-main"
    if isinstance(raw, DictConfig) and "model" in raw and "run" in raw:
        return "launcher-training"
    return "nemo"


def plan_source(path: Path, overrides: Sequence[str]) -> Source:
    """The :class:`Source` of ``path`` with ``overrides``; raises :class:`ConfigLoadError` for
    an override that would be silently dropped where the file is used."""
    try:
        raw = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 - Hydra's compose reports the YAML's own error
        return Source("nemo", path, list(overrides))
    kind = kind_of(raw)
    if kind == "launcher-main":
        return _main_source(path, raw, overrides)
    source = Source(kind, path)
    for override in overrides:
        sign, key, rest = _split(override)
        if key.startswith("training."):
            if kind == "nemo":
                raise ConfigLoadError(
                    f"{path}: {override}: NeMo reads no training: node (this is a NeMo training "
                    f"config, not a launcher one), so it would be ignored; write "
                    f"{sign}{key[len('training.'):]}{rest}")
            override = f"{sign}{key[len('training.'):]}{rest}"  # the launcher's spelling
            source.prefix = "training."  # fixes in the user's own form, pasteable beside it
        source.overrides.append(override)
    return source


def _main_source(path: Path, raw: DictConfig, overrides: Sequence[str]) -> Source:
    source = Source("launcher-main", path, prefix="training.", choice=_training_choice(raw))
    for override in overrides:
        sign, key, rest = _split(override)
        if key == "training" and sign in ("", "+", "++") and rest.startswith("="):
            source.choice = rest[1:]
        elif key.startswith("training."):
            source.overrides.append(f"{sign}{key[len('training.'):]}{rest}")
        elif key.split(".")[0] in TRAINING_KEYS:
            raise ConfigLoadError(
                f"{path}: {override}: the launcher's config.yaml holds the training config "
                f"under training:, so the launcher would not read {key} (a new top-level "
                f"node); write ++training.{key}{rest}")
        else:
            source.unread.append(override)
    training_dir = path.parent / "training"
    yaml = training_dir / f"{source.choice}.yaml"
    if not yaml.is_file():
        known = sorted(str(p.relative_to(training_dir).with_suffix(""))
                       for p in training_dir.rglob("*.yaml")) if training_dir.is_dir() else []
        shown = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        raise ConfigLoadError(f"{path}: training={source.choice}: no such file {yaml}"
                              + (f"; choices include {shown}" if known else
                                 f"; {training_dir} does not exist"))
    source.path = yaml
    return source
