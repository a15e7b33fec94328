"""NeMo's MegatronDistributedFusedAdam (Apex DistributedFusedAdam) + TE FP8 parameters + the
plugin's ApexAdapter, several ranks on one GPU.

The same GPT chunks as validation/real_stack_mcore.py (megatron-core TE layer spec, ``fp8_param=True``,
bf16), but no megatron-core DDP: the optimizer is NeMo 2.3.3's
``MegatronDistributedFusedAdam`` (uint8 FP8 param buckets, ``_param_copy_fragments`` that resets
the transpose caches) with ``overlap_grad_sync`` and ``overlap_param_sync``, set up the way NeMo's
``MegatronBaseModel`` does for ``optim.name=distributed_fused_adam`` with ``fp8_params``
(one bucket per transformer layer, reversed; ``store_params``; bf16 param sync; the schedule's
``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func`` bound to the optimizer as NeMo's
``fwd_bwd_step`` binds them). If NeMo's optimizer does not import, Apex's
``DistributedFusedAdam`` is used directly and the summary says so. The plugin is a
``TransposeAligner`` over ``ApexAdapter`` (what the NeMo mixin builds).

Usage: python3 validation/real_stack_apex.py --dp 2 --recipe delayed --out DIR
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from functools import partial
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from validation import real_stack_common as common  # noqa: E402
from validation import real_stack_mcore as mcore  # noqa: E402


def _optimizer_class():
    try:
        from nemo.core.optim.distributed_adam import MegatronDistributedFusedAdam
        return MegatronDistributedFusedAdam, "nemo_toolkit MegatronDistributedFusedAdam"
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
        return DistributedFusedAdam, f"apex DistributedFusedAdam (NeMo's did not import: {exc!r})"


def _optimizer(chunks: List[torch.nn.Module], bucket_cap_mb: float):
    from megatron.core import parallel_state

    cls, name = _optimizer_class()
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    opt = cls(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
              overlap_grad_sync=True, overlap_param_sync=True, contiguous_grad_buffer=True,
              dtype=torch.float32, param_sync_dtype=torch.bfloat16, store_params=True,
              bucket_cap_mb=bucket_cap_mb, process_group=parallel_state.get_data_parallel_group())
    # NeMo (MegatronGPTModel.configure_optimizers): one bucket per transformer layer, reversed;
    # the remaining parameters join the last bucket.
    buckets = [[p for p in layer.parameters() if p.requires_grad]
               for chunk in chunks for layer in chunk.decoder.layers]
    buckets.reverse()
    used = {id(p) for b in buckets for p in b}
    buckets[-1].extend(p for p in params if id(p) not in used)
    for bucket in buckets:
        opt.init_params_bucket(bucket)
    opt.init_params(reversed(params))
    return opt, name


class CopyWatch:
    """Apex's parameter copies inside the schedule (its pre-forward hook, or the plugin's
    ApexAdapter): how many found a needed bucket never launched (SHARDED: a blocking
    all-gather right there)."""

    def __init__(self, opt: Any) -> None:
        self.opt, self.blocking, self.copies, self.counting = opt, 0, 0, False
        original = opt._param_copy

        def param_copy(params: Any) -> Any:
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            if not self.counting:  # only inside the schedule (forward/backward)
                return original(params)
            ids = {f.bucket_id for p in params for f in opt.state[p].get("fragments", ())
                   if f.bucket_id in opt._params_buckets}
            self.copies += 1
            if any(opt._params_buckets[i].status == opt.ParameterStatus.SHARDED for i in ids):
                self.blocking += 1
            return original(params)

        opt._param_copy = param_copy


def run_policy(o: mcore.Opts, policy: str, out_dir: str, rank: int, run_index: int) -> Dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_fp8_align.config import AlignConfig, Policy
    from nemo_fp8_align.core.aligner import TransposeAligner
    from nemo_fp8_align.assemble import schedule_for, telemetry_writer
    from nemo_fp8_align.core.telemetry import record_problems
    from nemo_fp8_align.backends.te import TEBackend
    from nemo_fp8_align.adapters.apex import ApexAdapter

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    mcore.seed_everything(o)
    config, spec = mcore.gpt_config(o, gradient_accumulation_fusion=False)
    chunks = mcore.gpt_chunks(o, config, spec, pp_rank)
    backend = TEBackend()
    weights = [list(backend.weights_of(c)) for c in chunks]  # before any hook is armed
    chunk_params = [list(c.parameters()) for c in chunks]
    opt, opt_name = _optimizer(chunks, o.bucket_cap_mb)
    # Which parameters have bytes in this rank's shard (the all-gather brings the others'):
    owned = [any(f.in_local_shard for f in opt.state[p]["fragments"])
             for ps in chunk_params for p in ps if p.requires_grad]
    copies = CopyWatch(opt)
    config.no_sync_func = partial(opt.no_sync, greedy_grad_copy=True)
    config.grad_sync_func = opt.try_grad_sync
    config.finalize_model_grads_func = None
    sync = ApexAdapter(opt, chunks)
    align = AlignConfig(policy=Policy(policy),
                        telemetry_path=os.path.join(out_dir, f"telemetry.run{run_index}.rank{rank}.jsonl"))
    aligner = TransposeAligner(
        chunks, schedule=schedule_for(config, pp=o.pp, vp=o.vp, num_microbatches=o.microbatches),
        pp_rank=pp_rank, dp_rank=dp_rank, adapter=sync, weights=weights, backend=backend,
        config=align, telemetry=telemetry_writer(align.telemetry_path))
    aligner.attach()
    # NeMo's path: its sync_overlap_parameters starts the sync, then reports the launch.
    config.param_sync_func = _reporting_launches(opt._try_start_bucket_param_sync, sync)
    watch = common.TransposeWatch()
    for c, ws in enumerate(weights):
        watch.watch(c, ws, prefix="")
    watch.install()
    probe = common.FirstUseProbe(chunks, weights, backend)
    fwd_bwd = get_forward_backward_func()
    result: Dict[str, Any] = {"policy": policy, "pp_rank": pp_rank, "dp_rank": dp_rank,
                              "optimizer": opt_name, "weights": [len(w) for w in weights],
                              "weight_types": sorted({type(w).__name__ for ws in weights for w in ws}),
                              "params_with_local_shard": f"{sum(owned)} of {len(owned)}",
                              "buckets": len(opt.state["buckets"]),
                              "losses": [], "grads": [], "params": [], "step_seconds": []}
    try:
        for step in range(o.steps):
            data = mcore._batches(o, step, dp_rank, "cuda")
            opt.zero_grad()
            # NeMo's MegatronGPTModel.training_step does this before fwd_bwd_step: embedding
            # parameters go straight into C++ (F.embedding) and would bypass Apex's pre-forward
            # hook, so it touches them (data_ptr) to run their copy first.
            for chunk in chunks:
                if getattr(chunk, "embedding", None) is not None:
                    for param in chunk.embedding.parameters():
                        param.data_ptr()
            copies.counting = True
            probe.start_step(step)
            watch.step, watch.phase = step, "fwd_bwd"
            t0 = time.monotonic()
            out = fwd_bwd(forward_step_func=mcore._forward_step,
                          data_iterator=[iter(data) for _ in chunks], model=chunks,
                          num_microbatches=o.microbatches, seq_length=o.seq,
                          micro_batch_size=o.micro_batch_size, forward_only=False)
            watch.phase = "optimizer"
            copies.counting = False
            opt._finish_bucket_grad_sync()  # as NeMo's training_step does
            # The shards reduced during the backward (Apex reduces the rest inside step(); the
            # parameters after the step cover every gradient).
            shards = [b.grads_shard for _, b in sorted(opt._grads_buckets.items())
                      if b.grads_shard is not None]
            result["grads"].append(f"{len(shards)} shards {common.digest(shards)}")
            opt.step()
            torch.cuda.synchronize()
            result["step_seconds"].append(round(time.monotonic() - t0, 4))
            result["params"].append(common.digest(
                [b.params_shard for b in opt.state["buckets"] if b.params_shard is not None]))
            if out:
                result["losses"].append(float(torch.stack([x["lm loss"] for x in out]).mean()))
            watch.phase = "idle"
    finally:
        aligner.detach()
        probe.remove()
        watch.uninstall()
    records = [asdict(r) for r in aligner.records]
    problems: List[str] = []
    if policy != "off":
        problems += record_problems(records, policy=policy)
        if len(records) != o.steps * o.vp:
            problems.append(f"{len(records)} plugin records, expected {o.steps * o.vp}")
    problems += common.weight_problems(policy, o.steps, watch, probe, records,
                                       [len(w) for w in weights])
    if policy == "aligned" and (sum(sync.blocking_all_gathers) or copies.blocking):
        problems.append(f"blocking all-gathers: plugin {sync.blocking_all_gathers}, "
                        f"Apex copies of never-launched buckets {copies.blocking}")
    result.update(records=records, events=watch.events, problems=problems,
                  plugin_blocking_all_gathers=sync.blocking_all_gathers,
                  apex_param_copies=copies.copies, apex_blocking_copies=copies.blocking,
                  first_use_valid={str(s): v for s, v in probe.valid.items()},
                  backend=backend.describe())
    del opt, chunks, aligner, sync
    mcore.reset_fp8_state(o)
    return result


if __name__ == "__main__":
    sys.exit(mcore.main(runner=run_policy, description=__doc__))


def _reporting_launches(sync: Any, adapter: Any) -> Any:
    """``sync`` (a ``param_sync_func`` taking a chunk's parameters) reporting each launch to
    ``adapter``, as NeMo's session does around its ``sync_overlap_parameters``."""
    def param_sync(params: Any = None, **kwargs: Any) -> Any:
        params = list(params) if params is not None else []  # the schedule passes a generator
        out = sync(params, **kwargs)
        adapter.launched(params, **kwargs)
        return out
    return param_sync
