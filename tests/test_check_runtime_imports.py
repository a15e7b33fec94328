"""What the runtime's startup checks import of the checker (issue 38 item 4): the NeMo callback
and session (find_violations, align_config_from, plugin_off_override, the block's structured
config) and Megatron-LM's attach (megatron_lm_violations on the parsed arguments) evaluate the
rules; the command line's machinery (the fix line and its re-check, launcher reading, Megatron-LM's
argument-list parsing: its flag table or its own parser) and the fix search (the layout solver,
layout strings, the batch fixes, the split's fallbacks) are not loaded by them, even where a
layout, world-size or microbatch rule fires: without the command line's fixer a rule gives the
fix it can name without a search. A fresh interpreter per case: sys.modules of the test process
holds everything the other tests used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: The command line's modules: the combined fix line, argument-list edits, launcher YAMLs,
#: Megatron-LM's flag table / own parser, and the fix search (:mod:`.fix_search` and what it
#: runs: the layout solver, layout strings, batch fixes, the split's fallbacks).
CLI_ONLY = ("nemo_fp8_align.config_check.fixes", "nemo_fp8_align.config_check.megatron_lm_edits",
            "nemo_fp8_align.config_check.launcher",
            "nemo_fp8_align.config_check.megatron_lm_parser", "megatron.training",
            "nemo_fp8_align.config_check.fix_search", "nemo_fp8_align.config_check.layout",
            "nemo_fp8_align.config_check.layout_string", "nemo_fp8_align.config_check.batch_fix",
            "nemo_fp8_align.config_check.split_math")

#: Configs on which the rules whose command-line fix is a search fire: (what the violations
#: must say, config changes). The seed is valid: PP 4, VP 2, 16 layers, 8 GPUs, M = 8.
NEMO_SEARCH_CASES = """
    SEED = {"trainer": {"devices": 8, "num_nodes": 1, "precision": "bf16"},
            "model": {"pipeline_model_parallel_size": 4,
                      "virtual_pipeline_model_parallel_size": 2, "num_layers": 16,
                      "micro_batch_size": 1, "global_batch_size": 16, "megatron_amp_O2": True,
                      "mcore_gpt": True, "transformer_engine": True, "fp8": True,
                      "fp8_hybrid": True, "fp8_params": True,
                      "optim": {"name": "mcore_distributed_optim", "overlap_param_sync": True,
                                "overlap_grad_sync": True, "align_param_gather": True}}}
    CASES = [  # (text a violation holds, trainer changes, model changes, megatron-core)
        ("divisible by pipeline_model_parallel_size", {}, {"num_layers": 18}, None),
        ("a multiple of VP = 2", {}, {"num_layers_in_first_pipeline_stage": 3}, None),
        ("GPUs to be a multiple of", {"devices": 6}, {}, None),
        ("M = global_batch_size / (micro_batch_size * DP)", {}, {"global_batch_size": 12},
         None),
        ("model.virtual_pipeline_model_parallel_size: found null", {},
         {"virtual_pipeline_model_parallel_size": None, "num_layers": 12}, None),
        ("expert TP * EP * PP", {}, {"expert_model_parallel_size": 3, "num_moe_experts": 6},
         None),
        ("PP >= 3 with", {}, {"pipeline_model_parallel_size": 2, "num_layers": 8}, "0.7.0"),
    ]
    from nemo_fp8_align.mcore_versions import rules_for
    for said, trainer, model, version in CASES:
        cfg = OmegaConf.create(SEED)
        cfg.trainer.update(trainer)
        for key, value in model.items():
            OmegaConf.update(cfg, "model." + key, value, force_add=True)
        found = find_violations(cfg, mcore=rules_for(version) if version else None)
        assert any(said in str(v) for v in found), (said, [str(v) for v in found])
"""

MEGATRON_LM_SEARCH_CASES = """
    BASE = dict(args, num_layers=8)
    CASES = [  # (text a violation holds, argument changes, world size)
        ("--num-layers: found 9", {"num_layers": 9}, 4),
        ("the world size 6 to be a multiple", {"pipeline_model_parallel_size": 4}, 6),
        ("--pipeline-model-parallel-layout: found", {
            "pipeline_model_parallel_size": 4, "num_layers": 4,
            "num_virtual_stages_per_pipeline_rank": None,
            "pipeline_model_parallel_layout": "Et|t|t|tL"}, 8),
        ("--step-batch-size-schedule: found", {"global_batch_size": None,
                                               "step_batch_size_schedule": "0:6 100:16"}, 4),
        ("num_layers = 61 divisible", {"num_layers": 61, "pipeline_model_parallel_size": 4}, 8),
    ]
    for said, changes, world in CASES:
        found = megatron_lm_violations({**BASE, **changes}, world_size=world)
        assert any(said in str(v) for v in found), (said, [str(v) for v in found])
"""

RUNTIME = {
    "nemo": """
        from nemo_fp8_align.config_check.check import (FP8AlignConfigError, align_config_from,
                                                       find_violations, plugin_off_override)
        from nemo_fp8_align.config_check.structured import BLOCK_KEY, block_values
        from omegaconf import OmegaConf
        cfg = OmegaConf.create({"trainer": {"devices": 4, "num_nodes": 1},
                                "model": {"pipeline_model_parallel_size": 1, "num_layers": 8}})
        assert find_violations(cfg)  # evaluated, not only imported
        plugin_off_override(cfg), align_config_from(cfg)
    """,
    "megatron_lm": """
        from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations
        args = {"pipeline_model_parallel_size": 2, "num_layers": 9,
                "num_virtual_stages_per_pipeline_rank": 2, "fp8": "hybrid",
                "fp8_param_gather": True, "use_distributed_optimizer": True,
                "overlap_param_gather": True, "overlap_grad_reduce": True,
                "micro_batch_size": 1, "global_batch_size": 16, "tensor_model_parallel_size": 1,
                "context_parallel_size": 1}
        assert megatron_lm_violations(args, world_size=4)  # evaluated, not only imported
    """,
}


@pytest.mark.parametrize("entry", sorted(RUNTIME))
def test_the_runtime_check_loads_none_of_the_command_lines_machinery(entry):
    cases = {"nemo": NEMO_SEARCH_CASES, "megatron_lm": MEGATRON_LM_SEARCH_CASES}[entry]
    code = textwrap.dedent(RUNTIME[entry]) + textwrap.dedent(cases) + textwrap.dedent(f"""
        import sys
        print(sorted(m for m in {CLI_ONLY!r} if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
