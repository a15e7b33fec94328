"""Spawns ``demo --loop megatron-lm``'s ranks (Megatron-LM's own loop, megatron-core >= 0.19) and
gathers their results in the shape the demo's judge reads. With ``resume_at = k`` it runs two
jobs, as a user would: the first trains k iterations and saves a checkpoint through Megatron-LM's
own checkpointing (``--save``), the second loads it (``--load``) and trains the rest."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, List, Optional

import torch.multiprocessing as mp

from nemo_fp8_align.core.schedule import InterleavedSchedule
from nemo_fp8_align.errors import DemoRankError

__all__ = ["run_megatron_lm_demo"]

_CONCAT = ("losses", "grads", "params", "builds_per_step", "records", "unlaunched_steps",
           "metrics")


def run_megatron_lm_demo(opts: Any, telemetry_path: Optional[str] = None) -> Any:
    from nemo_fp8_align.demo.launch import DemoResult, _free_port
    from nemo_fp8_align.demo.megatron_lm_loop import run_rank

    InterleavedSchedule(opts.pp, opts.vp, opts.microbatches, opts.group_size)
    with tempfile.TemporaryDirectory(prefix="nemo_fp8_align_mlm_") as out_dir:
        ckpt = os.path.join(out_dir, "checkpoint")
        if opts.resume_at:
            phases = [dict(exit_at=opts.resume_at, save=ckpt, load=None),
                      dict(exit_at=None, save=None, load=ckpt)]
        else:
            phases = [dict(exit_at=None, save=None, load=None)]
        parts = []
        for i, phase in enumerate(phases):
            run_dir = os.path.join(out_dir, f"job{i}")
            os.makedirs(run_dir)
            parts.append(_spawn(run_rank, opts, run_dir, phase))
        ranks = [_merge([p[r] for p in parts]) for r in range(opts.world_size)]
    records = sorted((rec for r in ranks for rec in r["records"]),
                     key=lambda x: (x["step"], x["chunk"], x["pp_rank"], x["dp_rank"]))
    if telemetry_path:
        with open(telemetry_path, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
    return DemoResult(opts, ranks, records)


def _spawn(run_rank: Any, opts: Any, out_dir: str, phase: Dict[str, Any]) -> List[Dict[str, Any]]:
    from nemo_fp8_align.demo.launch import _free_port

    try:
        mp.start_processes(run_rank, args=(opts.world_size, _free_port(), opts, out_dir, phase,
                                           True),
                           nprocs=opts.world_size, join=True, start_method="spawn")
    except Exception as err:
        errors = [open(os.path.join(out_dir, n), encoding="utf-8").read()
                  for n in sorted(os.listdir(out_dir)) if n.endswith(".error")]
        failure = DemoRankError("\n".join(e.splitlines()[0] for e in errors) or str(err))
        failure.reports = dict(enumerate(errors or [str(err)]))
        raise failure from err
    out = []
    for rank in range(opts.world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as f:
            out.append(json.load(f))
    return out


def _merge(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's results of the jobs, in order (the first job's, then the resumed one's)."""
    merged = dict(parts[0])
    for part in parts[1:]:
        for key in _CONCAT:
            merged[key] = merged[key] + part[key]
        merged["evidence"] = {k: merged["evidence"][k] + part["evidence"][k]
                              for k in merged["evidence"]}
        merged["unlaunched_forwards"] += part["unlaunched_forwards"]
    return merged
