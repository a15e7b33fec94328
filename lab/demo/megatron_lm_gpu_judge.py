"""The checks of ``demo --loop megatron-lm --device cuda``, read from what each rank saw of
Transformer Engine's own transpose builds (``GpuBook``: its watch on ``_create_transpose``, the
first use of each chunk, the schedule's forwards) and cross-checked with the plugin's records.

Per rank, step and chunk (a job's first iteration runs without launches and is left out): every
FP8 weight's transpose built once in the step (once or twice where an evaluation's forced
all-gather before the step built it already); under ``aligned`` every transpose valid at the
chunk's first forward, the builds inside the plugin's slot window, one plugin record each. Each
build's place among the rank's forwards (its observed position) is turned into the schedule slot
it stands for; it must be the one the policy gives (``aligned``: the chunk's aligned slot, the
same on every pipeline rank; ``lazy`` / ``off``: the chunk's first use), and under ``aligned``
every rank's observed slot must be equal.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Dict, List, Sequence, Set, Tuple

from nemo_fp8_align.core.observe import _slot, expected_position
from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.core.telemetry import record_problems

__all__ = ["gpu_problems", "observed_slots"]


def _position(t: float, forwards: Sequence[Sequence[float]]) -> Tuple[int, bool]:
    """(forwards finished before ``t``, whether one was running at ``t``)."""
    finished = sum(1 for _, t0, t1 in forwards if t1 <= t)
    started = sum(1 for _, t0, t1 in forwards if t0 <= t)
    return finished, started > finished


def _skipped(opts: Any) -> Set[int]:
    """Each job's first iteration (no launches: Megatron-LM binds no param_sync_func)."""
    return {0} | ({opts.resume_at} if opts.resume_at else set())


def observed_slots(opts: Any, rank: Dict[str, Any]) -> Dict[Tuple[int, int], Set[int]]:
    """(step, chunk) -> the schedule slots at which this rank's in-step builds were seen."""
    schedule = InterleavedSchedule(opts.pp, opts.vp, opts.microbatches, opts.group_size)
    forwards = defaultdict(list)
    for f in rank["forwards"]:
        forwards[int(f[0])].append(f)
    out: Dict[Tuple[int, int], Set[int]] = defaultdict(set)
    for e in rank["events"]:
        if e["kind"] == "build" and e["phase"] == "fwd_bwd" and e["step"] not in _skipped(opts):
            pos = _position(e["t"], forwards[e["step"]])
            aligned = schedule.aligned_slot(e["chunk"])
            out[(e["step"], e["chunk"])].add(_slot(pos, rank["pp_rank"], aligned))
    return out


def _build_problems(opts: Any, rank: Dict[str, Any], step: int, chunk: int) -> List[str]:
    events = rank["events"]
    here = Counter(e["weight"] for e in events if e["kind"] == "build" and e["step"] == step
                   and e["phase"] == "fwd_bwd" and e["chunk"] == chunk)
    before = Counter(e["weight"] for e in events if e["kind"] == "build" and e["step"] == step - 1
                     and e["phase"] == "eval" and e["chunk"] == chunk)
    n = rank["weights"][chunk]
    where = f"rank {rank['rank']} step {step} chunk {chunk}"
    if before:  # an evaluation's forced all-gather built them between the steps
        total = before + here
        if len(total) != n or any(v > 2 for v in total.values()) or any(v > 1 for v in
                                                                           here.values()):
            return [f"{where}: builds per weight {dict(here)} in the step, {dict(before)} "
                    f"before it (expected each of {n} weights once or twice in all)"]
        return []
    if len(here) != n or any(v != 1 for v in here.values()):
        return [f"{where}: builds per weight {dict(here)} (expected each of {n} weights once)"]
    return []


def _aligned_problems(rank: Dict[str, Any], step: int, chunk: int,
                      records: Dict[Tuple[int, int], Dict[str, Any]]) -> List[str]:
    where = f"rank {rank['rank']} step {step} chunk {chunk}"
    flags = rank["first_use_valid"].get(str(step), {}).get(str(chunk))
    problems = [] if flags and all(flags) else [f"{where}: transposes valid at first use: {flags}"]
    rec = records.get((step, chunk))
    if rec is None:
        return problems + [f"{where}: no plugin record"]
    lo, hi = rec.get("t_slot"), rec.get("t_done")
    outside = [e for e in rank["events"] if e["kind"] == "build" and e["phase"] == "fwd_bwd"
               and e["step"] == step and e["chunk"] == chunk
               and (lo is None or hi is None or not lo <= e["t"] <= hi)]
    if outside:
        problems.append(f"{where}: {len(outside)} TE builds outside the plugin's slot window "
                        f"[{lo}, {hi}]")
    return problems


def gpu_problems(opts: Any, ranks: List[Dict[str, Any]]) -> List[str]:
    """Every check above that fails, as sentences (empty: all hold)."""
    policy = getattr(opts.policy, "value", opts.policy)
    schedule = InterleavedSchedule(opts.pp, opts.vp, opts.microbatches, opts.group_size)
    problems: List[str] = []
    types = sorted({t for r in ranks for t in r["weight_types"]})
    if types != ["Float8Tensor"]:
        problems.append(f"FP8 weight types {types}, expected Transformer Engine's Float8Tensor")
    slots: Dict[Tuple[int, int], Dict[int, Set[int]]] = defaultdict(dict)
    for r in ranks:
        records = {(x["step"], x["chunk"]): x for x in r["records"]}
        for (step, chunk), seen in observed_slots(opts, r).items():
            slots[(step, chunk)][r["rank"]] = seen
            # Plugin off: TE builds at first use, where lazy observes them.
            pos = expected_position(schedule, "lazy" if policy == "off" else policy,
                                    r["pp_rank"], chunk)
            want = _slot(pos, r["pp_rank"], schedule.aligned_slot(chunk))
            if seen != {want}:
                problems.append(f"rank {r['rank']} step {step} chunk {chunk}: TE built the "
                                f"transposes at slot(s) {sorted(seen)}; {policy} means {want}")
        for step in range(opts.steps):
            if step in _skipped(opts):
                continue
            for chunk in range(opts.vp):
                problems += _build_problems(opts, r, step, chunk)
                if policy == "aligned":
                    problems += _aligned_problems(r, step, chunk, records)
        if policy != "off":
            problems += [f"rank {r['rank']}: {p}" for p in
                         record_problems(r["records"], policy=policy, observed_builds=False)]
            launched = opts.steps - len(_skipped(opts) & set(range(opts.steps)))
            if len(r["records"]) != launched * opts.vp:
                problems.append(f"rank {r['rank']}: {len(r['records'])} plugin records, "
                                f"expected {launched * opts.vp}")
    if policy == "aligned":
        for key, by_rank in sorted(slots.items()):
            if len({frozenset(s) for s in by_rank.values()}) != 1:
                problems.append(f"step {key[0]} chunk {key[1]}: observed slots differ across "
                                f"ranks: {by_rank}")
    return problems
