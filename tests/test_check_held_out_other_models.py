"""Held-out models the plugin does not drive (issue 25's fifth trial, issue 38): T5 (both modes),
NeMo's BERT, Mamba, RETRO and Griffin configs are named alone, with no line but the plugin off;
a hybrid model whose TP and CP fill the world gets a CP, not a world size; then every row's
line. Upstream configs, Megatron-LM CI
argument lists and Megatron-Bridge recipes (as flags) that no other test contained, checked as a
new user would, each printed fix line pasted and checked again (records/check-held-out-trials.md, "Fifth
trial"; sources in tests/data/upstream/README.md). The first tests are the wrong answers it found
(each seen failing before its fix), then every case's line."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.held_out import (FP8, FP8_FLAGS, bridge_args, ON, PLUGIN, UP, args_of,
                              assert_megatron_lm_line, assert_nemo_line, launcher, megatron_lm, run)

pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")


# --- what the trial found wrong -------------------------------------------------------------

HYBRID_CP4 = "ft_hybrid_mr_mcore_te_tp2_pp1_cp4_dgx_a100_1N8G"


def test_a_hybrid_model_whose_tp_and_cp_fill_the_world_gets_a_cp_not_a_world_size():
    """Megatron-LM's hybrid TP 2 x CP 4 test on its 8 GPUs (a pattern of 44 layers, one
    segment): TP * CP fills the world, and CP 2 with PP 2 fits it (the documented order, as for
    GPT models since the second trial). The line said 'launch 16 processes': the VP fix cut the
    pattern for the PP given (1: two segments), so the re-check saw PP 2 with VP 1, where no
    CP can help, before the next round cut it in four."""
    status, payload = megatron_lm(8, args_of(HYBRID_CP4) + FP8_FLAGS)
    assert status == 2 and payload["fix_passes"] is True, payload
    assert payload["fix_world_size"] in (None, 8), payload["fix_text"]
    assert "launch" not in payload["fix_text"], payload["fix_text"]
    fixed = payload["fixed_argv"]
    at = len(fixed) - 1 - fixed[::-1].index("--context-parallel-size")
    assert fixed[at + 1] == "2", payload["fix_text"]
    assert megatron_lm(8, fixed)[0] == 0


T5 = "ft_t5_mcore_te_tp2_pp1_vp1"


def test_an_encoder_decoder_argument_list_is_named_not_given_a_layer_count():
    """Megatron-LM's T5 test (pretrain_t5.py: --encoder-num-layers, --decoder-num-layers): the
    check said '--num-layers: found null' and asked for it, which Megatron-LM 0.19.2 asserts
    against ('cannot have both num-layers and encoder-num-layers specified'), and offered PP 2
    and VP 2 for a model the plugin does not drive (megatron-core's GPT model). It is now named
    as not supported, with no line."""
    status, payload = megatron_lm(8, args_of(T5) + PLUGIN)
    assert status == 2 and payload["fix_passes"] is False, payload
    keys = [v["key"] for v in payload["violations"]]
    assert keys == ["--encoder-num-layers"], keys
    assert "not supported by this plugin" in payload["violations"][0]["expected"]
    assert payload["fix_overrides"] == [] and payload["fix_drop"] == [], payload["fix_text"]


def test_validated_arguments_of_gpt_and_t5_models_are_told_apart():
    """Megatron-LM's validate_args copies --num-layers into encoder_num_layers for every model,
    so the hook's arguments (vars(get_args())) of a GPT model have it: not an encoder-decoder
    model (the refusal stopped every Megatron-LM-loop test when it read that alone). T5's have
    decoder_num_layers too."""
    from nemo_fp8_align.config_check.megatron_lm_refusals import encoder_decoder

    gpt = {"num_layers": 12, "encoder_num_layers": 12, "decoder_num_layers": None}
    assert encoder_decoder(gpt) == []
    t5 = {"num_layers": 12, "encoder_num_layers": 12, "decoder_num_layers": 12}
    assert [v.key for v in encoder_decoder(t5)] == ["--encoder-num-layers"]
    assert [v.key for v in encoder_decoder({"encoder_num_layers": 12})] == [
        "--encoder-num-layers"]


def _named_alone(status, payload, key, why):
    """A config of a model the plugin does not drive: one violation, at ``key``, saying ``why``,
    and no fix line (only the plugin off)."""
    assert status == 2 and payload["fix_passes"] is False, payload
    keys = [v["key"] for v in payload["violations"]]
    assert keys == [key], keys
    assert why in payload["violations"][0]["expected"]
    assert payload["fix_overrides"] == [], payload["fix_overrides"]


def test_a_nemo_t5_config_is_named_not_renamed_into_a_gpt_config():
    """The launcher's T5 220M config (NeMo's Megatron T5: model.encoder / model.decoder,
    model.mcore_t5): the line renamed mcore_t5 to mcore_gpt (NeMo's T5 model would then be
    built without megatron-core) and asked for a model.num_layers the T5 model does not read.
    It is now named as not supported, with no line but the plugin off."""
    status, payload = run([launcher("t5_220m"), *ON])
    _named_alone(status, payload, "model.encoder", "not supported by this plugin")
    assert run([launcher("t5_220m"), "+model.fp8_transpose_align.enabled=False"])[0] == 0


MAMBA = str(UP / "nemo_v2.3.2" / "megatron_mamba_config.yaml")


def test_a_nemo_mamba_config_is_named_not_given_a_virtual_pipeline():
    """NeMo v2.3.2's Mamba config (MegatronMambaModel, megatron-core's MambaModel): the line was
    PP 2 VP 2 and 'passed', but megatron-core 0.12.3's MambaStack asserts 'The Mamba hybrid
    model does not currently support virtual/interleaved pipeline parallelism', and the plugin
    needs VP >= 2. Named alone, with no line but the plugin off."""
    status, payload = run([MAMBA, *ON])
    _named_alone(status, payload, "model.hybrid_override_pattern", "virtual/interleaved pipeline")


def test_a_nemo_bert_config_is_named_not_given_mcore_gpt():
    """The launcher's BERT 110M config (NeMo's MegatronBertModel): the line added
    +model.mcore_gpt=True, a key the BERT model does not read, and passed for a model the plugin
    (NeMo's MegatronGPTModel) does not drive. Named alone."""
    status, payload = run([launcher("bert_110m"), *ON])
    _named_alone(status, payload, "model.bert_binary_head", "not supported by this plugin")

RETRO = str(UP / "nemo_v2.3.2" / "megatron_retro_config.yaml")
GRIFFIN = str(UP / "nemo_v2.3.2" / "megatron_griffin_config.yaml")


def test_a_nemo_retro_config_is_named_not_given_a_pipeline():
    """NeMo v2.3.2's RETRO config (MegatronRetroModel, megatron-core's RETRO decoder: the
    model.retro block): the line was PP 2 VP 2 and 'passed', but megatron-core's
    get_retro_decoder_block_spec asserts 'retro does not currently support pipeline
    parallelism' (and virtual pipeline parallelism), and the plugin needs both. Named alone."""
    status, payload = run([RETRO, *ON])
    _named_alone(status, payload, "model.retro", "pipeline parallelism")
    assert run([RETRO, "+model.fp8_transpose_align.enabled=False"])[0] == 0


def test_a_nemo_griffin_config_is_named_not_given_a_pipeline():
    """NeMo v2.3.2's Griffin config (MegatronGriffinModel: model.logits_soft_cap): the line was
    PP 2 VP 13 and 'passed', but NeMo builds its GriffinModel without pre_process /
    post_process, so every pipeline stage would hold the embedding and the output layer and run
    the whole model's ends: no pipeline can run, and the plugin needs one. Named alone."""
    status, payload = run([GRIFFIN, *ON])
    _named_alone(status, payload, "model.logits_soft_cap", "pre_process")
    assert run([GRIFFIN, "+model.fp8_transpose_align.enabled=False"])[0] == 0


# --- every Megatron-LM case of the trial: the verdict's line, pasted and checked again ------

BRIDGE_QWEN3_32B = bridge_args("qwen3_32b")
BRIDGE_QWEN3_8B = bridge_args("qwen3_8b")
#: Megatron-Bridge 0.6.0 recipes as flags (their layout, _pretrain_common's batch, the named
#: Hugging Face model's architecture): qwen3.py's 32B 16-GPU and 8B 4-GPU pretraining configs
BRIDGE = {"BRIDGE_QWEN3_32B": BRIDGE_QWEN3_32B, "BRIDGE_QWEN3_8B": BRIDGE_QWEN3_8B}
MUON = "ft_gpt3_moe_mcore_te_ep8_resume_torch_dist_muon"
PP2_VP2 = '--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2'

#: (argument list or Bridge recipe, world size, added flags, the line)
ROWS = [
    # torch FSDP2: refused as Megatron-FSDP is, the memory trade-off named
    ('ft_gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist', 8, FP8_FLAGS,
     '--use-distributed-optimizer ' + PP2_VP2 + ' --overlap-param-gather --overlap-grad-reduce; '
     'drop --use-torch-fsdp2'),
    ('ft_gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances', 8, FP8_FLAGS,
     PP2_VP2),
    ('ft_gpt3_mcore_te_tp2_pp2_cp2_nondeterministic', 8, PLUGIN,
     '--num-virtual-stages-per-pipeline-rank 2'),
    # 12 layers at PP 4: one a chunk
    ('ft_gpt3_mcore_te_tp1_pp4_swiglu', 8, PLUGIN, '--num-virtual-stages-per-pipeline-rank 3'),
    ('ft_gpt3_mcore_tp2_pp2_uninstall_te', 8, PLUGIN,
     '--num-virtual-stages-per-pipeline-rank 2 --transformer-impl transformer_engine'),
    # ModelOpt's distillation flags (--export-kd-cfg too) kept
    ('ft_gpt3_mcore_te_tp2_pp1_modelopt_distill_resume', 8, FP8_FLAGS,
     PP2_VP2 + ' --overlap-param-gather --overlap-grad-reduce'),
    # TP 4 x PP 2 and ETP 2 x EP 2 x PP 2 both fill the 8 GPUs
    ('ft_gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel', 8, PLUGIN,
     '--num-virtual-stages-per-pipeline-rank 2 --transformer-impl transformer_engine'),
    ('ft_hybrid_mr_mcore_te_tp2_pp1_cp4_dgx_a100_1N8G', 8, FP8_FLAGS,
     "--pipeline-model-parallel-size 2 --hybrid-layer-pattern "
     "'M-M-M-M*-M-|M-M-M*-M-M-|M-M*-M-M-M-|M*-M-M-M-M-' --context-parallel-size 2"),
    ('ft_hybrid_mr_mcore_te_tp2_pp1_cp4_dgx_a100_1N8G', 16, FP8_FLAGS,
     "--pipeline-model-parallel-size 2 --hybrid-layer-pattern "
     "'M-M-M-M*-M-|M-M-M*-M-M-|M-M*-M-M-M-|M*-M-M-M-M-'"),
    ('ft_gpt3_mcore_te_tp2_pp1_te_8experts2parallel_ddp_average_in_collective', 8, FP8_FLAGS,
     PP2_VP2),
    ('ft_gpt3_mcore_te_tp1_pp4_swiglu', 4, PLUGIN, '--num-virtual-stages-per-pipeline-rank 3'),
    # TP 2 x PP 2 x CP 2 on 4 GPUs: CP fills what PP 2 needs
    ('ft_gpt3_mcore_te_tp2_pp2_cp2_nondeterministic', 4, PLUGIN,
     '--num-virtual-stages-per-pipeline-rank 2 --context-parallel-size 1'),
    ('ft_gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances', 16,
     FP8_FLAGS + ['--pipeline-model-parallel-size', '2'],
     '--num-virtual-stages-per-pipeline-rank 2'),
    ('BRIDGE_QWEN3_32B', 16, FP8_FLAGS, '--num-virtual-stages-per-pipeline-rank 2'),
    # TP 8 x PP 2 on 8 GPUs: TP fills the world (64 heads, 8 groups: TP 4 divides both)
    ('BRIDGE_QWEN3_32B', 8, FP8_FLAGS,
     '--num-virtual-stages-per-pipeline-rank 2 --tensor-model-parallel-size 4'),
    ('BRIDGE_QWEN3_8B', 4, FP8_FLAGS, PP2_VP2 + ' --tensor-model-parallel-size 2'),
]


@pytest.mark.parametrize("name,world,extra,line", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ROWS)])
def test_megatron_lm_rows_get_a_line_that_passes_and_keeps_the_model(name, world, extra, line):
    argv = (BRIDGE[name] if name in BRIDGE else args_of(name)) + list(extra)
    assert line is not None  # every row of this trial printed a line
    assert_megatron_lm_line(world, argv, line, same_world=True, kept=(
        "--num-layers", "--global-batch-size", "--micro-batch-size", "--hidden-size",
        "--seq-length"))


def test_muon_without_the_distributed_optimizer_is_named_and_never_changed():
    """The non-distributed Muon test: --optimizer muon left (the plugin is not run on
    Megatron-LM's layer-wise optimizer); with Adam, the line passes (EP 8 at PP 2 needs 16)."""
    status, payload = megatron_lm(8, args_of(MUON) + PLUGIN)
    assert status == 2 and payload["fix_passes"] is False, payload
    assert [v["key"] for v in payload["left"]] == ["--optimizer"], payload["left"]
    adam = ["adam" if a == "muon" else a for a in args_of(MUON)] + PLUGIN
    status, payload = megatron_lm(8, adam)
    assert payload["fix_text"] == PP2_VP2 + " --expert-model-parallel-size 4", payload["fix_text"]
    assert megatron_lm(8, payload["fixed_argv"])[0] == 0


def test_t5_with_a_vp_flag_on_more_gpus_is_still_named_alone():
    status, payload = megatron_lm(16, args_of(T5) + FP8_FLAGS
                                  + ["--num-virtual-stages-per-pipeline-rank", "2"])
    assert status == 2 and [v["key"] for v in payload["violations"]] == ["--encoder-num-layers"]


# --- every NeMo-mode case of the trial ------------------------------------------------------

PLUGIN_NEMO = ["model.fp8=True", "+model.fp8_params=True", "+model.optim.align_param_gather=True"]
NEMO_PP2_VP2 = ["model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2"]

#: (config, overrides, the line)
NEMO_ROWS = [
    # 4 nodes, TP 8 x CP 4 = 32: CP fills the world; CP 2 with PP 2 (seq 65536)
    (launcher("gpt3_5b_64k"), ON, NEMO_PP2_VP2 + PLUGIN_NEMO + ["model.context_parallel_size=2"]),
    (launcher("gpt3_5b_64k"), FP8 + ["trainer.num_nodes=8"], NEMO_PP2_VP2),
    (launcher("gpt3_5b_64k"), FP8 + ["model.context_parallel_size=2"], NEMO_PP2_VP2),
    # TP 8 PP 16 VP 6 CP 4 on 64 nodes: one layer a chunk, M 32 (2 x PP)
    (launcher("gpt3_175b_64k"), ON, ["model.fp8=True", "+model.fp8_params=True"]),
    # 48 nodes: PP 16 divides no 384 GPUs with TP 8 x CP 4; PP 12 VP 4 (2 layers a chunk), N 16
    (launcher("gpt3_175b_64k"), FP8 + ["trainer.num_nodes=48"],
     ["+model.microbatch_group_size_per_vp_stage=16",
      "model.virtual_pipeline_model_parallel_size=4", "model.pipeline_model_parallel_size=12"]),
    (launcher("llama_8b_16nodes_tp2_cp2"), ON,
     NEMO_PP2_VP2 + ["model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True"]),
    (launcher("llama_8b_16nodes_tp2_cp2"), FP8 + ["trainer.num_nodes=1"], NEMO_PP2_VP2),
    # a batch of 1000 on DP 32: PP 4 (DP 8, M 125) with N 5 keeps it
    (launcher("llama_8b_16nodes_tp2_cp2"), FP8 + ["model.global_batch_size=1000"],
     ["model.pipeline_model_parallel_size=4", "model.virtual_pipeline_model_parallel_size=2",
      "+model.microbatch_group_size_per_vp_stage=5"]),
]


@pytest.mark.parametrize("config,overrides,line", NEMO_ROWS,
                         ids=[f"{Path(r[0]).stem}-{i}" for i, r in enumerate(NEMO_ROWS)])
def test_nemo_rows_get_a_line_that_passes_and_keeps_the_model(config, overrides, line):
    assert line  # every row of this trial printed a line
    assert_nemo_line(config, overrides, line,
                     kept=("num_layers", "global_batch_size", "micro_batch_size", "num_nodes"))
