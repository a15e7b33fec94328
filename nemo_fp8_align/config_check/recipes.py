"""The quantized-weight recipes, for both modes of the startup check: which recipe the settings
select, whether the plugin aligns its post-all-gather work on the megatron-core the mode runs,
and the combinations megatron-core itself rejects. One table, two spellings (NeMo's model keys,
Megatron-LM's flags: :data:`SETTINGS`).

What the plugin aligns per recipe is docs/guarantees.md's and docs/design.md's section 5c: the per-tensor
recipes' transposes on every version; blockwise FP8 (columnwise copy), NVFP4 (its transpose) and
MXFP8 (the requantize of grad-buffer reuse; nothing without it) from the megatron-core whose
post-processing places them: the runtime's own table, ``SINCE`` of
:mod:`nemo_fp8_align.support` (0.16, 0.17 and 0.18), read here rather than
repeated, so the check and the refusal at attach cannot disagree. The verdict is the version's
the check runs against (:func:`judged_at`: ``--megatron-core``, else the installed one, the
version the command's note names; NeMo 2.3.3 runs 0.12.3). A recipe is never a fix: a recipe the plugin does not
align is "not supported by this plugin", with the switch that turns the plugin off.

The rejections are read from megatron-core 0.19.2: ``megatron.training.arguments``
(``validate_args``), ``TransformerConfig.__post_init__``, ``DistributedDataParallelConfig`` and
``OptimizerConfig``. Pure functions of plain values; nothing here imports megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

from nemo_fp8_align.mcore_versions import NEWEST, VersionRules, parse_version
from nemo_fp8_align.support import RECIPE_KIND
from nemo_fp8_align.support import SINCE

__all__ = ["MCORE_NEMO", "RECIPES", "SETTINGS", "Finding", "Recipe",
           "Setting", "findings", "judged_at", "recipe_of", "rejected"]

MCORE_NEMO = (0, 12)  #: NeMo 2.3.3's megatron-core (0.12.3): NeMo mode's stack


def judged_at(mcore: Optional[VersionRules]) -> Tuple[int, int]:
    """The megatron-core line a recipe is judged by: the version the check runs against (the
    one ``--megatron-core`` gives, else the installed one: the version the command's note
    names), the newest without one, as the check's other version rules."""
    parsed = parse_version(mcore.version) if mcore is not None else None
    return NEWEST if parsed is None else parsed[:2]


def _since(name: str) -> Tuple[int, int]:
    """The megatron-core from which the runtime aligns recipe ``name``'s work (its ``SINCE``;
    per-tensor transposes: every version)."""
    since = SINCE.get(RECIPE_KIND[name])
    if since is None:
        return (0, 0)
    major, minor = since.split(".")
    return (int(major), int(minor))


class Setting(NamedTuple):
    nemo: str  #: the key of NeMo's model config (TransformerConfig / DDP config field)
    flag: str  #: Megatron-LM's flag


SETTINGS = {
    "fp8": Setting("fp8", "--fp8-format"),
    "fp8_recipe": Setting("fp8_recipe", "--fp8-recipe"),
    "fp8_param": Setting("fp8_params", "--fp8-param-gather"),
    "reuse": Setting("reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag"),
    "fp4": Setting("fp4", "--fp4-format"),
    "fp4_recipe": Setting("fp4_recipe", "--fp4-recipe"),
    "fp4_param": Setting("fp4_param", "--fp4-param-gather"),
    "fp8_output_proj": Setting("fp8_output_proj", "--fp8-output-proj"),
    "gather_with_step": Setting("optim.overlap_param_gather_with_optimizer_step",
                                "--overlap-param-gather-with-optimizer-step"),
    "cpu_offload": Setting("optim.optimizer_cpu_offload", "--optimizer-cpu-offload"),
}


@dataclass(frozen=True)
class Recipe:
    name: str
    nemo: str  #: NeMo's model keys that select it
    megatron_lm: str  #: Megatron-LM's flags that select it (with the weights gathered quantized)
    weights: str  #: the parameters' class (Transformer Engine)
    post: str  #: the post-all-gather work the plugin places
    since: Tuple[int, int]  #: the megatron-core from which the plugin aligns it


RECIPES = (
    Recipe("delayed", "fp8_recipe=delayed (the default) fp8_params=True",
           "--fp8-recipe delayed (the default) --fp8-param-gather", "Float8Tensor",
           "transpose", _since("delayed")),
    Recipe("tensorwise", "fp8_recipe=tensorwise fp8_params=True",
           "--fp8-recipe tensorwise --fp8-param-gather", "Float8Tensor", "transpose",
           _since("tensorwise")),
    Recipe("blockwise", "fp8_recipe=blockwise fp8_params=True",
           "--fp8-recipe blockwise --fp8-param-gather", "Float8BlockwiseQTensor",
           "columnwise copy (data and scales)", _since("blockwise")),
    Recipe("mxfp8", "fp8_recipe=mxfp8 fp8_params=True reuse_grad_buf_for_mxfp8_param_ag=True",
           "--fp8-recipe mxfp8 --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag",
           "MXFP8Tensor", "requantize from the grad buffer (none without grad-buffer reuse)",
           _since("mxfp8")),
    Recipe("nvfp4", "fp4=e2m1 fp4_recipe=nvfp4 fp4_param=True",
           "--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-param-gather", "NVFP4Tensor",
           "NVFP4 transpose", _since("nvfp4")),
)
_BY_NAME = {r.name: r for r in RECIPES}


class Finding(NamedTuple):
    """One problem, in neither spelling: the setting (a :data:`SETTINGS` name), the reason, and
    the fix: ``("set", name, value)``, ``("drop", name)`` or ``("manual", sentence)`` (a
    sentence with ``{name}`` fields spelt by the caller), or ``("off",)`` (the plugin off)."""

    setting: str
    why: str
    fix: Tuple[Any, ...]


def recipe_of(q: Mapping[str, Any]) -> Optional[str]:
    """The recipe the settings select (FP4 first, as megatron-core's autocast), None without
    FP8 or FP4; an unknown name is returned as given."""
    if q.get("fp4"):
        return q.get("fp4_recipe") or "nvfp4"  # TransformerConfig's default
    if q.get("fp8"):
        return q.get("fp8_recipe") or "delayed"
    return None


def _version(v: Tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _support(q: Mapping[str, Any], mcore: Tuple[int, int]) -> List[Finding]:
    """The plugin's own verdict on the recipe (never a recipe change as the fix)."""
    name = recipe_of(q)
    if name is None or (q.get("fp4") and q.get("fp8")):
        return []  # no recipe, or FP4 and FP8 at once: which one is the user's to say first
    # the setting the user gave (an FP4 recipe left to its default is named by its format)
    setting = ("fp4_recipe" if q.get("fp4_recipe") else "fp4") if q.get("fp4") else (
        "fp8_recipe" if q.get("fp8_recipe") else "fp8")
    recipe = _BY_NAME.get(name)
    if recipe is None:  # custom (a quantizer factory) or a name megatron-core does not have
        return [Finding(setting, f"the {name!r} recipe is not supported by this plugin (its "
                        "post-all-gather work, if any, is not one it knows how to place)",
                        ("off",))]
    if mcore >= recipe.since:
        return []
    # the version named is the one that judged (the note's), never a stack assumed by mode
    stack = f"megatron-core {_version(mcore)}"
    why = {"blockwise": "it has no blockwise recipe",
           "mxfp8": "it raises 'MXFP8 currently does not support fp8_param'",
           "nvfp4": "it has no FP4"}[name] if mcore == MCORE_NEMO else (
        "its DDP does not post-process these weights after the all-gather")
    return [Finding(setting, f"{name} is not supported by this plugin on {stack} ({why}); the "
                    f"plugin aligns its {recipe.post} from megatron-core "
                    f"{_version(recipe.since)} on (Megatron-LM or Megatron-Bridge)", ("off",))]


def rejected(q: Mapping[str, Any], megatron_lm: bool) -> List[Finding]:
    """What megatron-core 0.19.2 (and Megatron-LM's ``validate_args``) reject."""
    out: List[Finding] = []
    recipe = recipe_of(q)
    if q.get("fp4") and q.get("fp8"):
        out.append(Finding("fp4", "not with {fp8} (megatron-core raises 'fp4 and fp8 cannot "
                           "be used simultaneously')", ("manual", "none that keeps both: drop "
                           "{fp4} or {fp8} yourself (a choice of the training numerics)")))
    if q.get("fp4_param") and not q.get("fp4"):
        out.append(Finding("fp4_param", "only with {fp4} (megatron-core raises 'fp4_param must "
                           "be used together with fp4 mode')", ("drop", "fp4_param")))
    if q.get("reuse") and not q.get("fp8_param"):
        out.append(Finding("reuse", "only with {fp8_param} (megatron-core's "
                           "DistributedDataParallelConfig asserts 'Reuse grad buffer only when "
                           "keeping params in MXFP8')", ("set", "fp8_param", True)))
    if q.get("reuse") and q.get("gather_with_step"):
        out.append(Finding("gather_with_step", "not with {reuse} (megatron-core's "
                           "OptimizerConfig raises 'overlap_param_gather_with_optimizer_step is "
                           "not supported with reuse_grad_buf_for_mxfp8_param_ag')",
                           ("drop", "gather_with_step")))
    if q.get("fp8_output_proj") and not (q.get("fp8") and recipe == "mxfp8"):
        out.append(Finding("fp8_output_proj", "only with FP8 and the mxfp8 recipe "
                           "(megatron-core raises 'fp8_output_proj requires fp8_recipe="
                           "'mxfp8''); the output projection's FP8 is not the plugin's",
                           ("drop", "fp8_output_proj")))
    if megatron_lm and q.get("cpu_offload") and q.get("fp8_param") and recipe != "delayed":
        out.append(Finding("cpu_offload", "not with {fp8_param} and a recipe other than "
                           "delayed (Megatron-LM asserts 'When `--fp8-param-gather` is "
                           "enabled, the optimizer cpu offload must be used in conjunction "
                           "with `--fp8-recipe delayed`')", ("drop", "cpu_offload")))
    return out


def _needed(q: Mapping[str, Any]) -> List[Finding]:
    """What the plugin needs of an FP4 recipe (the FP8 ones: the FP8 rules)."""
    if q.get("fp4") and not q.get("fp8") and not q.get("fp4_param"):
        return [Finding("fp4_param", "set with {fp4} (NVFP4 weights, gathered as NVFP4, are "
                        "what the plugin post-processes; without it the weights are BF16 and "
                        "nothing is left to align)", ("set", "fp4_param", True))]
    return []


def findings(q: Mapping[str, Any], mcore: Tuple[int, int], megatron_lm: bool) -> List[Finding]:
    """Every finding on the settings ``q`` (keyed by :data:`SETTINGS` names; absent: off) for
    a stack on megatron-core ``mcore``: megatron-core's rejections, then the plugin's needs and
    its verdict on the recipe."""
    return rejected(q, megatron_lm) + _needed(q) + _support(q, mcore)
