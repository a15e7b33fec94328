"""``report``'s cross-check of each record's fields against one another: what a record says in
two places must agree, or the table would show one field while the judges read the other (an
``obs_slot`` that disagrees with ``obs_at`` was shown in the table, and passed).

The relations are the ones docs/telemetry.md defines: ``slot`` is ``vmid + pp_rank`` (0 for
``vmid`` -1); ``obs_at`` holds the distinct positions ``[k, inside]`` of the ``obs_built``
builds (none without builds, at most one per build); ``obs_slot`` is the slot of the first
position (``k + pp_rank``; a build before the rank's first forward gets the aligned slot when it
lies in ``[0, pp_rank]``, else ``pp_rank``), null without builds; with the schedule shape, a
position lies within the rank's ``M x VP`` forwards of the step.
"""

from __future__ import annotations

import json
from typing import Any, List, Mapping, Optional, Sequence

__all__ = ["SIZE_FLAGS", "completeness_judged", "field_problems", "observed_slot"]

_OBSERVED = ("obs_built", "obs_at", "obs_slot")
#: record field -> what it counts; given on the command line for records that lack it.
SIZE_FLAGS = {"pp_size": "pipeline-parallel size", "vp_size": "model chunks per pipeline rank",
              "dp_size": "data-parallel size"}


def observed_slot(position: Sequence[Any], pp_rank: int, aligned_slot: int) -> int:
    """The schedule slot of an observed build position ``[k, inside]``."""
    k, inside = position
    return k + pp_rank if (k or inside) else min(aligned_slot, pp_rank)


def _where(r: Mapping[str, Any]) -> str:
    return f"step {r['step']} chunk {r['chunk']} pp rank {r['pp_rank']} dp rank {r['dp_rank']}"


def _slot_problem(r: Mapping[str, Any]) -> Optional[str]:
    want = 0 if r["vmid"] == -1 else r["vmid"] + r["pp_rank"]
    if r["slot"] != want:
        return (f"slot {r['slot']} disagrees with vmid {r['vmid']} (slot is vmid + pp_rank = "
                f"{want}, 0 for vmid -1)")
    return None


def _observed_problems(r: Mapping[str, Any]) -> List[str]:
    if all(r.get(k) is None for k in _OBSERVED):
        return []  # not observed (telemetry off, or an older version)
    built, at, slot = r.get("obs_built"), r.get("obs_at"), r.get("obs_slot")
    if built is None or at is None:
        given = ", ".join(k for k in _OBSERVED if r.get(k) is not None)
        return [f"{given} without {' and '.join(k for k in ('obs_built', 'obs_at') if r.get(k) is None)}"
                " (the observed fields are written together)"]
    positions = [tuple(p) for p in at]
    out = []
    if len(set(positions)) != len(positions):
        out.append(f"obs_at {json.dumps(at)} repeats a position (it holds distinct positions)")
    if len(set(positions)) > built:
        out.append(f"obs_at has {len(set(positions))} positions but obs_built is {built} "
                   "(each position is at least one build)")
    if built and not positions:
        out.append(f"obs_built {built} with no position in obs_at")
    if positions:
        want = observed_slot(min(positions), r["pp_rank"], r["aligned_slot"])
        if slot != want:
            out.append(f"obs_slot {slot} disagrees with obs_at {json.dumps(at)}: its first "
                       f"position {json.dumps(list(min(positions)))} is slot {want}")
    elif slot is not None:
        out.append(f"obs_slot {slot} with no observed build (obs_at is empty)")
    forwards = (r.get("microbatches") or 0) * (r.get("vp_size") or 0)
    if forwards:
        beyond = [list(p) for p in positions if p[0] > forwards or (p[1] and p[0] >= forwards)]
        if beyond:
            out.append(f"obs_at {json.dumps(beyond)} beyond the rank's {forwards} forwards of the step "
                       f"(M={r['microbatches']} x VP={r['vp_size']})")
    return out


def field_problems(records: Sequence[Mapping[str, Any]]) -> List[str]:
    """Every record whose fields contradict one another, one sentence each."""
    out = []
    for r in records:
        found = [p for p in (_slot_problem(r),) if p] + _observed_problems(r)
        out += [f"{_where(r)}: {p}" for p in found]
    return out


def completeness_judged(records: List[dict]) -> Optional[str]:
    """None when every record carries the sizes that say which records should exist; else why
    completeness cannot be judged and what to pass."""
    lacking = [k for k in SIZE_FLAGS if any(r.get(k) is None for r in records)]
    if not lacking:
        return None
    flags = " ".join(f"--{k.replace('_', '-')} N" for k in lacking)
    return (f"completeness not judged: records without {'/'.join(lacking)} (older telemetry) "
            "cannot tell a rank whose file is missing from one that does not exist; pass every "
            f"rank's file and the run's sizes ({flags}) to judge it")
