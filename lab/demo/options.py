"""The demo's options: one frozen dataclass, which the CLI flags map onto."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_fp8_align.config import Policy
from lab.demo.model import DemoModelConfig

__all__ = ["DemoOptions"]


@dataclass(frozen=True)
class DemoOptions:
    """Everything one demo run needs; the CLI flags map onto these fields."""

    pp: int = 2
    vp: int = 2
    dp: int = 1
    microbatches: int = 4
    group_size: Optional[int] = None
    steps: int = 3
    policy: Policy = Policy.ALIGNED
    micro_batch_size: int = 2
    #: A forward-only pass after every step. Off by default: its DDP pre-hooks all-gather and
    #: wait for the new parameters, which would hide a missing wait in the next step.
    eval_after_each_step: bool = False
    #: Run that evaluation as Megatron-LM's ``evaluate`` does with the distributed optimizer and
    #: overlapped all-gathers: DDP pre-hooks disabled with a forced synchronous all-gather first
    #: (where megatron-core < 0.18 skips the FP8 post-all-gather processing).
    eval_forced_sync: bool = False
    #: FP8 weights that keep a stale transpose flagged valid, as TE's under megatron-core >= 0.16
    #: do, rebuilt where megatron-core post-processes (demo/te_post_processing.py).
    manual_post_processing: bool = False
    #: The quantized-weight recipe the reference weights stand in for: delayed, tensorwise
    #: (per-tensor FP8: the plugin's transposes), blockwise, nvfp4 (block-scaled: rebuilt by
    #: megatron-core's own post-processing, demo/recipe_post_processing.py).
    recipe: str = "delayed"
    device: str = "cpu"
    model: DemoModelConfig = field(default_factory=DemoModelConfig)
    #: A named fault from :mod:`lab.demo.faults` that the launcher injects in every
    #: rank (tests, ``demo --fault``).
    fault: Optional[str] = None
    #: The GEMMs check that the FP8 copies they read match the parameter bytes (a digest per
    #: read; see ReferenceFP8Weight.check_provenance). Off for timing.
    check_provenance: bool = True
    #: Save a checkpoint before this step and resume from it in a new model, optimizer and
    #: aligner, Megatron-LM style (its first step without pre-hooks or launches).
    resume_at: Optional[int] = None
    #: A module that is not a model chunk (a probe, a reference model as in NeMo-RL) runs a
    #: forward and backward with gradients inside every forward step, before the chunk's forward
    #: (between the schedule's launches and the first forward, and between one microbatch's
    #: backward and the next forward), and between steps. It must never count.
    foreign_forwards: bool = False
    #: The process groups' timeout in seconds (None: torch's default, 30 minutes): a short one
    #: turns a rank blocked in a collective or p2p receive into an error quickly (tests).
    pg_timeout_s: Optional[float] = None
    #: ``OptimizerConfig(overlap_param_gather_with_optimizer_step=True)``: chunk 0's all-gather is
    #: dispatched by the optimizer step (megatron-core then builds a ChainedOptimizer).
    overlap_param_gather_with_optimizer_step: bool = False
    #: Fill every gradient with inf after this step's backward, so the optimizer skips the step
    #: (a constant loss scale of 1.0 makes it check; bytes are unchanged by it).
    skip_step_at: Optional[int] = None
    #: Attach the way :mod:`nemo_fp8_align.integrations.megatron_lm` does (to the DDP chunks,
    #: before the loop binds ``config.param_sync_func``), then bind it as Megatron-LM's
    #: ``train()`` does, and run the first step as its first iteration (no launches).
    rebinding_loop: bool = False

    #: megatron-core 0.7/0.8 only: bind ``config.param_sync_func`` to the optimizer's
    #: ``finish_param_sync(chunk)``, one per chunk, as Megatron-LM's ``--delay-param-gather``
    #: meant to (its lambdas all capture the last chunk index): the schedule then finishes each
    #: chunk's chained all-gather at the launch slot itself.
    delay_param_gather: bool = False

    #: ``--device cuda`` (``--loop megatron-lm``): the process groups of the ranks sharing the one
    #: GPU (demo/megatron_lm_gpu.py ``GROUPS``), and Megatron-LM's ``--eval-interval`` (0: none).
    gpu_groups: str = "host_staging"
    eval_interval: int = 0

    #: megatron-core >= 0.10's ``num_distributed_optimizer_instances`` (Megatron-LM's
    #: ``--num-distributed-optimizer-instances``): the data-parallel ranks split into this many
    #: optimizer instances; each all-gathers its parameters within itself, and the gradients are
    #: all-reduced across instances after the reduce-scatter.
    dist_opt_instances: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp
