"""Reading the file ``nemo-fp8-align check`` is given: what kind of path it is, which YAML to
compose (:mod:`nemo_fp8_align.config_check.launcher`), and Hydra's composition with the
overrides, every failure a :class:`~nemo_fp8_align.errors.ConfigLoadError` with one reason.
"""

from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from nemo_fp8_align.errors import ConfigLoadError

__all__ = ["file_problem", "load_config", "load_source"]


def load_config(path: Path, overrides: Sequence[str] = ()) -> Any:
    """Compose ``path`` with Hydra and apply ``overrides``; raises :class:`ConfigLoadError`.

    The launcher's ``conf/config.yaml`` gives ``{"training": <the composed training YAML>}``
    (see :mod:`nemo_fp8_align.config_check.launcher`). An override of a key the YAML does not
    have gets "did you mean" (the nearest key under the same parent) instead of Hydra's advice
    to append it with ``+``.
    """
    return load_source(path, overrides)[1]


def load_source(path: Path, overrides: Sequence[str] = ()) -> Tuple[Any, Any]:
    """(:class:`~nemo_fp8_align.config_check.launcher.Source`, composed config) of ``path``."""
    from omegaconf import OmegaConf

    from nemo_fp8_align.config_check.launcher import plan_source

    problem = file_problem(path)
    if problem is not None:
        raise ConfigLoadError(f"{path}: {problem}")
    source = plan_source(path, overrides)
    cfg = _compose_reporting(source.path, source.overrides)
    if source.kind == "launcher-main":
        cfg = OmegaConf.create({"training": OmegaConf.to_container(cfg, resolve=False)})
    return source, cfg


def file_problem(path: Path) -> Optional[str]:
    """Why ``path`` cannot be a config file (None: it can be read)."""
    if path.is_dir():
        return "is a directory, not a config file; pass the training YAML (e.g. " \
               "conf/megatron_gpt_config.yaml, or the launcher's conf/config.yaml)"
    if not path.exists():
        return "no such file"
    if not path.is_file():
        kind = "a character device" if path.is_char_device() else "not a regular file"
        return f"is {kind}, not a config file; pass a training YAML"
    if path.suffix != ".yaml":
        return (f"Hydra reads only .yaml files; rename it to "
                f"{path.with_suffix('.yaml').name}")
    return None


def _compose_reporting(path: Path, overrides: Sequence[str]) -> Any:
    try:
        return _compose(path, overrides)
    except Exception as err:  # noqa: BLE001 - Hydra, OmegaConf and YAML errors: report them all
        hints = _override_key_hints(path, overrides)
        if hints:
            raise ConfigLoadError("\n".join(f"{path}: {hint}" for hint in hints)) from err
        reason = str(err).strip() or type(err).__name__
        cause = err.__cause__
        if cause is not None and str(cause).strip() and str(cause) not in reason:
            reason += f" ({str(cause).strip()})"
        raise ConfigLoadError(f"{path}: could not compose the config: {reason}") from err


def _compose(path: Path, overrides: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from nemo_fp8_align.config_check.structured import register_configs

    register_configs()
    with warnings.catch_warnings(), \
            initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
        # Launcher YAMLs name /opt/NeMo/... in hydra.searchpath; absent here, and not needed.
        warnings.filterwarnings("ignore", message="provider=hydra.searchpath")
        return compose(config_name=path.stem, overrides=list(overrides))


def _override_key_hints(path: Path, overrides: Sequence[str]) -> List[str]:
    """One line per plain ``key=value`` override whose key the YAML lacks."""
    from omegaconf import DictConfig, OmegaConf

    from nemo_fp8_align.config_check.structured import BLOCK_KEY, block_fields

    try:
        base = _compose(path, ())
    except Exception:  # noqa: BLE001 - the YAML itself does not compose: Hydra's reason stands
        return []
    hints = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if override.startswith(("+", "~")) or not sep:
            continue
        missing = object()
        if OmegaConf.select(base, key, default=missing,
                            throw_on_resolution_failure=False) is not missing:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(base, parent, default=None,
                                throw_on_resolution_failure=False) if parent else base
        names = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        if parent == f"model.{BLOCK_KEY}" and not names:
            names = list(block_fields())
        close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.8)
        where = f"{parent}." if parent else ""
        if close:
            hints.append(f"{override}: {path.name} has no key {key}; did you mean "
                         f"{where}{close[0]}? (fix: {where}{close[0]}={value})")
        else:
            hints.append(f"{override}: {path.name} has no key {key}, and none spelt like it; "
                         f"if NeMo reads such a key, add it with +{key}={value}, otherwise "
                         "check the spelling against the YAML")
    return hints
