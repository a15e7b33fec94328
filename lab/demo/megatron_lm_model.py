"""The demo GPT as a Megatron-LM ``ModelConfig`` (megatron-core >= 0.19's ``megatron.training``):
``pretrain(cfg_container, ...)`` builds it through its model-builder path, which wraps the chunks
in DDP and then runs ``ModelConfig.post_wrap_hooks`` — where the plugin is attached, the way a
Megatron-LM user attaches it to ``GPTModelConfig``.

Imports megatron.training at import time: only the ``demo --loop megatron-lm`` ranks import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional

from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage,
                                                   is_vp_first_stage, is_vp_last_stage)
from megatron.training.models.base import ModelBuilder, ModelConfig, compose_hooks
from megatron.training.models.dist_utils import unimodal_build_distributed_models

from nemo_fp8_align.backends.reference import ReferenceBackend
from lab.demo.model import DemoModelConfig, GPTChunk

__all__ = ["DemoGPTBuilder", "DemoGPTModelConfig"]


@dataclass
class DemoGPTModelConfig(ModelConfig):
    """The demo GPT's settings plus megatron-core's ``TransformerConfig`` (``transformer``)."""

    builder: ClassVar[str] = "lab.demo.megatron_lm_model.DemoGPTBuilder"
    transformer: Any = None
    demo: DemoModelConfig = field(default_factory=DemoModelConfig)
    virtual_pipeline_model_parallel_size: Optional[int] = None
    #: Shared by every chunk of this rank (the FP8 weights it owns; not serialised).
    backend: Any = field(default_factory=ReferenceBackend, repr=False)
    #: Filled by the builder: this rank's chunks (unwrapped), for the demo's bookkeeping.
    built: List[Any] = field(default_factory=list, repr=False)


class DemoGPTBuilder(ModelBuilder):
    """Builds :class:`~lab.demo.model.GPTChunk` stages and wraps them as
    megatron-core's GPT builder does (virtual stages, DDP), then runs the post-wrap hooks."""

    def build_model(self, pg_collection: Any, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, vp_stage: Optional[int] = None) -> Any:
        cfg: DemoGPTModelConfig = self._model_config
        vp, pp = cfg.virtual_pipeline_model_parallel_size, pg_collection.pp
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp) and is_pp_first_stage(pp)
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp) and is_pp_last_stage(pp)
        stage = (vp_stage or 0) * pp.size() + pp.rank()
        chunk = GPTChunk(cfg.demo, config=cfg.transformer, stage=stage, vp_stage=vp_stage or 0,
                         pre_process=pre_process, post_process=post_process,
                         backend=cfg.backend)
        chunk.pg_collection = pg_collection  # Megatron-LM's train() looks it up on the model
        cfg.built.append(chunk)
        return chunk

    def build_distributed_models(self, pg_collection: Any, ddp_config: Any = None,
                                 overlap_param_gather_with_optimizer_step: bool = False,
                                 use_megatron_fsdp: bool = False, use_torch_fsdp2: bool = False,
                                 wrap_with_ddp: bool = True,
                                 data_parallel_random_init: bool = True,
                                 mixed_precision_wrapper: Any = None, model_type: Any = None,
                                 ) -> List[Any]:
        cfg: DemoGPTModelConfig = self._model_config
        models = unimodal_build_distributed_models(
            self.build_model, cfg.transformer, pg_collection, ddp_config,
            overlap_param_gather_with_optimizer_step, use_megatron_fsdp, use_torch_fsdp2,
            wrap_with_ddp, data_parallel_random_init, None,
            compose_hooks(cfg.pre_wrap_hooks))
        wrapped = compose_hooks(cfg.post_wrap_hooks)(models)
        return wrapped if wrapped is not None else models
