"""What the runtime's startup checks import of the checker (issue 38 item 4): the NeMo callback
and session (find_violations, align_config_from, plugin_off_override, the block's structured
config) and Megatron-LM's attach (megatron_lm_violations on the parsed arguments) evaluate the
rules; the command line's machinery (the fix line and its re-check, launcher reading, Megatron-LM's
argument-list parsing: its flag table or its own parser) is not loaded by them. A fresh
interpreter per case: sys.modules of the test process holds everything the other tests used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: The command line's modules: the combined fix line, argument-list edits, launcher YAMLs, and
#: Megatron-LM's flag table / own parser.
CLI_ONLY = ("nemo_fp8_align.config_check.fixes", "nemo_fp8_align.config_check.megatron_lm_edits",
            "nemo_fp8_align.config_check.launcher",
            "nemo_fp8_align.config_check.megatron_lm_parser", "megatron.training")

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
    code = textwrap.dedent(RUNTIME[entry]) + textwrap.dedent(f"""
        import sys
        print(sorted(m for m in {CLI_ONLY!r} if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
