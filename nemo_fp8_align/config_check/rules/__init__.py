"""The startup check's rules, one function per rule (``rule(ctx) -> None``), grouped by what they
read: :mod:`.parallel` (sizes, precision, experts), :mod:`.split` (the layer split), :mod:`.fp8`
(FP8 and the optimizer), :mod:`.batch` (world size, data-parallel size, microbatches) and
:mod:`.model` (the model NeMo builds, the plugin block) and :mod:`.version` (the megatron-core
version checked against). :data:`RULES` is the list, in report
order; every rule runs whatever the others found. A rule whose best fix is a search reports a
fix request (:class:`~..context.FixRequest`) that the command line's fixer answers; no rule
imports the search.
"""

from __future__ import annotations

from typing import Callable, Tuple

from nemo_fp8_align.config_check.context import CheckContext
from nemo_fp8_align.config_check.rules import batch, fp8, model, parallel, refused, split, version

__all__ = ["RULES", "Rule"]

Rule = Callable[[CheckContext], None]

#: Every rule, in report order.
RULES: Tuple[Rule, ...] = (
    model.rule_plugin_block, model.rule_mcore_gpt,
    parallel.rule_pipeline_size, parallel.rule_virtual_pipeline_size,
    version.rule_interleaved_pipeline_size, version.rule_version_options,
    version.rule_version_optimizer,
    parallel.rule_other_parallel_sizes, parallel.rule_cpu_offloading, model.rule_attention_heads,
    split.rule_num_layers,
    split.rule_split_option_values, split.rule_split_options_exclusive,
    split.rule_layer_split,
    fp8.rule_transformer_engine, fp8.rule_fp8_enabled, fp8.rule_fp8_params,
    parallel.rule_megatron_amp_o2, fp8.rule_fp8_format, fp8.rule_fp8_recipe,
    fp8.rule_transpose_cache, fp8.rule_bf16_edge_layers, fp8.rule_apex_current_scaling,
    fp8.rule_gather_with_optimizer, refused.rule_refusals,
    fp8.rule_optimizer_name, fp8.rule_overlap_param_sync, fp8.rule_overlap_grad_sync,
    fp8.rule_align_param_gather, parallel.rule_expert_parallel, parallel.rule_precision,
    model.rule_cuda_graph,
    batch.rule_telemetry_path, batch.rule_fixed_microbatches,
    batch.rule_trainer_devices, batch.rule_world_size, batch.rule_expert_world_size,
    batch.rule_data_parallel_value, batch.rule_data_parallel_agrees,
    batch.rule_batch_sizes, batch.rule_group_size, batch.rule_microbatches,
    model.rule_shared_embedding_bucket,
)
