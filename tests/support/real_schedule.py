"""The installed megatron-core's own validation of an interleaved shape, run on the CPU in one
process: its ``forward_backward_pipelining_with_interleaving`` (what ``get_forward_backward_func``
returns with VP) up to where the schedule starts, and 0.7's ``initialize_model_parallel`` up to
where it creates process groups. The process-group queries answer the shape asked about; the
first call after the checks (``get_model_type`` / ``get_rank``) stops the run. Returns
megatron-core's own error message, or None where it accepts the shape."""

from __future__ import annotations

from typing import Optional

import torch


class _Passed(Exception):
    """megatron-core got past its checks."""


def _stop(*_args, **_kwargs):
    raise _Passed


def schedule_error(monkeypatch, pp: int, vp: int, microbatches: int,
                   group_size: Optional[int] = None) -> Optional[str]:
    """megatron-core's interleaved schedule on PP ``pp``, VP ``vp``, M ``microbatches`` (and N
    where the version has it): its RuntimeError/ValueError message, or None."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=pp * vp, hidden_size=8, num_attention_heads=2,
                  pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                  pipeline_dtype=torch.float32)
    if group_size is not None:
        kwargs["microbatch_group_size_per_vp_stage"] = group_size
    config = TransformerConfig(**kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a: pp)
        patch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a: 0)
        patch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                      lambda *a: vp)
        patch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
        patch.setattr(schedules, "get_model_type", _stop)
        func = get_forward_backward_func()
        assert func is schedules.forward_backward_pipelining_with_interleaving, func
        chunks = []
        for _ in range(vp):
            chunk = torch.nn.Linear(2, 2)
            chunk.config = config
            chunks.append(chunk)
        try:
            func(forward_step_func=None, data_iterator=[iter(())] * vp, model=chunks,
                 num_microbatches=microbatches, seq_length=4, micro_batch_size=1,
                 forward_only=False)
        except _Passed:
            return None
        except (RuntimeError, ValueError) as err:
            return str(err)
    raise AssertionError("the schedule neither refused the shape nor reached its start")


def model_parallel_error(monkeypatch, pp: int, vp: int) -> Optional[str]:
    """megatron-core's ``initialize_model_parallel(1, pp, vp)`` on a world of ``pp`` processes
    (one data-parallel replica): its RuntimeError message, or None."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with monkeypatch.context() as patch:
        patch.setattr(dist, "is_initialized", lambda: True)
        patch.setattr(dist, "get_world_size", lambda *a: pp)
        patch.setattr(dist, "get_rank", _stop)
        patch.setattr(dist, "new_group", _stop)
        for name in ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
                     "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"):
            patch.setattr(parallel_state, name, getattr(parallel_state, name, None),
                          raising=False)
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vp)
        except _Passed:
            return None
        except RuntimeError as err:
            return str(err)
    raise AssertionError("initialize_model_parallel neither refused the shape nor went on")
