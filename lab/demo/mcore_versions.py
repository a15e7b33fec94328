"""What the demo asks of each megatron-core version's own classes (0.7.0 on): the config fields
a version has, 0.7's DDP group arguments, and the DistributedOptimizer's all-gather chain of 0.7
and 0.8 (its per-chunk counts, Megatron-LM's ``--delay-param-gather`` binding)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Dict, List

__all__ = ["chain_handles", "ddp_groups", "delayed_param_gather", "instance_kwargs",
           "optimizer_instances", "own_fields"]


def chain_handles(optimizer: Any, chunks: int) -> List[int]:
    """megatron-core 0.7/0.8: each chunk's number of chained all-gathers (buckets); [] where
    the DDP chunks own the all-gather."""
    handles = getattr(optimizer, "model_index_to_all_gather_handle_index_map", None)
    return [] if handles is None else [len(handles.get(c, [])) for c in range(chunks)]


def delayed_param_gather(optimizer: Any, chunks: int) -> List[Any]:
    """megatron-core 0.7/0.8's ``--delay-param-gather`` binding, each entry for its own chunk:
    the schedule's call for chunk c waits c's chained all-gathers (and so dispatches the next)."""
    if not hasattr(optimizer, "model_index_to_all_gather_handle_index_map"):
        raise ValueError("delay_param_gather: megatron-core 0.7/0.8's DistributedOptimizer only "
                         "(>= 0.9 launches through the chunks' start_param_sync)")
    return [partial(_finish_chunk, optimizer, c) for c in range(chunks)]


def _finish_chunk(optimizer: Any, chunk: int, *params: Any) -> None:
    optimizer.finish_param_sync(chunk)


def optimizer_instances(chunks: List[Any]) -> List[Dict[str, Any]]:
    """Per chunk, the distributed-optimizer instances its DDP config asks for and the sizes of
    the groups its bucket groups all-gather over (0.10 on: one instance's data-parallel ranks;
    megatron-core 0.19 takes those groups from parallel_state, not from the config)."""
    return [{"instances": getattr(c.ddp_config, "num_distributed_optimizer_instances", 1),
             "gather_group": sorted({bg.intra_distributed_optimizer_instance_size
                                     for bg in getattr(c, "bucket_groups", [])
                                     if hasattr(bg, "intra_distributed_optimizer_instance_size")})}
            for c in chunks]


def instance_kwargs(opts: Any) -> Dict[str, int]:
    """The demo's ``dist_opt_instances`` as megatron-core's keyword, given only where it is not
    the default (before 0.10 there is no such keyword; the demo's input check refuses more than
    one instance there)."""
    n = opts.dist_opt_instances
    return {} if n == 1 else {"num_distributed_optimizer_instances": n}


def own_fields(config_class: Any, versioned: Dict[str, Any], **always: Any) -> Dict[str, Any]:
    """``always`` plus those of ``versioned`` that this megatron-core's ``config_class`` has:
    no field a version lacks is passed to it."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return dict(always, **{k: v for k, v in versioned.items() if k in names})


def ddp_groups() -> Dict[str, Any]:
    """megatron-core 0.7's DistributedDataParallel takes its data-parallel groups as arguments
    (0.8 on reads them from parallel_state itself)."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    if "data_parallel_group" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {}
    return {"data_parallel_group":
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            "expert_data_parallel_group": parallel_state.get_data_modulo_expert_parallel_group()}
