"""Save and resume the demo the way Megatron-LM's training loop does, to test the plugin there.

Save: the DDP pre-hooks are disabled with a forced synchronous all-gather (so the saved model
holds the current parameters, not half-gathered buffers), the model chunks' and optimizer's state
dicts and the DistributedOptimizer's sharded parameter state are written, and the pre-hooks are
enabled again. Resume: a new run (new model, optimizer and aligner) loads them, and its first
step runs with the pre-hooks disabled and ``config.param_sync_func = None``, as Megatron-LM's
first iteration after a load does; both come back after that step's optimizer step.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["save", "load", "first_step_after_load"]


def _paths(run: Any, directory: str) -> tuple:
    rank = torch.distributed.get_rank()
    return (os.path.join(directory, f"model_optim.rank{rank}.pt"),
            os.path.join(directory, f"param_state.pp{run.pp_rank}.pt"))


def _adam_states(optimizer: Any) -> list:
    """The inner torch optimizer's per-parameter state dicts, in a fixed order."""
    states = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        states += [inner.state[p] for group in inner.param_groups for p in group["params"]]
    return states


def save(run: Any, directory: str) -> None:
    """Write ``run``'s model and optimizer state (collective over the data-parallel group)."""
    for chunk in run.chunks:
        chunk.disable_forward_pre_hook()  # param_sync=True: a forced, synchronous all-gather
    own, params = _paths(run, directory)
    # Without apex/TE, megatron-core falls back to torch's AdamW, whose per-parameter "step"
    # its parameter-state file leaves out (0.12.3): keep it in this rank's file.
    torch.save({"model": [c.state_dict() for c in run.chunks],
                "optimizer": run.optimizer.state_dict(),
                "adam_steps": [st.get("step") for st in _adam_states(run.optimizer)]}, own)
    run.optimizer.save_parameter_state(params)  # written by data-parallel rank 0
    for chunk in run.chunks:
        chunk.enable_forward_pre_hook()


def load(run: Any, directory: str) -> None:
    """Load what :func:`save` wrote into a freshly built ``run``."""
    torch.distributed.barrier()  # data-parallel rank 0's parameter-state file is complete
    own, params = _paths(run, directory)
    state = torch.load(own, weights_only=False)
    for chunk, chunk_state in zip(run.chunks, state["model"]):
        chunk.load_state_dict(chunk_state)
    run.optimizer.load_state_dict(state["optimizer"])
    adam = _adam_states(run.optimizer)
    for st in adam:
        st.pop("step", None)
    with torch.no_grad():  # its shards of fp32 main parameters are leaves that require grad
        run.optimizer.load_parameter_state(params)
    for st, step in zip(adam, state["adam_steps"]):
        if step is not None:
            st["step"] = step


@contextmanager
def first_step_after_load(run: Any) -> Iterator[None]:
    """The first training step after a load, as Megatron-LM runs it (wrap forward, backward
    and optimizer step)."""
    for chunk in run.chunks:
        _disable_pre_hook_without_sync(chunk)
    saved, run.config.param_sync_func = run.config.param_sync_func, None
    try:
        yield
    finally:
        for chunk in run.chunks:
            chunk.enable_forward_pre_hook()
        run.config.param_sync_func = saved


def _disable_pre_hook_without_sync(chunk: Any) -> None:
    """``disable_forward_pre_hook(param_sync=False)``; megatron-core 0.10 has no such argument
    and always synchronises the parameters there (as its Megatron-LM did after a load)."""
    if "param_sync" in inspect.signature(chunk.disable_forward_pre_hook).parameters:
        chunk.disable_forward_pre_hook(param_sync=False)
    else:
        chunk.disable_forward_pre_hook()
