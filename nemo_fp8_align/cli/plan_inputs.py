"""``plan``'s inputs: a NeMo or launcher config (read by the startup check's reader), a preset or
explicit sizes, then flags; what none of them gives takes a default, and the plan says which.
Every bad value is one :class:`PlanInputError` line naming the flag (or key), the value, the fix.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from nemo_fp8_align.errors import PlanInputError
from nemo_fp8_align.planner.costs import GPUS, MODELS, ModelShape
from nemo_fp8_align.planner.recipes import RECIPES

__all__ = ["PlanInputs", "DEFAULTS", "resolve"]

#: Parallel layout and p2p defaults. p2p: Megatron-LM's with interleaving (overlap on, which
#: megatron-core requires batch off); NeMo 1.x YAMLs without the keys mean overlap off, batch on.
DEFAULTS: Dict[str, Any] = {"tp": 8, "pp": 8, "vp": 2, "dp": 1, "cp": 1, "ep": 1,
                            "micro_batch": 1, "overlap_p2p": True, "batch_p2p": False}
NEMO_P2P = {"overlap_p2p": False, "batch_p2p": True}
_INT_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "tp", "pp", "vp", "dp", "cp",
              "ep", "expert_tp", "experts", "topk", "moe_ffn", "micro_batch", "global_batch",
              "group_size")
_FLOAT_FLAGS = ("tflops", "transpose_tbps", "allgather_gbps", "p2p_gbps", "overlap_penalty")
#: flag -> the model.* key of a NeMo config it reads
CONFIG_KEYS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_query_groups", "ffn": "ffn_hidden_size", "seq": "encoder_seq_length",
               "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
               "ep": "expert_model_parallel_size", "expert_tp": "expert_tensor_parallel_size",
               "experts": "num_moe_experts", "topk": "moe_router_topk",
               "moe_ffn": "moe_ffn_hidden_size", "micro_batch": "micro_batch_size",
               "global_batch": "global_batch_size",
               "group_size": "microbatch_group_size_per_vp_stage",
               "overlap_p2p": "overlap_p2p_comm", "batch_p2p": "batch_p2p_comm"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class PlanInputs:
    """Everything the plan needs, and where each value came from."""

    values: Dict[str, Any]
    model: ModelShape
    source: str  # preset name, config path or "custom model"
    defaulted: List[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


def _check_numbers(args: argparse.Namespace) -> None:
    for name in _INT_FLAGS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise PlanInputError(f"{flag(name)} {value}: must be an integer >= 1")
    for name in _FLOAT_FLAGS:
        value = getattr(args, name, None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise PlanInputError(f"{flag(name)} {value}: must be > 0 and finite")


def _from_config(path: str, overrides: List[str]) -> Dict[str, Any]:
    """The sizes a NeMo (or launcher: under ``training:``) config gives, by flag name, read as
    ``check`` reads them: NeMo's and the launcher's resolvers (``${multiply:4, ${.hidden_size}}``)
    and ``${training.*}`` resolve; ``fp8``, ``fp8_recipe``, ``fp4`` / ``fp4_recipe`` and
    ``reuse_grad_buf_for_mxfp8_param_ag`` come along (``fp8``, ``recipe``, ``reuse_grad_buf``)."""
    from nemo_fp8_align.cli.deps import CHECK_NEEDS, missing_dependency

    missing = missing_dependency("plan CONFIG.yaml", CHECK_NEEDS)
    if missing is not None:  # before anything imports OmegaConf or Hydra
        raise PlanInputError(f"{missing} (or plan with --model or the size flags)")
    from nemo_fp8_align.cli.check_load import load_config
    from nemo_fp8_align.config_check.resolvers import upstream_resolvers
    from nemo_fp8_align.errors import ConfigLoadError

    try:
        cfg = load_config(Path(path), overrides)
    except ConfigLoadError as err:
        raise PlanInputError(str(err).splitlines()[0]) from None
    with upstream_resolvers():
        return _read_config(path, cfg)


def _read_config(path: str, cfg: Any) -> Dict[str, Any]:
    from nemo_fp8_align.config_check.check import config_nodes
    from nemo_fp8_align.config_check.context import CheckContext
    from nemo_fp8_align.config_check.reader import ABSENT, Reader

    prefix = "training." if "model" not in cfg and "training" in cfg else ""
    model_node, trainer_node, problems = config_nodes(cfg)
    if model_node is None or ("model" not in cfg and not prefix):
        raise PlanInputError(f"{path}: no model: block, not a NeMo training config")
    model = Reader(model_node, prefix + "model.")
    trainer = None if trainer_node is None else Reader(trainer_node, prefix + "trainer.")
    ctx = CheckContext(model, trainer)
    out: Dict[str, Any] = {}
    for name, key in CONFIG_KEYS.items():
        value = model.get(key)
        if value is ABSENT or value is None:
            continue
        if name in ("overlap_p2p", "batch_p2p"):
            if not isinstance(value, bool):
                raise PlanInputError(f"{prefix}model.{key}={value!r}: expected true or false")
        elif type(value) is not int or value < 1:
            raise PlanInputError(f"{prefix}model.{key}={value!r}: expected an integer >= 1")
        out[name] = value
    out.update(_config_fp8(model, prefix))
    if model.violations:
        raise PlanInputError(str(model.violations[0]))
    if out.get("vp") == 1:
        out["vp"] = None
    gated = model.get("activation")
    if isinstance(gated, str):
        out["gated_mlp"] = gated.lower() in ("swiglu", "geglu", "reglu", "fast-swiglu")
    dp = ctx.trainer_data_parallel()
    world, mp = ctx.world(), ctx.model_parallel()
    if dp is None and world is not None and mp is not None:
        raise PlanInputError(
            f"{prefix}trainer.devices x num_nodes = {world} GPUs is not divisible by TP x PP x CP "
            f"= {mp} (megatron-core refuses it): change the node count or the layout, or pass "
            "--dp to plan one data-parallel size")
    if dp is not None:
        out["dp"] = dp
    for name, value in NEMO_P2P.items():
        out.setdefault(name, value)  # NeMo's own defaults for a config without the keys
    return out


def _config_fp8(model: Any, prefix: str) -> Dict[str, Any]:
    """``fp8`` (False: the config trains without FP8), ``recipe`` (NeMo copies
    ``mcore_customization_config`` last, so its ``fp8_recipe`` wins; an ``fp4`` format with
    ``fp4_recipe``, megatron-core's NVFP4 keys, wins over both) and ``reuse_grad_buf`` of a
    config's model node."""
    from nemo_fp8_align.config_check.reader import ABSENT

    out: Dict[str, Any] = {}
    for key, name in (("fp8", "fp8"), ("fp8_params", "fp8_params"),
                      ("reuse_grad_buf_for_mxfp8_param_ag", "reuse_grad_buf")):
        value = model.get(key)
        if value is ABSENT or value is None:
            continue
        if not isinstance(value, bool):
            raise PlanInputError(f"{prefix}model.{key}={value!r}: expected true or false")
        out[name] = value
    for key in ("fp8_recipe", "mcore_customization_config.fp8_recipe"):
        recipe = model.get(key)
        if recipe is ABSENT or recipe is None:
            continue
        if recipe not in RECIPES:
            raise PlanInputError(f"{prefix}model.{key}={recipe!r}: not an FP8 recipe plan knows; "
                                 f"one of {', '.join(RECIPES)} (or pass --recipe)")
        out["recipe"] = recipe
    fp4 = model.get("fp4")
    if fp4 not in (ABSENT, None, False):
        recipe = model.get("fp4_recipe")
        recipe = "nvfp4" if recipe in (ABSENT, None) else recipe
        if recipe != "nvfp4":
            raise PlanInputError(f"{prefix}model.fp4_recipe={recipe!r}: plan knows the FP4 "
                                 "recipe nvfp4 only (or pass --recipe)")
        out["recipe"] = recipe
    return out


def _model(v: Dict[str, Any], preset: Optional[str]) -> ModelShape:
    sizes = {k: v.get(k) for k in ("layers", "hidden", "heads", "ffn")}
    if preset is None:
        missing = [flag(k) for k, x in sizes.items() if x is None]
        if missing:
            raise PlanInputError(f"give a CONFIG.yaml, --model ({', '.join(sorted(MODELS))}) or all "
                                 f"of --layers --hidden --heads --ffn (missing {' '.join(missing)})")
        base = ModelShape(sizes["layers"], sizes["hidden"], sizes["heads"],
                          v.get("kv_heads") or sizes["heads"], sizes["ffn"],
                          bool(v.get("gated_mlp")), v.get("seq") or 2048)
    else:
        base = MODELS[preset]
    changes = {k: x for k, x in sizes.items() if x is not None}
    for name, attr in (("kv_heads", "kv_heads"), ("gated_mlp", "gated_mlp"), ("seq", "seq"),
                       ("experts", "experts"), ("topk", "topk"), ("moe_ffn", "moe_ffn")):
        if v.get(name) is not None:
            changes[attr] = v[name]
    model = replace(base, **changes)
    if model.heads % model.kv_heads:
        raise PlanInputError(f"--kv-heads {model.kv_heads}: must divide the {model.heads} attention "
                             "heads (each KV head serves a group of query heads)")
    if model.hidden % model.heads:
        raise PlanInputError(f"--hidden {model.hidden}: must be divisible by the {model.heads} heads")
    if model.experts and model.topk > model.experts:
        raise PlanInputError(f"--topk {model.topk}: more than the {model.experts} experts")
    return model


def _fit_default_layout(v: Dict[str, Any], layers: int, defaulted: List[str]) -> None:
    """PP and VP that were not given default to the pair nearest PP8 VP2 whose product divides
    the layer count (the 126 layers of Llama 3 405B: PP9 VP2): a default never makes the plan
    fail. A PP or VP that was given is kept (its error names it)."""
    free = [name for name in ("pp", "vp") if name in defaulted]
    if not free or layers % (v["pp"] * v["vp"]) == 0:
        return
    pps = range(2, layers + 1) if "pp" in free else [v["pp"]]
    vps = range(2, layers + 1) if "vp" in free else [v["vp"]]
    fits = [(abs(pp - DEFAULTS["pp"]), abs(vp - DEFAULTS["vp"]), -pp, pp, vp)
            for pp in pps for vp in vps if layers % (pp * vp) == 0]
    if not fits and len(free) == 2:
        raise PlanInputError(
            f"{layers} layers: no PP >= 2 and VP >= 2 whose product divides them (the interleaved "
            "schedule gives every chunk the same layers); pass a layer count that has such a split")
    if not fits:
        fixed, other = ("pp", "vp") if "vp" in free else ("vp", "pp")
        raise PlanInputError(
            f"{flag(fixed)} {v[fixed]}: no {other.upper()} >= 2 makes PP x VP divide the {layers} "
            f"layers (every chunk gets the same layers); pass another {flag(fixed)}")
    v["pp"], v["vp"] = min(fits)[3:]


def resolve(args: argparse.Namespace) -> PlanInputs:
    """Config, then preset, then flags; the rest from :data:`DEFAULTS` (named in ``defaulted``)."""
    _check_numbers(args)
    if args.gpu.lower() not in GPUS:
        raise PlanInputError(f"--gpu {args.gpu!r} is not known; use one of {', '.join(sorted(GPUS))}"
                             " (or the closest one with --tflops and --transpose-tbps)")
    v: Dict[str, Any] = dict.fromkeys((*_INT_FLAGS, "gated_mlp", "overlap_p2p", "batch_p2p",
                                       "fp8", "fp8_params", "recipe", "reuse_grad_buf"))
    v.update(_from_config(args.config, args.overrides) if args.config else {})
    if args.overrides and not args.config:
        raise PlanInputError(f"override {args.overrides[0]!r} without a CONFIG.yaml: pass the "
                             "config first (plan CONFIG.yaml key=value ...) or use the flags")
    for name in (*_INT_FLAGS, "gated_mlp", "overlap_p2p", "batch_p2p", "reuse_grad_buf"):
        if getattr(args, name, None) is not None:
            v[name] = getattr(args, name)
    defaulted = []
    for name, value in DEFAULTS.items():
        if v.get(name) is None:
            v[name], _ = value, defaulted.append(name)
    if v["overlap_p2p"] and v["batch_p2p"]:
        raise PlanInputError("--overlap-p2p-comm with --batch-p2p-comm: megatron-core allows one "
                             "of them (pass --no-batch-p2p-comm or --no-overlap-p2p-comm)")
    v["gpu"] = args.gpu.lower()
    for name in _FLOAT_FLAGS:
        v[name] = getattr(args, name)
    v["recipe"] = args.recipe or v["recipe"] or "delayed"  # the flag, the config, megatron-core's
    model = _model(v, args.model)
    _fit_default_layout(v, model.layers, defaulted)
    if model.kv_heads % v["tp"] and v["tp"] % model.kv_heads:
        raise PlanInputError(f"--tp {v['tp']}: the {model.kv_heads} KV heads must be divisible by "
                             "TP (or TP by them)")
    return PlanInputs(v, model, args.model or args.config or "custom model", defaulted)
