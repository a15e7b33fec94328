"""megatron-core's real config classes as the tests need them (issue 18: no test builds a
SimpleNamespace where a real config class exists)."""

import dataclasses

import torch


def has_group_size() -> bool:
    """Whether the installed megatron-core's TransformerConfig has
    ``microbatch_group_size_per_vp_stage`` (0.10 on); before it, the interleaved schedule runs
    forwards in groups of PP (the schedule model's ``legacy_order``)."""
    from megatron.core.transformer import TransformerConfig

    return "microbatch_group_size_per_vp_stage" in {f.name for f in
                                                    dataclasses.fields(TransformerConfig)}


def model_config(pp=1, vp=None, **fields):
    """The ``TransformerConfig`` of a PP x VP pipeline: the smallest model its checks accept
    (one layer per chunk), ``fields`` on top (e.g. ``param_sync_func``)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=pp * (vp or 1), hidden_size=8, num_attention_heads=2,
                             pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vp,
                             pipeline_dtype=torch.float32, **fields)
