"""The ``model.fp8_transpose_align`` block as a Hydra structured config, built from AlignConfig.

:class:`AlignBlock` is generated from the fields of :class:`~nemo_fp8_align.config.AlignConfig`
(names, types, defaults), so the YAML block and the dataclass cannot drift apart and there is no
second set of defaults. One deliberate difference: ``policy`` is a ``str`` here. OmegaConf's enum
nodes accept only member *names* (``ALIGNED``), while the documented spelling is the value
(``policy=aligned``); :func:`nemo_fp8_align.config_check.check.align_config_from` checks the value
against :class:`~nemo_fp8_align.config.Policy` and names the choices.

Register the block before Hydra composes a config whose defaults list names it
(``conf/megatron_gpt_fp8_align.yaml`` does)::

    from nemo_fp8_align.config_check.structured import register_configs
    register_configs()   # then @hydra_runner / hydra.compose as usual

and in the YAML defaults list: ``- fp8_transpose_align@model.fp8_transpose_align: default``.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Dict, List, Tuple

from omegaconf import DictConfig, OmegaConf

from nemo_fp8_align.config import AlignConfig

__all__ = ["AlignBlock", "BLOCK_KEY", "GROUP", "NAME", "block_fields", "block_schema",
           "block_values", "register_configs"]

#: Where the block lives under the NeMo ``model:`` node.
BLOCK_KEY = "fp8_transpose_align"
#: Hydra ConfigStore group and option name of the block.
GROUP = "fp8_transpose_align"
NAME = "default"


def _schema_type(tp: Any) -> Any:
    # Enums become str (see module docstring); Optional[Enum] would become Optional[str].
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return str
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and args:
        return typing.Union[tuple(_schema_type(a) for a in args)]
    return tp


def _schema_default(field: dataclasses.Field) -> dataclasses.Field:
    if field.default is not dataclasses.MISSING:
        value = field.default
        return dataclasses.field(default=value.value if isinstance(value, enum.Enum) else value)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return dataclasses.field(default_factory=field.default_factory)  # type: ignore[misc]
    return dataclasses.field()


def _build_block_class() -> type:
    hints = typing.get_type_hints(AlignConfig)
    spec: List[Tuple[str, Any, dataclasses.Field]] = [
        (f.name, _schema_type(hints[f.name]), _schema_default(f))
        for f in dataclasses.fields(AlignConfig)
    ]
    cls = dataclasses.make_dataclass("AlignBlock", spec)
    cls.__module__ = __name__
    cls.__doc__ = ("Hydra schema of ``model.fp8_transpose_align``: AlignConfig's fields and "
                   "defaults, with ``policy`` as its string value.")
    return cls


#: The structured-config class of the block (mutable, so Hydra can merge YAML and overrides in).
AlignBlock = _build_block_class()


def block_fields() -> Dict[str, Any]:
    """Field name -> schema type of the block, in declaration order."""
    return {f.name: f.type for f in dataclasses.fields(AlignBlock)}


def block_schema() -> DictConfig:
    """A fresh structured DictConfig of the block holding AlignConfig's defaults."""
    return OmegaConf.structured(AlignBlock)


def block_values(config: AlignConfig) -> Dict[str, Any]:
    """``config`` as the block's YAML values: every AlignConfig field (enums as their values),
    so what :func:`nemo_fp8_align.config_check.check.align_config_from` reads back equals ``config``."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(AlignConfig)}
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()}


def register_configs() -> None:
    """Store the block in Hydra's ConfigStore as ``fp8_transpose_align/default`` (idempotent)."""
    from hydra.core.config_store import ConfigStore  # only needed when Hydra composes

    ConfigStore.instance().store(group=GROUP, name=NAME, node=AlignBlock)
