"""Spawns ``demo --loop megatron-lm``'s ranks (Megatron-LM's own loop, megatron-core >= 0.19) and
gathers their results in the shape the demo's judge reads. With ``resume_at = k`` it runs two
jobs, as a user would: the first trains k iterations and saves a checkpoint through Megatron-LM's
own checkpointing (``--save``), the second loads it (``--load``) and trains the rest."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional

from nemo_fp8_align.core.schedule import InterleavedSchedule
from lab.demo.ranks import read_results, spawn_and_wait

__all__ = ["run_megatron_lm_demo"]

_MEGATRON_LM_PG_TIMEOUT_S = 600.0
_CONCAT = ("losses", "grads", "params", "builds_per_step", "records", "unlaunched_steps",
           "metrics")
_CONCAT_GPU = ("events", "forwards")  # --device cuda (demo/megatron_lm_gpu.py)


def _rank_main(rank: int, world_size: int, port: int, opts: Any, *args: Any) -> None:
    if opts.fault is not None:
        from lab.demo.faults import inject

        inject(opts.fault, loop="megatron-lm")  # this process only, for its whole life
    if opts.device == "cuda":  # megatron-core's GPT with TE FP8 weights, ranks sharing GPU 0
        from lab.demo.megatron_lm_gpu import run_gpu_rank

        run_gpu_rank(rank, world_size, port, opts, *args[:2])
        return
    from lab.demo.megatron_lm_loop import run_rank

    run_rank(rank, world_size, port, opts, *args)


def run_megatron_lm_demo(opts: Any, telemetry_path: Optional[str] = None) -> Any:
    from lab.demo.launch import demo_result

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
            # Megatron-LM's process groups time out after --distributed-timeout-minutes (10).
            codes = spawn_and_wait(_rank_main, opts.world_size, (opts, run_dir, phase, True),
                                   opts.pg_timeout_s or _MEGATRON_LM_PG_TIMEOUT_S,
                                   "spawn" if opts.device == "cuda" else "forkserver")
            parts.append(read_results(run_dir, codes))
        ranks = [_merge([p[r] for p in parts]) for r in range(opts.world_size)]
    return demo_result(opts, ranks, telemetry_path)


def _merge(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's results of the jobs, in order (the first job's, then the resumed one's)."""
    merged = dict(parts[0])
    for part in parts[1:]:
        for key in _CONCAT + _CONCAT_GPU:
            if key in merged:
                merged[key] = merged[key] + part[key]
        if "evidence" in merged:
            merged["evidence"] = {k: merged["evidence"][k] + part["evidence"][k]
                                  for k in merged["evidence"]}
        if "first_use_valid" in merged:
            merged["first_use_valid"] = dict(merged["first_use_valid"], **part["first_use_valid"])
        merged["unlaunched_forwards"] += part["unlaunched_forwards"]
    return merged
