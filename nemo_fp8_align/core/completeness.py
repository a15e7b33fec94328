"""Which telemetry records should exist, and whether the ranks agree on each chunk's slot.

:func:`~nemo_fp8_align.core.telemetry.record_problems` judges the records it is given; this
module judges what is *not* there. The records carry the parallel sizes and the schedule shape
(``pp_size``, ``vp_size``, ``dp_size``, ``world_size``, ``microbatches``, ``group_size``), so every
(step, chunk, pp_rank, dp_rank) of the steps seen must have a record, every global rank of the
world must have written some, and every rank must name the same aligned slot for a chunk in a
step. Records written before the sizes existed are held to the ranks and chunks they show.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Mapping, Sequence, Set, Tuple

__all__ = ["completeness_problems", "MAX_LISTED"]

#: Missing records named one by one; beyond this many, the rest are counted.
MAX_LISTED = 64


def _size(records: Sequence[Mapping], key: str, problems: List[str]):
    """The one value of ``key`` over the records (None when none carries it)."""
    values = sorted({r.get(key) for r in records if r.get(key) is not None})
    if len(values) > 1:
        problems.append(f"records disagree on {key}: {', '.join(map(str, values))} (files of "
                        "several runs or jobs? pass the files of one run)")
    return values[-1] if values else None


def _expected(records: Sequence[Mapping], key: str, size_key: str, problems: List[str]) -> List[int]:
    size = _size(records, size_key, problems)
    seen = {r[key] for r in records}
    return sorted(seen | set(range(size))) if size is not None else sorted(seen)


def _missing_positions(records: Sequence[Mapping], problems: List[str]) -> List[str]:
    steps = sorted({r["step"] for r in records})
    chunks = _expected(records, "chunk", "vp_size", problems)
    pps = _expected(records, "pp_rank", "pp_size", problems)
    dps = _expected(records, "dp_rank", "dp_size", problems)
    have = {(r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]) for r in records}
    out = []
    for pp in pps:
        if not any(r["pp_rank"] == pp for r in records):
            out.append(f"pipeline rank {pp} wrote no records (of PP={len(pps)})")
    for dp in dps:
        if not any(r["dp_rank"] == dp for r in records):
            out.append(f"data-parallel rank {dp} wrote no records (of DP={len(dps)})")
    missing = [(s, c, p, d) for s in steps for c in chunks for p in pps for d in dps
               if (s, c, p, d) not in have]
    out += [f"missing record: step {s} chunk {c} pp rank {p} dp rank {d}"
            for s, c, p, d in missing[:MAX_LISTED]]
    if len(missing) > MAX_LISTED:
        out.append(f"... and {len(missing) - MAX_LISTED} more missing records")
    return out


def _rank_problems(records: Sequence[Mapping], problems: List[str]) -> List[str]:
    """Global ranks: every rank of the world wrote records, each for every (step, chunk)."""
    world = _size(records, "world_size", problems)
    ranks: Dict[int, Set[Tuple[int, int]]] = defaultdict(set)
    for r in records:
        if r.get("rank", -1) >= 0:
            ranks[r["rank"]].add((r["step"], r["chunk"]))
    out = []
    if world is not None:
        absent = [k for k in range(world) if k not in ranks]
        if absent:
            shown = ", ".join(map(str, absent[:MAX_LISTED])) + (" ..." if len(absent) > MAX_LISTED else "")
            out.append(f"{len(absent)} of {world} global ranks wrote no records (ranks {shown}): "
                       "pass every rank's file, e.g. 'telemetry.rank{rank}.jsonl'")
    wanted = {(r["step"], r["chunk"]) for r in records}
    for rank, got in sorted(ranks.items()):
        gaps = sorted(wanted - got)
        if gaps:
            out.append(f"global rank {rank}: no record for (step, chunk) "
                       + ", ".join(map(str, gaps[:8])) + (" ..." if len(gaps) > 8 else ""))
    return out


def _disagreements(records: Iterable[Mapping]) -> List[str]:
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
    """Every record that should exist and does not, every absent rank, every disagreement
    between ranks on a chunk's aligned slot (empty when the records are complete)."""
    problems: List[str] = []
    if not records:
        return ["no records"]
    problems += _missing_positions(records, problems)
    problems += _rank_problems(records, problems)
    problems += _disagreements(records)
    return problems
