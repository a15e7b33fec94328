"""Settings megatron-core has and the plugin refuses at attach, read from NeMo's model config,
which NeMo passes through to ``TransformerConfig`` under the same names.

No rule is written here: every row of the one table,
:data:`nemo_fp8_align.support.REFUSALS`, runs on the model config as it runs on
``TransformerConfig`` at attach (the row reads ``model.<field>`` where it reads the config's
attribute), and reports the row's reason and fix."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT, UNRESOLVED, Reader
from nemo_fp8_align.support import REFUSALS, Setup

__all__ = ["rule_refusals"]


class _ModelConfig:
    """The model config as a row reads ``TransformerConfig``: ``getattr(config, field,
    default)``. A missing or unreadable key is a missing attribute (the row's default); lists
    and mappings are plain Python, as in ``TransformerConfig``."""

    def __init__(self, model: Reader) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        value = self._model.get(name)
        if value is ABSENT or value is UNRESOLVED:
            raise AttributeError(name)
        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
        return value


def rule_refusals(ctx: CheckContext) -> None:
    """Every row of the refusal table that fires on the model config, in table order."""
    setup = Setup(config=_ModelConfig(ctx.model))
    reported = {v.key for v in ctx.model.violations}
    for row in REFUSALS:
        if row.value(setup) is None or ctx.model.prefix + row.field in reported:
            continue  # a setting the recipe table (rules/fp8.py) already reported: one entry
        ctx.model.add(row.field, ctx.model.get(row.field), f"{row.fix} ({row.why})",
                      row.nemo_fix)
