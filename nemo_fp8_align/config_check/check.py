"""Startup check of a NeMo 1.x GPT config for the aligned FP8-transpose plugin.

Run it before any model is built: it reads an OmegaConf config only (no NeMo, no megatron-core
import) and reports *every* setting that stops the plugin, or that NeMo 2.3.3 / megatron-core
0.12.3 / 0.16.1 would reject at model build, at once, each with the Hydra override that fixes it::

    from nemo_fp8_align.config_check.check import check_config
    check_config(cfg)   # the full training config (trainer:, model:), its model node, or a
                        # NeMo-Framework-Launcher training YAML (or the launcher's whole config)

The rules are data: :data:`RULES` (:mod:`nemo_fp8_align.config_check.rules`) lists one small
function per rule (``rule(ctx) -> None``); every rule runs whatever the others found, so no
violation hides another. The fixes of the layer split, the world size and the microbatches are
a search: the command line passes its fixer (:class:`~.fix_search.FixSearch`), whose fixes
change the parallel layout (:mod:`nemo_fp8_align.config_check.layout`), not the model, the
batch or the node count, unless no layout is found (the message then names the trade-off).
Without a fixer (the runtime's startup check, and :func:`check_config`) those rules give the
fix they can name without the search (:class:`~.context.FixRequest`), and the search is never
imported. A rule that
needs a value another rule found invalid (a layer split without a valid PP) does not run: the
invalid value is what is reported. Two gates: the plugin's own block (with ``enabled:
false`` or ``policy: off`` the plugin is inactive and only errors inside that block are
reported), and a model other than megatron-core's GPT model (T5, BERT, NeMo's Mamba, RETRO,
Griffin), which is named alone: the plugin does not drive it, and the GPT rules' fixes would rewrite it.

What is read, by rule (the module of each rule names where NeMo or megatron-core enforces it):
the plugin block (``model.fp8_transpose_align``, a misspelt key gets "did you mean"); PP >= 2
and VP >= 2; TP, CP, EP, expert TP; ``num_layers`` and its split over the pipeline under every
split option (even, ``num_layers_in_first/last_pipeline_stage``, ``account_for_embedding/
loss_in_pipeline_split``, and NeMo 2.3.3's own chunk assertion); Transformer Engine, FP8,
FP8 params, FP8 format and a per-tensor recipe, the transpose cache, BF16 edge layers;
``megatron_amp_O2``; the optimizer (Apex ``distributed_fused_adam`` or
``mcore_distributed_optim`` with ``align_param_gather``, overlapped param and grad sync);
``trainer.precision``; expert parallelism (not with Apex's optimizer, ``num_moe_experts``,
sequence parallelism with TP); the world size (``trainer.devices * trainer.num_nodes``) against
TP * PP * CP and expert TP * EP * PP; the data-parallel size (derived, or given, and the two
agreeing); microbatches (M = global_batch_size / (micro_batch_size * DP) fits megatron-core's
interleaved schedule; no ``rampup_batch_size``); ``mcore_gpt``; attention heads and query
groups against TP; megatron-core 0.12.3's shared-embedding bucket bug; ``enable_cuda_graph``;
and, where the caller asks (the command line), the plugin block's presence.

Interpolations are resolved with NeMo's and the launcher's resolvers (``multiply``, ``sum``,
``divide_ceil``, ``divide_floor``; registered only while reading, and only where not
registered already) and, for launcher training YAMLs, ``${training.*}`` pointing at the
config itself, as the launcher composes it. Values of every type (missing, null, zero,
negative, strings, lists, a ``model`` that is not a mapping, an empty config) are violations,
never exceptions.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Iterable, List, Mapping, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.config_check.context import CheckContext, Fixer
from nemo_fp8_align.config_check.reader import (ABSENT, UNRESOLVED, Reader, Violation, show_value,
                                               with_typo_hints)
from nemo_fp8_align.config_check.resolvers import upstream_resolvers
from nemo_fp8_align.config_check.rules import RULES, Rule
from nemo_fp8_align.config_check.rules.fp8 import PER_TENSOR_RECIPES, SUPPORTED_OPTIMIZERS
from nemo_fp8_align.config_check.rules.model import other_model_refused
from nemo_fp8_align.config_check.structured import BLOCK_KEY, block_fields, block_schema
from nemo_fp8_align.mcore_versions import VersionRules

__all__ = ["FP8AlignConfigError", "RULES", "Violation", "align_config_from", "check_config",
           "data_parallel_size_of", "find_violations", "plugin_off_override", "PER_TENSOR_RECIPES",
           "SUPPORTED_OPTIMIZERS"]


class FP8AlignConfigError(ValueError):
    """The config has settings that stop the aligned FP8-transpose plugin from working."""

    def __init__(self, violations: Iterable[Violation], off: Optional[str] = None) -> None:
        self.violations: List[Violation] = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(
            f"{len(self.violations)} setting(s) stop the aligned FP8-transpose plugin "
            f"(model.{BLOCK_KEY}) from working:\n{lines}\n"
            f"Apply the fixes above, or turn the plugin off with "
            f"{off or f'+model.{BLOCK_KEY}.enabled=False'}.")


# ---------------------------------------------------------------------------------------------
# Public API


def check_config(cfg: Any, *, data_parallel_size: Optional[int] = None) -> None:
    """Raise :class:`FP8AlignConfigError` listing every violation; return None when valid.

    Args:
        cfg: the full training config (``trainer:``, ``model:``, ...), just its model node, a
            NeMo-Framework-Launcher training YAML, or the launcher's config with ``training:``.
        data_parallel_size: DP for the microbatch checks; derived from ``trainer:`` when None
            (when both are known they must agree).

    Judged by the importable megatron-core's rules (its recipes, schedule and options), as the
    plugin's own check at attach and ``nemo-fp8-align check`` judge; the newest rules where
    none is importable. The fixes are the startup check's: where the command line's is a
    search (a layout that fits), the rule's own, which names the command.
    """
    from nemo_fp8_align.mcore_versions import importable_rules

    violations = find_violations(cfg, data_parallel_size=data_parallel_size,
                                 mcore=importable_rules())
    if violations:
        raise FP8AlignConfigError(violations, off=plugin_off_override(cfg))


def plugin_off_override(cfg: Any) -> str:
    """The override that turns the plugin off, in the form ``cfg`` needs: plain where the block
    has an ``enabled`` key, ``+`` where it has not (a block without it, or no block)."""
    with upstream_resolvers():
        model, _, _ = config_nodes(cfg)
    key = f"model.{BLOCK_KEY}.enabled"
    block = model._get_node(BLOCK_KEY) if isinstance(model, DictConfig) and BLOCK_KEY in \
        map(str, model.keys()) else None
    if isinstance(block, DictConfig) and "enabled" in map(str, block.keys()):
        return f"{key}=False"
    if block is not None and not isinstance(block, DictConfig):
        return f"~model.{BLOCK_KEY} +{key}=False"
    return f"+{key}=False"


def find_violations(cfg: Any, *, data_parallel_size: Any = None,
                    data_parallel_name: str = "data_parallel_size",
                    require_block: bool = False, dialect: str = "nemo",
                    mcore: Optional[VersionRules] = None,
                    fixer: Optional[Fixer] = None) -> List[Violation]:
    """Every violation in ``cfg``, in :data:`RULES` order; empty when valid, and when the plugin
    block turns the plugin off (errors inside the block itself are still listed).

    ``data_parallel_name`` is how messages name the data-parallel size the caller passed
    (the CLI passes ``--data-parallel-size``). ``require_block``: an absent plugin block is a
    violation (the entry-point callback, unlike the mixin, does nothing without it).
    ``dialect``: ``megatron_lm`` for Megatron-LM's arguments mapped onto the keys (NeMo's own
    assertions left out; :mod:`.megatron_lm_args`). ``mcore``: the megatron-core version to
    check against (its own schedule rules and options, :mod:`.rules.version`); None: the
    newest rules. ``fixer``: the fix search (the command line's
    :data:`~.fix_search.FIX_SEARCH`); None: each rule's fix without the search.
    """
    with upstream_resolvers():
        model, trainer, problems = config_nodes(cfg)
        if model is None:
            return problems
        found: List[Violation] = list(problems)
        ctx = CheckContext(Reader(model, "model.", found),
                           None if trainer is None else Reader(trainer, "trainer.", found),
                           data_parallel_size, data_parallel_name, found,
                           require_block=require_block, dialect=dialect, mcore=mcore,
                           fixer=fixer)
        align = _read_block(ctx.model)
        # a model the plugin does not drive is named alone: the GPT rules' fixes would rewrite it
        if align.active and not other_model_refused(ctx):
            for rule in RULES:
                _run_rule(rule, ctx)
        readers = {"model.": ctx.model, **({"trainer.": ctx.trainer} if ctx.trainer else {})}
        return with_typo_hints(found, readers)


def data_parallel_size_of(cfg: Any) -> Optional[int]:
    """DP = trainer.devices * trainer.num_nodes / (TP * PP * CP), or None when not derivable
    (no ``trainer:`` block, ``devices: auto``, a size that does not divide, ...)."""
    with upstream_resolvers():
        model, trainer, _ = config_nodes(cfg)
        if model is None or trainer is None:
            return None
        ctx = CheckContext(Reader(model, "model."), Reader(trainer, "trainer."))
        return ctx.trainer_data_parallel()


def align_config_from(cfg: Any) -> AlignConfig:
    """The plugin's :class:`AlignConfig` from ``model.fp8_transpose_align`` (defaults if absent).

    Raises :class:`FP8AlignConfigError` when the block has unknown keys or invalid values (or
    the config has no readable model node).
    """
    with upstream_resolvers():
        model, _, problems = config_nodes(cfg)
        if model is None:
            raise FP8AlignConfigError(problems)
        reader = Reader(model, "model.")
        align = _read_block(reader)
        if reader.violations:
            raise FP8AlignConfigError(reader.violations)
        return align


def _run_rule(rule: Rule, ctx: CheckContext) -> None:
    try:
        rule(ctx)
    except Exception as err:  # noqa: BLE001 - one broken rule must not hide the others
        ctx.violations.append(Violation(
            f"<check rule {rule.__name__}>", f"{type(err).__name__}: {err}",
            "the rule to finish (an error in the check itself, not in the config)",
            "none from the config; the other violations are still complete"))


# ---------------------------------------------------------------------------------------------
# Which node is the model, which the trainer


def config_nodes(cfg: Any) -> Tuple[Optional[DictConfig], Optional[DictConfig], List[Violation]]:
    """(model node, trainer node or None, problems). The model node is None when there is
    nothing to check (not a mapping, empty, ``model`` not a mapping): ``problems`` says why.

    A config with ``model:`` is a training config, one without is a model node; a launcher
    config with ``training:`` is read at its training node. A training config is read through a
    copy that also holds it under ``training:``, so the launcher's ``${training.model.*}``
    interpolations resolve as they do when the launcher composes it.
    """
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.create(dict(cfg))
        except Exception as err:  # noqa: BLE001 - unconvertible values in a plain dict
            return None, None, [_config_problem("config", cfg, f"a config OmegaConf can hold "
                                                f"({type(err).__name__}: {err})")]
    if not isinstance(cfg, DictConfig):
        return None, None, [_config_problem("config", cfg, "a mapping: a NeMo training config "
                                            "(trainer:, model:) or its model node")]
    if len(cfg) == 0:
        return None, None, [Violation("config", "an empty config", "a NeMo training config "
                                      "with trainer: and model: (or its model node)",
                                      "check the file: nothing was read from it")]
    training = _peek(cfg, "training")
    if "model" not in cfg and isinstance(training, DictConfig) and "model" in training:
        cfg = training  # the launcher's whole config: its training node
    elif "model" in cfg and "training" not in cfg:
        cfg = _with_training_alias(cfg)
    if "model" not in cfg:
        if not any(key in cfg for key in MODEL_NODE_KEYS):
            return None, None, [_not_a_training_config(cfg)]
        return cfg, None, []  # a model node alone
    model, trainer = _peek(cfg, "model"), _peek(cfg, "trainer")
    problems = []
    if not isinstance(model, DictConfig):
        return None, None, [_config_problem("model", model, "a mapping of the model's settings "
                                            "(NeMo reads cfg.model.<key>)")]
    if trainer is not ABSENT and not isinstance(trainer, DictConfig):
        problems.append(_config_problem("trainer", trainer, "a mapping of the Lightning "
                                        "Trainer's settings (devices, num_nodes, precision)"))
    return model, trainer if isinstance(trainer, DictConfig) else None, problems


#: Keys every NeMo GPT model node has (a config without ``model:`` and without any of these
#: is some other config: a cluster, a data-preparation stage, ...).
MODEL_NODE_KEYS = ("num_layers", "hidden_size", "tensor_model_parallel_size",
                   "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
                   "encoder_seq_length", "optim", "fp8")


def _not_a_training_config(cfg: DictConfig) -> Violation:
    keys = [str(k) for k in cfg.keys()]
    shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
    return Violation("config", f"no model: block (top-level keys: {shown})",
                     "a NeMo training config (trainer:, model:), a launcher training YAML or "
                     "the launcher's conf/config.yaml; this is not a NeMo training config",
                     "check the training YAML (e.g. the launcher's conf/training/<model>/"
                     "<size>.yaml), not this file")


def _peek(cfg: DictConfig, key: str) -> Any:
    try:
        return cfg[key] if key in cfg else ABSENT
    except Exception:  # noqa: BLE001 - an interpolation at the top: treated as not a mapping
        return UNRESOLVED


def _with_training_alias(cfg: DictConfig) -> DictConfig:
    try:
        tree = OmegaConf.to_container(cfg, resolve=False)
        return OmegaConf.create({**tree, "training": tree})
    except Exception:  # noqa: BLE001 - keep reading the config as it is
        return cfg


def _config_problem(key: str, value: Any, expected: str) -> Violation:
    if value is UNRESOLVED:
        shown = "an interpolation that does not resolve"
    else:
        shown = f"{show_value(value)} (a {type(value).__name__})"
    return Violation(key, shown, expected, f"make {key} a YAML block of keys, as in NeMo's "
                     "megatron_gpt_config.yaml")


# ---------------------------------------------------------------------------------------------
# The plugin's own block


def _read_block(reader: Reader) -> AlignConfig:
    """AlignConfig of ``model.fp8_transpose_align`` (violations recorded on ``reader``); an
    invalid value leaves its default."""
    sub = Reader(OmegaConf.create({}), f"{reader.prefix}{BLOCK_KEY}.", reader.violations)
    block = reader.get(BLOCK_KEY)
    if block is ABSENT or block is None or block is UNRESOLVED:
        return AlignConfig()
    fields = block_fields()
    if not isinstance(block, DictConfig):
        reader.add(BLOCK_KEY, block, "a mapping with keys " + ", ".join(fields),
                   fix=f"~{reader.prefix}{BLOCK_KEY}")
        return AlignConfig()
    sub.node = block
    schema = block_schema()
    values = {}
    for key in map(str, block.keys()):
        value = sub.get(key)
        if value is ABSENT or value is UNRESOLVED:
            continue
        try:  # the structured config rejects unknown keys and unconvertible values
            OmegaConf.merge(schema, {key: value})
        except ConfigKeyError:
            _unknown_block_key(sub, key, value, fields)
            continue
        except ValidationError:
            pass
        default = getattr(schema, key)
        if (_block_value_ok(sub, key, value, fields[key], default)
                and _align_config_accepts(sub, key, value, default)):
            values[key] = value
    return AlignConfig(**values)


def _align_config_accepts(sub: Reader, key: str, value: Any, default: Any) -> bool:
    """Run AlignConfig's own validation on the one field ``key``: its rules (a policy it knows,
    ``verify_every_n_steps >= 0``, ...) live there only, and its ValueError becomes a violation
    here, so a bad value never raises out of the check nor hides the other violations."""
    try:
        AlignConfig(**{key: value})
    except ValueError as err:
        sub.add(key, value, f"a value the plugin accepts ({err})", default)
        return False
    return True


def _unknown_block_key(sub: Reader, key: str, value: Any, fields: Mapping[str, Any]) -> None:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "known keys: " + ", ".join(fields)
    fix = (f"~{sub.prefix}{key} "
           + sub.override(close[0], value, present=close[0] in map(str, sub.node.keys()))
           if close else f"~{sub.prefix}{key}")
    sub.add(key, value, f"no such key in the plugin block; {hint}", fix=fix)


def _block_value_ok(sub: Reader, key: str, value: Any, tp: Any, default: Any) -> bool:
    if key == "policy":
        choices = [p.value for p in Policy]
        if isinstance(value, str) and value in choices:
            return True
        sub.add(key, value, "one of: " + ", ".join(choices), default)
        return False
    allowed = tuple(a for a in (typing.get_args(tp) or (tp,)) if isinstance(a, type))
    # OmegaConf would coerce "yes" or 1 to a bool; the plugin wants exactly the declared type.
    if isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool)):
        return True
    names = " or ".join("null" if a is type(None) else a.__name__ for a in allowed)
    sub.add(key, value, f"a value of type {names}", default)
    return False
