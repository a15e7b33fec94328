"""Demo runs shared by the engine and fault tests: each shape/policy/fault runs once per session."""

import functools

from nemo_fp8_align.config import Policy
from nemo_fp8_align.demo.launch import run_demo
from nemo_fp8_align.demo.train import DemoOptions


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
