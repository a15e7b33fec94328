"""The plugin's per-step effect, gathered over the pipeline ranks, for the experiment logger.

Used by the NeMo session (callback and mixin) and Megatron-LM's metrics listener. Every rank
calls :func:`gather_step_metrics` with the records its aligner emitted for the step just
finished (the same steps on every rank: it is a collective over the rank's pipeline group); the
result, on every rank, is one flat dict of floats that the caller logs from global rank 0 only,
with ``LightningModule.log`` so the values land on the same logger step as NeMo's own
``train_step_timing`` and ``reduced_train_loss``.

Keys (``c`` = model chunk; times in milliseconds, host clock, except ``wait_ms`` and
``transpose_ms`` on a GPU: the records' CUDA-event times there):

* ``fp8_align/chunk{c}/slot_skew``: largest minus smallest schedule slot at which the pipeline
  ranks had the chunk's transposes (``aligned``: 0; ``lazy``: PP-1, each rank at its first use),
  from the *observed* slot where the record has one (``obs_slot``: where the builds really
  happened, counted by hooks apart from the aligner's; its own ``slot`` is the plan);
* ``fp8_align/chunk{c}/time_skew_ms``: the same spread in time, each rank's slot measured from
  its own launch of chunk 0's all-gather at the step start (no clock shared across hosts needed);
* ``fp8_align/chunk{c}/wait_ms``: the longest all-gather wait at the slot (``aligned`` only:
  under ``lazy`` megatron-core waits inside the first forward, unobserved);
* ``fp8_align/chunk{c}/transpose_ms``: the longest transpose build at the slot (``aligned``);
* ``fp8_align/chunk{c}/slot_to_valid_ms``: slot to transposes valid, longest over the ranks
  (``aligned``: wait plus build; ``lazy``: the whole first forward that built them);
* ``fp8_align/chunk{c}/transposes_built`` and ``fp8_align/transposes_built``: transposes built,
  summed over the pipeline ranks (``aligned``: by the plugin; ``lazy``: observed at first use);
* ``fp8_align/records``: records gathered (chunks x pipeline ranks; fewer means a chunk or rank
  reported nothing for the step).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from nemo_fp8_align.errors import MetricsError

__all__ = ["gather_step_metrics", "last_step_records", "step_metrics"]

_MS = 1000.0


def _compact(record: Any) -> Dict[str, Any]:
    """What the metrics need from one record (small, picklable, clock-relative)."""
    return {k: getattr(record, k, None) for k in (
        "chunk", "pp_rank", "slot", "obs_slot", "transposed", "valid", "seconds", "t_launch",
        "t_slot", "t_gathered", "t_done", "gpu_wait_ms", "gpu_build_ms")}


def _spread(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) - min(present) if len(present) > 1 else (0.0 if present else None)


def _longest(values: Iterable[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _span(r: Mapping[str, Any], gpu: str, start: str, end: str) -> Optional[float]:
    """A record's GPU time where it has one (CUDA events), else its host time."""
    if r.get(gpu) is not None:
        return r[gpu]
    if r[start] is None or r[end] is None:
        return None
    return (r[end] - r[start]) * _MS


def step_metrics(rows: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """The logger keys (see the module docstring) from one step's compact records of all the
    pipeline ranks (empty when there are none: nothing to log)."""
    if not rows:
        return {}
    start: Dict[int, float] = {}  # per pp rank: its launch of chunk 0 (or its first slot)
    for r in rows:
        t0 = r["t_launch"] if r["chunk"] == 0 and r["t_launch"] is not None else None
        if t0 is not None:
            start[r["pp_rank"]] = t0
    for r in rows:
        if r["pp_rank"] not in start and r["t_slot"] is not None:
            start[r["pp_rank"]] = min(x["t_slot"] for x in rows
                                      if x["pp_rank"] == r["pp_rank"] and x["t_slot"] is not None)
    by_chunk: Dict[int, List[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_chunk[r["chunk"]].append(r)
    out: Dict[str, float] = {"fp8_align/records": float(len(rows)),
                             "fp8_align/transposes_built": float(sum(r["transposed"] for r in rows))}
    for chunk, mine in sorted(by_chunk.items()):
        p = f"fp8_align/chunk{chunk}/"
        values = {
            "slot_skew": _spread([r["slot"] if r.get("obs_slot") is None else r["obs_slot"]
                                  for r in mine]),
            "time_skew_ms": _spread([
                (r["t_slot"] - start[r["pp_rank"]]) * _MS if r["t_slot"] is not None else None
                for r in mine]),
            "wait_ms": _longest(_span(r, "gpu_wait_ms", "t_slot", "t_gathered") for r in mine),
            "transpose_ms": _longest(_span(r, "gpu_build_ms", "t_gathered", "t_done")
                                     for r in mine),
            "slot_to_valid_ms": _longest((r["t_done"] - r["t_slot"]) * _MS for r in mine
                                         if r["t_done"] is not None and r["t_slot"] is not None),
            "transposes_built": float(sum(r["transposed"] for r in mine)),
        }
        out.update({p + k: float(v) for k, v in values.items() if v is not None})
    return out


def gather_step_metrics(records: Union[Sequence[Any], Callable[[], Sequence[Any]]], *,
                        group: Any = None) -> Dict[str, float]:
    """Gather this step's records over the pipeline ``group`` (all ranks of it must call) and
    summarise them; without an initialised process group, this rank's records alone.

    ``records`` may be a function giving them. Whatever fails on one rank before the gather
    (finding or reading its records) still enters the gather, as that rank's failure, so no
    peer is left waiting in it; then every rank raises :class:`MetricsError` naming it."""
    import torch.distributed as dist

    try:
        mine: List[Dict[str, Any]] = [_compact(r) for r in
                                      (records() if callable(records) else records)]
        failure = None
    except Exception as err:  # rank-local: carried through the collective
        mine, failure = [], f"{type(err).__name__}: {err}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (mine, failure), group=group)
        failures = [f"  rank {dist.get_global_rank(group, i) if group is not None else i}: {f}"
                    for i, (_, f) in enumerate(parts) if f is not None]
        rows = [row for part, _ in parts for row in part]
    else:
        failures = [f"  this rank: {failure}"] if failure is not None else []
        rows = mine
    if failures:
        raise MetricsError("nemo_fp8_align: the step's metrics could not be gathered:\n"
                           + "\n".join(failures))
    return step_metrics(rows)


def last_step_records(records: Sequence[Any]) -> List[Any]:
    """The records of the newest step in ``records`` (the aligner's list or bounded deque)."""
    if not records:
        return []
    step = records[-1].step
    out: List[Any] = []
    for record in reversed(records):
        if record.step != step:
            break
        out.append(record)
    return out[::-1]
