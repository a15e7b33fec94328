"""The smallest change of the parallel layout that makes a config's layer split, world size and
microbatches fit, holding the model, the batch and the cluster fixed: the layout solver of the
command line's fix search (:mod:`.fix_search`), never loaded by the runtime's startup check.

A fix the startup check proposes for these rules changes only the layout: the pipeline size PP,
the model chunks per rank VP, the first/last stage split and the group size N. The model's
architecture (num_layers, hidden, FFN, heads, experts), the global and micro batch, the sequence
and the node count are what the user chose to train; changing them to fit a layout is the wrong
way round. :func:`layout_fix` searches the layouts that change one setting, then two, then three
(nearest values first; VP up to one layer per chunk) and returns the first that passes every
layout constraint. Where TP or CP is the cause (TP * CP divides no world of this size, or fills
it, so no PP >= 2 can fit), it tries the nearest TP or CP that lets a layout fit (a change of the memory per GPU,
which the rule names). None when nothing fits (the rule then says so and names the trade-off of
what it changes instead: the micro or global batch (:mod:`.batch_fix`), the node count, the
layer count).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.reader import ABSENT
from nemo_fp8_align.config_check.rules.batch import schedule_error
from nemo_fp8_align.config_check.rules.split import layer_split_error

__all__ = ["FIXED_WHY", "KEYS", "Fixed", "Layout", "fixed_why", "layout_fix", "layout_inputs",
           "layout_overrides", "layout_problem", "micro_batch_layout_fix",
           "smaller_micro_batch_layout", "split_error"]

#: Layout variable -> the model key it is set by.
KEYS = {"n": "microbatch_group_size_per_vp_stage", "first": "num_layers_in_first_pipeline_stage",
        "last": "num_layers_in_last_pipeline_stage", "vp": "virtual_pipeline_model_parallel_size",
        "pp": "pipeline_model_parallel_size"}
#: Search order on ties: the least disruptive change first (N only reorders the schedule).
_ORDER = tuple(KEYS)
#: What the fixes hold fixed, said once in messages where no layout change exists.
FIXED_WHY = ("the search (up to three of PP, VP, the first/last stage split and the group size "
             "N, nearest values first) found no layout that fits with the model, the batch and "
             "the node count held")
_MAX_CHANGED = 4


def fixed_why(ctx: CheckContext) -> str:
    """:data:`FIXED_WHY`, naming only the settings the megatron-core version checked against
    has (no N before 0.10, no first/last split in NeMo's spelling before 0.11)."""
    if not ctx.legacy() and ctx.has_stage_split():
        return FIXED_WHY
    settings = ["PP", "VP"] + (["the first/last stage split"] if ctx.has_stage_split() else [])
    return (f"the search (of {', '.join(settings[:-1])} and {settings[-1]}, the layout settings "
            f"megatron-core {ctx.mcore.version} has, nearest values first) found no layout that "
            "fits with the model, the batch and the node count held")


_MAX_TRIED = 40_000  # candidate layouts per search: a suggestion is never worth a hang


@dataclass(frozen=True)
class Layout:
    pp: int
    vp: Optional[int]
    first: Optional[int]
    last: Optional[int]
    n: Optional[int]


@dataclass(frozen=True)
class Fixed:
    """What a layout fix never changes."""

    layers: int
    world: Optional[int]
    tp: int
    cp: int
    emb: bool
    loss: bool
    mbs: Optional[int]
    gbs: Optional[int]
    given_dp: Optional[int]
    ep: int = 1
    etp: int = 1
    #: NeMo 2.3.3's own split assertions apply (False under Megatron-LM).
    nemo: bool = True
    #: The settings the search may change (only N under a Megatron-LM layout string, which
    #: fixes PP, VP and the split).
    changeable: Tuple[str, ...] = ("n", "first", "last", "vp", "pp")
    #: Megatron-LM's --pipeline-model-parallel-layout places any number of layers in each
    #: stage: only at least one layer per stage is asked of the split.
    free_split: bool = False
    #: megatron-core before 0.10 (the version checked against): no N, M a multiple of PP.
    legacy: bool = False
    #: The least PP that version's interleaving accepts (0.7: 3).
    min_pp: int = 2

    def dp(self, pp: int) -> Optional[int]:
        """The data-parallel size with ``pp`` (the world's when known, else the given one)."""
        if self.world is None:
            return self.given_dp
        mp = self.tp * pp * self.cp
        return self.world // mp if self.world % mp == 0 else None


def split_error(layers: int, lay: Layout, emb: bool, loss: bool,
                nemo: bool = True) -> Optional[str]:
    """Why megatron-core or NeMo 2.3.3 refuse this split (None: they accept it)."""
    for count in (lay.first, lay.last):
        if count is not None and lay.vp and count % lay.vp:
            return "a first/last stage count not a multiple of VP"
    if (lay.first is not None or lay.last is not None) and (emb or loss):
        return "first/last stage counts with an account_for_* flag"
    error = layer_split_error(layers, lay.pp, lay.vp, lay.first, lay.last, emb, loss, nemo)
    return None if error is None else error[1]


def layout_problem(fixed: Fixed, lay: Layout) -> Optional[str]:
    """The first layout constraint ``lay`` breaks, or None when it fits everything."""
    if lay.pp < 2 or lay.vp is None or lay.vp < 2:
        return "the plugin needs PP >= 2 and VP >= 2"
    if lay.pp < fixed.min_pp:
        return f"the megatron-core version checked against needs PP >= {fixed.min_pp} with VP"
    if fixed.world is not None and fixed.world % (fixed.tp * lay.pp * fixed.cp):
        return "TP * PP * CP does not divide the world size"
    if fixed.world is not None and fixed.ep > 1 and fixed.world % (fixed.etp * fixed.ep * lay.pp):
        return "expert TP * EP * PP does not divide the world size"
    if fixed.free_split:
        error = "more stages than layers" if lay.pp * lay.vp > fixed.layers else None
    else:
        error = None if fixed.changeable == ("n",) else split_error(
            fixed.layers, lay, fixed.emb, fixed.loss, fixed.nemo)
    if error is not None:
        return error
    dp = fixed.dp(lay.pp)
    if dp is None or fixed.mbs is None or fixed.gbs is None:
        return None  # the microbatch count is unknown: nothing more to fit
    if fixed.gbs % (fixed.mbs * dp):
        return "the global batch is not a multiple of micro_batch_size * DP"
    if lay.n is not None and lay.n < 1:
        return "N < 1"
    return schedule_error(lay.pp, lay.vp, fixed.gbs // (fixed.mbs * dp), lay.n, fixed.legacy)


def _candidates(var: str, fixed: Fixed, cur: Layout) -> List[Any]:
    """Values to try for ``var`` other than the current one, nearest first."""
    old = getattr(cur, var)
    if var == "pp":
        if fixed.world is not None:
            span = fixed.world // (fixed.tp * fixed.cp) if fixed.world % (fixed.tp * fixed.cp) \
                == 0 else 0
            values = [d for d in range(2, min(span, 512) + 1) if span % d == 0]
        else:
            values = list(range(2, min(fixed.layers, 64) + 1))
        return sorted((v for v in values if v != old), key=lambda v: (abs(v - old), v))
    if var == "vp":
        return _vp_candidates(fixed, cur)
    if var in ("first", "last"):
        values = [None] + list(range(1, min(fixed.layers, 64)))
        return sorted((v for v in values if v != old),
                      key=lambda v: (abs((v or 0) - (old or 0)), v is not None))
    return _n_candidates(fixed, cur)


def _n_candidates(fixed: Fixed, cur: Layout, pp: Optional[int] = None) -> List[Optional[int]]:
    """N values other than the current one: null (= PP) first, then counts near the current
    one; with ``pp`` (the PP of the layout being tried) only counts above it, nearest it
    first: megatron-core asks PP <= N <= M, and null is PP itself."""
    old = cur.n
    # N <= M; M grows as another PP shrinks DP, so bound N by the largest M (DP 1), not by the
    # current PP's M (PP 1 on 192 GPUs has M < 2, and N = 4 at PP 3 was never tried)
    top = (fixed.gbs // fixed.mbs) if fixed.mbs and fixed.gbs else 64
    values = [None] + list(range(2 if pp is None else max(pp + 1, 2), min(top, 256) + 1))
    base = old if old is not None else (cur.pp if pp is None else pp)
    return sorted((v for v in values if v != old),
                  key=lambda v: (v is not None, abs((v or base) - base)))


def _vp_candidates(fixed: Fixed, cur: Layout) -> List[int]:
    """VP values other than the current one: every count up to one layer per chunk, up to 512
    (not 32: 82 layers fit PP 2 VP 41). Without a first/last stage split, the VPs that divide the
    layers per rank of some candidate PP come first, nearest first: those are the only ones
    that can fit, and a search changing two settings keeps only the first few of each."""
    total = fixed.layers + fixed.emb + fixed.loss
    # bounded as PP is: a layer count of 10**9 must not become a list of 10**9 candidates
    values = [v for v in range(2, min(max(total, 2), 512) + 1) if v != cur.vp]
    pps = {cur.pp, *(_candidates("pp", fixed, cur) if "pp" in fixed.changeable else ())}
    per_rank = {total // p for p in pps if p >= 1 and total % p == 0}
    even = cur.first is None and cur.last is None

    def divides(v: int) -> bool:
        return even and any(r % v == 0 for r in per_rank)

    return sorted(values, key=lambda v: (not divides(v), abs(v - (cur.vp or 2)), v))


def _distance(cur: Layout, lay: Layout) -> int:
    """How far ``lay`` is from ``cur``: layers moved, chunks or group size changed (null counts
    as what it means: no extra stage, VP 1, N = PP)."""
    meaning = {"first": 0, "last": 0, "vp": 1}
    total = 0
    for var in _ORDER:
        old, new = getattr(cur, var), getattr(lay, var)
        if old != new:
            none = meaning.get(var, lay.pp)
            total += abs((none if new is None else new) - (none if old is None else old))
    return total


def _layouts(fixed: Fixed, cur: Layout, changed: Sequence[str]) -> Iterator[Layout]:
    # Several at once: only the nearest values of each (a suggestion is never worth a hang).
    width = {1: None, 2: 24, 3: 4, 4: 4}[len(changed)]
    others = [var for var in changed if var != "n"]
    pools = [_candidates(var, fixed, cur)[:width] for var in others]
    base = {var: getattr(cur, var) for var in _ORDER}
    for values in itertools.product(*pools):
        base.update(zip(others, values))
        if "n" not in changed:
            yield Layout(**base)
            continue
        # Up to three settings at once, N next to the PP of this layout, not the given one:
        # megatron-core asks PP <= N, so with PP going from 1 to 5 the N nearest 1 (2, 3, 4)
        # never fit, and 8 does (LLaMA-1 13B on 20 nodes kept its batch of 2048). Four at
        # once keep N near the given PP: wider, they would trade a node count for PP, both
        # end stages and N together, further from what the user wrote.
        pp = base["pp"] if len(changed) <= 3 else None
        for n in _n_candidates(fixed, cur, pp)[:width]:
            yield Layout(**{**base, "n": n})


def search(fixed: Fixed, cur: Layout) -> Optional[Layout]:
    """The valid layout nearest ``cur`` changing the fewest settings (None: none found)."""
    if layout_problem(fixed, cur) is None:
        return cur
    tried = 0
    for size in range(1, _MAX_CHANGED + 1):
        best: Optional[Tuple[Tuple[int, int], Layout]] = None
        for changed in itertools.combinations([v for v in _ORDER if v in fixed.changeable],
                                              size):
            for lay in _layouts(fixed, cur, changed):
                tried += 1
                if tried > _MAX_TRIED:
                    return best[1] if best else None
                if layout_problem(fixed, lay) is None:
                    # the least disruptive settings first (N before the split, VP, PP), then
                    # the nearest values
                    rank = (sum(_ORDER.index(v) for v in changed), _distance(cur, lay))
                    if best is None or rank < best[0]:
                        best = (rank, lay)
                    if size == 1:
                        break  # one setting: candidates come nearest first
        if best is not None:
            return best[1]
    return None


def layout_inputs(ctx: CheckContext) -> Optional[Tuple[Fixed, Layout]]:
    """(fixed, current layout) when every value they need is valid, else None."""
    m = ctx.model
    layers, pp, tp, cp = m.peek_int("num_layers"), ctx.pp(), ctx.tp(), ctx.cp()
    ep, etp = ctx.ep(), ctx.etp()
    if None in (layers, pp, tp, cp, ep, etp):
        return None
    # An invalid VP (0, a string, Megatron-LM's layers per virtual stage that do not divide) is
    # reported by its own rule; the search starts from no VP and chooses one, so the other rules
    # still get a layout fix (not a world-size or batch change the layout does not need).
    vp = ctx.vp()
    values: Dict[str, Any] = {}
    # what the version checked against lacks is reported by its own rule (rules/version.py)
    # and read as that version reads it: absent
    lacking = ({"n"} if ctx.legacy() else set()) | (
        set() if ctx.has_stage_split() else {"first", "last"})
    for var in ("first", "last", "n"):
        value = m.get(KEYS[var])
        value = None if value is ABSENT or var in lacking else value
        if value is not None and not (type(value) is int and value >= 1):
            return None
        values[var] = value
    flags = []
    for key in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        value = m.get(key) if ctx.mcore is None or ctx.mcore.split_accounting else ABSENT
        if value is not ABSENT and not isinstance(value, bool):
            return None
        flags.append(value is True)
    if ctx.trainer is not None and ctx.trainer.get("devices") not in (ABSENT, -1, "auto", "-1") \
            and ctx.world() is None:
        return None  # invalid devices / num_nodes: reported by their own rule
    changeable = tuple(v for v in (("n",) if ctx.layout_string() else Fixed.changeable)
                       if v not in lacking)
    fixed = Fixed(layers, ctx.world(), tp, cp, flags[0], flags[1],
                  m.peek_int("micro_batch_size"), m.peek_int("global_batch_size"),
                  ctx.given_data_parallel() if ctx.world() is None else None, ep, etp,
                  nemo=ctx.nemo, changeable=changeable, legacy=ctx.legacy(),
                  min_pp=ctx.min_interleaved_pp())
    return fixed, Layout(pp, vp, values["first"], values["last"], values["n"])


def layout_fix(ctx: CheckContext) -> Optional[Dict[str, Any]]:
    """{model key: new value} of the nearest layout that fits (empty: the current one fits;
    None: no layout change fits, or a value it needs is invalid). Computed once per check."""
    cache = ctx.cache
    if "layout_fix" not in cache:
        inputs = layout_inputs(ctx)
        found = search(*inputs) if inputs is not None else None
        change = None if found is None else {
            KEYS[var]: getattr(found, var) for var in _ORDER
            if getattr(found, var) != getattr(inputs[1], var)}
        if change is None and inputs is not None:
            change = _cause_fix(ctx, *inputs)
        cache["layout_fix"] = change
    return cache["layout_fix"]


def micro_batch_layout_fix(ctx: CheckContext, mbs: int) -> Optional[Dict[str, Any]]:
    """{model key: new value} of the nearest layout that fits with micro batch ``mbs`` (which
    keeps the global batch; the caller tries the smaller ones), None when none does."""
    inputs = layout_inputs(ctx)
    if inputs is None:
        return None
    fixed, cur = inputs
    found = search(replace(fixed, mbs=mbs), cur)
    return None if found is None else {
        KEYS[var]: getattr(found, var) for var in _ORDER
        if getattr(found, var) != getattr(cur, var)}


def smaller_micro_batch_layout(ctx: CheckContext) -> Optional[Tuple[int, Dict[str, Any]]]:
    """(micro batch, {model key: new value}): the largest of the next 8 micro batches below the
    given one with which a layout fits (the model and the global batch kept), or None. Tried
    where no layout fits as given, before the global batch or the layer count change; shared by
    the layer-split and the microbatch rules so that their fixes agree. Computed once."""
    cache = ctx.cache
    if "smaller_micro_batch_layout" not in cache:
        mbs = ctx.model.peek_int("micro_batch_size")
        found = None
        for smaller in range(mbs - 1, max(mbs - 9, 0), -1) if mbs else ():
            change = micro_batch_layout_fix(ctx, smaller)
            if change is not None:
                found = (smaller, change)
                break
        cache["smaller_micro_batch_layout"] = found
    return cache["smaller_micro_batch_layout"]


def _tp_fits(ctx: CheckContext, tp: int) -> bool:
    """TP divides the sizes megatron-core splits over it (those the config gives)."""
    sizes = [ctx.model.peek_int(k) for k in ("num_attention_heads", "num_query_groups",
                                             "hidden_size", "ffn_hidden_size")]
    return all(size is None or size % tp == 0 for size in sizes)


def _cause_fix(ctx: CheckContext, fixed: Fixed, cur: Layout) -> Optional[Dict[str, Any]]:
    """Where TP or CP is the cause (TP * CP divides no world of this size, or fills it while
    the PP is the plugin's least, so no PP >= 2 can fit): the nearest TP (a divisor of the GPUs per node that divides the heads and
    hidden sizes) or CP (the sequence a multiple of 2 * CP, as Megatron-LM asserts) with which
    a layout fits, and that layout. CP first where TP divides the world (as given, TP is then
    not what breaks the division), TP where it does not or no CP fits. None: neither is the
    cause, or no value fits."""
    world = fixed.world
    if world is None:
        return None
    mp = fixed.tp * fixed.cp
    # "fills it": TP * CP alone is the world, and the PP is at most the plugin's least (2);
    # a larger PP given for more processes says the world is what is off, not TP or CP
    fills = world // mp < 2 and cur.pp <= 2
    if world % mp == 0 and not fills:
        return None
    seq = ctx.model.peek_int("encoder_seq_length")
    tries = [("tensor_model_parallel_size", fixed.tp, ctx.devices() or world,
              lambda t: world % (t * fixed.cp) == 0 and _tp_fits(ctx, t))]
    if world % fixed.tp == 0:
        tries.insert(0, ("context_parallel_size", fixed.cp, world // fixed.tp,
                         lambda c: c == 1 or seq is None or seq % (2 * c) == 0))
    for key, old, span, ok in tries:
        var = "tp" if key.startswith("tensor") else "cp"
        for value in sorted((v for v in range(1, min(span, 64) + 1)
                             if span % v == 0 and v != old and ok(v)),
                            key=lambda v: (abs(v - old), v)):
            found = search(replace(fixed, **{var: value}), cur)
            if found is not None:
                return {key: value, **{KEYS[v]: getattr(found, v) for v in _ORDER
                                       if getattr(found, v) != getattr(cur, v)}}
    return None


def layout_overrides(ctx: CheckContext, change: Dict[str, Any]) -> str:
    """The change as Hydra overrides for the config being checked (``+`` for an absent key)."""
    return " ".join(ctx.model.override(key, value, present=ctx.model.get(key) is not ABSENT)
                    for key, value in change.items())
