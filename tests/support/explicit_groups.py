"""A multi-process CPU run whose model is built with explicit process groups that are not the
global ``parallel_state`` (megatron-core >= 0.14: DDP, optimizer, schedule and gradient
finalisation all take a ``ProcessGroupCollection``).

4 gloo processes; ``parallel_state`` is initialised for PP=2 x DP=2 (its pipeline groups [0, 2]
and [1, 3]), while the model runs PP=4 x DP=1 (one pipeline group [0, 1, 2, 3]) with VP=2, on
the demo's GPT chunks and reference FP8 weights. Each rank writes ``rank{N}.json``: the model's
pipeline rank and size, what ``parallel_state`` says, and the aligner's records.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from lab.demo.ranks import read_results, spawn_and_wait, write_error, write_result
from lab.demo.ranks import DemoRankError

WORLD = 4
MODEL_PP, VP, M, STEPS = 4, 2, 4, 2
GLOBAL_PP = 2
TIMEOUT_S = 60.0


def _groups() -> Any:
    """The model's ProcessGroupCollection: PP=4 over every rank, the others of one rank each.
    Every rank creates every group in the same order (torch.distributed's rule)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    timeout = timedelta(seconds=TIMEOUT_S)
    pp = dist.new_group(list(range(WORLD)), timeout=timeout)
    singles = {}
    # The demo GPT's embedding is not tied to its head: no embedding all-reduce, a rank's own
    # group (None would make finalize_model_grads look parallel_state's up).
    for name in ("dp", "tp", "cp", "expt_dp", "embd"):
        for r in range(WORLD):
            group = dist.new_group([r], timeout=timeout)
            if r == rank:
                singles[name] = group
    return ProcessGroupCollection(
        pp=pp, tp=singles["tp"], cp=singles["cp"], dp=singles["dp"], dp_cp=singles["dp"],
        intra_dp_cp=singles["dp"], expt_dp=singles["expt_dp"],
        intra_expt_dp=singles["expt_dp"], tp_cp=singles["tp"], mp=pp, ep=singles["tp"],
        expt_tp=singles["tp"], tp_ep=singles["tp"], tp_ep_pp=pp, tp_dp_cp=singles["dp"],
        embd=singles["embd"], pos_embd=singles["embd"],
        inter_dist_opt=None, intra_dist_opt=singles["dp"])


def _train(out_dir: str) -> Dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from nemo_fp8_align.backends.reference import ReferenceBackend
    from nemo_fp8_align.config import AlignConfig
    from lab.demo.model import DemoModelConfig, GPTChunk
    from lab.demo.train import DemoOptions, _batches, _forward_step
    from nemo_fp8_align.integrations.megatron_core import align_fp8_transposes

    parallel_state.initialize_model_parallel(1, GLOBAL_PP, VP,
                                             distributed_timeout_minutes=TIMEOUT_S / 60)
    pgc = _groups()
    pp_rank = pgc.pp.rank()
    model_cfg = DemoModelConfig()
    config = TransformerConfig(
        num_layers=MODEL_PP * VP, hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_heads, pipeline_model_parallel_size=MODEL_PP,
        virtual_pipeline_model_parallel_size=VP, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, batch_p2p_comm=False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True, align_param_gather=True, bucket_size=20000)
    backend = ReferenceBackend()
    chunks = []
    for c in range(VP):
        module = GPTChunk(model_cfg, config=config, stage=c * MODEL_PP + pp_rank, vp_stage=c,
                          pre_process=pp_rank == 0 and c == 0,
                          post_process=pp_rank == MODEL_PP - 1 and c == VP - 1, backend=backend)
        chunks.append(DistributedDataParallel(config, ddp_config, module,
                                              disable_bucketing=c > 0, pg_collection=pgc))
    config.param_sync_func = [chunk.start_param_sync for chunk in chunks]
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pgc)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                        params_dtype=torch.float32), chunks, use_gloo_process_groups=False,
        pg_collection=pgc)
    # No pg_collection here: the aligner must find the groups on the DDP chunks.
    aligner = align_fp8_transposes(
        chunks, num_microbatches=M, backend=backend,
        weights_of=lambda chunk: chunk.module.fp8_weights(), config=config,
        align_config=AlignConfig())
    weights = [w for chunk in chunks for w in chunk.module.fp8_weights()]
    fwd_bwd = get_forward_backward_func(pp_size=MODEL_PP, vp_size=VP)
    p2p = P2PCommunicator(pp_group=pgc.pp, config=config)
    opts = DemoOptions(pp=MODEL_PP, vp=VP, microbatches=M)
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = [dict(b) for b in _batches(opts, step, 0)]
        fwd_bwd(forward_step_func=_forward_step, data_iterator=[iter(data) for _ in chunks],
                model=chunks, num_microbatches=M, seq_length=model_cfg.seq_length,
                micro_batch_size=opts.micro_batch_size, forward_only=False,
                p2p_communicator=p2p, pg_collection=pgc)
        optimizer.step()
        for w in weights:
            w.invalidate()
    result = dict(
        model_pp_rank=pp_rank, model_pp_size=pgc.pp.size(),
        global_pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        global_pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        aligner_pp_rank=aligner.pp_rank, aligner_pp_size=aligner.schedule.pp,
        aligner_dp_rank=aligner.dp_rank, steps=aligner._step,
        records=[dict(step=r.step, pp_rank=r.pp_rank, chunk=r.chunk, vmid=r.vmid, slot=r.slot,
                      aligned_slot=r.aligned_slot, transposed=r.transposed) for r in aligner.records])
    aligner.detach()

    def attach(pg_collection: Any) -> Any:
        return align_fp8_transposes(
            chunks, num_microbatches=M, backend=backend, config=config,
            weights_of=lambda chunk: chunk.module.fp8_weights(), pg_collection=pg_collection)

    again = attach(pgc)  # the keyword: the same groups, given explicitly
    result.update(kw_pp_rank=again.pp_rank, kw_pp_size=again.schedule.pp)
    again.detach()
    try:  # parallel_state's pipeline, given explicitly, disagrees with the chunks'
        attach(ProcessGroupCollection(pp=parallel_state.get_pipeline_model_parallel_group()))
        result.update(disagree_pg="not refused")
    except ValueError as err:
        result.update(disagree_pg=str(err))
    # A chunk built without explicit groups keeps parallel_state's.
    other = DistributedDataParallel(config, ddp_config, torch.nn.Linear(4, 4))
    result.update(disagree_chunks=_refusal([chunks[0], other], None))
    return result


def _refusal(chunks: List[Any], pg_collection: Any) -> str:
    from nemo_fp8_align.adapters.groups import resolve_ranks

    try:
        resolve_ranks(chunks, pg_collection)
    except ValueError as err:
        return str(err)
    return "not refused"


def run_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One spawned rank: gloo, the CPU compat shims, the run; its result or error to out_dir."""
    from lab.demo.cpu_redirects import enable_cpu_compat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    compat = enable_cpu_compat()
    try:
        write_result(out_dir, rank, _train(out_dir))
    except Exception as err:  # noqa: BLE001 - reported to the test by run_all
        write_error(out_dir, rank, err)
    compat.undo()
    dist.destroy_process_group()


def run_all(out_dir: str) -> List[Dict[str, Any]]:
    """Spawn the 4 ranks, wait (bounded), return each rank's result; raise with their errors."""
    codes = spawn_and_wait(run_rank, WORLD, (out_dir,), TIMEOUT_S)
    try:
        return read_results(out_dir, codes)
    except DemoRankError as err:  # every rank's traceback, for the test's output
        raise RuntimeError("\n".join([str(err), *err.tracebacks.values()])) from err
