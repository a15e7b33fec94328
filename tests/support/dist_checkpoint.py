"""NeMo 2.3.3's distributed checkpoints (torch_dist format) on the CPU: for tests and the CPU
smoke run ONLY, applied by :func:`support.cpu_nemo.enable_nemo_cpu_compat`.

The smoke run's save/resume pair saves through NeMo's own checkpoint callback and resumes
through exp_manager, as on a cluster. In the CPU environment (no tensorstore, no apex or
Transformer Engine, torch 2.13 with megatron-core 0.12.3) that path fails in four places,
none of which concerns the plugin; each patch below says where and why. Nothing changes the
checkpoint's content or format (NeMo's default, ``model.dist_ckpt_format=torch_dist``).

Verified with nemo_toolkit 2.3.3, megatron-core 0.12.3, torch 2.13 (CPU build).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

__all__ = ["patch_dist_checkpointing"]

#: ``patch(owner, name, value)``: sets the attribute and remembers the old one for undo.
Patch = Callable[[Any, str, Any], None]


def patch_dist_checkpointing(patch: Patch) -> None:
    """Apply the four fixes through ``patch`` (NemoCpuCompat's, so ``undo`` restores them)."""
    _complete_dist_ckpt_io_imports(patch)
    _pass_serialization_format(patch)
    _initialise_empty_torch_adam_state_before_load(patch)
    _keep_torch_adam_step_out_of_the_state_copy(patch)


def _complete_dist_ckpt_io_imports(patch: Patch) -> None:
    """Why: with mcore_gpt=True, MegatronTrainerBuilder always adds DistributedCheckpointIO.
    ``nemo.utils.callbacks.dist_ckpt_io`` imports megatron-core's checkpointing names in one try
    block, one of them the tensorstore strategy (used by the deprecated zarr format only);
    without the tensorstore package the names imported after it stay undefined and
    HAVE_MEGATRON_CORE False, so the constructor raises ImportError and a save or load would
    raise NameError. Bind those names from megatron-core; zarr stays unavailable."""
    import importlib

    dist_ckpt_io = importlib.import_module("nemo.utils.callbacks.dist_ckpt_io")
    if dist_ckpt_io.HAVE_MEGATRON_CORE:
        return
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import dict_utils, mapping, serialization, validation
    from megatron.core.dist_checkpointing.strategies import async_utils, base, fully_parallel
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    names = {
        "dist_checkpointing": dist_checkpointing,
        "extract_matching_values": dict_utils.extract_matching_values,
        "ShardedBase": mapping.ShardedBase,
        "get_default_load_sharded_strategy": serialization.get_default_load_sharded_strategy,
        "get_default_save_sharded_strategy": serialization.get_default_save_sharded_strategy,
        "AsyncCallsQueue": async_utils.AsyncCallsQueue,
        "AsyncRequest": async_utils.AsyncRequest,
        "SaveShardedStrategy": base.SaveShardedStrategy,
        "FullyParallelLoadStrategyWrapper": fully_parallel.FullyParallelLoadStrategyWrapper,
        "FullyParallelSaveStrategyWrapper": fully_parallel.FullyParallelSaveStrategyWrapper,
        "TorchDistSaveShardedStrategy": torch_strategy.TorchDistSaveShardedStrategy,
        "StrictHandling": validation.StrictHandling,
        "get_data_parallel_group": parallel_state.get_data_parallel_group,
        "HAVE_MEGATRON_CORE": True,
    }
    for name, value in names.items():
        patch(dist_ckpt_io, name, value)


def _pass_serialization_format(patch: Patch) -> None:
    """Why: megatron-core 0.12.3's torch_dist writer
    (megatron.core.dist_checkpointing.strategies.filesystem_async) calls torch's private
    ``_write_item`` without the ``serialization_format`` argument torch 2.13 requires, so
    every save fails in its writer processes ("_write_item() missing 1 required positional
    argument: 'serialization_format'"). Pass torch's default,
    SerializationFormat.TORCH_SAVE (FileSystemWriter's own default, and the only format the
    torch versions megatron-core 0.12.3 was written for had). A torch/megatron-core version
    mismatch, not a CPU one: patched only where torch's signature requires the argument."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    write_item = filesystem_async._write_item
    if "serialization_format" not in inspect.signature(write_item).parameters:
        return
    torch_save = filesystem.SerializationFormat.TORCH_SAVE

    def write_item_torch_save(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 6:  # the writer passes five arguments positionally, no format
            kwargs.setdefault("serialization_format", torch_save)
        return write_item(*args, **kwargs)

    # A module attribute: the writer processes are forked and inherit it.
    patch(filesystem_async, "_write_item", write_item_torch_save)


def _initialise_empty_torch_adam_state_before_load(patch: Patch) -> None:
    """Why: without apex or TE, megatron-core 0.12.3's DistributedOptimizer runs torch's Adam,
    and ``sharded_state_dict(is_loading=True)`` (NeMo's load_checkpoint builds the load
    template with it) first calls ``state_dict()``, which asserts that every parameter's Adam
    state holds one common ``step`` (megatron.core.optimizer.distrib_optimizer,
    ``assert len(steps) == 1``). In a fresh process nothing has stepped yet, the state is
    empty and the load fails. Initialise
    the empty state first with megatron-core's own ``init_state_fn`` (zero moments) and step 0:
    a template only; the load then overwrites the moments in place and the step from the
    checkpoint (DistributedOptimizer.load_state_dict sets every ``step`` from its param groups)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    original = cls.sharded_state_dict

    def sharded_state_dict(self: Any, model_sharded_state_dict: Any, is_loading: bool = False,
                           **kwargs: Any) -> Any:
        if is_loading and len(self.optimizer.state) == 0 and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        return original(self, model_sharded_state_dict, is_loading, **kwargs)

    patch(cls, "sharded_state_dict", sharded_state_dict)


def _keep_torch_adam_step_out_of_the_state_copy(patch: Patch) -> None:
    """Why: loading then copies each parameter's saved tensors into its optimizer state
    (DistributedOptimizer._set_main_param_and_optimizer_states, ``dst_tensors[key].copy_(
    tensors[key])`` for every key of the state). Torch's Adam state also holds ``step``, which
    the checkpoint keeps in the param groups, not per parameter, so the copy raises
    ``KeyError: 'step'``. Leave ``step`` (already set from the param groups) out of that copy."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    if not hasattr(cls, "_set_main_param_and_optimizer_states"):
        return  # megatron-core < 0.12 (NeMo 2.0-2.2's): no such per-parameter state copy
    original = cls._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> Any:
        if ("step" in tensors or self.config.use_precision_aware_optimizer
                or self.ddp_config.use_custom_fsdp):
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    patch(cls, "_set_main_param_and_optimizer_states", set_main_param_and_optimizer_states)
