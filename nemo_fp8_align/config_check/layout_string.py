"""Megatron-LM's ``--pipeline-model-parallel-layout`` as a layout fix: where no even or
first/last split of the layers fits PP, VP >= 2 (a prime layer count: DeepSeek-V3's 61), a
layout string places any number of layers in each stage, so the split can keep the model
(:func:`layout_string_fix`); the layer count is changed only where this fails too. A string (or
a hybrid pattern) of one stage per rank keeps its own stages where a smaller PP fits
(:func:`kept_string_fix`), and one of PP x VP stages regroups them at another PP where the
given one does not fit (:func:`regrouped_string_fix`). NeMo mode has no such fix (megatron-core
0.12.3 has no layout string). Part of the command line's fix search (:mod:`.fix_search`); the
string itself is written by :func:`~.megatron_lm_rules.layout_text`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.layout import KEYS, Fixed, Layout, layout_inputs, search
from nemo_fp8_align.config_check.megatron_lm_rules import layout_text
from nemo_fp8_align.config_check.reader import ABSENT

__all__ = ["kept_string_fix", "layout_string_fix", "regrouped_string_fix"]


def layout_string_fix(ctx: CheckContext) -> Optional[Dict[str, Any]]:
    """Megatron-LM only, where no even or first/last split fits the layer count (61 layers,
    DeepSeek-V3's, split into no PP * VP >= 4 stages): the nearest PP / VP / N that fit the
    world and the batch, with a ``--pipeline-model-parallel-layout`` that places the layers
    over their stages as evenly as it can (the model kept; the split is then uneven by a
    layer). {model key: new value}, or None (NeMo mode: megatron-core 0.12.3 has no layout
    string, nor has the version checked against before 0.13; a hybrid model's pattern;
    nothing fits)."""
    if ctx.nemo or ctx.model.get("hybrid_layer_pattern") not in (ABSENT, None) or (
            ctx.mcore is not None and not ctx.mcore.layout_string):
        return None
    inputs = layout_inputs(ctx)
    if inputs is None:
        return None
    fixed, cur = inputs
    mtp = ctx.model.peek_int("mtp_num_layers") or 0
    found = search(replace(fixed, emb=False, loss=False, changeable=("n", "vp", "pp"),
                           free_split=True), replace(cur, first=None, last=None))
    if found is None:
        return None
    change: Dict[str, Any] = {"pipeline_model_parallel_layout":
                              layout_text(fixed.layers, found.pp, found.vp, mtp)}
    for var in ("pp", "n"):
        if getattr(found, var) != getattr(cur, var):
            change[KEYS[var]] = getattr(found, var)
    for var in ("first", "last"):  # Megatron-LM takes one way of splitting the pipeline
        if getattr(cur, var) is not None:
            change[KEYS[var]] = None
    for key in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if ctx.model.get(key) is True:
            change[key] = False
    return change


def kept_string_fix(ctx: CheckContext) -> Optional[Dict[str, Any]]:
    """Megatron-LM: a layout string or a hybrid pattern with as many stages as PP (VP 1) keeps
    the user's stages (and their balancing) at the largest PP that makes VP >= 2 and fits the
    world and the batch (Bridge's DeepSeek-V3 layout of 16 stages: PP 16 -> PP 8, VP 2).
    {model key: new value}, or None (no such PP)."""
    if not ctx.layout_string() or ctx.vp() is not None:
        return None
    inputs = layout_inputs(ctx)
    if inputs is None:
        return None
    fixed, cur = inputs
    stages = cur.pp  # VP 1: one stage per rank
    largest_first = [stages // vp for vp in range(2, stages // 2 + 1) if stages % vp == 0]
    return _regrouped(fixed, cur, stages, largest_first)


def regrouped_string_fix(ctx: CheckContext) -> Optional[Dict[str, Any]]:
    """Megatron-LM: a layout string or a hybrid pattern of PP x VP stages (VP >= 2) keeps its
    stages at the nearest other PP that fits the world (expert sizes included) and the batch,
    VP >= 2 (Megatron-LM derives VP from the stages and asserts the VP flags absent; the
    DeepSeek-V3 proxy's 8 stages at PP 4 with EP 16 on 32 GPUs: PP 2, VP 4, EP kept).
    {model key: new value}, or None (no such PP)."""
    if not ctx.layout_string() or ctx.vp() is None:
        return None
    inputs = layout_inputs(ctx)
    if inputs is None:
        return None
    fixed, cur = inputs
    stages = cur.pp * cur.vp
    pps = sorted((p for p in range(2, stages // 2 + 1) if stages % p == 0 and p != cur.pp),
                 key=lambda p: (abs(p - cur.pp), p))
    return _regrouped(fixed, cur, stages, pps)


def _regrouped(fixed: Fixed, cur: Layout, stages: int,
               pps: List[int]) -> Optional[Dict[str, Any]]:
    """The first of ``pps`` (each dividing ``stages``) at which the same stages fit, as the
    change of PP (and of N where the search moved it); None if none fits."""
    for pp in pps:
        found = search(fixed, Layout(pp, stages // pp, None, None, cur.n))
        if found is not None:
            change = {KEYS["pp"]: found.pp}
            if found.n != cur.n:
                change[KEYS["n"]] = found.n
            return change
    return None
