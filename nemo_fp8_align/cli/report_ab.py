"""``report A --baseline B``: two runs of one configuration side by side, e.g. ``aligned`` (A)
against ``lazy`` (B): per chunk, how far apart the pipeline ranks had its transposes (slot skew,
observed where recorded), the all-gather wait at the slot and the slot-to-valid time (medians),
and the transposes built per step; then each run's verdict."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

from nemo_fp8_align.cli.report_fields import completeness_judged
from nemo_fp8_align.cli.report_plot import shown_slot

__all__ = ["ab_summary", "chunk_figures"]


def _median_ms(values: List[float]) -> Optional[float]:
    return 1e3 * statistics.median(values) if values else None


def chunk_figures(records: List[dict]) -> Dict[int, Dict[str, Optional[float]]]:
    """Per chunk: ``skew`` (largest slot spread over the pipeline ranks in any step and
    data-parallel rank), ``wait_ms``, ``valid_ms`` (medians) and ``built`` (per step)."""
    by_chunk: Dict[int, List[dict]] = defaultdict(list)
    for r in records:
        by_chunk[r["chunk"]].append(r)
    out: Dict[int, Dict[str, Optional[float]]] = {}
    for chunk, recs in sorted(by_chunk.items()):
        spread: Dict[Tuple[int, int], List[int]] = defaultdict(list)
        for r in recs:
            spread[(r["step"], r["dp_rank"])].append(shown_slot(r))
        steps = len({r["step"] for r in recs})
        out[chunk] = {
            "skew": float(max(max(v) - min(v) for v in spread.values())),
            "wait_ms": _median_ms([r["t_gathered"] - r["t_slot"] for r in recs
                                   if r.get("t_gathered") is not None and r.get("t_slot") is not None]),
            "valid_ms": _median_ms([r["t_done"] - r["t_slot"] for r in recs
                                    if r.get("t_done") is not None and r.get("t_slot") is not None]),
            "built": sum(r["transposed"] if r.get("obs_built") is None else r["obs_built"]
                         for r in recs) / max(steps, 1),
        }
    return out


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict_b(b: List[dict], problems: List[str]) -> str:
    if problems:
        return f"{len(problems)} problems"
    return "OK" if completeness_judged(b) is None else "OK, completeness not judged (no sizes)"


def _source(a: List[dict], b: List[dict]) -> str:
    """Which slot the skew column is from, per run."""
    seen = ["observed" if any(r.get("obs_slot") is not None for r in run) else "reported"
            for run in (a, b)]
    return (f"{seen[0]} slots" if seen[0] == seen[1]
            else f"A's {seen[0]}, B's {seen[1]} slots")


def _skew_note(name: str, policy: str, figures: Dict[int, Dict[str, Optional[float]]]) -> str:
    """What the run's skews say: the same slot on every rank, or how far apart, on which chunks."""
    skewed = {c: int(f["skew"] or 0) for c, f in figures.items() if f["skew"]}
    if not skewed:
        return f"{name} ({policy}): 0 on every chunk, every pipeline rank at the same slot"
    chunks = ", ".join(map(str, sorted(skewed)))
    most = max(skewed.values())
    return (f"{name} ({policy}): pipeline ranks up to {most} slot{'s' if most != 1 else ''} "
            f"apart on chunk{'s' if len(skewed) > 1 else ''} {chunks}")


def ab_summary(a: List[dict], b: List[dict],
               judge: Callable[[List[dict]], List[str]]) -> Tuple[str, List[str]]:
    """The A/B table and B's problems (A's are judged by the caller)."""
    fa, fb = chunk_figures(a), chunk_figures(b)
    pa, pb = a[0]["policy"], b[0]["policy"]
    rows = [f"A/B: A = this run (policy {pa}, {len(a)} records), B = baseline (policy {pb}, "
            f"{len(b)} records)",
            f"{'chunk':<6}{'slot skew A/B':>16}{'all-gather wait ms A/B':>26}"
            f"{'slot->valid ms A/B':>24}{'built per step A/B':>22}"]
    for chunk in sorted(set(fa) | set(fb)):
        x, y = fa.get(chunk, {}), fb.get(chunk, {})
        pair = lambda k, d: f"{_cell(x.get(k), d)} / {_cell(y.get(k), d)}"  # noqa: E731
        rows.append(f"{chunk:<6}{pair('skew', 0):>16}{pair('wait_ms', 3):>26}"
                    f"{pair('valid_ms', 3):>24}{pair('built', 0):>22}")
    problems_b = judge(b)
    rows.append(f"(slot skew: largest minus smallest slot over the pipeline ranks, "
                f"{_source(a, b)}; {_skew_note('A', pa, fa)}; {_skew_note('B', pb, fb)}; "
                f"B's verdict: {_verdict_b(b, problems_b)})")
    if pa == pb:
        rows.append(f"(both runs are {pa}: an A/B of placement compares aligned with lazy)")
    return "\n".join(rows) + "\n", problems_b
