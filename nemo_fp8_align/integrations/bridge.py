"""The plugin in Megatron-Bridge's training loop (megatron-bridge 0.6.x), as one callback::

    from nemo_fp8_align.integrations.bridge import FP8TransposeAlignCallback
    pretrain(config, forward_step_func, callbacks=[FP8TransposeAlignCallback()])

What Bridge 0.6.2 does around it (``megatron/bridge/training/``): the training setup's ``setup()`` builds the
DDP chunks, the optimizer and the checkpoint load, then binds ``config.param_sync_func =
[chunk.start_param_sync for chunk in model]`` (``_update_model_config_funcs``). ``train.py::train``
fires ``on_train_start`` just before its loop; only after that does it stash ``param_sync_func``,
set it to None for the first iteration (forward pre-hooks off) and put the stash back after that
iteration. The callback attaches at ``on_train_start``: it checks Bridge's config with the
startup rules (mapped as Megatron-LM's arguments) and attaches to the chunks the way
:mod:`~nemo_fp8_align.integrations.megatron_lm` does, pointing the already bound list at the
chunks' wrapped ``start_param_sync``, so the stash and its restore carry the wrappers.
``on_train_end`` (after ``train()``'s forced all-gather) detaches it.

Not ``on_data_init_start``: Bridge 0.6.2's ``setup`` raises ``ValueError("num_epochs is not
supported with on_data_init_start callbacks")`` whenever ``train.num_epochs`` is set and any
callback registers that event.

Duck-typed: Bridge's ``CallbackManager.add`` registers each method named after one of its events,
from any object, so this module imports neither megatron-bridge (whose package import pulls in
transformers and Transformer Engine, which raises ``RuntimeError`` without CUDA) nor TE.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional

from nemo_fp8_align.config import AlignConfig
from nemo_fp8_align.integrations import megatron_lm

__all__ = ["FP8TransposeAlignCallback", "bridge_args"]


def bridge_args(cfg: Any) -> SimpleNamespace:
    """Bridge's ``ConfigContainer`` as the Megatron-LM argument names the startup check reads."""
    model, ddp = getattr(cfg, "model", None), getattr(cfg, "ddp", None)
    optim, train = getattr(cfg, "optimizer", None), getattr(cfg, "train", None)

    def of(node: Any, name: str, default: Any = None) -> Any:
        return getattr(node, name, default) if node is not None else default

    return SimpleNamespace(
        pipeline_model_parallel_size=of(model, "pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=of(model, "virtual_pipeline_model_parallel_size"),
        tensor_model_parallel_size=of(model, "tensor_model_parallel_size", 1),
        context_parallel_size=of(model, "context_parallel_size", 1),
        expert_model_parallel_size=of(model, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=of(model, "expert_tensor_parallel_size"),
        num_experts=of(model, "num_moe_experts"), num_layers=of(model, "num_layers"),
        sequence_parallel=of(model, "sequence_parallel", False),
        fp8=of(model, "fp8"), fp8_recipe=of(model, "fp8_recipe", "delayed"),
        fp8_param_gather=of(ddp, "fp8_param_gather", False) or of(model, "fp8_param", False),
        transformer_impl=of(model, "transformer_impl", "transformer_engine"),
        first_last_layers_bf16=of(model, "first_last_layers_bf16", False),
        cuda_graph_impl=of(model, "cuda_graph_impl", "none"),
        use_distributed_optimizer=of(ddp, "use_distributed_optimizer", False),
        overlap_param_gather=of(ddp, "overlap_param_gather", False),
        overlap_grad_reduce=of(ddp, "overlap_grad_reduce", False),
        align_param_gather=of(ddp, "align_param_gather", False),
        use_megatron_fsdp=of(ddp, "use_megatron_fsdp", False),
        overlap_param_gather_with_optimizer_step=of(
            optim, "overlap_param_gather_with_optimizer_step", False),
        micro_batch_size=of(train, "micro_batch_size"),
        global_batch_size=of(train, "global_batch_size"),
        rampup_batch_size=of(train, "rampup_batch_size"),
        microbatch_group_size_per_vp_stage=of(model, "microbatch_group_size_per_vp_stage"),
        log_interval=of(getattr(cfg, "logger", None), "log_interval", 1))


class FP8TransposeAlignCallback:
    """Attaches the aligned FP8-transpose engine at Bridge's ``on_train_start`` and detaches it
    at ``on_train_end``.

    Args: as :func:`nemo_fp8_align.integrations.megatron_lm.attach` (``backend``,
    ``weights_of``, ``align_config``, ``pg_collection``: None takes the DDP chunks' own groups,
    which Bridge builds them with); ``check`` runs the startup rules on Bridge's config.
    """

    def __init__(self, *, backend: Any = None, weights_of: Any = None,
                 align_config: AlignConfig = AlignConfig(), check: bool = True,
                 pg_collection: Any = None) -> None:
        if not isinstance(align_config, AlignConfig):
            raise TypeError(f"align_config={align_config!r}: pass an AlignConfig")
        self.backend, self.weights_of = backend, weights_of
        self.align_config, self.check = align_config, check
        self.pg_collection = pg_collection
        self.aligner: Optional[Any] = None
        self._chunks: List[Any] = []

    def on_train_start(self, context: Any) -> None:
        model = list(context.model)
        if self.aligner is not None:
            if _same(model, self._chunks):
                return  # attached to these chunks already
            # An in-process restart rebuilt the model without on_train_end: let go of the old
            # chunks (and their config) before attaching to the new ones.
            self.on_train_end(context)
        state = getattr(context, "state", None)
        cfg = getattr(state, "cfg", None)
        args = bridge_args(cfg) if self.check and cfg is not None else None
        self.aligner = megatron_lm.attach(
            model, backend=self.backend, weights_of=self.weights_of,
            align_config=self.align_config, args=args, log_metrics=False,
            step_number=_train_step(state), pg_collection=self.pg_collection)
        self._chunks = model

    def on_train_end(self, context: Any) -> None:
        if self.aligner is not None:
            aligner, chunks = self.aligner, self._chunks
            self.aligner, self._chunks = None, []
            # train()'s end on every rank (the context's model is ours): what a rank still holds
            # stops every rank; on_train_start's restart call (another model) stays local.
            aligner.detach(agree=_same(list(getattr(context, "model", None) or []), chunks))


def _same(model: List[Any], chunks: List[Any]) -> bool:
    return len(model) == len(chunks) and all(a is b for a, b in zip(model, chunks))


def _train_step(state: Any) -> Any:
    """Bridge's step counter (``state.train_state.step``) for the records, when it has one."""
    if getattr(getattr(state, "train_state", None), "step", None) is None:
        return None
    return lambda: int(state.train_state.step)
