"""One rank of the CPU demo: megatron-core's interleaved schedule, DDP with overlapped and
aligned param all-gathers, the DistributedOptimizer, reference FP8 weights, and the aligner.

It sets ``config.param_sync_func`` the way Megatron-LM's training loop does, so the schedule
launches the all-gathers itself; the aligner only adds the transposes at the aligned slots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from dataclasses import asdict
from functools import partial
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from nemo_fp8_align.config import AlignConfig, Policy
from lab.demo.model import GPTChunk
from lab.demo.options import DemoOptions
from lab.demo.mcore_versions import (chain_handles, ddp_groups, delayed_param_gather,
                                                instance_kwargs, optimizer_instances, own_fields)
from lab.demo.ranks import write_error, write_result

__all__ = ["DemoOptions", "run_rank"]


def _batches(opts: DemoOptions, step: int, dp_rank: int) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(opts.model.seed * 7919 + step * 131 + dp_rank)
    out = []
    for _ in range(opts.microbatches):
        tokens = torch.randint(0, opts.model.vocab_size, (opts.micro_batch_size, opts.model.seq_length),
                               generator=gen)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, shifts=-1, dims=1)})
    return out


def _foreign_forward(probe: Optional[torch.nn.Module]) -> None:
    if probe is not None and torch.is_grad_enabled():
        probe(torch.ones(2, probe.in_features, device=probe.weight.device)).square().sum().backward()


def _forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module,
                  probe: Optional[torch.nn.Module] = None):
    _foreign_forward(probe)
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["labels"])

    def loss_func(per_token: torch.Tensor):
        loss = per_token.mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

    return output, loss_func


def _digest(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bind_schedule_funcs(config: Any, chunks: List[Any]) -> None:
    """What Megatron-LM's training loop binds with overlap_param_gather and
    align_param_gather. On megatron-core 0.7/0.8 the chunks launch nothing (no
    ``start_param_sync``): Megatron-LM of that era binds no ``param_sync_func`` without
    ``--delay-param-gather``, and the optimizer's chain gathers on its own."""
    from megatron.core.distributed import finalize_model_grads

    owned = not callable(getattr(chunks[0], "start_param_sync", None))
    config.param_sync_func = None if owned else [chunk.start_param_sync for chunk in chunks]
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads


def _group_size(config_class: Any, group_size: Optional[int]) -> Dict[str, Any]:
    """``microbatch_group_size_per_vp_stage`` where this megatron-core has it (0.10 on); before,
    forwards run in groups of PP (the pre-0.10 order) and no other size can be asked for."""
    if "microbatch_group_size_per_vp_stage" in {f.name for f in dataclasses.fields(config_class)}:
        return {"microbatch_group_size_per_vp_stage": group_size}
    if group_size is not None:
        raise ValueError(f"--group-size {group_size}: this megatron-core (< 0.10) has no "
                         "microbatch_group_size_per_vp_stage; its interleaved schedule runs "
                         "forwards in groups of PP: leave --group-size out")
    return {}


def _build(opts: DemoOptions, pp_rank: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_align.backends.reference import ReferenceBackend

    config = TransformerConfig(
        num_layers=opts.pp * opts.vp * opts.model.layers_per_chunk,
        hidden_size=opts.model.hidden_size, num_attention_heads=opts.model.num_heads,
        pipeline_model_parallel_size=opts.pp, virtual_pipeline_model_parallel_size=opts.vp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        batch_p2p_comm=False,  # gloo pairs batched same-peer messages wrongly (STACK.md)
        **_group_size(TransformerConfig, opts.group_size))
    mxfp8 = dict(fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True) \
        if opts.recipe == "mxfp8" else {}  # the grad-buffer-reuse branch of _post_param_sync
    ddp_config = DistributedDataParallelConfig(**own_fields(
        DistributedDataParallelConfig,
        dict(overlap_param_gather=True, align_param_gather=True),  # 0.9 on (else the optimizer's)
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        bucket_size=20000, **mxfp8, **instance_kwargs(opts)))
    backend = ReferenceBackend(check_provenance=opts.check_provenance)
    chunks = []
    for c in range(opts.vp):
        # First/last virtual stage computed here: parallel_state's helpers changed their
        # virtual-stage defaults between megatron-core 0.12 and 0.16.
        module = GPTChunk(dataclasses.replace(opts.model, recipe=opts.recipe), config=config, stage=c * opts.pp + pp_rank, vp_stage=c,
                          pre_process=pp_rank == 0 and c == 0,
                          post_process=pp_rank == opts.pp - 1 and c == opts.vp - 1, backend=backend)
        # As Megatron-LM does: only the first chunk is bucketed.
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                              disable_bucketing=c > 0, **ddp_groups()))
    if not opts.rebinding_loop:  # else bound after the plugin attached, as train() does
        bind_schedule_funcs(config, chunks)
    return config, chunks, backend


def _optimizer(chunks, opts: DemoOptions):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with_step = opts.overlap_param_gather_with_optimizer_step
    cfg = OptimizerConfig(**own_fields(
        OptimizerConfig,
        # 0.7/0.8: the optimizer's all-gather overlap (>= 0.9 reads the DDP config's); the
        # optimizer-step dispatch exists from 0.9 (the demo's input check refuses it before).
        dict(overlap_param_gather=True, overlap_param_gather_with_optimizer_step=with_step),
        optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0,
        use_distributed_optimizer=True, params_dtype=torch.float32,
        loss_scale=None if opts.skip_step_at is None else 1.0))
    return get_megatron_optimizer(cfg, chunks)


class PipelineRun:
    """One rank's model chunks, optimizer and aligner, built once; trains and evaluates steps.

    Shared by the demo (which digests gradients and counts builds) and the GPU step-time
    benchmark (which times steps), so both run exactly the same training code.
    """

    def __init__(self, opts: DemoOptions, telemetry_path: Optional[str]) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes

        self.opts = opts
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        with torch.device(opts.device):
            self.config, self.chunks, self.backend = _build(opts, self.pp_rank)
        self.optimizer = _optimizer(self.chunks, opts)
        if opts.delay_param_gather:
            self.config.param_sync_func = delayed_param_gather(self.optimizer, len(self.chunks))
        self.weights = [w for chunk in self.chunks for w in chunk.module.fp8_weights()]
        # Policy off still builds the aligner (unattached), so every policy runs the same code.
        self.aligner = align_fp8_transposes(
            self.chunks, num_microbatches=opts.microbatches, backend=self.backend,
            weights_of=lambda chunk: chunk.module.fp8_weights(), config=self.config,
            align_config=AlignConfig(policy=opts.policy, telemetry_path=telemetry_path),
            optimizer=self.optimizer)  # read on megatron-core 0.7/0.8 (the optimizer's gather)
        if opts.rebinding_loop:
            bind_schedule_funcs(self.config, self.chunks)
        self._fwd_bwd = get_forward_backward_func()
        self._undo_post_processing = _manual_post_processing(self) if opts.manual_post_processing \
            else _recipe_post_processing(self)
        hidden = opts.model.hidden_size
        self.probe = torch.nn.Linear(hidden, hidden, device=opts.device) \
            if opts.foreign_forwards else None
        self._stale = HeldStaleReads(self.weights) if opts.check_provenance else None

    def _agree_on_stale_reads(self, step: int) -> None:
        if self._stale is not None:
            self._stale.agree(f"rank {dist.get_rank()} (pipeline rank {self.pp_rank}, "
                              f"data-parallel rank {self.dp_rank}, step {step})")

    def _run(self, step: int, forward_only: bool) -> List[Dict[str, torch.Tensor]]:
        data = [{k: v.to(self.opts.device) for k, v in b.items()}
                for b in _batches(self.opts, step, self.dp_rank)]
        return self._fwd_bwd(
            forward_step_func=partial(_forward_step, probe=self.probe),
            data_iterator=[iter(data) for _ in self.chunks],
            model=self.chunks, num_microbatches=self.opts.microbatches,
            seq_length=self.opts.model.seq_length, micro_batch_size=self.opts.micro_batch_size,
            forward_only=forward_only)

    def forward_backward(self, step: int) -> Optional[float]:
        """Forward and backward of one step; returns the mean loss on the last stage."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(step, forward_only=False)
        self._agree_on_stale_reads(step)
        return float(torch.stack([o["lm loss"] for o in out]).mean()) if out else None

    def optimizer_step(self) -> bool:
        """The optimizer step; returns whether it updated the parameters (False: skipped)."""
        updated = self.optimizer.step()[0]
        for w in self.weights:  # the next all-gather brings new values: FP8 copies are stale
            w.data_changed()
        return updated

    def evaluate(self, step: int) -> None:
        """A forward-only pass, as validation runs it."""
        if self.opts.eval_forced_sync:
            for chunk in self.chunks:
                chunk.disable_forward_pre_hook()  # param_sync=True: forced synchronous all-gather
        with torch.no_grad():
            self._run(step, forward_only=True)
        self._agree_on_stale_reads(step)
        if self.opts.eval_forced_sync:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()

    def close(self) -> None:
        """Detach, at the same point on every rank (the end of the run, or before a resume):
        what a rank still holds (a failure after the last step end, the final telemetry flush)
        stops every rank with the plugin's error, none left in the teardown's barrier."""
        try:
            self.aligner.detach(agree=True)
        finally:
            self._undo_post_processing()


class HeldStaleReads:
    """The demo GEMMs' stale-byte check (each reference FP8 weight's ``check_provenance``), held
    to the end of the schedule instead of raised inside it.

    Raised where the GEMM runs, on one pipeline rank, it left that rank's pipeline peers in
    their p2p receives: they died with gloo's "Connection closed by peer" and never showed the
    cause (``demo --dp 2 --fault no_wait``: ranks 2 and 3). Held, the step runs to its end on
    the stale bytes (as a real GPU run would, silently), and every rank then agrees on the first
    stale read with the plugin's own step-end agreement: every rank raises ``StaleFP8Error``,
    the others naming the rank that read stale bytes and what it read."""

    def __init__(self, weights: List[Any]) -> None:
        self.first: Optional[Exception] = None
        for weight in weights:
            weight.check_provenance = partial(self._check, weight.check_provenance)

    def _check(self, check: Any, use: str) -> None:
        from nemo_fp8_align.errors import StaleFP8Error

        try:
            check(use)
        except StaleFP8Error as err:
            if self.first is None:
                self.first = err

    def agree(self, label: str) -> None:
        """Every rank, at the same point (after the schedule returned)."""
        from nemo_fp8_align.core.step_end import agree

        found, self.first = self.first, None
        agree(found, label=label)


def _manual_post_processing(run: PipelineRun):
    from lab.demo.te_post_processing import emulate_post_processing

    for w in run.weights:
        w.manual_post_processing = True
    return emulate_post_processing(run.chunks, [c.module.fp8_weights() for c in run.chunks],
                                   run.backend)


def _recipe_post_processing(run: PipelineRun):
    """Block-scaled recipes: megatron-core's own post-processing rebuilds the weights."""
    if run.opts.recipe in ("delayed", "tensorwise"):
        return lambda: None
    from lab.demo.recipe_post_processing import route_post_processing

    return route_post_processing(run.weights, run.backend)


def _train(opts: DemoOptions, telemetry_path: Optional[str], out_dir: str) -> Dict[str, Any]:
    from lab.demo import checkpoint
    from lab.demo.evidence import EvidenceLog

    def start(run: PipelineRun) -> EvidenceLog:
        return EvidenceLog([c.module for c in run.chunks],
                           [c.module.fp8_weights() for c in run.chunks], run.backend)

    run = PipelineRun(opts, telemetry_path)
    evidence, logs = start(run), []
    result: Dict[str, Any] = {"pp_rank": run.pp_rank, "dp_rank": run.dp_rank, "losses": [],
                              "grads": [], "params": [], "builds_per_step": [], "eval_builds": 0,
                              "records": [], "unlaunched_steps": [], "unlaunched_forwards": 0,
                              "skipped_steps": [], "gather_by_optimizer": [
                                  bool(getattr(c, "overlap_param_gather_with_optimizer_step",
                                               False)) for c in run.chunks],
                              "bucket_groups": [len(getattr(c, "bucket_groups", c.buffers))
                                                for c in run.chunks],
                              "chain_handles": chain_handles(run.optimizer, len(run.chunks)),
                              "optimizer_instances": optimizer_instances(run.chunks),
                              "forced_sync_watch": run.aligner.forced_syncs is not None,
                              "forced_sync_rebuilds": 0}
    for step in range(opts.steps):
        after_load = opts.resume_at == step
        first_of_loop = after_load or (opts.rebinding_loop and step == 0)
        if after_load:  # save, then continue in a new run loaded from the checkpoint
            checkpoint.save(run, out_dir)
            result["records"] += [asdict(r) for r in run.aligner.records]
            logs.append(evidence.as_dict())
            evidence.close()
            run.close()
            run = PipelineRun(opts, telemetry_path)
            run.aligner.set_next_step(step + 1)  # step `step` itself runs without launches
            checkpoint.load(run, out_dir)
            evidence = start(run)
            result["unlaunched_steps"].append(step)
        if first_of_loop and not after_load:
            result["unlaunched_steps"].append(step)
            run.aligner.set_next_step(step + 1)
        with checkpoint.first_step_after_load(run) if first_of_loop else nullcontext():
            _train_step(run, evidence, step, result)
        _foreign_forward(run.probe)
        if opts.eval_after_each_step:
            records_before = len(run.aligner.records)
            built_before = [w.transposes_built for w in run.weights]
            run.evaluate(step)
            result["eval_builds"] += sum(w.transposes_built - b
                                         for w, b in zip(run.weights, built_before))
            result["eval_builds"] += len(run.aligner.records) - records_before
    result["records"] += [asdict(r) for r in run.aligner.records]
    logs.append(evidence.as_dict())
    result["evidence"] = {key: [row for log in logs for row in log[key]] for key in logs[0]}
    result["unlaunched_forwards"] = run.aligner.unlaunched_forwards
    if run.aligner.forced_syncs is not None:
        result["forced_sync_rebuilds"] = run.aligner.forced_syncs.rebuilt
    evidence.close()
    run.close()
    return result


def _train_step(run: PipelineRun, evidence: Any, step: int, result: Dict[str, Any]) -> None:
    built_before = [w.transposes_built for w in run.weights]
    evidence.step = step
    loss = run.forward_backward(step)
    evidence.step = -1
    result["builds_per_step"].append(
        [w.transposes_built - b for w, b in zip(run.weights, built_before)])
    result["grads"].append(_digest([b.grad_data for c in run.chunks for b in c.buffers]))
    if step == run.opts.skip_step_at:
        for buffer in (b for c in run.chunks for b in c.buffers):
            buffer.grad_data.fill_(float("inf"))
    if not run.optimizer_step():
        result["skipped_steps"].append(step)
    result["params"].append(_digest([p for c in run.chunks for p in _settled_params(c)]))
    if loss is not None:
        result["losses"].append(loss)


def _settled_params(chunk: Any) -> List[torch.Tensor]:
    """The chunk's parameter bytes right after the optimizer step. A chunk whose all-gather the
    optimizer step dispatched (overlap_param_gather_with_optimizer_step) is still receiving the
    other ranks' shards, so only this rank's own shard of each bucket is settled."""
    if not getattr(chunk, "overlap_param_gather_with_optimizer_step", False):
        return [b.param_data for b in chunk.buffers]
    out = []
    for group in chunk.bucket_groups:
        n, r = _shard_of(group)
        for bucket in group.buckets:
            size = bucket.param_data.numel() // n
            out.append(bucket.param_data.view(-1)[r * size:(r + 1) * size])
    return out


def _shard_of(group: Any) -> tuple:
    """(ranks sharing the bucket, this rank's index among them). megatron-core 0.9 shards over
    the whole data-parallel group (``data_parallel_*``); 0.10 on over one distributed-optimizer
    instance (``intra_distributed_optimizer_instance_*``)."""
    if hasattr(group, "intra_distributed_optimizer_instance_size"):
        return (group.intra_distributed_optimizer_instance_size,
                group.intra_distributed_optimizer_instance_rank)
    return group.data_parallel_world_size, group.data_parallel_rank


def _quiet_cpu_warnings() -> None:
    """Silence, in this CPU rank only, the warnings every rank would print for things that are
    expected here: megatron-core's fallbacks without apex / TE, torch's renamed collectives, and
    the schedule reading ``.grad`` of received activations (attributed to the compat mode)."""
    for message in (r".*(Apex|Transformer Engine).* not installed", r".*is deprecated. Please use",
                    r"The \.grad attribute of a Tensor that is not a leaf"):
        warnings.filterwarnings("ignore", message=message)


@contextmanager
def distributed(rank: int, world_size: int, opts: DemoOptions) -> Iterator[None]:
    """Process group + megatron-core model-parallel state for one rank, torn down on exit.

    CPU runs use gloo and the CPU compat shims (refused on machines with a GPU); CUDA runs use
    NCCL on GPU ``rank % device_count`` and no shim at all.
    """
    compat = None
    timeout = {} if opts.pg_timeout_s is None else {"timeout": timedelta(seconds=opts.pg_timeout_s)}
    if opts.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl", rank=rank, world_size=world_size, **timeout)
    else:
        torch.set_num_threads(1)
        _quiet_cpu_warnings()
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **timeout)
        from lab.demo.cpu_redirects import enable_cpu_compat
        compat = enable_cpu_compat()
    try:
        from megatron.core import parallel_state

        minutes = {} if opts.pg_timeout_s is None else {
            "distributed_timeout_minutes": opts.pg_timeout_s / 60}  # its groups' own timeout
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=opts.pp,
            virtual_pipeline_model_parallel_size=opts.vp, **minutes, **instance_kwargs(opts))
        yield
        dist.barrier()
        parallel_state.destroy_model_parallel()
    finally:
        if compat is not None:
            compat.undo()
        dist.destroy_process_group()


def run_rank(rank: int, world_size: int, port: int, opts: DemoOptions, out_dir: str,
             telemetry: bool) -> None:
    """Entry point of one spawned rank; writes ``rank{N}.json`` (and telemetry) to out_dir."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        with distributed(rank, world_size, opts):
            # {rank}: the engine puts in the global rank (this process's rank) and checks it
            path = os.path.join(out_dir, "telemetry.rank{rank}.jsonl") if telemetry else None
            result = _train(opts, path, out_dir)
            result["rank"] = rank
            write_result(out_dir, rank, result)
    except Exception as err:
        write_error(out_dir, rank, err)  # for the launcher to report with the other ranks'
        raise
