"""Demo runs shared by the engine and fault tests: each shape/policy/fault runs once per session;
and the demo's command line as a shell runs it."""

import functools
import subprocess
import sys
from pathlib import Path

from nemo_fp8_align.config import Policy
from lab.demo.launch import run_demo
from lab.demo.train import DemoOptions

#: The repository root: ``python -m lab.demo`` reads lab/ from the checkout, as ``make demo`` does.
ROOT = Path(__file__).resolve().parents[2]


def demo_cli(*flags, timeout=600):
    """``python -m lab.demo FLAGS`` in a new process at the repository root (text output)."""
    return subprocess.run([sys.executable, "-m", "lab.demo", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def demo(pp, vp, dp, m, policy, steps=2, n=None, eval_after_each_step=False, fault=None,
         check_provenance=True, resume_at=None, eval_forced_sync=False, foreign_forwards=False,
         gather_with_optimizer=False, skip_step_at=None, manual_post_processing=False,
         recipe="delayed", delay_param_gather=False, dist_opt_instances=1):
    return run_demo(DemoOptions(pp=pp, vp=vp, dp=dp, microbatches=m, group_size=n, steps=steps,
                                policy=Policy(policy), eval_after_each_step=eval_after_each_step,
                                fault=fault, check_provenance=check_provenance,
                                resume_at=resume_at, eval_forced_sync=eval_forced_sync,
                                foreign_forwards=foreign_forwards,
                                overlap_param_gather_with_optimizer_step=gather_with_optimizer,
                                skip_step_at=skip_step_at,
                                manual_post_processing=manual_post_processing, recipe=recipe,
                                delay_param_gather=delay_param_gather,
                                dist_opt_instances=dist_opt_instances))
