"""Held-out Megatron-LM CI lists (issue 25's fourth trial): ModelOpt's script flags neither
unknown nor dropped, an emerging optimizer named and never changed, a group size that keeps the
global batch, the VP that splits evenly, an EP the layout's PP keeps; then every row's line.
Upstream configs, Megatron-LM CI
argument lists and Megatron-Bridge recipes (as flags) that no other test contained, checked as a
new user would, each printed fix line pasted and checked again (records/check-held-out-trials.md, "Fourth
trial"; sources in tests/data/upstream/README.md). The first tests are the three wrong answers it
found (each seen failing before its fix), then the two weaker lines of the third trial (also seen
failing), then every case's line. In-process calls: 55 tests in 12 s on the 2 shared cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.held_out import (FP8, FP8_FLAGS, bridge_args, ON, PLUGIN, UP, args_of,
                              assert_megatron_lm_line, assert_nemo_line, launcher, megatron_lm, run)

pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")


# --- what the trial found wrong -------------------------------------------------------------

QAD = "ft_hybrid_nemotron_v3_pico_7b_a1b_tp1_ep8_QAD_dgx_h100_1N8G"


def test_modelopts_flags_of_the_pretraining_scripts_are_neither_unknown_nor_dropped():
    """Megatron-LM's QAD test (Nemotron-3 pico, pretrain_hybrid.py) passes ModelOpt's
    --export-te-mcore-model, --export-kd-teacher-load and --export-model-type, which
    pretrain_gpt.py and pretrain_hybrid.py add to the parser themselves (ModelOpt's group,
    megatron/post_training/arguments.py). The check called them 'not a Megatron-LM 0.19.2 flag'
    and its line dropped them: no teacher, no distillation, another model class."""
    status, payload = megatron_lm(8, args_of(QAD))
    assert status == 2 and payload["fix_passes"] is True, payload
    keys = [v["key"] for v in payload["violations"]]
    assert not any(k.startswith("--export-") for k in keys), keys
    assert payload["fix_drop"] == [], payload["fix_drop"]
    for flag in ("--export-te-mcore-model", "--export-kd-teacher-load", "--export-model-type"):
        assert flag in payload["fixed_argv"], flag
    assert any(n.startswith("not read: --export-te-mcore-model --export-kd-teacher-load "
                            "--export-model-type") for n in payload["notes"]), payload["notes"]
    assert megatron_lm(8, payload["fixed_argv"])[0] == 0


MUON = "ft_gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon"


def test_an_emerging_optimizer_is_named_and_never_changed():
    """Megatron-LM's distributed-Muon test: with --optimizer muon, Megatron-LM 0.19.2's
    validate_args turns --use-distributed-optimizer off and trains with its
    LayerWiseDistributedOptimizer, whose all-gather the plugin has not been run on; the check
    read the flag as set and passed the line. The optimizer is the user's training choice: no
    fix changes it (as with the FP8 recipe), the plugin is the thing to leave off."""
    status, payload = megatron_lm(8, args_of(MUON))
    assert status == 2 and payload["fix_passes"] is False, payload
    (left,) = payload["left"]
    assert left["key"] == "--optimizer" and left["found"] == "'muon'", left
    assert "LayerWiseDistributedOptimizer" in left["expected"], left
    assert "--optimizer" not in payload["fix_overrides"], payload["fix_overrides"]
    adam = [a for a in args_of(MUON)]
    at = adam.index("--optimizer")
    adam[at + 1] = "adam"
    assert "--optimizer" not in [v["key"] for v in megatron_lm(8, adam)[1]["violations"]]


def test_a_larger_group_size_with_the_layout_keeps_the_global_batch():
    """Launcher LLaMA-1 13B (TP 2, micro batch 2, global batch 2048) on 20 nodes: PP 2 gives DP
    80... PP 2 (DP 40) fits no 2048 with micro batch 2 or 1, and the fix was global batch 2080.
    PP 5 VP 2 with N 8 keeps 2048 (DP 16, M 64, 64 % 8 = 0) and passes the check: the search
    tried N only near the given PP (1), never at or above the PP it was changing to."""
    argv = [str(UP / "launcher" / "llama_llama1_13b.yaml"), *FP8, "trainer.num_nodes=20"]
    status, payload = run(argv)
    line = payload["fix_overrides"]
    assert status == 2 and payload["fix_passes"] is True, payload
    assert not any("global_batch_size" in o or "micro_batch_size" in o for o in line), line
    assert "model.pipeline_model_parallel_size=5" in line, line
    assert run(argv + line)[0] == 0


# --- the weaker lines the third trial left, and this trial met again --------------------------

UNTIE = "ft_gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs"
MIXTRAL_22B = "ft_mixtral_8x22b_tp2pp8ep8vpp1_release"
MIXTRAL_7B = "ft_mixtral_8x7b_alltoall_tp2pp4ep4_release"


@pytest.mark.parametrize("name,world,extra,vp", [
    (UNTIE, 8, PLUGIN, "3"),  # 12 layers at PP 4: one a chunk (was VP 2, a first stage of 6)
    (MIXTRAL_22B, 128, ["--fp8-format", "hybrid", "--fp8-param-gather"], "7"),  # was first 14
    ("ft_gpt3_mcore_te_tp2_pp1_gdn", 8, PLUGIN, "3"),  # 6 layers at PP 2 (was a first stage of 2)
])
def test_a_missing_vp_gets_the_vp_that_splits_evenly(name, world, extra, vp):
    """The VP rule gave VP 2 and the split rule then added a first stage that made VP 2 fit
    (6 layers on the first rank of Megatron-LM's untied-embedding test, 1 on each chunk of the
    others); the VP is now the layout search's, which tries an even split before a first/last
    one."""
    status, payload = megatron_lm(world, args_of(name) + extra)
    assert status == 2 and payload["fix_passes"] is True, payload
    fixed = payload["fixed_argv"]
    assert fixed[len(fixed) - 1 - fixed[::-1].index("--num-virtual-stages-per-pipeline-rank")
                 + 1] == vp, payload["fix_text"]
    assert "--decoder-first-pipeline-num-layers" not in payload["fix_text"], payload["fix_text"]
    assert megatron_lm(world, fixed)[0] == 0


def test_an_ep_that_fits_the_layouts_pp_is_kept():
    """Mixtral 8x22B (ETP 2, EP 8, PP 8) on 64 GPUs: 2 * 8 * 8 = 128 divides no 64, and the
    line changed both PP (8 -> 4, where 2 * 8 * 4 = 64 divides) and EP (8 -> 4, worked out at
    the given PP 8). The layout's PP is enough: EP stays 8."""
    status, payload = megatron_lm(64, args_of(MIXTRAL_22B))
    assert status == 2 and payload["fix_passes"] is True, payload
    assert "--expert-model-parallel-size" not in payload["fix_overrides"], payload["fix_text"]
    assert "--pipeline-model-parallel-size" in payload["fix_overrides"], payload["fix_text"]
    assert megatron_lm(64, payload["fixed_argv"])[0] == 0


def test_mixtral_8x7b_on_48_gpus_keeps_ep_4_at_pp_3():
    """The third trial's Mixtral 8x7B (ETP 2, EP 4, PP 4) on 48 GPUs got EP 2 with PP 3; EP 4
    fits at PP 3 (2 * 4 * 3 = 24 divides 48)."""
    argv = args_of(MIXTRAL_7B) + ["--fp8-format", "hybrid", "--fp8-param-gather",
                                  "--num-virtual-stages-per-pipeline-rank", "2"]
    status, payload = megatron_lm(48, argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert "--expert-model-parallel-size" not in payload["fix_overrides"], payload["fix_text"]
    assert megatron_lm(48, payload["fixed_argv"])[0] == 0


# --- every Megatron-LM case of the trial: the verdict's line, pasted and checked again ------

BRIDGE_QWEN30 = bridge_args("qwen30")
BRIDGE_QWEN235 = bridge_args("qwen235")
BRIDGE_LLAMA8_2 = bridge_args("llama8_2")
BRIDGE_LLAMA8_16K = bridge_args("llama8_16k")
BRIDGE_OSS120 = bridge_args("oss120")
#: Megatron-Bridge 0.6.0 recipes as flags (their layout and batch, the named Hugging Face
#: model's architecture): qwen3_moe.py's 30B-A3B 8-GPU and 235B-A22B 256-GPU configs (the latter
#: with both accounting flags), llama3.py's 8B 2-GPU (CP 2) and 16k 16-GPU configs, gpt_oss.py's
#: 120B 64-GPU config
BRIDGE = {"BRIDGE_QWEN30": BRIDGE_QWEN30, "BRIDGE_QWEN235": BRIDGE_QWEN235,
          "BRIDGE_LLAMA8_2": BRIDGE_LLAMA8_2, "BRIDGE_LLAMA8_16K": BRIDGE_LLAMA8_16K,
          "BRIDGE_OSS120": BRIDGE_OSS120}

#: (argument list or Bridge recipe, world size, added flags, the line)
ROWS = [
    ('ft_gpt3_15b_8t_release', 64, [],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --fp8-format '
     'hybrid --fp8-param-gather'),
    ('ft_gpt3_7b_tp4_pp1_memory_speed', 8, [],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --fp8-format '
     'hybrid --fp8-param-gather'),
    ('ft_gpt3_mcore_te_tp1_pp4_vp1_calculate_per_token_loss', 8, [],
     '--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer '
     '--overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_dp_last', 8, [],
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs', 8, [],
     '--num-virtual-stages-per-pipeline-rank 3 --fp8-format hybrid --fp8-param-gather '
     '--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp2_pp1_gdn', 8, [],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3 --fp8-format '
     'hybrid --fp8-param-gather --use-distributed-optimizer --overlap-param-gather '
     '--overlap-grad-reduce'),
    ('ft_gpt3_mcore_tp1_pp2_fp16', 8, [],
     '--num-virtual-stages-per-pipeline-rank 2 --transformer-impl transformer_engine '
     '--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer '
     '--overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4', 8, [],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --fp8-format '
     'hybrid --fp8-param-gather --use-distributed-optimizer --overlap-param-gather '
     '--overlap-grad-reduce; drop --overlap-moe-expert-parallel-comm'),
    ('ft_gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic_dp_last', 8, [],
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce'),
    ('ft_hybrid_mr_mcore_te_tp1_pp4_cp1_dgx_a100_1N8G', 8, [],
     '--pipeline-model-parallel-size 2 --fp8-format hybrid --fp8-param-gather'),
    ('ft_hybrid_nemotron_v3_pico_7b_a1b_tp1_ep8_QAD_dgx_h100_1N8G', 8, [],
     '--pipeline-model-parallel-size 2 --hybrid-layer-pattern '
     "'MEMEM*EMEMEM*|EMEMEM*EMEMEM|*EMEMEM*EMEME|MEM*EMEMEMEME' --fp8-format hybrid "
     '--fp8-param-gather'),
    ('ft_gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor', 8, [],
     '--use-distributed-optimizer --pipeline-model-parallel-size 2 '
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--overlap-param-gather --overlap-grad-reduce --ckpt-format torch_dist; drop '
     '--use-megatron-fsdp'),
    ('ft_gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap', 8, [],
     '--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer '
     '--overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute', 8, [],
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_mcore_te_tp4_pp2_resume_torch_dist_reshard_8x1xNone', 8, [],
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--overlap-param-gather --overlap-grad-reduce'),
    ('ft_gpt3_15b_8t_release', 48, PLUGIN,
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2'),
    ('ft_gpt3_7b_tp4_pp1_memory_speed', 4, PLUGIN,
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 '
     '--tensor-model-parallel-size 2'),
    ('ft_gpt3_mcore_te_tp1_pp4_vp1_calculate_per_token_loss', 6, PLUGIN,
     '--microbatch-group-size-per-virtual-pipeline-stage 4 --pipeline-model-parallel-size 3 '
     '--num-layers-per-virtual-pipeline-stage 2'),
    ('ft_gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4', 16,
     PLUGIN + ['--pipeline-model-parallel-size', '2'],
     '--num-virtual-stages-per-pipeline-rank 2; drop --overlap-moe-expert-parallel-comm'),
    ('ft_gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap', 16, PLUGIN,
     '--micro-batch-size 2'),
    ('ft_hybrid_mr_mcore_te_tp1_pp4_cp1_dgx_a100_1N8G', 4, PLUGIN,
     '--pipeline-model-parallel-size 2'),
    ('ft_gpt3_mcore_tp1_pp2_fp16', 8, PLUGIN + ['--num-virtual-stages-per-pipeline-rank', '2'],
     '--transformer-impl transformer_engine'),
    ('ft_gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute', 8,
     PLUGIN + ['--num-virtual-stages-per-pipeline-rank', '3'],
     None),
    ('ft_gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs', 8,
     PLUGIN + ['--account-for-embedding-in-pipeline-split', '--account-for-loss-in-pipeline-split',
               '--num-virtual-stages-per-pipeline-rank', '2'],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 7'),
    ('BRIDGE_QWEN30', 8, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 2'),
    ('BRIDGE_QWEN235', 256, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 2'),
    ('BRIDGE_LLAMA8_2', 2, FP8_FLAGS,
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 '
     '--context-parallel-size 1'),
    ('BRIDGE_LLAMA8_16K', 16, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 2'),
    ('BRIDGE_OSS120', 64, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 3'),
    ('BRIDGE_QWEN235', 128, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 2'),
    ('BRIDGE_OSS120', 64,
     ['--fp8-format', 'e4m3', '--fp8-recipe', 'blockwise', '--fp8-param-gather'],
     '--num-virtual-stages-per-pipeline-rank 3'),
    ('ft_mixtral_8x22b_tp2pp8ep8vpp1_release', 64, [],
     '--num-virtual-stages-per-pipeline-rank 2 --fp8-format hybrid --fp8-param-gather '
     '--pipeline-model-parallel-size 4'),
    ('ft_mixtral_8x22b_tp2pp8ep8vpp1_release', 128, [],
     '--num-virtual-stages-per-pipeline-rank 7 --fp8-format hybrid --fp8-param-gather'),
    ('ft_mixtral_8x7b_alltoall_tp2pp4ep4_release', 48,
     FP8_FLAGS + ['--num-virtual-stages-per-pipeline-rank', '2'],
     '--microbatch-group-size-per-virtual-pipeline-stage 8 '
     '--decoder-first-pipeline-num-layers 2 --pipeline-model-parallel-size 6'),
    ('ft_gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon', 8, ['--optimizer', 'adam'],
     '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --fp8-format '
     'hybrid --fp8-param-gather --overlap-param-gather --overlap-grad-reduce '
     '--expert-model-parallel-size 4'),
]


@pytest.mark.parametrize("name,world,extra,line", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ROWS)])
def test_megatron_lm_rows_get_a_line_that_passes_and_keeps_the_model(name, world, extra, line):
    argv = (BRIDGE[name] if name in BRIDGE else args_of(name)) + list(extra)
    assert_megatron_lm_line(world, argv, line, kept=("--num-layers", "--global-batch-size",
                                                     "--hidden-size", "--seq-length"))


# --- every NeMo-mode case of the trial ------------------------------------------------------

FINETUNE = str(UP / "nemo_v2.3.2" / "megatron_gpt_finetuning_config.yaml")
PLUGIN_NEMO = ["model.fp8=True", "+model.fp8_params=True", "+model.optim.align_param_gather=True"]
PP2_VP2 = ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"]

#: (config, overrides, the line)
NEMO_ROWS = [
    # TP 8 PP 4 VP 12 CP 2 as shipped: one layer a chunk, M 16; only the plugin's settings
    (launcher("gpt3_40b_32k"), ON, PLUGIN_NEMO),
    (launcher("gpt3_5b_16k"), ON, PP2_VP2 + PLUGIN_NEMO),
    (launcher("llama_llama1_13b"), ON,
     PP2_VP2 + ["model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True",
                "+model.optim.align_param_gather=True"]),
    # 96 GPUs: TP 8 x PP 4 x CP 2 = 64 divides none; PP 3 VP 8 (2 layers a chunk), N 4
    (launcher("gpt3_40b_32k"), FP8 + ["trainer.num_nodes=12"],
     ["+model.microbatch_group_size_per_vp_stage=4", "model.virtual_pipeline_model_parallel_size=8",
      "model.pipeline_model_parallel_size=3"]),
    # TP 4 x CP 2 fill one node: CP 1 with PP 2 (the documented order: CP where it fills it)
    (launcher("gpt3_5b_16k"), FP8 + ["model.context_parallel_size=2", "trainer.num_nodes=1"],
     PP2_VP2 + ["model.context_parallel_size=1"]),
    (launcher("llama_llama1_13b"), FP8 + ["trainer.num_nodes=20"],
     ["model.pipeline_model_parallel_size=5", "model.virtual_pipeline_model_parallel_size=2",
      "+model.microbatch_group_size_per_vp_stage=8"]),
    # 40 layers + the embedding: 41 splits over no PP x VP (NeMo allows no first/last split
    # with an accounting flag): the flag goes, the model stays
    (launcher("llama_llama1_13b"), FP8 + ["+model.account_for_embedding_in_pipeline_split=True"],
     PP2_VP2 + ["model.account_for_embedding_in_pipeline_split=False"]),
    (launcher("gpt3_5b_16k"), FP8 + ["model.pipeline_model_parallel_size=4"],
     ["model.virtual_pipeline_model_parallel_size=2"]),
    # a batch of 1000 no layout of up to four settings fits (DP 128 at PP 2): the nearest, named
    (launcher("llama_llama1_13b"), FP8 + ["model.global_batch_size=1000"],
     PP2_VP2 + ["model.global_batch_size=1024"]),
    (launcher("gpt3_40b_32k"), ["+training.model.fp8_transpose_align.policy=aligned",
                                "training.model.fp8=True", "training.trainer.num_nodes=8"],
     ["+training.model.fp8_params=True", "+training.model.optim.align_param_gather=True"]),
    # NeMo's GPT fine-tuning config on 8 GPUs (its model comes from restore_from_path; the
    # layer count given here); NeMo's distributed Adam is what the plugin needs
    (FINETUNE, ON + ["+model.fp8=True", "+model.fp8_params=True", "+model.fp8_hybrid=True",
                     "+model.optim.align_param_gather=True", "trainer.devices=8",
                     "+model.num_layers=32"],
     ["+model.mcore_gpt=True", "model.pipeline_model_parallel_size=2",
      "+model.virtual_pipeline_model_parallel_size=2", "+model.transformer_engine=True",
      "model.megatron_amp_O2=True", "model.optim.name=distributed_fused_adam",
      "+model.optim.overlap_param_sync=True", "+model.optim.overlap_grad_sync=True"]),
]


@pytest.mark.parametrize("config,overrides,line", NEMO_ROWS,
                         ids=[f"{Path(r[0]).stem}-{i}" for i, r in enumerate(NEMO_ROWS)])
def test_nemo_rows_get_a_line_that_passes_and_keeps_the_model(config, overrides, line):
    assert_nemo_line(config, overrides, line)


def test_the_fine_tuning_config_as_shipped_leaves_the_layer_count_to_the_user():
    """NeMo's fine-tuning config has no num_layers (the restored model's): the line leaves it
    (a placeholder, not a guessed count) and says that it does not pass yet."""
    status, payload = run([FINETUNE, *ON])
    assert status == 2 and payload["fix_passes"] is False, payload
    assert [v["key"] for v in payload["left"]] == ["model.num_layers"]
