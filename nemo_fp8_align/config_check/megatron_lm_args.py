"""The startup check for Megatron-LM's (and megatron-core 0.19's ``megatron.training``) command-line
arguments: the same rules as the NeMo check, with messages that name Megatron-LM's flags.

The rules read a NeMo-style config (``model.*``, ``trainer.*``); this adapter maps Megatron-LM's
arguments onto the values they read (:data:`FLAGS`), runs every rule, and translates each
violation's key and fix back into the flag a Megatron-LM user sets::

    from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
    megatron_lm_violations(vars(megatron.training.get_args()), world_size=8)
    # a command line, read by .megatron_lm_parser.parse_megatron_lm_argv (the check command's)
    megatron_lm_violations(parse_megatron_lm_argv(sys.argv[1:]), world_size=8)

What NeMo needs and Megatron-LM does not (``megatron_amp_O2``, a half ``trainer.precision``) is
filled in so those rules hold; what only Megatron-LM has (FSDP instead of DDP) is checked here.
The refusal table's rows (whole-step CUDA graphs, the combined 1F1B schedule) run on the flags
of the same names. Nothing here imports megatron-core, nor reads a command line: the runtime's
check of Megatron-LM's parsed arguments loads no parser or flag table
(:mod:`.megatron_lm_parser` reads command lines, for the check command), and no fix search:
the check command passes its fixer (:data:`~.fix_search.FIX_SEARCH`), without which each rule
gives the fix it names without a search.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

from nemo_fp8_align.config_check.context import Fixer
from nemo_fp8_align.config_check.megatron_lm_hybrid import (HYBRID, hybrid_layers,
                                                            hybrid_pattern, hybrid_segments)
from nemo_fp8_align.config_check.megatron_lm_refusals import encoder_decoder
from nemo_fp8_align.config_check.megatron_lm_rules import (
    _VP_DESTS, LAYOUT, PARSE_PROBLEMS, implicit_global_batch, layout_stages, megatron_lm_only,
    step_schedule, vp_flag, vp_of, vp_spelling)
from nemo_fp8_align.config_check.reader import Violation

__all__ = ["FLAGS", "READ_DESTS", "megatron_lm_config", "megatron_lm_violations",
           "translate_fix"]

STORE_TRUE, STORE_FALSE, VALUE = "store_true", "store_false", "value"


class Flag(NamedTuple):
    dest: str  # Megatron-LM's argparse dest
    flag: str  # how it is spelt on the command line
    kind: str  # STORE_TRUE, STORE_FALSE or VALUE
    default: Any  # Megatron-LM's default


#: The rules' keys (without ``model.``), the Megatron-LM argument each one is read from.
FLAGS: Dict[str, Flag] = {
    "pipeline_model_parallel_size": Flag("pipeline_model_parallel_size",
                                         "--pipeline-model-parallel-size", VALUE, 1),
    "tensor_model_parallel_size": Flag("tensor_model_parallel_size",
                                       "--tensor-model-parallel-size", VALUE, 1),
    "context_parallel_size": Flag("context_parallel_size", "--context-parallel-size", VALUE, 1),
    "expert_model_parallel_size": Flag("expert_model_parallel_size",
                                       "--expert-model-parallel-size", VALUE, 1),
    "expert_tensor_parallel_size": Flag("expert_tensor_parallel_size",
                                        "--expert-tensor-parallel-size", VALUE, None),
    "num_moe_experts": Flag("num_experts", "--num-experts", VALUE, None),
    "sequence_parallel": Flag("sequence_parallel", "--sequence-parallel", STORE_TRUE, False),
    "num_layers": Flag("num_layers", "--num-layers", VALUE, None),
    "num_layers_in_first_pipeline_stage": Flag("decoder_first_pipeline_num_layers",
                                               "--decoder-first-pipeline-num-layers", VALUE, None),
    "num_layers_in_last_pipeline_stage": Flag("decoder_last_pipeline_num_layers",
                                              "--decoder-last-pipeline-num-layers", VALUE, None),
    "account_for_embedding_in_pipeline_split": Flag(
        "account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split",
        STORE_TRUE, False),
    "account_for_loss_in_pipeline_split": Flag(
        "account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split",
        STORE_TRUE, False),
    "pipeline_model_parallel_layout": Flag("pipeline_model_parallel_layout",
                                           "--pipeline-model-parallel-layout", VALUE, None),
    "fp8_recipe": Flag("fp8_recipe", "--fp8-recipe", VALUE, "delayed"),
    "fp8_params": Flag("fp8_param_gather", "--fp8-param-gather", STORE_TRUE, False),
    "first_last_layers_bf16": Flag("first_last_layers_bf16", "--first-last-layers-bf16",
                                   STORE_TRUE, False),
    "optim.overlap_param_sync": Flag("overlap_param_gather", "--overlap-param-gather",
                                     STORE_TRUE, False),
    "optim.overlap_grad_sync": Flag("overlap_grad_reduce", "--overlap-grad-reduce",
                                    STORE_TRUE, False),
    "optim.align_param_gather": Flag("align_param_gather", "--no-align-param-gather",
                                     STORE_FALSE, True),
    "optim.overlap_param_gather_with_optimizer_step": Flag(
        "overlap_param_gather_with_optimizer_step",
        "--overlap-param-gather-with-optimizer-step", STORE_TRUE, False),
    "num_attention_heads": Flag("num_attention_heads", "--num-attention-heads", VALUE, None),
    "micro_batch_size": Flag("micro_batch_size", "--micro-batch-size", VALUE, None),
    "global_batch_size": Flag("global_batch_size", "--global-batch-size", VALUE, None),
    "microbatch_group_size_per_vp_stage": Flag(
        "microbatch_group_size_per_vp_stage",
        "--microbatch-group-size-per-virtual-pipeline-stage", VALUE, None),
    # Rows of the refusal table (support.py), which the check runs on these.
    "cuda_graph_impl": Flag("cuda_graph_impl", "--cuda-graph-impl", VALUE, "none"),
    "overlap_moe_expert_parallel_comm": Flag("overlap_moe_expert_parallel_comm",
                                             "--overlap-moe-expert-parallel-comm", STORE_TRUE,
                                             False),
}

#: Arguments read to derive a rule's value (not one-to-one), with Megatron-LM's defaults.
_DERIVED: Dict[str, Flag] = {f.dest: f for f in (
    Flag("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage",
         VALUE, None),
    Flag("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank",
         VALUE, None),
    Flag("fp8", "--fp8-format", VALUE, None),
    Flag("transformer_impl", "--transformer-impl", VALUE, "transformer_engine"),
    Flag("use_distributed_optimizer", "--use-distributed-optimizer", STORE_TRUE, False),
    Flag("use_megatron_fsdp", "--use-megatron-fsdp", STORE_TRUE, False),
    Flag("use_torch_fsdp2", "--use-torch-fsdp2", STORE_TRUE, False),
    Flag("num_query_groups", "--num-query-groups", VALUE, 1),
    Flag("group_query_attention", "--group-query-attention", STORE_TRUE, False),
    Flag("step_batch_size_schedule", "--step-batch-size-schedule", VALUE, None),
    Flag("seq_length", "--seq-length", VALUE, None),
    Flag("overlap_p2p_comm", "--no-overlap-p2p-communication", STORE_FALSE, True),
    Flag("fp4", "--fp4-format", VALUE, None),
    Flag("fp4_param_gather", "--fp4-param-gather", STORE_TRUE, False),
    Flag("rampup_batch_size", "--rampup-batch-size", VALUE, None),
)}

#: Every Megatron-LM argument the check reads (their defaults are kept in the generated
#: table of Megatron-LM's flags, :mod:`.megatron_lm_flags`).
READ_DESTS = tuple(sorted({f.dest for f in FLAGS.values()} | set(_DERIVED)))

#: Derived keys: how a fix of the rule's key is spelt in Megatron-LM.
_DERIVED_FIX = {
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank {}",
    "fp8": "--fp8-format hybrid", "fp8_hybrid": "--fp8-format hybrid",
    "fp8_e4m3": "--fp8-format e4m3", "transformer_engine": "--transformer-impl transformer_engine",
    "optim.name": "--use-distributed-optimizer",
}
_DERIVED_KEY = {"virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage",
                "fp8": "--fp8-format", "fp8_hybrid": "--fp8-format", "fp8_e4m3": "--fp8-format",
                "transformer_engine": "--transformer-impl",
                "optim.name": "--use-distributed-optimizer"}

_DERIVED_EXPECTED = {
    "fp8": "hybrid or e4m3 (FP8 GEMMs are what need the transposed weights)",
    "fp8_hybrid": "hybrid or e4m3 (FP8 GEMMs are what need the transposed weights)",
    "optim.name": "set (megatron-core's DistributedOptimizer all-gathers the FP8 parameters "
                  "the plugin transposes)",
    "transformer_engine": "transformer_engine (FP8 weights are Transformer Engine tensors)",
}


def megatron_lm_config(args: Mapping[str, Any], world_size: Optional[int] = None) -> dict:
    """The NeMo-style config (``model:``, ``trainer:``) the rules read, from Megatron-LM's
    arguments (``vars(get_args())`` or :func:`parse_megatron_lm_argv`)."""
    def get(dest: str, default: Any = None) -> Any:
        return args.get(dest, default)

    model: Dict[str, Any] = {}
    for key, f in FLAGS.items():
        _put(model, key, get(f.dest, f.default))
    fmt, fp4 = get("fp8"), get("fp4") is not None
    schedule = step_schedule(args)
    if fp4 and fmt is None:
        # NVFP4 in place of FP8: what the FP8 rules ask of the format and the gathered weights
        # is the recipe table's to ask of FP4 (megatron_lm_rules), and megatron-core reads no
        # FP8 recipe then
        fmt = "hybrid"
        model.update(fp8_params=True, fp8_recipe=None)
    model.update(fp8=fmt is not None, fp8_hybrid=fmt == "hybrid", fp8_e4m3=fmt == "e4m3",
                 transformer_engine=get("transformer_impl", "transformer_engine")
                 == "transformer_engine",
                 virtual_pipeline_model_parallel_size=vp_of(args),
                 num_query_groups=get("num_query_groups") if get("group_query_attention")
                 else None,  # Megatron-LM passes its groups only with --group-query-attention
                 encoder_seq_length=get("seq_length"),  # a CP fix keeps it a multiple of 2CP
                 # a layout-string fix places the MTP layers; a hybrid pattern is its own split
                 mtp_num_layers=get("mtp_num_layers"),
                 hybrid_layer_pattern=hybrid_pattern(args),
                 rampup_batch_size=None,  # read by Megatron-LM 0.19.2 only to warn
                 megatron_amp_O2=True,  # NeMo's requirement; Megatron-LM keeps FP32 main params
                 mcore_gpt=True,  # NeMo's switch; Megatron-LM's models are megatron-core's
                 fp8_transpose_align={"enabled": True})
    if hybrid_pattern(args) is not None:  # Megatron-LM overrides --num-layers with it
        model["num_layers"] = hybrid_layers(hybrid_pattern(args))
    if isinstance(schedule, list) and schedule:
        model["global_batch_size"] = schedule[-1][1]  # the steady state; every entry: rules
    elif model["global_batch_size"] is None and world_size is not None:
        model["global_batch_size"] = implicit_global_batch(args, world_size)
    model["optim"]["name"] = ("mcore_distributed_optim" if get("use_distributed_optimizer")
                              else "adam")
    trainer = {"precision": "bf16-mixed"}  # NeMo's O2 needs a half precision, Megatron-LM not
    if world_size is not None:
        trainer.update(devices=world_size, num_nodes=1)
    return {"trainer": trainer, "model": model}


def _put(node: Dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if rest:
        _put(node.setdefault(head, {}), rest, value)
    else:
        node[head] = value


def megatron_lm_violations(args: Mapping[str, Any], world_size: Optional[int] = None,
                           mcore: Any = None, fixer: Optional[Fixer] = None
                           ) -> List[Violation]:
    """Every violation, keyed and fixed in Megatron-LM's flags; empty when valid. ``mcore``:
    the megatron-core version's rules to check against (None: the newest). ``fixer``: the
    command line's fix search (:data:`~.fix_search.FIX_SEARCH`); None (the runtime's check of
    the parsed arguments): each rule's fix without the search, which is then not loaded."""
    from nemo_fp8_align.config_check.check import find_violations

    out: List[Violation] = list(args.get(PARSE_PROBLEMS, ()))
    refused = encoder_decoder(args)
    if refused:  # T5: named alone, the GPT rules' fixes would rewrite it
        return out + refused
    out += megatron_lm_only(args, world_size, mcore, fixer)
    cfg = megatron_lm_config(args, world_size)
    # Layers per virtual stage without --num-layers give no VP: the --num-layers violation is
    # the one to fix (a VP fix would guess the model's layer count).
    vp_unknown = (args.get("num_layers") is None
                  and args.get("num_layers_per_virtual_pipeline_stage") is not None)
    for v in find_violations(cfg, dialect="megatron_lm", mcore=mcore, fixer=fixer):
        if step_schedule(args) is not None and v.key == "model.global_batch_size":
            continue  # every entry of the schedule is checked by megatron_lm_rules
        if vp_unknown and v.key == "model.virtual_pipeline_model_parallel_size":
            continue
        v = _translate(args, v, world_size, fixer)
        if not any(v.key == o.key and v.fix == o.fix for o in out):  # fp8 and its format
            out.append(v)
    return out


def _translate(args: Mapping[str, Any], v: Violation, world: Optional[int],
               fixer: Optional[Fixer] = None) -> Violation:
    v = Violation(v.key, v.found, _megatron_terms(v.expected), v.fix)
    key = v.key[len("model."):] if v.key.startswith("model.") else v.key
    if key == "trainer.num_nodes" and world is not None:
        return _world_size(args, v, world, fixer)
    if key in FLAGS:
        flag = FLAGS[key].flag
    elif key == "virtual_pipeline_model_parallel_size":
        flag = vp_flag(args)
        pattern = hybrid_pattern(args)
        layout = args.get("pipeline_model_parallel_layout")
        if flag == LAYOUT and isinstance(layout, str):  # its stages give VP: say so
            return Violation(flag, repr(layout), f"{layout_stages(layout)[0]} stage(s) = PP x "
                             "VP with VP >= 2 (Megatron-LM derives the model chunks per "
                             "pipeline rank from the stages; the fix keeps them at a smaller PP "
                             "where the world and the batch fit, else spreads the layers evenly "
                             "over PP x 2 stages: move layers between them by hand if you "
                             "balanced yours)", translate_fix(args, v.fix))
        if flag == HYBRID and pattern is not None:  # the segments give VP: say so in its terms
            return Violation(flag, repr(pattern), f"{hybrid_segments(pattern)} segment(s) "
                             "cut by '|' into PP x VP with VP >= 2 (Megatron-LM derives the "
                             "model chunks per pipeline rank from them and asserts the VP "
                             "flags absent)", translate_fix(args, v.fix))
    elif key in _DERIVED_KEY:
        flag = _DERIVED_KEY[key]
    elif v.key.startswith("trainer."):
        flag = "world size (WORLD_SIZE)"
    else:
        flag = "--" + key.replace("_", "-").replace(".", "-")
    if key in _DERIVED_EXPECTED:
        dest = {"transformer_engine": "transformer_impl", "optim.name":
                "use_distributed_optimizer"}.get(key, "fp8")
        return Violation(flag, repr(args.get(dest)) if args.get(dest) else "not set",
                         _DERIVED_EXPECTED[key], translate_fix(args, v.fix))
    return Violation(flag, v.found, v.expected, translate_fix(args, v.fix))


def _world_size(args: Mapping[str, Any], v: Violation, world: int,
                fixer: Optional[Fixer] = None) -> Violation:
    """The world-size fix of a Megatron-LM job: the nearest process count that TP * PP * CP
    divides and with which the batch fits (the fixer's search; NeMo's rule keeps the devices
    per node and changes the node count, a multiple of the world given, which is the fix where
    there is no fixer or it finds none; a launcher starts any count)."""
    fixed = fixer.nearest_world(args, world) if fixer is not None else None
    if fixed is None:
        nodes = re.search(r"num_nodes=(\d+)", v.fix)
        fixed = world * int(nodes.group(1)) if nodes else None
    # no "; " inside: that separates the edits of a fix (megatron_lm_edits)
    fix = (f"launch {fixed} processes (the world size, a multiple of TP * PP * CP) and "
           f"check with --world-size {fixed}" if fixed else v.fix)
    return Violation("--world-size", str(world), v.expected, fix)


def _megatron_terms(text: str) -> str:
    """A rule's words for the world in a Megatron-LM job's terms: one world size (the
    processes launched), never nodes, devices per node or NeMo's keys."""
    text = re.sub(r"trainer\.devices \* trainer\.num_nodes = \d+ \* \d+ = (\d+) GPUs",
                  r"the world size \1", text)
    text = text.replace("tensor_model_parallel_size * pipeline_model_parallel_size * "
                        "context_parallel_size", "TP * PP * CP")
    text = text.replace("the node count held", "the world size held")
    text = text.replace("or train on fewer nodes", "or launch fewer processes")
    return re.sub(r"changes the node count \(a multiple of \d+\)",
                  "changes the world size (the number of processes)", text)


_OVERRIDE = re.compile(r"([+~]{0,2})model\.([A-Za-z0-9_.]+)=(<[^>]*>|\S+)")  # <a placeholder>


def translate_fix(args: Mapping[str, Any], fix: str) -> str:
    """``model.key=value`` overrides in a fix, spelt as Megatron-LM flags; a change of PP or VP
    keeps the user's way of giving VP (``--num-layers-per-virtual-pipeline-stage`` stays that
    flag where the layers split that way), and never leaves two VP flags."""
    changes = {m.group(2): m.group(3) for m in _OVERRIDE.finditer(fix)}
    if not changes:
        return fix
    parts: List[str] = []
    for key, value in changes.items():
        if key == "virtual_pipeline_model_parallel_size":
            continue
        if key in _DERIVED_FIX:
            parts.append(_DERIVED_FIX[key].format(value))
            continue
        f = FLAGS.get(key)
        if f is None:
            parts.append("--" + key.replace("_", "-") + ("" if value == "True" else f" {value}"))
        elif f.kind == VALUE:
            shown = value if "<" in value else shlex.quote(value)  # a layout string's | and *
            parts.append(f"{f.flag} {shown}" if value != "null" else f"drop {f.flag}")
        else:
            on = (value == "True") if f.kind == STORE_TRUE else value != "True"
            parts.append(f.flag if on else f"drop {f.flag}")
    vp = changes.get("virtual_pipeline_model_parallel_size")
    pp = changes.get("pipeline_model_parallel_size")
    if "pipeline_model_parallel_layout" in changes:
        # the layout gives VP: Megatron-LM asserts no more than one of the three VP flags
        parts.extend(f"drop {flag}" for flag, dest in _VP_DESTS[:2]
                     if args.get(dest) is not None)
    elif vp is not None or (pp is not None and args.get("num_layers_per_virtual_pipeline_stage")):
        parts.extend(vp_spelling(args, int(pp) if pp else None,
                                 int(vp) if vp not in (None, "null") else vp_of(args)))
    rest = _OVERRIDE.sub("", fix).strip()
    return "; ".join(parts) + (f"; {rest}" if rest else "")


if __name__ == "__main__":  # regenerate the flag table in an environment with megatron-core 0.19
    import sys

    from nemo_fp8_align.config_check.megatron_lm_parser import write_flag_table

    if sys.argv[1:] != ["--write-flags"]:
        sys.exit("usage: python -m nemo_fp8_align.config_check.megatron_lm_args --write-flags")
    write_flag_table(READ_DESTS)
