"""Held-out expert-parallel layouts (issue 25's sixth trial): a layout string kept at a smaller
PP, or regrouped at another PP, keeps the EP that fits it (Megatron-Bridge's DeepSeek-V3); then
every row's line. Upstream configs, Megatron-LM CI
argument lists and Megatron-Bridge recipes (as flags) that no other test contained, checked as a
new user would, each printed fix line pasted and checked again (records/check-held-out-trials.md, "Sixth
trial"; sources in tests/data/upstream/README.md). The first test is the weaker line it found
(seen failing before its fix), then every case's line."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from support import held_out
from support.held_out import (FP8, FP8_FLAGS, bridge_args, PLUGIN, assert_megatron_lm_line,
                              assert_nemo_line, launcher, megatron_lm)

pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")


def args_of(name: str) -> List[str]:
    return held_out.args_of(f"ft_{name}")  # this trial's rows name the CI tests without "ft_"


#: Megatron-Bridge 0.6.0 recipes as flags (their layout and batch, the named Hugging Face
#: model's architecture): deepseek/h100/deepseek_v3.py's 1024-GPU pretraining config (its
#: layout for PP 16, VP 1, written as Megatron-LM's string) and llama/h100/llama3.py's
#: Llama 3 70B 32-GPU one
BRIDGE_DEEPSEEK_V3 = bridge_args("deepseek_v3")
BRIDGE_LLAMA3_70B = bridge_args("llama3_70b")
BRIDGE = {"BRIDGE_DEEPSEEK_V3": BRIDGE_DEEPSEEK_V3, "BRIDGE_LLAMA3_70B": BRIDGE_LLAMA3_70B}


# --- what the trial found weaker than needed ------------------------------------------------

def test_a_layout_string_kept_at_a_smaller_pp_keeps_the_ep_that_fits_it():
    """Bridge's DeepSeek-V3 (ETP 1, EP 64, PP 16, a 16-stage layout string) on 512 GPUs:
    1 * 64 * 16 = 1024 divides no 512. The layout fix keeps the string at PP 8 (VP 2), where
    1 * 64 * 8 = 512 divides; the line also lowered EP to 32 (worked out at the given PP 16),
    twice the experts on every GPU for no reason. EP stays 64."""
    status, payload = megatron_lm(512, BRIDGE_DEEPSEEK_V3 + FP8_FLAGS)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == "--pipeline-model-parallel-size 8", payload["fix_text"]
    assert megatron_lm(512, payload["fixed_argv"])[0] == 0


PROXY = "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release"


def test_a_layout_string_of_pp_x_vp_stages_moves_to_the_pp_that_keeps_ep():
    """Megatron-LM's DeepSeek-V3 proxy (ETP 1, EP 16, PP 4, a layout string of 8 stages: VP 2)
    on 32 GPUs: 1 * 16 * 4 = 64 divides no 32. The line was '--expert-model-parallel-size 8'
    (EP worked out at the given PP: the layout search may not move PP under a layout string);
    the same 8 stages at PP 2 (VP 4, which Megatron-LM derives from the string) fit with EP 16,
    and the issue's fix order is the layout first."""
    status, payload = megatron_lm(32, args_of(PROXY) + FP8_FLAGS)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == "--pipeline-model-parallel-size 2", payload["fix_text"]
    assert megatron_lm(32, payload["fixed_argv"])[0] == 0


# --- every Megatron-LM case of the trial: the verdict's line, pasted and checked again ------

ACCOUNT = "gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split"
OVERLAP_OPT = ("gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather"
               "_overlap_optimizer")
DROP_OPT_STEP = "drop --overlap-param-gather-with-optimizer-step"

#: (argument list or Bridge recipe, world size, added flags, the line: None where it passes)
ROWS = [
    # 6 layers + embedding + loss over PP 4 x VP 2: one unit a chunk (the first and last hold
    # no transformer layer)
    (ACCOUNT, 8, PLUGIN, None),
    (ACCOUNT, 4, PLUGIN, None),
    ("gpt3_mcore_te_tp1_pp4_vp1_decoupled_lr", 8, PLUGIN, None),  # VP 3 from 1 layer a stage
    # chunk 0's all-gather dispatched by the optimizer step: not run with the plugin
    (OVERLAP_OPT, 8, FP8_FLAGS, DROP_OPT_STEP),
    # 16 GPUs: DP 4, M = 32 / (4 * 4) = 2 < PP 4; micro batch 2 (global batch 32 kept)
    (OVERLAP_OPT, 16, FP8_FLAGS, "--micro-batch-size 2; " + DROP_OPT_STEP),
    ("mixtral_8x7b_tp1pp4ep8vpp8_release", 64, FP8_FLAGS, None),
    ("mixtral_8x7b_tp1pp4ep8vpp8_release", 32, FP8_FLAGS, None),  # ETP 1 x EP 8 x PP 4 = 32
    # a layout string of 8 stages at PP 4 (VP 2), MTP, EP 16
    ("deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release", 64, FP8_FLAGS, None),
    ("gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed", 8, FP8_FLAGS, None),  # MLA, MTP, VP 4
    ("gpt3_7b_tp1_pp4_memory_speed", 8, PLUGIN, None),
    ("BRIDGE_LLAMA3_70B", 32, FP8_FLAGS, None),
    ("BRIDGE_LLAMA3_70B", 64, FP8_FLAGS, None),
    # TP 4 x PP 4 x CP 2 = 32 on 16: PP 2 (80 layers at VP 5: 8 a chunk)
    ("BRIDGE_LLAMA3_70B", 16, FP8_FLAGS, "--pipeline-model-parallel-size 2"),
    # Bridge's 16-stage layout at PP 8 x VP 2 (the layout Bridge itself gives PP 8 VP 2)
    ("BRIDGE_DEEPSEEK_V3", 1024, FP8_FLAGS, "--pipeline-model-parallel-size 8"),
    ("BRIDGE_DEEPSEEK_V3", 512, FP8_FLAGS, "--pipeline-model-parallel-size 8"),
    # DP 4: M = 32 / (4 * 4) = 2 < PP 4; micro batch 2 (global batch 32 kept)
    (ACCOUNT, 16, PLUGIN, "--micro-batch-size 2"),
    # 48 GPUs: DP 6 divides no 256; PP 3 (DP 8, EP 8 kept: 1 * 8 * 3 = 24) with VP 2 needs a
    # first stage (4 layers; 14 on each other stage: valid, not balanced, docs say so)
    ("mixtral_8x7b_tp1pp4ep8vpp8_release", 48, FP8_FLAGS,
     "--microbatch-group-size-per-virtual-pipeline-stage 4 --decoder-first-pipeline-num-layers 4 "
     "--pipeline-model-parallel-size 3 --num-virtual-stages-per-pipeline-rank 2; "
     "drop --num-layers-per-virtual-pipeline-stage"),
    # 32 GPUs: the 8 stages at PP 2 (VP 4) keep EP 16 (was EP 8)
    (PROXY, 32, FP8_FLAGS, "--pipeline-model-parallel-size 2"),
]


@pytest.mark.parametrize("name,world,extra,line", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ROWS)])
def test_megatron_lm_rows_get_a_line_that_passes_and_keeps_the_model(name, world, extra, line):
    argv = (BRIDGE[name] if name in BRIDGE else args_of(name)) + list(extra)
    assert_megatron_lm_line(world, argv, line, same_world=True, kept=(
        "--num-layers", "--global-batch-size", "--hidden-size", "--seq-length",
        "--expert-model-parallel-size", "--pipeline-model-parallel-layout"))


# --- every NeMo-mode case of the trial ------------------------------------------------------

NEMO_PP2_VP2 = ["model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2"]
OVERLAP = ["+model.optim.overlap_param_sync=True", "+model.optim.overlap_grad_sync=True"]

#: (config, overrides, the line: [] where it passes)
NEMO_ROWS = [
    # TP 8 PP 2, 48 layers: VP 2 (12 a chunk); the optimizer's overlap flags absent
    (launcher("gpt3_40b_improved"), FP8,
     ["model.virtual_pipeline_model_parallel_size=2"] + OVERLAP),
    (launcher("gpt3_40b_improved"), FP8 + ["trainer.num_nodes=8"],
     ["model.virtual_pipeline_model_parallel_size=2"] + OVERLAP),
    # PP 4 VP 10 (one layer a chunk), overlap_p2p_comm, mcore distributed optimizer
    (launcher("llama_llama2_13b"), FP8, []),
    (launcher("llama_llama2_13b"), FP8 + ["trainer.num_nodes=2"], []),
    # CP 2 kept: PP 2 VP 2 fits 128 and 8 GPUs
    (launcher("llama_llama3_1_8b"), FP8, NEMO_PP2_VP2),
    (launcher("llama_llama3_1_8b"), FP8 + ["trainer.num_nodes=1", "model.global_batch_size=128"],
     NEMO_PP2_VP2),
    (launcher("mistral_mistral_7b"), FP8, NEMO_PP2_VP2 + OVERLAP),  # TP 8: DP 8, M 4
    (launcher("mistral_mistral_7b"), FP8 + ["trainer.num_nodes=2"], NEMO_PP2_VP2 + OVERLAP),
    # MoE, EP 8 (expert TP 2): 2 * 8 * 2 divides 64 and 32
    (launcher("grok_grok1_proxy"), FP8, NEMO_PP2_VP2),
    (launcher("grok_grok1_proxy"), FP8 + ["trainer.num_nodes=4"], NEMO_PP2_VP2),
    (launcher("nemotron_nemotron_8b"), FP8, NEMO_PP2_VP2),
    (launcher("nemotron_nemotron_8b"), FP8 + ["model.global_batch_size=24"], NEMO_PP2_VP2),
    # 16 GPUs: expert TP 2 (= TP) x EP 8 x PP 2 = 32; EP 4 (ETP 1 would fit too)
    (launcher("grok_grok1_proxy"), FP8 + ["trainer.num_nodes=2"],
     NEMO_PP2_VP2 + ["model.expert_model_parallel_size=4"]),
    # 3 nodes: DP 6 divides no 2048; the nearest batch, 2040 (left as is: the layout that
    # keeps 2048, PP 6 VP 2 with first/last stages of 4 and N 8, changes five settings)
    (launcher("llama_llama2_13b"), FP8 + ["trainer.num_nodes=3"],
     ["model.global_batch_size=2040"]),
]


@pytest.mark.parametrize("config,overrides,line", NEMO_ROWS,
                         ids=[f"{Path(r[0]).stem}-{i}" for i, r in enumerate(NEMO_ROWS)])
def test_nemo_rows_get_a_line_that_passes_and_keeps_the_model(config, overrides, line):
    assert_nemo_line(config, overrides, line)
