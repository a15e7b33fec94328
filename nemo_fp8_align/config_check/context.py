"""What every startup-check rule reads: the model and trainer nodes, and the sizes derived from
them (parallel sizes, world size, data-parallel size).

A derived size is None whenever a value it needs is missing or invalid; the rule that owns that
value reports it, so the rules built on the size simply do not run (and cannot report a
consequence of a value that is already reported as wrong).

A rule whose best fix is a search (the layer split, the world size, the microbatches: the
nearest parallel layout that fits) reports a :class:`FixRequest`: the violation with the fix the
rule can give without the search, and the values the search starts from. The command line puts
its fixer on the context (:class:`~.fix_search.FixSearch`), which records the searched fix
instead; the runtime's startup check has none, so it never loads the search and records the
rule's own fix (a value to use, or the settings that must change, the rule they must satisfy,
and the command that proposes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol

from omegaconf import ListConfig

from nemo_fp8_align.config_check.reader import ABSENT, Reader, Violation
from nemo_fp8_align.mcore_versions import VersionRules

__all__ = ["CheckContext", "FixRequest", "Fixer", "device_count"]


@dataclass(frozen=True)
class FixRequest:
    """A violation whose best fix needs the fix search.

    Attributes:
        rule: which rule asks (its name without ``rule_``); the fixer's method of that name
            answers it.
        violation: what the rule records without the search (its fix one a user can act on);
            None where the rule records its own violation when the search has no better fix.
        why: what must hold, as the rule says it (the searched fix's message builds on it).
        values: the rule's own values the search starts from.
    """

    rule: str
    violation: Optional[Violation]
    why: str = ""
    values: Mapping[str, Any] = field(default_factory=dict)


class Fixer(Protocol):
    """Turns fix requests into the fixes ``nemo-fp8-align check`` prints
    (:class:`~.fix_search.FixSearch`), and searches Megatron-LM's world size and step-schedule
    batches (:mod:`.megatron_lm_args`, :mod:`.megatron_lm_rules`)."""

    def fix(self, ctx: "CheckContext", request: FixRequest) -> bool:
        """Record the searched fix of ``request`` on ``ctx``; False: none better than the
        rule's own (the rule records that)."""

    def nearest_world(self, args: Mapping[str, Any], world: int) -> Optional[int]:
        """The process count nearest ``world`` that fits the model parallelism and the batch."""

    def nearest_batch(self, pp: int, vp: int, batch: int, per: int, n: Optional[int]) -> int:
        """The batch nearest ``batch`` (a multiple of ``per``) whose M fits."""


@dataclass
class CheckContext:
    """Readers of one check (sharing one violation list) and the caller's inputs.

    Attributes:
        model: reader of the model node (keys ``model.*``).
        trainer: reader of the trainer node; None when the config has no ``trainer:`` block.
        data_parallel_size: the data-parallel size the caller passed (unchecked), or None.
        data_parallel_name: how the caller spells it in messages (``--data-parallel-size``
            for the CLI).
    """

    model: Reader
    trainer: Optional[Reader]
    data_parallel_size: Any = None
    data_parallel_name: str = "data_parallel_size"
    violations: List[Violation] = field(default_factory=list)
    #: Whether an absent plugin block is a violation (the entry-point callback stays inert).
    require_block: bool = False
    #: Values computed once per check (the fixer's layout search).
    cache: Dict[str, Any] = field(default_factory=dict)
    #: Whose spelling the config is: ``nemo`` (NeMo 2.3.3 builds the model, and its own checks
    #: apply) or ``megatron_lm`` (Megatron-LM's arguments mapped onto the same keys: NeMo's
    #: assertions do not apply, and a ``pipeline_model_parallel_layout`` defines the split).
    dialect: str = "nemo"
    #: The megatron-core version checked against (its own schedule rules and options); None:
    #: none named, the newest rules (megatron-core >= 0.12).
    mcore: Optional[VersionRules] = None
    #: The fix search of the command line (None: each rule's fix without the search).
    fixer: Optional[Fixer] = None

    @property
    def nemo(self) -> bool:
        return self.dialect == "nemo"

    # --- fixes that need the search -------------------------------------------------------

    def searched(self, request: FixRequest) -> bool:
        """Whether the fixer recorded a fix for ``request`` (False without a fixer)."""
        return self.fixer is not None and self.fixer.fix(self, request)

    def request_fix(self, request: FixRequest) -> None:
        """The fixer's fix of ``request``, else the rule's own (``request.violation``)."""
        if self.searched(request) or request.violation is None:
            return
        if request.violation not in self.violations:
            self.violations.append(request.violation)

    def search_command(self) -> str:
        """The command that runs the fix search on this config, in its dialect."""
        return ("`nemo-fp8-align check CONFIG.yaml`" if self.nemo
                else "`nemo-fp8-align check --megatron-lm -- ARGS`")

    def legacy(self) -> bool:
        """megatron-core before 0.10: no N, M a multiple of PP with interleaving."""
        return self.mcore is not None and self.mcore.legacy_order

    def min_interleaved_pp(self) -> int:
        return 2 if self.mcore is None else self.mcore.min_interleaved_pp

    def has_stage_split(self) -> bool:
        """Whether the version has the first/last stage layer counts under the names this
        dialect reads: NeMo passes ``num_layers_in_first_pipeline_stage`` by that field name
        (0.11 on; 0.9 and 0.10 call it ``first_pipeline_num_layers``), Megatron-LM's
        ``--decoder-first-pipeline-num-layers`` sets either (0.9 on)."""
        if self.mcore is None:
            return True
        field = self.mcore.first_stage_field
        return field == "num_layers_in_first_pipeline_stage" if self.nemo else field is not None

    def layout_string(self) -> bool:
        """Megatron-LM's ``--pipeline-model-parallel-layout``, or a hybrid model's pattern cut
        into segments (``|``), gives the split itself."""
        if self.nemo or (self.mcore is not None and not self.mcore.layout_string):
            return False  # a version without one: reported by rules/version.py
        pattern = self.model.get("hybrid_layer_pattern")
        return isinstance(self.model.get("pipeline_model_parallel_layout"), str) or (
            isinstance(pattern, str) and "|" in pattern.split("/", 1)[0])

    # --- parallel sizes (None: missing or invalid, reported by the rule that owns the key) --

    def pp(self) -> Optional[int]:
        return self.model.peek_int("pipeline_model_parallel_size", 1)

    def vp(self) -> Optional[int]:
        """Model chunks per pipeline rank when interleaving; None for null, 1 (NeMo turns 1
        into None) and invalid values."""
        value = self.model.get("virtual_pipeline_model_parallel_size")
        return value if type(value) is int and value >= 2 else None

    def tp(self) -> Optional[int]:
        return self.model.peek_int("tensor_model_parallel_size", 1)

    def cp(self) -> Optional[int]:
        return self.model.peek_int("context_parallel_size", 1)

    def ep(self) -> Optional[int]:
        return self.model.peek_int("expert_model_parallel_size", 1)

    def etp(self) -> Optional[int]:
        """expert_tensor_parallel_size; megatron-core's default (null) is TP."""
        value = self.model.get("expert_tensor_parallel_size")
        if value is ABSENT or value is None:
            return self.tp()
        return value if type(value) is int and value >= 1 else None

    def model_parallel(self) -> Optional[int]:
        """TP * PP * CP, the ranks one data-parallel replica spans."""
        sizes = (self.tp(), self.pp(), self.cp())
        if any(s is None for s in sizes):
            return None
        return sizes[0] * sizes[1] * sizes[2]

    # --- world and data-parallel size ----------------------------------------------------

    def devices(self) -> Optional[int]:
        """Devices per node from ``trainer.devices``; None when unknown before launch."""
        if self.trainer is None:
            return None
        return device_count(self.trainer.get("devices"))

    def num_nodes(self) -> Optional[int]:
        if self.trainer is None:
            return None
        return self.trainer.peek_int("num_nodes", 1)

    def world(self) -> Optional[int]:
        devices, nodes = self.devices(), self.num_nodes()
        return None if devices is None or nodes is None else devices * nodes

    def trainer_data_parallel(self) -> Optional[int]:
        """devices * num_nodes / (TP * PP * CP) when the trainer says and it divides."""
        world, mp = self.world(), self.model_parallel()
        if world is None or mp is None or world % mp:
            return None
        return world // mp

    def given_data_parallel(self) -> Optional[int]:
        value = self.data_parallel_size
        return value if type(value) is int and value >= 1 else None

    def data_parallel(self) -> Optional[int]:
        """The caller's data-parallel size if valid, else the trainer's."""
        given = self.given_data_parallel()
        return given if given is not None else self.trainer_data_parallel()


def device_count(value: Any) -> Optional[int]:
    """Devices per node of a Lightning ``devices`` value: an int >= 1, a digit string, a list
    of device ids or a comma-separated id string; None for ``auto``/-1 and anything invalid."""
    if type(value) is int:
        return value if value >= 1 else None
    if isinstance(value, (list, tuple, ListConfig)):
        ids = list(value)
        return len(ids) if ids and all(type(i) is int and i >= 0 for i in ids) else None
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text) if int(text) >= 1 else None
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if "," in text and parts and all(p.isdigit() for p in parts):
            return len(parts)
    return None
