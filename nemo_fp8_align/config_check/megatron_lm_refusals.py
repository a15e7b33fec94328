"""The plugin's refusals that only Megatron-LM's command line has: an encoder-decoder model,
FSDP (Megatron-FSDP, torch FSDP2) and the flags Megatron-LM allows only with it, the optimizer
step's all-gather in Megatron-LM's loop, optimizers Megatron-LM trains with its layer-wise
optimizer, and the recipe table's verdicts on Megatron-LM's FP8/FP4 flags. Each names what the
plugin does not support and the off switch, or the flag to drop; none changes the model or the
numerics recipe. Pure functions of ``vars(args)``; nothing here imports Megatron-LM.
"""

from __future__ import annotations

from typing import Any, List, Mapping

from nemo_fp8_align.config_check.reader import Violation
from nemo_fp8_align.config_check.recipes import SETTINGS, findings, judged_at, recipe_of
from nemo_fp8_align.config_check.rules.model import ENCODER_DECODER_WHY

__all__ = ["emerging_optimizer", "encoder_decoder", "fsdp_only", "plugin_refusals"]


def encoder_decoder(args: Mapping[str, Any]) -> List[Violation]:
    """Megatron-LM's T5 training script gives --encoder-num-layers / --decoder-num-layers:
    validate_args reads the encoder's as --num-layers (and asserts the two are not both given),
    and the model is an encoder-decoder one, which the plugin does not drive. Named alone (no
    --num-layers to add, no layout for a model the plugin does not attach to)."""
    given = [f for f, d in (("--encoder-num-layers", "encoder_num_layers"),
                            ("--decoder-num-layers", "decoder_num_layers")) if args.get(d)
             is not None]
    # validate_args copies --num-layers into encoder_num_layers for every model: a GPT
    # model's validated arguments have it, and no decoder_num_layers
    if args.get("decoder_num_layers") is None and args.get("num_layers") is not None:
        return []
    if not given:
        return []
    return [Violation(given[0], "an encoder-decoder model (" + " and ".join(given) + ")",
                      ENCODER_DECODER_WHY, "none: train without the plugin (do not attach it)")]


def emerging_optimizer(args: Mapping[str, Any]) -> List[Violation]:
    """Megatron-LM 0.19.2 trains any optimizer but Adam and SGD (muon, lion, soap, ...) with its
    LayerWiseDistributedOptimizer: validate_args turns --use-distributed-optimizer off, so the
    DistributedOptimizer the plugin was built and run on is not there. The optimizer is a
    training choice: never a fix (as with the FP8 recipe); the plugin is what to leave off."""
    name = args.get("optimizer")
    if name in (None, "adam", "sgd"):
        return []
    return [Violation("--optimizer", repr(name), "adam or sgd: Megatron-LM 0.19.2 trains "
                      f"{name} with its LayerWiseDistributedOptimizer (validate_args turns "
                      "--use-distributed-optimizer off), whose parameter all-gather the plugin "
                      "has not been run on; not supported by this plugin",
                      f"none that keeps --optimizer {name}: train without the plugin (do not "
                      "attach it)")]


def plugin_refusals(args: Mapping[str, Any], mcore: Any = None) -> List[Violation]:
    """The recipe table's verdicts (judged by megatron-core ``mcore``'s rules, the version the
    check runs against; None: the newest), the optimizer step's all-gather and FSDP, in that
    order."""
    out = _recipes(args, mcore)
    if args.get("overlap_param_gather_with_optimizer_step") and not any(
            v.key == "--overlap-param-gather-with-optimizer-step" for v in out):
        # The chunk-level attachment opens a step at the schedule's launch of chunk 0, which
        # the optimizer step dispatches instead here (force_dispatch): not run in this mode.
        out.append(Violation("--overlap-param-gather-with-optimizer-step", "set",
                             "not set with Megatron-LM's loop (chunk 0's all-gather is then "
                             "dispatched by the optimizer step; not run with the plugin there)",
                             "drop --overlap-param-gather-with-optimizer-step"))
    for flag, dest in (("--use-megatron-fsdp", "use_megatron_fsdp"),
                       ("--use-torch-fsdp2", "use_torch_fsdp2")):
        if args.get(dest):
            out.append(Violation(flag, "set", "megatron-core's DistributedDataParallel (the "
                                 "plugin finishes its bucket groups' all-gathers; FSDP is not "
                                 "supported by this plugin: Megatron-FSDP's start_param_sync "
                                 "is a no-op); the fix trains with the distributed optimizer, "
                                 "which shards only the optimizer state, so each GPU holds "
                                 "more (the full parameters and gradients of its model-parallel "
                                 "part): or do not attach the plugin",
                                 f"drop {flag}; --use-distributed-optimizer"))
    return out


def fsdp_only(args: Mapping[str, Any]) -> List[Violation]:
    """Megatron-FSDP's own flags that Megatron-LM asserts on without it (left behind when the
    FSDP fix drops --use-megatron-fsdp: the line must still start Megatron-LM)."""
    if args.get("use_megatron_fsdp"):
        return []
    out = []
    if args.get("ckpt_format") == "fsdp_dtensor":
        out.append(Violation("--ckpt-format", "'fsdp_dtensor'", "a format other than "
                             "fsdp_dtensor without --use-megatron-fsdp (Megatron-LM asserts "
                             "'--ckpt-format fsdp_dtensor is only tested with Megatron FSDP')",
                             "--ckpt-format torch_dist"))
    if args.get("fsdp_manual_registration"):
        out.append(Violation("--fsdp-manual-registration", "set", "not set without "
                             "--use-megatron-fsdp (Megatron-LM asserts 'FSDP manual "
                             "registration is only supported with Megatron FSDP')",
                             "drop --fsdp-manual-registration"))
    return out


#: Megatron-LM's dest of each setting of the recipe table (config_check/recipes.py).
_RECIPE_DESTS = {"fp8": "fp8", "fp8_recipe": "fp8_recipe", "fp8_param": "fp8_param_gather",
                 "reuse": "reuse_grad_buf_for_mxfp8_param_ag", "fp4": "fp4",
                 "fp4_recipe": "fp4_recipe", "fp4_param": "fp4_param_gather",
                 "fp8_output_proj": "fp8_output_proj",
                 "gather_with_step": "overlap_param_gather_with_optimizer_step",
                 "cpu_offload": "optimizer_cpu_offload"}


def _recipes(args: Mapping[str, Any], mcore: Any = None) -> List[Violation]:
    """The recipe table's rows (the NeMo mode's too) on Megatron-LM's flags: what megatron-core
    0.19.2 rejects, what the plugin needs of FP4, and its verdict on the recipe on the version
    checked against (never a recipe change as the fix)."""
    q = {name: args.get(dest) for name, dest in _RECIPE_DESTS.items()}
    flags = {name: s.flag for name, s in SETTINGS.items()}
    out = []
    for f in findings(q, judged_at(mcore), megatron_lm=True):
        flag, value = flags[f.setting], q[f.setting]
        found = "set" if value is True else repr(value if value is not None else
                                                 recipe_of(q) if "recipe" in f.setting else None)
        kind = f.fix[0]
        fix = (f"none that keeps {flag} {recipe_of(q)}: train without the plugin (do not "
               "attach it)" if kind == "off" else f.fix[1].format(**flags)
               if kind == "manual" else f"drop {flags[f.fix[1]]}" if kind == "drop"
               else flags[f.fix[1]])
        out.append(Violation(flag, found, f.why.format(**flags), fix))
    return out
