"""Pieces shared by the real-stack harnesses (validation/real_stack_mcore.py, validation/real_stack_apex.py):
several ranks on the one GPU through the host-staging backend (lab/host_staging.py), a watch on
every Transformer Engine transpose build and cache reset (lab/transpose_watch.py), the per-step
checks read from the weights themselves, and the comparison of policies.

What "the weights themselves" means here: ``Float8TensorStorage._create_transpose`` (the one
function every TE 2.x path uses to fill a Float8Tensor's transpose: TE's
``post_all_gather_processing``, the lazy ``update_usage`` at first use, our backend) and
``Float8Tensor._reset_caches`` / ``remove_caches`` are wrapped, and every call on a watched
weight is logged with a monotonic time stamp, the step and the phase (forward/backward or
optimizer step). A forward pre-hook on each model chunk, registered after the plugin's, reads
whether each weight's transpose is valid when the chunk is first used in a step.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Sequence

import torch

from lab.transpose_watch import FirstUseProbe, TransposeWatch  # noqa: F401 (re-exported)

POLICY_RUNS = ("off", "aligned", "lazy", "off")  # "off" twice: proves no state leaks between runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world_size: int, port: int, device: str) -> None:
    """One process of several sharing the GPU: every group on the host-staging backend (on the
    CPU dry run too, where it stages CPU tensors the same way)."""
    import torch.distributed as dist

    from lab.host_staging import enable_host_staging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(enable_host_staging(), rank=rank, world_size=world_size)


def digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def weight_problems(policy: str, steps: int, watch: TransposeWatch, probe: FirstUseProbe,
                    records: Sequence[Dict[str, Any]], n_weights: Sequence[int],
                    evaluated: bool = False) -> List[str]:
    """The checks read from the weights (and cross-checked against the plugin's records).

    ``evaluated``: an evaluation with a forced all-gather ran after every step. Its
    post-processing (megatron-core's on >= 0.18, the plugin's on older) builds the transposes
    of the new weights before the next step, and where the next step gathers again
    megatron-core builds them once more: one or two builds per weight, counted from the
    evaluation before the step; that none is stale at first use is the verify mode's check."""
    problems: List[str] = []
    by_key = {(r["step"], r["chunk"]): r for r in records}
    for step in range(steps):
        for chunk, n in enumerate(n_weights):
            evs = [e for e in watch.events if e["chunk"] == chunk and (
                (e["step"] == step and e["phase"] == "fwd_bwd")
                or (evaluated and e["step"] == step - 1 and e["phase"] == "eval"))]
            builds = [e for e in evs if e["kind"] == "build"]
            per_weight = defaultdict(int)
            for e in builds:
                per_weight[e["weight"]] += 1
            where = f"step {step} chunk {chunk}"
            # Step 0 may build none: the weights come from fp8_model_init with their transposes
            # and, on the Apex path, nothing is gathered before the first optimizer step.
            exact = step > 0 or len(per_weight) > 0
            if (any(v > (2 if evaluated else 1) for v in per_weight.values())
                    or (exact and len(per_weight) != n)):
                problems.append(f"{where}: transpose builds per weight {dict(per_weight)} "
                                f"(expected each of {n} weights exactly once)")
            last_build = max((e["t"] for e in builds), default=None)
            late_resets = [e for e in evs if e["kind"] == "reset" and last_build is not None
                           and e["t"] > last_build]
            if late_resets:
                problems.append(f"{where}: {len(late_resets)} transpose cache resets after the "
                                "build, before the step ended")
            if policy != "aligned":
                continue
            flags = probe.valid.get(step, {}).get(chunk)
            if flags is None or not all(flags):
                problems.append(f"{where}: transposes valid at first use: {flags}")
            rec = by_key.get((step, chunk))
            if rec is None:
                problems.append(f"{where}: no plugin record")
                continue
            # megatron-core >= 0.16 builds them inside the finish_param_sync the plugin calls
            # (after its wait), so the window is [slot reached, transposes valid].
            lo, hi = rec.get("t_slot"), rec.get("t_done")
            outside = [e for e in builds if e["phase"] == "fwd_bwd" and (
                lo is None or hi is None or not lo <= e["t"] <= hi)]
            if outside:
                problems.append(f"{where}: {len(outside)} builds outside the plugin's slot "
                                f"window [slot reached {lo}, transposes valid {hi}]")
    return problems


def compare_policies(runs: List[Dict[str, Any]]) -> List[str]:
    """Losses, gradients and parameters must be bit-identical across every policy run."""
    problems = []
    ref = runs[0]
    for run in runs[1:]:
        for key in ("losses", "grads", "params"):
            if run[key] != ref[key]:
                problems.append(f"{key} differ: policy {run['policy']} {run[key]} vs "
                                f"{ref['policy']} {ref[key]}")
    return problems


def gpu_time_problems(records: Sequence[Dict[str, Any]]) -> List[str]:
    """On a GPU, every aligned record carries CUDA-event times of its slot (core/gpu_spans.py):
    a wait >= 0 and a build > 0, wherever the build ran (the plugin's backend, or megatron-core's
    post-processing inside finish_param_sync on >= 0.16 with TE >= 2.10)."""
    problems = []
    for r in records:
        wait, build = r.get("gpu_wait_ms"), r.get("gpu_build_ms")
        if wait is None or build is None or wait < 0 or not build > 0:
            problems.append(f"step {r['step']} chunk {r['chunk']} rank {r.get('rank')}: GPU times "
                            f"wait {wait} ms, build {build} ms (expected a wait >= 0, a build > 0)")
    return problems


def write_json(path: str, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str)


def transpose_buffer_moves(events: Sequence[Dict[str, Any]]) -> Dict[str, int]:
    """Per weight, how many builds wrote the transpose to another address than the first one:
    a CUDA graph captured once keeps reading the first address (informational)."""
    first: Dict[str, Any] = {}
    moves: Dict[str, int] = {}
    for e in events:
        if e["kind"] != "build" or e.get("ptr") is None:
            continue
        base = first.setdefault(e["weight"], e["ptr"])
        moves[e["weight"]] = moves.get(e["weight"], 0) + (e["ptr"] != base)
    return moves
