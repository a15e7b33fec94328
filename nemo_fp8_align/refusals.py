"""Every megatron-core setup the plugin cannot align, in one table, read where megatron-core
keeps each setting.

``align_fp8_transposes`` refuses at attach, before anything is wrapped, when any row fires,
and names every row that fired at once. Each row says which megatron-core versions have its
setting; on the others the row reads nothing (``getattr`` with a default) and never fires.
``tests/test_refusals.py`` builds megatron-core's own config classes for every row on every
version in CI.

The startup check (``nemo-fp8-align check``) runs the same rows on NeMo's model config, which
NeMo passes through to ``TransformerConfig`` under the same names
(``config_check/rules/refused.py``), and so on Megatron-LM's flags: this table is the one place
a refusal is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from nemo_fp8_align.errors import UnsupportedSetupError

__all__ = ["REFUSALS", "Refusal", "Setup", "fired", "refuse_unsupported"]


@dataclass(frozen=True)
class Setup:
    """What the rows read: the ``TransformerConfig`` the schedule reads."""

    config: Any


@dataclass(frozen=True)
class Refusal:
    """One setup the plugin refuses: the setting, where it lives, why, and the fix."""

    key: str
    setting: str  #: where megatron-core keeps it, e.g. ``TransformerConfig.cuda_graph_impl``
    versions: str  #: megatron-core versions whose config classes have the setting
    value: Callable[[Setup], Any]  #: the offending value, or None when the row does not fire
    why: str
    fix: str
    #: The value the startup check's fix sets ``model.<field>`` to in NeMo's config.
    nemo_fix: Any

    @property
    def field(self) -> str:
        """The ``TransformerConfig`` field, also the key of NeMo's model config."""
        return self.setting.rpartition(".")[2]

    def message(self, value: Any) -> str:
        return f"{self.setting}={value!r}: {self.why}. Fix: {self.fix}."


def _scope_names(config: Any) -> List[str]:
    scopes = getattr(config, "cuda_graph_scope", None) or []
    scopes = scopes if isinstance(scopes, (list, tuple)) else [scopes]
    return [getattr(s, "name", s) for s in scopes]  # str, or CudaGraphScope enum (>= 0.16)


def _whole_step_scope(setup: Setup) -> Optional[List[str]]:
    names = _scope_names(setup.config)
    return names if "full_iteration" in names else None


def _whole_step_impl(setup: Setup) -> Optional[str]:
    impl = getattr(setup.config, "cuda_graph_impl", None)
    return impl if impl == "full_iteration" else None


def _combined_1f1b(setup: Setup) -> Optional[bool]:
    return True if getattr(setup.config, "overlap_moe_expert_parallel_comm", False) else None


_REPLAY = ("replays of a captured step run no Python: no hook could place, time or check a "
           "transpose, and one captured inside would replay on the capture step's bytes")

#: The table, in report order.
REFUSALS = (
    Refusal("whole_step_graphs_scope", "TransformerConfig.cuda_graph_scope", "<= 0.17 (0.16.1, 0.17.1 read)",
            _whole_step_scope, "full_iteration captures whole training steps; " + _REPLAY,
            "per-layer CUDA graphs (cuda_graph_scope without full_iteration), or do not attach "
            "the plugin (policy=off)", "full"),
    Refusal("whole_step_graphs_impl", "TransformerConfig.cuda_graph_impl",
            ">= 0.18 (0.18.2, 0.19.2 read)",
            _whole_step_impl, "whole-step CUDA graphs (megatron-core >= 0.18 moves "
            "cuda_graph_scope=full_iteration here in TransformerConfig.__post_init__); "
            + _REPLAY, "cuda_graph_impl='local' or 'transformer_engine' (per-layer graphs), "
            "or do not attach the plugin (policy=off)", "transformer_engine"),
    Refusal("combined_1f1b", "TransformerConfig.overlap_moe_expert_parallel_comm",
            "0.16.1 to 0.19.2 read; not in 0.12.3",
            _combined_1f1b, "the combined 1F1B schedule runs the chunks' layers through its own "
            "schedule plan, so the model chunk's __call__ and the plugin's forward pre-hooks "
            "never run: no step could be counted or aligned",
            "overlap_moe_expert_parallel_comm=False, or do not attach the plugin (policy=off)",
            False),
)


def fired(setup: Setup) -> List[str]:
    """The message of every row that fires for ``setup``, in table order."""
    out = []
    for row in REFUSALS:
        value = row.value(setup)
        if value is not None:
            out.append(row.message(value))
    return out


def refuse_unsupported(setup: Setup) -> None:
    """Raise :class:`~nemo_fp8_align.errors.UnsupportedSetupError` naming every row that
    fires; return None when none does."""
    messages = fired(setup)
    if messages:
        raise UnsupportedSetupError(
            "nemo_fp8_align cannot align this megatron-core setup:\n"
            + "\n".join(f"  - {m}" for m in messages))
