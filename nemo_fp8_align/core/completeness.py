"""Which telemetry records should exist, and whether the ranks agree on each chunk's slot.

:func:`~nemo_fp8_align.core.telemetry.record_problems` judges the records it is given; this
module judges what is *not* there. The records carry the parallel sizes and the schedule shape
(``pp_size``, ``vp_size``, ``dp_size``, ``world_size``, ``microbatches``, ``group_size``), so every
(step, chunk, pp_rank, dp_rank) of the steps seen must have a record, every global rank of the
world must have written some, and every rank must name the same aligned slot for a chunk in a
step. Records written before the sizes existed are held to the ranks and chunks they show.

The writer does not say how many steps a run had: the expectation comes from the records
themselves. Every record of a run states the same shape (one M, PP, VP, DP, world); every global
rank lies inside the world and keeps one pipeline / data-parallel position; each process (a
global rank's ``run``) numbers its steps one after another, by its own clock (``t_slot`` grows
with the step); a step with no record on any rank is missing when some process ran steps on
both sides of it (between two processes' steps it is a step after a checkpoint load, which runs
without launches: :func:`unseen_steps`); and a run that observed its builds (``obs_*``) observed
them in every record. Sizes are counted, never enumerated, so an absurd ``world_size`` ends as
quickly as a real one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

__all__ = ["completeness_problems", "unseen_steps", "observed_all", "MAX_LISTED", "SHAPE_KEYS"]

#: Missing records named one by one; beyond this many, the rest are counted.
MAX_LISTED = 64
#: The fields every record of one run states alike (the run's shape and world).
SHAPE_KEYS = ("pp_size", "vp_size", "dp_size", "world_size", "microbatches", "group_size",
              "legacy_order")
#: A record's observed builds (all null or absent: not observed).
OBSERVED = ("obs_built", "obs_at", "obs_slot")


def _who(r: Mapping) -> Any:
    """Who wrote ``r``: its global rank, else its (pipeline, data-parallel) position."""
    rank = r.get("rank", -1)
    return rank if rank is not None and rank >= 0 else (r["pp_rank"], r["dp_rank"])


def _named(who: Set[Any]) -> str:
    ranks = sorted(w for w in who if isinstance(w, int))
    places = sorted(w for w in who if not isinstance(w, int))
    parts = []
    if ranks:
        parts.append(("rank " if len(ranks) == 1 else "ranks ") + _listed([str(k) for k in ranks]))
    if places:
        parts.append("pp/dp ranks " + _listed([f"{p}/{d}" for p, d in places]))
    return "; ".join(parts)


def _listed(items: Sequence[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (" ..." if len(items) > limit else "")


def _shape(records: Sequence[Mapping], problems: List[str]) -> Dict[str, Any]:
    """The one value of each :data:`SHAPE_KEYS` field over the records (None when none carries
    it); a disagreement, or a field some records carry and others lack, is a problem that names
    who said what."""
    out: Dict[str, Any] = {}
    for key in SHAPE_KEYS:
        said: Dict[Any, Set[Any]] = defaultdict(set)
        lacking = 0
        for r in records:
            value = r.get(key)
            if value is None and key not in ("group_size",):  # group_size null: legacy or N=PP
                lacking += 1
                continue
            said[value].add(_who(r))
        if not said:
            out[key] = None
            continue
        if len(said) > 1:
            parts = []
            for value, who in sorted(said.items(), key=lambda kv: str(kv[0])):
                parts.append(f"{value} ({_named(who)})")
            problems.append(f"records disagree on {key}: {', '.join(parts)} (one run has one "
                            "value on every rank: files of several runs or jobs, or altered "
                            "records; pass the files of one run)")
        if lacking and key != "legacy_order":
            problems.append(f"{lacking} of {len(records)} records without {key} where the "
                            "others carry it (one writer writes it in every record: files of "
                            "several versions, or altered records)")
        out[key] = sorted(said, key=str)[-1]
    return out


def _absent(size: Optional[int], seen: Set[int]) -> Tuple[int, Iterator[int]]:
    """How many of ``range(size)`` are not in ``seen``, and those numbers, lazily: a size of
    10**15 is counted, never listed in full."""
    if size is None:
        return 0, iter(())
    inside = sum(1 for k in seen if 0 <= k < size)
    return size - inside, (k for k in range(size) if k not in seen)


def _extent(size: Optional[int], seen: Set[int]) -> Tuple[int, Iterator[int]]:
    """(count, values) of ``range(size)`` together with ``seen`` (a value outside the size is
    judged elsewhere but still expected in every step), lazily."""
    if size is None:
        return len(seen), iter(sorted(seen))
    extra = sorted(k for k in seen if not 0 <= k < size)
    return size + len(extra), _chain(range(size), extra)


def _chain(*parts) -> Iterator[int]:
    for part in parts:
        yield from part


def _missing_positions(records: Sequence[Mapping], shape: Dict[str, Any]) -> List[str]:
    steps = sorted({r["step"] for r in records})
    have = {(r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]) for r in records}
    out = []
    for key, size_key, what, short in (("pp_rank", "pp_size", "pipeline rank", "PP"),
                                       ("dp_rank", "dp_size", "data-parallel rank", "DP")):
        seen = {r[key] for r in records}
        count, absent = _absent(shape[size_key], seen)
        total = shape[size_key] if shape[size_key] is not None else len(seen)
        for k in _take(absent, min(count, MAX_LISTED)):
            out.append(f"{what} {k} wrote no records (of {short}={total})")
        if count > MAX_LISTED:
            out.append(f"... and {count - MAX_LISTED} more {what}s that wrote no records")
    seen = {size_key: {r[key] for r in records} for key, size_key in
            (("chunk", "vp_size"), ("pp_rank", "pp_size"), ("dp_rank", "dp_size"))}
    counts = {k: _extent(shape[k], v)[0] for k, v in seen.items()}
    missing = len(steps) * counts["vp_size"] * counts["pp_size"] * counts["dp_size"] - len(have)
    if missing <= 0:
        return out
    listed: List[str] = []

    def positions() -> Iterator[Tuple[int, int, int, int]]:  # lazily, whatever the sizes
        for s in steps:
            for c in _extent(shape["vp_size"], seen["vp_size"])[1]:
                for p in _extent(shape["pp_size"], seen["pp_size"])[1]:
                    for d in _extent(shape["dp_size"], seen["dp_size"])[1]:
                        yield s, c, p, d

    for s, c, p, d in positions():
        if (s, c, p, d) not in have:
            listed.append(f"missing record: step {s} chunk {c} pp rank {p} dp rank {d}")
            if len(listed) == MAX_LISTED:
                break
    out += listed
    if missing > len(listed):
        out.append(f"... and {missing - len(listed)} more missing records")
    return out


def _take(items: Iterator[int], n: int) -> List[int]:
    out = []
    for item in items:
        if len(out) >= n:
            break
        out.append(item)
    return out


def _process(r: Mapping) -> Tuple[Any, ...]:
    """One process's records: a global rank's aligner (``run``); without a global rank, its
    pipeline / data-parallel position."""
    rank = r.get("rank", -1)
    return (rank, r.get("run", "")) if rank is not None and rank >= 0 else \
        (-1, r.get("run", ""), r["pp_rank"], r["dp_rank"])


def _span_text(lo: int, hi: int) -> str:
    return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"


def _step_gaps(records: Sequence[Mapping]) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """The runs of steps with no record on any rank between the first and the last: (inside a
    process's own steps, so missing; between processes, so not observed)."""
    steps = sorted({r["step"] for r in records})
    spans: Dict[Tuple[Any, ...], List[int]] = {}
    for r in records:
        lo_hi = spans.setdefault(_process(r), [r["step"], r["step"]])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], r["step"]), max(lo_hi[1], r["step"])
    inside, between = [], []
    for a, b in zip(steps, steps[1:]):
        if b > a + 1:
            spanned = any(lo <= a and b <= hi for lo, hi in spans.values())
            (inside if spanned else between).append((a + 1, b - 1))
    return inside, between


def unseen_steps(records: Sequence[Mapping]) -> List[Tuple[int, int]]:
    """Runs of steps (first, last) that no rank recorded, between two processes' steps (a job
    resumed from a checkpoint: the step after the load runs without launches): not seen, not
    judged, and not a failure."""
    return _step_gaps(records)[1]


def _step_problems(records: Sequence[Mapping]) -> List[str]:
    steps = sorted({r["step"] for r in records})
    inside, _ = _step_gaps(records)
    out = [f"{_span_text(lo, hi)}: no record on any rank (the records run from step {steps[0]} "
           f"to step {steps[-1]}, and a rank's run has steps on both sides: a step deleted or "
           "renumbered?)" for lo, hi in inside[:MAX_LISTED]]
    if len(inside) > MAX_LISTED:
        out.append(f"... and {len(inside) - MAX_LISTED} more runs of steps with no record")
    return out


def _clock_problems(records: Sequence[Mapping]) -> List[str]:
    """Per process and chunk, the slot's time (``t_slot``, one monotonic clock per host) grows
    with the step: a step renumbered past others shows as one that ran before them."""
    series: Dict[Tuple[Any, ...], List[Tuple[int, float]]] = defaultdict(list)
    for r in records:
        if r.get("t_slot") is not None:
            series[(_process(r), r["chunk"])].append((r["step"], r["t_slot"]))
    out: List[str] = []
    told: Set[Tuple[Any, ...]] = set()
    for (process, chunk), points in sorted(series.items(), key=lambda kv: str(kv[0])):
        points.sort()
        for (s0, t0), (s1, t1) in zip(points, points[1:]):
            if s1 != s0 and t1 < t0 and process not in told:
                told.add(process)
                who = (f"global rank {process[0]} (run {process[1] or '-'})" if process[0] >= 0
                       else f"pp/dp rank {process[2]}/{process[3]}")
                out.append(f"{who}: step {s1} ran before step {s0} by the rank's own clock "
                           f"(chunk {chunk}'s slot at t_slot {t1:.6f} < {t0:.6f}): steps "
                           "renumbered?")
    return out


def _rank_problems(records: Sequence[Mapping], shape: Dict[str, Any]) -> List[str]:
    """Global ranks: inside the world, one position each, every rank of the world wrote
    records, each for every (step, chunk)."""
    world, pp, dp = shape["world_size"], shape["pp_size"], shape["dp_size"]
    ranks: Dict[int, Set[Tuple[int, int]]] = defaultdict(set)
    places: Dict[int, Set[Tuple[int, int]]] = defaultdict(set)
    per_position: Dict[Tuple[int, int, int, int], Set[int]] = defaultdict(set)
    for r in records:
        rank = r.get("rank", -1)
        if rank is not None and rank >= 0:
            ranks[rank].add((r["step"], r["chunk"]))
            places[rank].add((r["pp_rank"], r["dp_rank"]))
            per_position[(r["step"], r["chunk"], r["pp_rank"], r["dp_rank"])].add(rank)
    out = []
    if world is not None:
        outside = sorted(k for k in ranks if k >= world)
        out += [f"global rank {k}: outside the world of {world} ranks (world_size {world}, "
                f"ranks 0-{world - 1}): records of another job, or altered"
                for k in outside[:MAX_LISTED]]
        count, absent = _absent(world, set(ranks))
        if count:
            shown = _take(absent, MAX_LISTED)
            out.append(f"{count} of {world} global ranks wrote no records (ranks "
                       f"{', '.join(map(str, shown))}{' ...' if count > len(shown) else ''}): "
                       "pass every rank's file, e.g. 'telemetry.rank{rank}.jsonl'")
    for rank, where in sorted(places.items()):
        if len(where) > 1:
            out.append(f"global rank {rank}: at more than one pipeline/data-parallel position "
                       f"(pp/dp {', '.join(f'{p}/{d}' for p, d in sorted(where))}); a process "
                       "keeps its position: records of several jobs, or altered")
    if world is not None and pp is not None and dp is not None and ranks:
        if world % (pp * dp):
            out.append(f"world_size {world} is not a multiple of pp_size x dp_size = {pp} x {dp}"
                       " (every pipeline/data-parallel position has the same number of ranks)")
        else:
            each = world // (pp * dp)
            crowded = [(k, v) for k, v in sorted(per_position.items()) if len(v) > each]
            for (s, c, p, d), who in crowded[:8]:
                out.append(f"step {s} chunk {c} pp rank {p} dp rank {d}: records of {len(who)} "
                           f"global ranks ({', '.join(map(str, sorted(who)))}), but a world of "
                           f"{world} ranks has {each} per pipeline/data-parallel position")
            if len(crowded) > 8:
                out.append(f"... and {len(crowded) - 8} more positions with too many ranks")
    wanted = {(r["step"], r["chunk"]) for r in records}
    for rank, got in sorted(ranks.items()):
        gaps = sorted(wanted - got)
        if gaps:
            out.append(f"global rank {rank}: no record for (step, chunk) "
                       + ", ".join(map(str, gaps[:8])) + (" ..." if len(gaps) > 8 else ""))
    return out


def observed_all(records: Sequence[Mapping]) -> Optional[bool]:
    """True when every record carries its observed builds, False when none does, None when
    some do and some do not (a problem: :func:`completeness_problems` names it)."""
    seen = [any(r.get(k) is not None for k in OBSERVED) for r in records]
    return True if all(seen) else False if not any(seen) else None


def _observation_problems(records: Sequence[Mapping]) -> List[str]:
    """A run observes its builds in every record or in none (telemetry on turns observation on
    for the aligner's whole life): records without them beside records with them hide where
    their builds ran."""
    if observed_all(records) is not None:
        return []
    bare = [r for r in records if all(r.get(k) is None for k in OBSERVED)]
    first = bare[0]
    return [f"{len(bare)} of {len(records)} records carry no observed builds "
            f"({'/'.join(OBSERVED)} missing or null) where the run's other records have them "
            f"(the run observed every step: altered records?), first step {first['step']} chunk "
            f"{first['chunk']} pp rank {first['pp_rank']} dp rank {first['dp_rank']}"]


def _disagreements(records: Sequence[Mapping]) -> List[str]:
    slots: Dict[Tuple[int, int], Dict[int, Set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in records:
        slots[(r["step"], r["chunk"])][r["aligned_slot"]].add(f"{r['pp_rank']}/{r['dp_rank']}")
    out = []
    for (step, chunk), by_slot in sorted(slots.items()):
        if len(by_slot) > 1:
            said = "; ".join(f"slot {s} by pp/dp ranks {', '.join(sorted(who))}"
                             for s, who in sorted(by_slot.items()))
            out.append(f"step {step} chunk {chunk}: ranks disagree on the aligned slot: {said}")
    return out


def completeness_problems(records: Sequence[Mapping]) -> List[str]:
    """Every record that should exist and does not, every absent or misplaced rank, every
    disagreement between ranks (on the run's shape, on a chunk's aligned slot), steps out of
    order by a rank's clock, and observations missing from some records (empty when the
    records are complete)."""
    problems: List[str] = []
    if not records:
        return ["no records"]
    shape = _shape(records, problems)
    problems += _step_problems(records)
    problems += _clock_problems(records)
    problems += _missing_positions(records, shape)
    problems += _rank_problems(records, shape)
    problems += _observation_problems(records)
    problems += _disagreements(records)
    return problems
