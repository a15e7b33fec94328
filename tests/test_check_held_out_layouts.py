"""Held-out upstream configs and Megatron-LM scripts (issue 25's first three trials): the parallel
layout fixes (a TP or CP that fills the node or the world changed before the node count or the
world size, DeepSeek-V3's layout string, hybrid patterns, hierarchical CP) and every row's
line. Upstream inputs that the other tests do not contain, checked as a new user would, each printed fix line pasted and checked
again (records/check-held-out-trials.md has the table, tests/data/upstream/README.md the sources). Every row
holds the verdict (the keys or flags named), the fix line, that the line passes when pasted, and
what the line changes beyond the layout and the plugin's own settings (only where the row says
why). In-process calls: 37 rows in 16 s measured on the 2 shared cores (the first trial's 30
rows took 12 to 27 s under load); the second trial's rows are at the end."""

from __future__ import annotations

from typing import List, Tuple

import pytest

from support.held_out import FP8, ON, UP, args_of, bridge_args, run

pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")
LAYOUT = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "microbatch_group_size_per_vp_stage", "num_layers_in_first_pipeline_stage",
          "context_parallel_size")
PLUGIN = ("fp8", "fp8_params", "fp8_hybrid", "optim.align_param_gather",
          "optim.overlap_param_sync", "optim.overlap_grad_sync", "cpu_offloading")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].split("model.", 1)[-1].split("trainer.", 1)[-1]


#: (launcher training YAML, overrides, what the line may change beyond the layout and the
#: plugin's settings, and why)
NEMO = [(name, ON, ()) for name in (
    "gpt3_20b", "gpt3_40b", "gpt3_1b_improved", "gpt3_7b_improved", "gpt3_175b_16k",
    "llama_llama3_8b", "llama_llama3_1_70b", "llama_llama2_7b", "mixtral_mixtral_8x3b",
    "nemotron_nemotron_15b", "nemotron_nemotron_22b", "mistral_mistral_nemo_12b")] + [
    ("llama_llama3_1_70b", FP8 + ["+model.account_for_embedding_in_pipeline_split=True",
                                  "+model.account_for_loss_in_pipeline_split=True"], ()),
    ("llama_llama3_8b", FP8 + ["model.context_parallel_size=3"], ()),
    # 800 GPUs, TP 4 x CP 2: DP divides 2048 only at PP 25 (a first stage of 18 layers): the
    # nearest batch that fits (2000), named as a change of the training recipe
    ("llama_llama3_1_70b", FP8 + ["trainer.num_nodes=100"], ("global_batch_size",)),
    # 127 nodes: TP 4 x PP 4 x CP 2 = 32 GPUs divides no 1016-GPU world; 128 nodes (named)
    ("llama_llama3_1_70b", FP8 + ["trainer.num_nodes=127"], ("num_nodes",)),
    ("gpt3_20b", FP8 + ["trainer.num_nodes=24"], ()),
    # a batch of 2000 is no multiple of DP 128 (2048, the nearest, named)
    ("gpt3_40b", FP8 + ["model.global_batch_size=2000"], ("global_batch_size",)),
    ("nemotron_nemotron_22b", FP8 + ["+model.cpu_offloading=True"], ()),
    ("mixtral_mixtral_8x3b", FP8 + ["trainer.num_nodes=3"], ()),
    ("nemotron_nemotron_15b", FP8 + ["model.pipeline_model_parallel_size=3",
                                     "trainer.num_nodes=6"], ()),
    ("llama_llama3_1_70b", FP8 + ["+model.fp8_recipe=tensorwise"], ()),
    ("gpt3_20b", ["+training.model.fp8_transpose_align.policy=aligned",
                  "training.trainer.num_nodes=24"], ()),
]


@pytest.mark.parametrize("name,overrides,changes", NEMO,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(NEMO)])
def test_nemo_launcher_configs_get_a_line_that_passes_and_keeps_the_model(name, overrides,
                                                                         changes):
    argv = [str(UP / "launcher" / f"{name}.yaml"), *overrides]
    status, payload = run(argv)
    if status == 0:
        return
    line = payload["fix_overrides"]
    assert payload["fix_passes"] is True, payload
    assert run(argv + line)[0] == 0, line
    other = sorted({_key(o) for o in line} - set(LAYOUT) - set(PLUGIN))
    assert other == sorted(changes), line
    prefix = "training." if overrides[0].lstrip("+").startswith("training.") else ""
    assert all(o.lstrip("+~").startswith(prefix + ("model." if "trainer." not in o else ""))
               for o in line), line


def test_a_recipe_megatron_core_0_12_lacks_is_left_to_the_user_in_nemo_mode():
    argv = [str(UP / "launcher" / "llama_llama3_1_70b.yaml"), *FP8,
            "+model.fp8_recipe=blockwise"]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is False and payload["fix_overrides"] == []
    assert [v["key"] for v in payload["left"]] == ["model.fp8_recipe"]


#: (argument list, world size, the flags named, the line)
MEGATRON_LM = [
    ("ft_gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap", 8,
     ["--num-virtual-stages-per-pipeline-rank", "--overlap-param-gather",
      "--overlap-grad-reduce"],
     "--num-virtual-stages-per-pipeline-rank 2 --overlap-param-gather --overlap-grad-reduce"),
    # blockwise FP8 with a layout string: only the gathered FP8 weights are missing
    ("ft_gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph", 8, ["--fp8-param-gather"],
     "--fp8-param-gather"),
    ("ft_gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8", 8, ["--fp8-param-gather"],
     "--fp8-param-gather"),
    # FSDP: the line trains with DDP and must still start Megatron-LM (its FSDP-only flags)
    ("ft_deepseek_proxy_fsdp_ep2_fsdp2", 8,
     ["--use-megatron-fsdp", "--pipeline-model-parallel-size",
      "--num-virtual-stages-per-pipeline-rank"],
     "--use-distributed-optimizer --pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 2 --ckpt-format torch_dist; "
     "drop --use-megatron-fsdp"),
    ("train_llama3_8b_fsdp_h100_fp8", 8,
     ["--use-megatron-fsdp", "--pipeline-model-parallel-size",
      "--num-virtual-stages-per-pipeline-rank"],
     "--use-distributed-optimizer --pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 2 --ckpt-format torch_dist; "
     "drop --use-megatron-fsdp --fsdp-manual-registration"),
]


@pytest.mark.parametrize("name,world,named,line", MEGATRON_LM,
                         ids=[r[0] for r in MEGATRON_LM])
def test_megatron_lm_argument_lists_get_a_line_that_passes(name, world, named, line):
    status, payload = run(["--megatron-lm", "--world-size", str(world), "--", *args_of(name)])
    assert status == 2 and [v["key"] for v in payload["violations"]] == named, payload
    assert payload["fix_text"] == line and payload["fix_passes"] is True
    assert run(["--megatron-lm", "--world-size", str(world), "--",
                *payload["fixed_argv"]])[0] == 0


def test_a_value_megatron_lm_rejects_does_not_hide_the_rest_of_the_list():
    """Nemotron 3 Super (MXFP8 with grad-buffer reuse, a hybrid model): its CI config leaves
    ${TOKENIZER_TYPE} to the environment. Megatron-LM's parser stops there; the check read
    every other setting as Megatron-LM's default (--num-layers, the batch: 'found null')."""
    status, payload = run(["--megatron-lm", "--world-size", "128", "--",
                           *args_of("ft_nemotron3_super_release_gb200")])
    assert [v["key"] for v in payload["violations"]] == [
        "--tokenizer-type", "--pipeline-model-parallel-size",
        "--hybrid-layer-pattern"], payload["violations"]
    # Second trial: the line gave --num-virtual-stages-per-pipeline-rank 2, which Megatron-LM
    # 0.19.2 asserts against beside --hybrid-layer-pattern; the pattern cut into 4 segments
    # (22 layers each) is its way of giving PP 2 x VP 2
    assert payload["fix_text"] == (
        "--pipeline-model-parallel-size 2 --hybrid-layer-pattern "
        "'MEMEMEM*EMEMEMEM*EMEME|MEM*EMEMEMEMEM*EMEMEME|MEM*EMEMEMEMEM*EMEMEME|"
        "MEM*EMEMEMEM*EMEMEMEME/*E/*E'"), payload["fix_text"]
    assert [v["key"] for v in payload["left"]] == ["--tokenizer-type"]
    assert any(n.startswith("--hybrid-layer-pattern:") for n in payload["notes"]), payload["notes"]


# --- the second trial (records/check-held-out-trials.md, "Second trial") --------------------------


def test_a_tp_that_fills_the_node_is_changed_before_the_node_count():
    """Mistral NeMo 123B on one node (8 GPUs, TP 8): PP 2 needs TP * PP = 16 GPUs. TP 4 with
    PP 2 VP 2 fits the node (96 heads, 8 query groups); the fix was trainer.num_nodes=2 (TP
    was read as a cause only where it divides no world of this size)."""
    argv = [str(UP / "launcher" / "mistral_mistral_nemo_123b.yaml"), *FP8,
            "+model.optim.overlap_param_sync=True", "+model.optim.overlap_grad_sync=True",
            "trainer.num_nodes=1"]
    status, payload = run(argv)
    line = payload["fix_overrides"]
    assert status == 2 and payload["fix_passes"] is True, payload
    assert sorted(line) == ["model.pipeline_model_parallel_size=2",
                            "model.tensor_model_parallel_size=4",
                            "model.virtual_pipeline_model_parallel_size=2"], line
    assert run(argv + line)[0] == 0


def test_a_cp_that_fills_the_world_is_changed_before_the_world_size():
    """Megatron-LM's weekly TP 4 x CP 2 FP8 test on its 8 GPUs: PP 2 needs 16. CP 1 with PP 2
    VP 2 keeps the 8 (the sequence is not split); the fix was 'launch 16 processes'."""
    argv = ["--megatron-lm", "--world-size", "8", "--",
            *args_of("ft_gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap")]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == ("--pipeline-model-parallel-size 2 "
                                   "--num-virtual-stages-per-pipeline-rank 2 "
                                   "--overlap-param-gather --overlap-grad-reduce "
                                   "--context-parallel-size 1"), payload
    assert run(argv[:3] + ["--", *payload["fixed_argv"]])[0] == 0


def test_deepseek_v3s_61_layers_get_a_layout_string_not_60_layers():
    """Megatron-LM's DeepSeek-V3 example (61 layers, one MTP layer; its defaults: Megatron-FSDP,
    EP 8) on 64 GPUs: 61 is prime, so no even or first/last split gives PP, VP >= 2, and the
    fix was --num-layers 60 (a model change). A --pipeline-model-parallel-layout places the 61
    layers over PP 2 x VP 2 stages (15 or 16 each) and keeps the model; megatron-core's own
    layout class accepts it (test_megatron_lm_parser_019.py)."""
    argv = ["--megatron-lm", "--world-size", "64", "--", *args_of("sbatch_mfsdp_deepseek_v3")]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert "--num-layers" not in payload["fix_text"], payload["fix_text"]
    assert ("--pipeline-model-parallel-layout 'Et*15|t*16|t*15|t*15mL'"
            in payload["fix_text"]), payload["fix_text"]
    assert "--num-virtual-stages-per-pipeline-rank" in payload["fix_drop"], payload
    assert run(argv[:3] + ["--", *payload["fixed_argv"]])[0] == 0


def test_a_hybrid_models_pattern_gives_its_layers_and_its_stages():
    """Megatron-LM's Mamba example (examples/mamba/train.sh, 800M: --hybrid-layer-pattern of 48
    layers, no --num-layers) on its 8 GPUs: the check said '--num-layers: found null' (Megatron-
    LM takes the count from the pattern) and its line added --num-virtual-stages-per-pipeline-
    rank 2, which Megatron-LM asserts against with a pattern. VP is the pattern's segments."""
    argv = ["--megatron-lm", "--world-size", "8", "--", *args_of("mamba_train")]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert "--num-layers" not in [v["key"] for v in payload["violations"]], payload
    assert payload["fix_text"] == (
        "--pipeline-model-parallel-size 2 --hybrid-layer-pattern "
        "'M-M-M--M-*M-|M-M-M--*M-M-|M-M-*M--M-M-|M-*M-M--M-M-' --fp8-format hybrid "
        "--fp8-param-gather"), payload["fix_text"]
    assert run(argv[:3] + ["--", *payload["fixed_argv"]])[0] == 0


def test_a_layout_string_of_one_stage_per_rank_gets_one_of_two():
    """Megatron-LM's DeepSeek-V3 proxy release test (PP 2, layout 'Et*7|t*7mL': VP 1, 14 layers,
    one MTP layer) on 64 GPUs: the VP fix was the sentence '<a --pipeline-model-parallel-layout
    of PP x VP = 4 stages>' (nothing to paste) and the finding read 'found null'."""
    argv = ["--megatron-lm", "--world-size", "64", "--",
            *args_of("ft_deepseekv3_proxy_flex_tp2pp2emp16etp1cp1_gb_200_release")]
    status, payload = run(argv + ["--fp8-format", "hybrid", "--fp8-param-gather"])
    assert status == 2 and payload["fix_passes"] is True, payload
    (v,) = payload["violations"]
    assert v["key"] == "--pipeline-model-parallel-layout" and v["found"] == "'Et*7|t*7mL'", v
    assert payload["fix_text"] == "--pipeline-model-parallel-layout 'Et*3|t*4|t*4|t*3mL'"


#: Megatron-Bridge 0.6.0's deepseek_v3_pretrain_1024gpu_h100_bf16_config (recipes/deepseek/h100/
#: deepseek_v3.py, Apache-2.0) written as Megatron-LM flags: TP 2, PP 16 with Bridge's own
#: (16, 1) layout, EP 64, MTP 1, micro batch 1, global batch 4096; blockwise FP8 weights added.
BRIDGE_DSV3 = bridge_args("deepseek_v3_fp8_blockwise")


def test_a_balanced_layout_string_is_kept_at_a_smaller_pipeline_size():
    """Bridge's DeepSeek-V3 layout has 16 stages at PP 16 (VP 1); at PP 8 the same string gives
    VP 2 (Bridge's own (8, 2) entry) and keeps its balancing. The fix rewrote the string into
    32 stages of 1 or 2 layers."""
    argv = ["--megatron-lm", "--world-size", "1024", "--", *BRIDGE_DSV3]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == "--pipeline-model-parallel-size 8", payload["fix_text"]
    assert run(argv[:3] + ["--", *payload["fixed_argv"]])[0] == 0


def test_a_hybrid_pattern_of_one_segment_per_rank_is_kept_at_a_smaller_pipeline_size():
    """The Mamba example's pattern cut by hand into 4 segments at PP 4 (VP 1): PP 2 gives VP 2
    with the user's segments kept."""
    pattern = "M-M-M--M-*M-|M-M-M--*M-M-|M-M-*M--M-M-|M-*M-M--M-M-"
    argv = ["--megatron-lm", "--world-size", "8", "--", *args_of("mamba_train"),
            "--pipeline-model-parallel-size", "4", "--hybrid-layer-pattern", pattern,
            "--fp8-format", "hybrid", "--fp8-param-gather"]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_text"] == "--pipeline-model-parallel-size 2", payload["fix_text"]


# --- the third trial (records/check-held-out-trials.md, "Third trial") ----------------------------


CP_A2A_P2P = "ft_gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic"
PLUGIN_FLAGS = ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
                "--overlap-param-gather", "--overlap-grad-reduce",
                "--num-virtual-stages-per-pipeline-rank", "2"]


def _hierarchical(argv: List[str]) -> Tuple[int, List[int]]:
    """(--context-parallel-size, --hierarchical-context-parallel-sizes) as Megatron-LM reads
    them: the last occurrence of each."""
    cp = int(argv[len(argv) - 1 - argv[::-1].index("--context-parallel-size") + 1])
    at = len(argv) - 1 - argv[::-1].index("--hierarchical-context-parallel-sizes") + 1
    sizes = []
    while at < len(argv) and not argv[at].startswith("--"):
        sizes.append(int(argv[at]))
        at += 1
    return cp, sizes


def test_a_cp_fix_keeps_the_hierarchical_cp_sizes_multiplying_to_it():
    """Megatron-LM's TP 1 x PP 2 x CP 4 a2a+p2p test (hierarchical CP sizes 2 2) on 4 GPUs: the
    fix changed CP to 2 and left the sizes 2 2, which the re-check passed but Megatron-LM 0.19.2
    asserts on (context_parallel_size == prod(hierarchical_context_parallel_sizes))."""
    argv = ["--megatron-lm", "--world-size", "4", "--", *args_of(CP_A2A_P2P), *PLUGIN_FLAGS]
    status, payload = run(argv)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert "--hierarchical-context-parallel-sizes" in payload["fix_text"], payload["fix_text"]
    cp, sizes = _hierarchical(payload["fixed_argv"])
    assert cp == 2 and len(sizes) == 2 and sizes[0] * sizes[1] == cp, (cp, sizes)
    assert run(argv[:3] + ["--", *payload["fixed_argv"]])[0] == 0


def test_hierarchical_cp_sizes_that_do_not_multiply_to_cp_are_named():
    """The same list on its 8 GPUs passes; sizes 2 4 for CP 4 are what Megatron-LM asserts on."""
    argv = ["--megatron-lm", "--world-size", "8", "--", *args_of(CP_A2A_P2P), *PLUGIN_FLAGS]
    assert run(argv)[0] == 0
    status, payload = run(argv + ["--hierarchical-context-parallel-sizes", "2", "4"])
    assert status == 2 and [v["key"] for v in payload["violations"]] == [
        "--hierarchical-context-parallel-sizes"], payload["violations"]
    cp, sizes = _hierarchical(payload["fixed_argv"])
    assert cp == 4 and sizes[0] * sizes[1] == 4, (cp, sizes)
