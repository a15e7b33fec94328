"""``demo --loop megatron-lm --device cuda`` checked on one GPU (several ranks sharing it through
CUDA MPS): Megatron-LM's own ``pretrain``/``train()`` from the megatron-core 0.19.2 wheel, the
GPT built by Megatron-LM's ``gpt_config_from_args`` with Transformer Engine ``Float8Tensor``
weights, the plugin attached by ``post_wrap_hook()`` (lab/demo/megatron_lm_gpu.py).

For one shape (``--pp``, VP=2): off, lazy and aligned jobs with an evaluation every 2 iterations,
each judged by demo/megatron_lm_gpu_judge.py (TE's own builds, where and how often), and their
losses, gradients and parameters compared bit for bit; with ``--resume``, an aligned job saved at
iteration K (``--save``, ``--exit-interval``) and resumed in a new job (``--load``) compared with
the uninterrupted one; with ``--fault NAME``, every rank must raise the plugin's error.
Writes ``summary.json`` under ``--out`` and prints PASS/FAIL lines.

  python3 validation/megatron_lm_gpu.py --pp 4 --resume 3 --fault capture_on_one_rank --out DIR
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.model import DemoModelConfig  # noqa: E402
from lab.demo.options import DemoOptions  # noqa: E402

#: The fault's error class, which every rank must raise (tests/support/rank_errors.py).
FAULT_ERRORS = {"capture_on_one_rank": "CudaGraphCaptureError",
                "mismatch_on_one_rank": "StepMismatchError",
                "extra_forward_on_one_rank": "StepMismatchError"}


def _opts(a: argparse.Namespace, **extra: Any) -> DemoOptions:
    model = DemoModelConfig(hidden_size=a.hidden, num_heads=4, seq_length=a.seq,
                            vocab_size=1024, layers_per_chunk=1)
    base = dict(pp=a.pp, vp=2, dp=1, microbatches=a.microbatches, steps=a.steps,
                device="cuda", eval_interval=a.eval_interval, gpu_groups=a.groups, model=model,
                pg_timeout_s=300.0)
    base.update(extra)
    return DemoOptions(**base)


def _run(opts: DemoOptions) -> Dict[str, Any]:
    from lab.demo.launch_megatron_lm import run_megatron_lm_demo
    from lab.demo.megatron_lm_gpu_judge import gpu_problems

    t0 = time.time()
    try:
        result = run_megatron_lm_demo(opts)
    except Exception as err:  # noqa: BLE001 - reported with the run
        reports = getattr(err, "reports", None)
        return {"error": type(err).__name__, "reports": reports or {"-": traceback.format_exc()},
                "times": getattr(err, "times", {}), "seconds": round(time.time() - t0, 1)}
    ranks = result.ranks
    return {"ranks": ranks, "problems": gpu_problems(opts, ranks),
            "seconds": round(time.time() - t0, 1)}


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    out = []
    for ra, rb in zip(a["ranks"], b["ranks"]):
        for key in ("losses", "grads", "params"):
            if ra[key] != rb[key]:
                out.append(f"rank {ra['rank']} {key}: {ra[key][:4]} vs {rb[key][:4]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--eval-interval", type=int, default=2)
    ap.add_argument("--groups", default="host_staging", choices=["host_staging", "mps_ipc"])
    ap.add_argument("--resume", type=int, default=0, metavar="K")
    ap.add_argument("--fault", default=None)
    ap.add_argument("--parallel", type=int, default=3, help="jobs at a time")
    ap.add_argument("--resume-only", action="store_true",
                    help="only the aligned job and the saved-and-resumed one")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    checks: List[Dict[str, Any]] = []

    def check(name: str, problems: List[str]) -> None:
        checks.append({"check": name, "ok": not problems, "problems": problems[:8]})
        print(f"[{'PASS' if not problems else 'FAIL'}] PP={a.pp} {name}"
              + ("" if not problems else " -- " + " | ".join(problems[:3])[:1500]), flush=True)

    policies = ("aligned",) if a.resume_only else ("off", "lazy", "aligned")
    jobs = {p: _opts(a, policy=Policy(p)) for p in policies}
    if a.resume:
        jobs["resumed"] = _opts(a, policy=Policy.ALIGNED, resume_at=a.resume)
    if a.fault:
        jobs["fault"] = _opts(a, policy=Policy.ALIGNED, fault=a.fault, steps=3)
    # Independent jobs (each its own ranks on the shared GPU), a few at a time.
    with ThreadPoolExecutor(a.parallel) as pool:
        runs: Dict[str, Dict[str, Any]] = dict(zip(jobs, pool.map(_run, jobs.values())))
    for policy in policies:
        run = runs[policy]
        check(f"{policy}: every rank ran; TE builds judged ({run['seconds']} s)",
              [f"{run.get('error')}: {run.get('reports')}"[:1500]] if "error" in run
              else run["problems"])
    ok = [p for p in policies if "error" not in runs[p]]
    if len(ok) == 3:
        check("losses, gradients, parameters bit-identical: off = lazy = aligned",
              _same(runs["off"], runs["lazy"]) + _same(runs["off"], runs["aligned"]))
    if a.resume:
        run = runs["resumed"]
        problems = ([f"{run.get('error')}: {run.get('reports')}"[:1500]] if "error" in run
                    else run["problems"] + (_same(runs["aligned"], run) if "aligned" in ok
                                            else ["no uninterrupted aligned job to compare"]))
        check(f"aligned, saved at iteration {a.resume} and resumed in a new job: bit-identical "
              f"to the uninterrupted job ({run['seconds']} s)", problems)
    if a.fault:
        run = runs["fault"]
        want = FAULT_ERRORS.get(a.fault, "Error")
        reports = run.get("reports") or {}
        times = list((run.get("times") or {}).values())
        problems = [] if run.get("error") == "DemoRankError" else [f"the job ended {run.get('error')}"]
        problems += [f"rank {r}: {str(t)[:300]}" for r, t in reports.items()
                     if f": {want}: nemo_fp8_align" not in str(t)]
        if len(reports) != a.pp:
            problems.append(f"{len(reports)} of {a.pp} ranks raised")
        if times and max(times) - min(times) > 10.0:
            problems.append(f"ranks raised {max(times) - min(times):.1f} s apart")
        check(f"fault {a.fault}: every rank exits with the plugin's {want} ({run['seconds']} s)",
              problems)
    summary = {"pp": a.pp, "vp": 2, "args": vars(a), "checks": checks,
               "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
               "losses": {p: r["ranks"][-1]["losses"] for p, r in runs.items() if "ranks" in r},
               "process_groups": next((r["ranks"][0].get("process_groups") for r in runs.values()
                                       if "ranks" in r), None),
               "fault_reports": runs.get("fault", {}).get("reports")}
    with open(os.path.join(a.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(a.out, "runs.json"), "w", encoding="utf-8") as f:
        json.dump({p: {k: v for k, v in r.items() if k != "ranks"} | (
            {"records_rank0": r["ranks"][0]["records"][:8], "events_rank0": r["ranks"][0]["events"][:40]}
            if "ranks" in r else {}) for p, r in runs.items()}, f, indent=1, default=str)
    print(f"SUMMARY PP={a.pp}: {summary['passed']} passed, {summary['failed']} failed; losses "
          f"{summary['losses']}", flush=True)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
