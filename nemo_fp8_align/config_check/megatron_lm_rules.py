"""What Megatron-LM 0.19.2's ``validate_args`` (``megatron.training.arguments``) and its
microbatch calculator check on the settings the plugin depends on, and NeMo has no spelling for:
the three ways of giving the virtual-pipeline size (at most one), the batch ramp of
``--step-batch-size-schedule`` (every entry; not with ``--global-batch-size``), FP4, the
interleaved schedule's PP > 2 without ``--overlap-p2p-comm``, the hierarchical CP sizes; the
plugin's refusals that only Megatron-LM has are in :mod:`.megatron_lm_refusals`. The rules shared
with NeMo run in :mod:`.megatron_lm_args`; :func:`layout_text` writes the layout string a VP fix
gives (the inverse of :func:`layout_stages`). Pure functions of ``vars(args)``; nothing here
imports Megatron-LM, nor the command line's fix search (the fixer passed in searches).
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Any, List, Mapping, Optional, Tuple, Union

from nemo_fp8_align.config_check.context import Fixer
from nemo_fp8_align.config_check.reader import Violation
from nemo_fp8_align.config_check.rules.batch import schedule_fits
from nemo_fp8_align.config_check.megatron_lm_hybrid import (HYBRID, hybrid_pattern,
                                                            hybrid_segments, with_segments)
from nemo_fp8_align.config_check.megatron_lm_refusals import (emerging_optimizer, fsdp_only,
                                                              plugin_refusals)

__all__ = ["PARSE_PROBLEMS", "implicit_global_batch", "layout_stages", "layout_text",
           "megatron_lm_only", "step_schedule", "vp_flag", "vp_of", "vp_spelling"]

#: Key of :func:`parse_megatron_lm_argv`'s result holding what Megatron-LM's parser stops on.
PARSE_PROBLEMS = "_nemo_fp8_align_parse_problems"
PER_STAGE, STAGES, LAYOUT = ("--num-layers-per-virtual-pipeline-stage",
                             "--num-virtual-stages-per-pipeline-rank",
                             "--pipeline-model-parallel-layout")
_VP_DESTS = ((PER_STAGE, "num_layers_per_virtual_pipeline_stage"),
             (STAGES, "num_virtual_stages_per_pipeline_rank"),
             (LAYOUT, "pipeline_model_parallel_layout"))


def _int(value: Any) -> Optional[int]:
    return value if type(value) is int else None


def _total_layers(args: Mapping[str, Any]) -> Optional[int]:
    """num_layers + 1 per accounting flag: what Megatron-LM splits over the pipeline."""
    layers = _int(args.get("num_layers"))
    if layers is None:
        return None
    return (layers + bool(args.get("account_for_embedding_in_pipeline_split"))
            + bool(args.get("account_for_loss_in_pipeline_split")))


def layout_stages(layout: str) -> Tuple[int, int]:
    """(stages, decoder layers) of a ``--pipeline-model-parallel-layout`` string: ``|``
    separates stages, ``(...)*n`` and ``x*n`` repeat, commas are cosmetic, ``t`` is a decoder
    layer."""
    text = layout.replace(",", "")
    while True:  # innermost groups first
        expanded = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        if expanded == text:
            break
        text = expanded
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.count("|") + 1, text.count("t")


def layout_text(layers: int, pp: int, vp: int, mtp: int = 0) -> str:
    """A ``--pipeline-model-parallel-layout`` of ``pp * vp`` stages holding ``layers`` decoder
    layers (``t``), as even as can be: the layers left over go to the middle stages first (the
    first holds the embedding ``E``, the last the MTP layers ``m`` and the loss ``L``, as
    megatron-core's PipelineParallelLayerLayout asks)."""
    stages = pp * vp
    counts = [layers // stages] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for i in order[:layers % stages]:
        counts[i] += 1
    parts = []
    for i, count in enumerate(counts):
        text = "t" if count == 1 else (f"t*{count}" if count else "")
        if i == 0:
            text = "E" + text
        if i == stages - 1:
            text += "m" * mtp + "L"
        parts.append(text)
    return "|".join(parts)


def vp_of(args: Mapping[str, Any]) -> Any:
    """Model chunks per pipeline rank as Megatron-LM derives them (validated args carry it);
    a sentence where the flags give none."""
    if args.get("virtual_pipeline_model_parallel_size") is not None:
        return args["virtual_pipeline_model_parallel_size"]
    pp = _int(args.get("pipeline_model_parallel_size")) or 1
    pattern = hybrid_pattern(args)
    if pattern is not None:  # Megatron-LM derives VP from the pattern's segments
        segments = hybrid_segments(pattern)
        if segments > 1 and segments % pp:
            return (f"{segments} {HYBRID} segments / PP {pp}: not a whole number (Megatron-LM "
                    "asserts the segments are evenly divisible by the pipeline size)")
        return segments // pp if segments // pp > 1 else None
    layout = args.get("pipeline_model_parallel_layout")
    if isinstance(layout, str):
        stages, _ = layout_stages(layout)
        if stages % pp:
            return (f"{stages} layout stages / PP {pp}: not a whole number (Megatron-LM asserts "
                    "the layout's length is divisible by the pipeline size)")
        return stages // pp if stages // pp > 1 else None
    if args.get("num_virtual_stages_per_pipeline_rank") is not None:
        return args["num_virtual_stages_per_pipeline_rank"]
    per_stage, total = args.get("num_layers_per_virtual_pipeline_stage"), _total_layers(args)
    if per_stage is None:
        return None
    if total is not None and type(per_stage) is int and per_stage > 0 \
            and total % pp == 0 and (total // pp) % per_stage == 0:
        return total // pp // per_stage if total // pp // per_stage > 1 else None
    return (f"num_layers (+1 per --account-for-*-in-pipeline-split) {total} / (PP {pp} x "
            f"{per_stage} per virtual stage): not a whole number")


def vp_flag(args: Mapping[str, Any]) -> str:
    """The flag the user gives VP with (the one a VP fix is spelt in); a hybrid model's is its
    pattern (Megatron-LM asserts the VP flags absent with it)."""
    if hybrid_pattern(args) is not None:
        return HYBRID
    for flag, dest in _VP_DESTS[::-1]:
        if args.get(dest) is not None:
            return flag
    return STAGES


def vp_spelling(args: Mapping[str, Any], pp: Optional[int], vp: Any) -> List[str]:
    """Setting VP (with PP, when it changes too) in the user's form: the layers per virtual
    stage where they split that way, else the stage count (dropping the per-stage flag)."""
    pp = pp or _int(args.get("pipeline_model_parallel_size")) or 1
    if type(vp) is not int:
        return []
    flag = vp_flag(args)
    if flag == HYBRID:
        # The segments are PP x VP, so they follow the PP the line leaves: a PP below the
        # plugin's least (2) is raised to 2 by the pipeline-size rule in the same line. Cut
        # for the PP given (1), the pattern would have VP 1 at PP 2 on the re-check, where no
        # TP or CP change fits and the world size was changed instead.
        pattern = hybrid_pattern(args)
        return [f"{HYBRID} {shlex.quote(with_segments(pattern, max(pp, 2) * vp))}"]
    if flag == LAYOUT:
        layers = _int(args.get("num_layers"))
        if layers is None or layers < pp * vp:
            return [f"<a {LAYOUT} of PP x VP = {pp * vp} stages>"]
        # the layers spread evenly over the stages (the given string's own placement is the
        # user's to redo by hand; this one is a valid start, named as such by the rule)
        return [f"{LAYOUT} "
                + shlex.quote(layout_text(layers, pp, vp, _int(args.get("mtp_num_layers")) or 0))]
    if flag == PER_STAGE:
        total = _total_layers(args)
        if total is not None and total % (pp * vp) == 0:
            return [f"{PER_STAGE} {total // (pp * vp)}"]
        return [f"drop {PER_STAGE}", f"{STAGES} {vp}"]
    return [f"{STAGES} {vp}"]


def step_schedule(args: Mapping[str, Any]) -> Union[None, str, List[Tuple[int, int, str]]]:
    """The entries of ``--step-batch-size-schedule`` as (threshold, batch size, threshold as
    written), sorted; a sentence when Megatron-LM's calculator would refuse it; None unset."""
    text = args.get("step_batch_size_schedule")
    if text is None:
        return None
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
    entries = []
    for entry in str(text).replace(",", " ").split():
        match = re.fullmatch(r"([0-9.]+)([KMBT]?):([0-9.]+)([KMBT]?)", entry.upper())
        if match is None:
            return f"entry '{entry}' is not THRESHOLD:BATCH_SIZE"
        threshold = int(float(match.group(1)) * scale.get(match.group(2), 1))
        batch = int(float(match.group(3)) * scale.get(match.group(4), 1))
        entries.append((threshold, batch, entry.split(":")[0]))
    entries.sort()
    if not entries or entries[0][0] != 0:
        return "the first entry must have threshold 0"
    if any(b <= 0 for _, b, _ in entries):
        return "every batch size must be positive"
    return entries


def implicit_global_batch(args: Mapping[str, Any], world: int) -> Optional[int]:
    """Megatron-LM's global batch without ``--global-batch-size``: micro batch * DP (M = 1)."""
    mbs = _int(args.get("micro_batch_size"))
    mp = 1
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        mp *= _int(args.get(dest)) or 1
    return mbs * (world // mp) if mbs and world % mp == 0 else None


def megatron_lm_only(args: Mapping[str, Any], world: Optional[int],
                     mcore: Any = None, fixer: Optional[Fixer] = None) -> List[Violation]:
    """Every Megatron-LM-only violation, in the order Megatron-LM validates (the recipe
    verdict by megatron-core ``mcore``'s rules; None: the newest). ``fixer``: the command
    line's fix search (:class:`~.fix_search.FixSearch`), which proposes the nearest batch for a
    step-schedule entry; None: the fix names what must hold."""
    out: List[Violation] = []
    given = [(flag, dest) for flag, dest in _VP_DESTS if args.get(dest) is not None]
    if len(given) > 1:
        keep = next(flag for flag, _ in given if flag != PER_STAGE)
        for flag, dest in given:
            if flag != keep:
                out.append(Violation(flag, f"{args[dest]!r}, with {keep} {args[keep_dest(keep)]!r}",
                                     f"at most one of {PER_STAGE}, {STAGES}, {LAYOUT} "
                                     "(Megatron-LM asserts 'No more than one of the following "
                                     "arguments can be set at the same time')", f"drop {flag}"))
    if args.get("num_layers_per_virtual_pipeline_stage") is not None and len(given) == 1 and (
            args.get("decoder_first_pipeline_num_layers") is not None
            or args.get("decoder_last_pipeline_num_layers") is not None):
        vp = vp_of(args)
        out.append(Violation(PER_STAGE, repr(args["num_layers_per_virtual_pipeline_stage"]),
                             f"{STAGES} with an uneven first/last stage (Megatron-LM asserts "
                             f"'please use {STAGES} ... when enable uneven pipeline "
                             "parallelism')", f"drop {PER_STAGE}; {STAGES} "
                             f"{vp if type(vp) is int else 2}"))
    layout = args.get("pipeline_model_parallel_layout")
    layers = _int(args.get("num_layers"))
    if isinstance(layout, str) and layers is not None and layout_stages(layout)[1] != layers:
        out.append(Violation(LAYOUT, repr(layout), f"{layers} decoder layers ('t'), as "
                             f"--num-layers says; it has {layout_stages(layout)[1]}",
                             f"<a {LAYOUT} with {layers} 't' layers>"))
    vp, pp = vp_of(args), _int(args.get("pipeline_model_parallel_size")) or 1
    if type(vp) is int and vp > 1 and pp <= 2 and not args.get("overlap_p2p_comm", True):
        out.append(Violation("--no-overlap-p2p-communication", "set", "PP > 2 without overlapped "
                             f"P2P communication when interleaving (PP = {pp}; Megatron-LM "
                             "asserts it)", "drop --no-overlap-p2p-communication"))
    out += _batch_schedule(args, world, vp, pp, fixer) + _optimizer_instances(args, world, pp)
    out += [v for v in plugin_refusals(args, mcore) if v not in out]
    return out + fsdp_only(args) + _hierarchical_cp(args) + emerging_optimizer(args)


def _optimizer_instances(args: Mapping[str, Any], world: Optional[int],
                         pp: int) -> List[Violation]:
    """megatron-core's initialize_model_parallel asserts that the optimizer instances split
    DP x CP evenly (after validate_args: the job starts, then stops). The fix is the largest
    count that does: the optimizer state each GPU holds changes, the model does not."""
    n = _int(args.get("num_distributed_optimizer_instances")) or 1
    tp = _int(args.get("tensor_model_parallel_size")) or 1
    if n == 1 or world is None or world % (tp * pp):
        return []
    dp_cp = world // (tp * pp)
    if dp_cp % n == 0:
        return []
    fix = max(k for k in range(1, min(n, dp_cp) + 1) if dp_cp % k == 0)
    return [Violation("--num-distributed-optimizer-instances", repr(n), f"a divisor of DP x CP = "
                      f"{dp_cp} on {world} GPUs (megatron-core asserts 'Data parallel size should "
                      "be divisible by partial DistOpt shard factor'); the fix changes how much "
                      "optimizer state each GPU holds, not the model",
                      f"--num-distributed-optimizer-instances {fix}")]


def _hierarchical_cp(args: Mapping[str, Any]) -> List[Violation]:
    """Megatron-LM asserts that the hierarchical CP sizes multiply to the CP size: a fix that
    changes CP (a world it fills) must change them too, or the line passes here and not there."""
    sizes, cp = args.get("hierarchical_context_parallel_sizes"), _int(args.get(
        "context_parallel_size", 1))
    if not sizes or cp is None or any(type(s) is not int or s < 1 for s in sizes):
        return []
    if math.prod(sizes) == cp:
        return []
    return [Violation("--hierarchical-context-parallel-sizes", " ".join(map(str, sizes)),
                      f"sizes whose product is --context-parallel-size {cp} (Megatron-LM "
                      "asserts 'context_parallel_size == prod(hierarchical_context_parallel_"
                      "sizes)')", "--hierarchical-context-parallel-sizes "
                      + " ".join(map(str, _sizes_for(list(sizes), cp))))]


def _sizes_for(sizes: List[int], cp: int) -> List[int]:
    """The given levels rescaled to multiply to ``cp``: a smaller CP takes its factor out of
    the outer (last) levels first; otherwise the last level takes what the others leave."""
    ratio, total = divmod(math.prod(sizes), cp)
    if total == 0:
        for i in reversed(range(len(sizes))):
            g = math.gcd(sizes[i], ratio)
            sizes[i], ratio = sizes[i] // g, ratio // g
        return sizes
    inner = math.prod(sizes[:-1])
    return sizes[:-1] + [cp // inner] if cp % inner == 0 else [cp] + [1] * (len(sizes) - 1)


def keep_dest(flag: str) -> str:
    return dict(_VP_DESTS)[flag]


def _batch_schedule(args: Mapping[str, Any], world: Optional[int], vp: Any,
                    pp: int, fixer: Optional[Fixer] = None) -> List[Violation]:
    """``--step-batch-size-schedule``: not with ``--global-batch-size``; every entry's M fits
    the interleaved schedule (the plugin follows M as it changes). The fix of an entry is the
    nearest batch that fits (the fixer's search); without a fixer, what the entries must be."""
    flag = "--step-batch-size-schedule"
    entries = step_schedule(args)
    if entries is None:
        return []
    out = []
    if args.get("_is_global_batch_size_explicitly_specified"):
        out.append(Violation("--global-batch-size", repr(args.get("global_batch_size")),
                             f"not set with {flag} (Megatron-LM raises 'Cannot specify both "
                             f"{flag} and --global-batch-size'; the schedule's last entry is the "
                             "global batch)", "drop --global-batch-size"))
    if isinstance(entries, str):
        out.append(Violation(flag, repr(args["step_batch_size_schedule"]), f"a schedule "
                             f"Megatron-LM's calculator accepts: {entries}",
                             f"<a {flag} of THRESHOLD:BATCH_SIZE entries from 0>"))
        return out
    mbs, tp = _int(args.get("micro_batch_size")), _int(args.get("tensor_model_parallel_size")) or 1
    cp = _int(args.get("context_parallel_size")) or 1
    n = _int(args.get("microbatch_group_size_per_vp_stage"))
    if world is None or mbs is None or world % (tp * pp * cp) or type(vp) is not int or pp < 2:
        return out
    per = mbs * (world // (tp * pp * cp))
    bad, fixed = [], []
    for threshold, batch, written in entries:
        ok = batch % per == 0 and schedule_fits(pp, vp, batch // per, n)
        if not ok:
            bad.append(f"{written}:{batch} (M = {batch / per:g})")
        if fixer is not None:
            fixed.append(f"{written}:{batch if ok else fixer.nearest_batch(pp, vp, batch, per, n)}")
    if bad:
        fix = (f"{flag} '{' '.join(fixed)}'" if fixer is not None else
               f"{flag} with those entries' batch sizes changed to such multiples: "
               "`nemo-fp8-align check --megatron-lm -- ARGS` proposes the nearest")
        out.append(Violation(flag, ", ".join(bad), f"every entry a multiple of micro batch * DP "
                             f"= {per} whose M fits the interleaved schedule (PP = {pp} <= N <= "
                             "M, not 0 < M mod N < PP; N = --microbatch-group-size-per-virtual-"
                             "pipeline-stage, default PP); the fix changes those entries' batch "
                             "sizes, which changes the batch ramp of the training recipe", fix))
    return out
