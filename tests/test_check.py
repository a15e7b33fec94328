"""The NeMo startup check: every violation at once, each with its key, value found and fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from support.nemo_config import only, seed_config

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.config_check.check import (FP8AlignConfigError, Violation, align_config_from,
                                       check_config, data_parallel_size_of, find_violations)
from nemo_fp8_align.config_check.fix_search import FIX_SEARCH
from nemo_fp8_align.support import REFUSALS, Setup


def without(cfg, dotted):
    parent, _, leaf = ("model." + dotted).rpartition(".")
    node = OmegaConf.select(cfg, parent)
    del node[leaf]
    return cfg


def test_seed_config_passes():
    assert find_violations(seed_config()) == []
    check_config(seed_config())  # does not raise


def test_model_node_alone_is_accepted_and_skips_microbatch_checks():
    model = seed_config(global_batch_size=3).model  # M would be wrong, but DP is unknown
    assert find_violations(model) == []
    # ...unless DP is given explicitly.
    v = only(find_violations(model, data_parallel_size=2))
    assert v.key == "model.global_batch_size"


# Each single violation: (overrides of the seed, key, found, fix).
def _NO_RECIPE_FIX(recipe):  # noqa: N802 - a constant's shape, used in the table below
    return f"none that keeps fp8_recipe={recipe}: turn the plugin off"


SINGLE = [
    ({"pipeline_model_parallel_size": 1}, "model.pipeline_model_parallel_size", "1",
     "model.pipeline_model_parallel_size=2"),
    ({"virtual_pipeline_model_parallel_size": None},
     "model.virtual_pipeline_model_parallel_size", "null",
     "model.virtual_pipeline_model_parallel_size=2"),
    ({"virtual_pipeline_model_parallel_size": 1},
     "model.virtual_pipeline_model_parallel_size", "1",
     "model.virtual_pipeline_model_parallel_size=2"),
    ({"transformer_engine": False}, "model.transformer_engine", "False",
     "model.transformer_engine=True"),
    ({"fp8": False}, "model.fp8", "False", "model.fp8=True"),
    ({"fp8_params": False}, "model.fp8_params", "False", "model.fp8_params=True"),
    ({"megatron_amp_O2": False}, "model.megatron_amp_O2", "False", "model.megatron_amp_O2=True"),
    ({"fp8_hybrid": False}, "model.fp8_hybrid", "False", "model.fp8_hybrid=True"),
    ({"optim.name": "fused_adam"}, "model.optim.name", "'fused_adam' (a string)",
     "model.optim.name=distributed_fused_adam"),
    ({"optim.overlap_param_sync": False}, "model.optim.overlap_param_sync", "False",
     "model.optim.overlap_param_sync=True"),
    ({"optim.overlap_grad_sync": False}, "model.optim.overlap_grad_sync", "False",
     "model.optim.overlap_grad_sync=True"),
    ({"disable_parameter_transpose_cache": True}, "model.disable_parameter_transpose_cache",
     "True", "model.disable_parameter_transpose_cache=False"),
    ({"mcore_customization_config.disable_parameter_transpose_cache": True},
     "model.mcore_customization_config.disable_parameter_transpose_cache", "True",
     "model.mcore_customization_config.disable_parameter_transpose_cache=False"),
    # Not supported by the plugin: the recipe is the training's numerics, never a "fix".
    ({"fp8_recipe": "mxfp8"}, "model.fp8_recipe", "'mxfp8' (a string)", _NO_RECIPE_FIX("mxfp8")),
    ({"fp8_recipe": "blockwise"}, "model.fp8_recipe", "'blockwise' (a string)",
     _NO_RECIPE_FIX("blockwise")),
    ({"mcore_customization_config.fp8_recipe": "mxfp8"},
     "model.mcore_customization_config.fp8_recipe", "'mxfp8' (a string)", _NO_RECIPE_FIX("mxfp8")),
    # M = 12 / 2 = 6: 6 mod N=PP=4 = 2, in (0, PP): megatron-core raises RuntimeError. The fix
    # is the group size N = 6 (a layout change), not another global batch.
    ({"global_batch_size": 12}, "model.microbatch_group_size_per_vp_stage", "<missing>",
     "+model.microbatch_group_size_per_vp_stage=6"),
    # M = 6 / 2 = 3 < PP = 4.
    ({"global_batch_size": 6}, "model.global_batch_size", "6 (M = 6 / (1 * DP 2) = 3)",
     "model.global_batch_size=8"),
    # Not a multiple of micro_batch_size * DP = 2: PP 8 (DP 1, M = 17) with N = 9 keeps the
    # batch (17 mod 9 = 8 >= PP); was global_batch_size=24, N being bounded by PP 4's M.
    ({"global_batch_size": 17}, "model.global_batch_size", "17 (M = 17 / (1 * DP 2) = 8.5)",
     "+model.microbatch_group_size_per_vp_stage=9 model.pipeline_model_parallel_size=8"),
    # N = 3 < PP = 4, while the default N would be fine.
    ({"microbatch_group_size_per_vp_stage": 3}, "model.microbatch_group_size_per_vp_stage", "3",
     "model.microbatch_group_size_per_vp_stage=null"),
    # 16 layers / PP 4 = 4 per rank: 3 chunks cannot split them evenly.
    ({"virtual_pipeline_model_parallel_size": 3}, "model.virtual_pipeline_model_parallel_size",
     "3", "model.virtual_pipeline_model_parallel_size=2"),
]


@pytest.mark.parametrize("overrides,key,found,fix", SINGLE,
                         ids=[next(iter(case[0])) + "=" + str(next(iter(case[0].values())))
                              for case in SINGLE])
def test_each_single_violation_is_reported_alone_with_its_fix(overrides, key, found, fix):
    # judged as check_config judges: by the importable megatron-core (NeMo 2.3.3's 0.12.3,
    # which has no blockwise recipe and no MXFP8 parameters); the fix is the command line's
    # (its fix search)
    from nemo_fp8_align.mcore_versions import importable_rules

    v = only(find_violations(seed_config(**overrides), mcore=importable_rules(),
                             fixer=FIX_SEARCH))
    assert (v.key, v.found, v.fix) == (key, found, fix)
    with pytest.raises(FP8AlignConfigError) as info:
        check_config(seed_config(**overrides))
    # the startup check reports it alone too; where the command line's fix is a search, its
    # own fix (without the search) names the command that proposes one
    (runtime,) = info.value.violations
    if runtime != v:
        assert "`nemo-fp8-align check CONFIG.yaml` proposes" in runtime.fix, runtime
        key, fix = runtime.key, runtime.fix
    assert key in str(info.value) and fix in str(info.value)


def test_group_size_above_m_is_blamed_on_the_group_size():
    # N = 16 > M = 8; N = 8 would do, and so would the default.
    v = only(find_violations(seed_config(microbatch_group_size_per_vp_stage=16),
                             fixer=FIX_SEARCH))
    assert v.key == "model.microbatch_group_size_per_vp_stage"


def test_valid_group_size_with_remainder_of_at_least_pp_passes():
    # M = 20 / 2 = 10, N = 6: 10 mod 6 = 4 >= PP = 4, accepted by megatron-core.
    assert find_violations(seed_config(global_batch_size=20,
                                       microbatch_group_size_per_vp_stage=6)) == []


@pytest.mark.parametrize("key,fix", [
    ("transformer_engine", "+model.transformer_engine=True"),
    ("fp8", "+model.fp8=True"),
    ("fp8_params", "+model.fp8_params=True"),
    ("optim.name", "+model.optim.name=distributed_fused_adam"),
    ("optim.overlap_param_sync", "+model.optim.overlap_param_sync=True"),
    ("virtual_pipeline_model_parallel_size", "+model.virtual_pipeline_model_parallel_size=2"),
])
def test_missing_key_is_a_violation_fixed_with_plus(key, fix):
    v = only(find_violations(without(seed_config(), key)))
    assert (v.key, v.found, v.fix) == ("model." + key, "<missing>", fix)


def test_missing_optional_keys_take_nemo_defaults():
    # fp8_recipe absent: megatron-core's default "delayed"; transpose cache absent: on.
    cfg = seed_config()
    assert "fp8_recipe" not in cfg.model and "disable_parameter_transpose_cache" not in cfg.model
    assert find_violations(cfg) == []
    mcore = {"optim": {"name": "mcore_distributed_optim", "overlap_param_sync": True,
                       "overlap_grad_sync": True, "align_param_gather": True}}
    assert find_violations(seed_config(fp8_recipe="tensorwise", **mcore)) == []


def test_current_scaling_with_apex_distributed_adam_is_refused():
    """NeMo 2.3.3's distributed Adam fails on FP8 params with current scaling (seen on the H200
    with TE 2.20.2), with or without the plugin."""
    v = only(find_violations(seed_config(fp8_recipe="tensorwise")))
    # the recipe is never the fix (issue 25): megatron-core's distributed optimizer is
    assert (v.key, v.fix) == ("model.optim.name", "model.optim.name=mcore_distributed_optim")
    assert "Float8CurrentScalingQuantizer" in str(v)


@pytest.mark.parametrize("key,value,fix", [
    ("fp8", "yes", "model.fp8=True"),
    ("fp8_params", 1, "model.fp8_params=True"),
    ("virtual_pipeline_model_parallel_size", "2", "model.virtual_pipeline_model_parallel_size=2"),
    ("pipeline_model_parallel_size", "4", "model.pipeline_model_parallel_size=4"),
    ("pipeline_model_parallel_size", 4.0, "model.pipeline_model_parallel_size=2"),
    ("optim.overlap_grad_sync", "True", "model.optim.overlap_grad_sync=True"),
    ("disable_parameter_transpose_cache", "no", "model.disable_parameter_transpose_cache=False"),
])
def test_wrong_types_are_violations(key, value, fix):
    v = only(find_violations(seed_config(**{key: value})))
    assert v.key == "model." + key
    assert v.fix == fix
    if isinstance(value, str):
        assert v.found == f"{value!r} (a string)"


def test_all_violations_are_listed_at_once():
    cfg = OmegaConf.create({
        "trainer": {"devices": 8},
        "model": {"pipeline_model_parallel_size": 1, "fp8": "yes", "fp8_recipe": "mxfp8",
                  "disable_parameter_transpose_cache": True, "optim": {"name": "adam"},
                  "fp8_transpose_align": {"polcy": "lazy"}},
    })
    with pytest.raises(FP8AlignConfigError) as info:
        check_config(cfg)
    keys = [v.key for v in info.value.violations]
    assert keys == [
        "model.fp8_transpose_align.polcy",
        "model.mcore_gpt",
        "model.pipeline_model_parallel_size",
        "model.virtual_pipeline_model_parallel_size",
        "model.num_layers",
        "model.transformer_engine",
        "model.fp8",
        "model.fp8_params",
        "model.megatron_amp_O2",
        "model.fp8_hybrid",
        "model.fp8_recipe",
        "model.disable_parameter_transpose_cache",
        "model.optim.name",
        "model.optim.overlap_param_sync",
        "model.optim.overlap_grad_sync",
        "trainer.precision",
        "model.micro_batch_size",
        "model.global_batch_size",
    ]
    message = str(info.value)
    assert message.startswith("18 setting(s)")
    for v in info.value.violations:
        assert f"  - {v.key}: found {v.found}; expected " in message
        assert f"| fix: {v.fix}" in message
    assert isinstance(info.value, ValueError)


def test_data_parallel_size_of():
    assert data_parallel_size_of(seed_config()) == 2
    assert data_parallel_size_of(seed_config().model) is None
    cfg = seed_config(context_parallel_size=2)
    assert data_parallel_size_of(cfg) == 1
    cfg.trainer.devices = 12  # not a multiple of TP*PP*CP = 8
    assert data_parallel_size_of(cfg) is None


def test_unresolvable_trainer_devices_skip_the_microbatch_checks():
    cfg = seed_config(global_batch_size=3)
    cfg.trainer.devices = "auto"
    assert find_violations(cfg) == []


def test_data_parallel_size_counts_tp_pp_and_cp():
    cfg = seed_config(tensor_model_parallel_size=2, global_batch_size=8)
    cfg.trainer.devices, cfg.trainer.num_nodes = 8, 4  # DP = 32 / (TP 2 * PP 4) = 4: M = 2 < PP
    v = only(find_violations(cfg, fixer=FIX_SEARCH))
    assert v.found == "8 (M = 8 / (1 * DP 4) = 2)"
    assert v.fix == "model.global_batch_size=16"
    cfg.model.context_parallel_size = 2  # DP = 32 / 16 = 2: M = 4 = PP
    assert find_violations(cfg) == []


# --- the mcore_distributed_optim path ---

def mcore(**extra):
    return seed_config(**{"optim.name": "mcore_distributed_optim", **extra})


def test_mcore_distributed_optim_accepted_with_align_param_gather():
    assert find_violations(mcore(**{"optim.align_param_gather": True})) == []


def test_mcore_distributed_optim_rejected_without_align_param_gather():
    v = only(find_violations(mcore()))
    assert (v.key, v.found, v.fix) == ("model.optim.align_param_gather", "<missing>",
                                       "+model.optim.align_param_gather=True")
    v = only(find_violations(mcore(**{"optim.align_param_gather": False})))
    assert v.fix == "model.optim.align_param_gather=True"


def test_mcore_distributed_optim_still_needs_the_overlap_settings():
    violations = find_violations(mcore(**{"optim.align_param_gather": True,
                                          "optim.overlap_param_sync": False}))
    assert [v.key for v in violations] == ["model.optim.overlap_param_sync"]


# --- the plugin's own block ---

def test_typo_in_plugin_block_suggests_the_key():
    v = only(find_violations(seed_config(fp8_transpose_align={"polcy": "lazy"})))
    assert v.key == "model.fp8_transpose_align.polcy"
    assert "did you mean 'policy'?" in v.expected
    # The block has no policy key: the rename appends it (a plain override would not compose).
    assert v.fix == "~model.fp8_transpose_align.polcy +model.fp8_transpose_align.policy=lazy"


def test_unknown_key_without_a_close_match_lists_the_keys():
    v = only(find_violations(seed_config(fp8_transpose_align={"zzz": 1})))
    assert "known keys: enabled, policy, telemetry_path" in v.expected
    assert v.fix == "~model.fp8_transpose_align.zzz"


def test_wrong_policy_names_the_choices():
    v = only(find_violations(seed_config(fp8_transpose_align={"policy": "eager"})))
    assert v.key == "model.fp8_transpose_align.policy"
    assert v.expected == "one of: aligned, lazy, off"
    assert v.fix == "model.fp8_transpose_align.policy=aligned"


@pytest.mark.parametrize("key,value", [("enabled", "yes"), ("enabled", 1),
                                       ("use_triton_kernel", "false"),
                                       ("telemetry_path", 3), ("telemetry_path", True)])
def test_wrong_types_in_plugin_block(key, value):
    v = only(find_violations(seed_config(fp8_transpose_align={key: value})))
    assert v.key == f"model.fp8_transpose_align.{key}"
    assert v.expected.startswith("a value of type ")


def test_plugin_block_with_a_list_instead_of_a_mapping():
    v = only(find_violations(seed_config(fp8_transpose_align=["aligned"])))
    assert (v.key, v.fix) == ("model.fp8_transpose_align", "~model.fp8_transpose_align")


@pytest.mark.parametrize("block", [{"enabled": False}, {"policy": "off"}])
def test_inactive_plugin_reports_nothing(block):
    cfg = seed_config(fp8_transpose_align=block, fp8=False, **{"optim.name": "adam"})
    assert find_violations(cfg) == []
    check_config(cfg)


def test_inactive_plugin_still_reports_errors_in_its_own_block():
    cfg = seed_config(fp8_transpose_align={"enabled": False, "polcy": "x"}, fp8=False)
    assert [v.key for v in find_violations(cfg)] == ["model.fp8_transpose_align.polcy"]


def test_align_config_from_block_and_defaults():
    assert align_config_from(seed_config()) == AlignConfig()
    cfg = seed_config(fp8_transpose_align={"policy": "lazy", "telemetry_path": "/tmp/t{rank}"})
    align = align_config_from(cfg)
    assert align.policy is Policy.LAZY and align.telemetry_path == "/tmp/t{rank}"
    assert align.enabled is AlignConfig().enabled
    assert align_config_from(cfg.model) == align
    with pytest.raises(FP8AlignConfigError, match="did you mean 'enabled'"):
        align_config_from(seed_config(fp8_transpose_align={"enabld": False}))


def test_plain_dict_input():
    cfg = OmegaConf.to_container(seed_config())
    assert find_violations(cfg) == []
    cfg["model"]["fp8"] = False
    assert [v.key for v in find_violations(cfg)] == ["model.fp8"]


def test_unresolvable_interpolation_in_a_checked_key_is_a_violation():
    cfg = seed_config()
    cfg.model.fp8 = "${nowhere.fp8}"
    v = only(find_violations(cfg))
    assert v.key == "model.fp8" and v.expected.startswith("a value that resolves")


def test_interpolations_elsewhere_are_not_resolved():
    cfg = seed_config()
    cfg.model.ffn_hidden_size = "${multiply:4, ${.hidden_size}}"  # resolver not registered
    cfg.model.fp8_params = "${.fp8}"  # resolvable: True
    assert find_violations(cfg) == []


def test_violation_str():
    v = Violation("model.fp8", "False", "True", "model.fp8=True")
    assert str(v) == "model.fp8: found False; expected True | fix: model.fp8=True"


def test_check_imports_neither_nemo_nor_megatron():
    code = textwrap.dedent("""
        import sys
        import nemo_fp8_align.config_check
        from nemo_fp8_align.config_check.check import check_config
        bad = [m for m in sys.modules if m.split('.')[0] in ('nemo', 'megatron', 'torch')]
        print(bad)
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_size_rampup_is_rejected():
    v = only(find_violations(seed_config(rampup_batch_size=[4, 4, 1000])))
    assert v.key == "model.rampup_batch_size" and v.fix == "model.rampup_batch_size=null"
    assert find_violations(seed_config(rampup_batch_size=None)) == []


def test_overlap_param_gather_with_optimizer_step_is_accepted():
    """Supported on megatron-core's DDP path (tests/test_gather_with_optimizer.py runs it);
    a value that is not a boolean is still reported."""
    optim = {"name": "mcore_distributed_optim", "overlap_param_sync": True,
             "overlap_grad_sync": True, "align_param_gather": True}
    key = "overlap_param_gather_with_optimizer_step"
    assert find_violations(seed_config(optim={**optim, key: True})) == []
    v = only(find_violations(seed_config(optim={**optim, key: "sometimes"})))
    assert v.key == "model.optim." + key


#: (row of support.py, a value of NeMo's model config that fires it)
REFUSAL_CASES = [
    ("whole_step_graphs_scope", "full_iteration"),
    ("whole_step_graphs_scope", ["attn", "full_iteration"]),
    ("whole_step_graphs_impl", "full_iteration"),
    ("combined_1f1b", True),
]


@pytest.mark.parametrize("key,value", REFUSAL_CASES)
def test_each_refusal_row_is_reported_by_the_check_with_its_reason_and_fix(key, value):
    """The check runs the rows of support.py on NeMo's model config, which NeMo
    passes through to TransformerConfig: the row's field, its reason, its fix."""
    row = next(r for r in REFUSALS if r.key == key)
    v = only(find_violations(seed_config(**{row.field: value})))
    assert (v.key, v.fix) == ("model." + row.field, f"model.{row.field}={row.nemo_fix}")
    assert row.why in v.expected and row.fix in v.expected


def test_the_check_and_the_refusal_table_agree():
    """Every row is covered above, and on one config holding every firing value the check
    reports exactly the rows the table fires (in table order), nothing else."""
    assert {k for k, _ in REFUSAL_CASES} == {r.key for r in REFUSALS}
    values = {next(r for r in REFUSALS if r.key == k).field: v for k, v in REFUSAL_CASES}
    # megatron-core 0.12.3 (this environment) has none of these TransformerConfig fields, so
    # the table reads a namespace here; tests/test_refusals.py runs it on the real class.
    table = [r.field for r in REFUSALS
             if r.value(Setup(config=SimpleNamespace(**values))) is not None]
    found = find_violations(seed_config(**values))
    assert [v.key for v in found] == ["model." + f for f in table] and len(table) == 3


def test_per_layer_cuda_graphs_and_no_combined_schedule_pass_the_check():
    assert find_violations(seed_config(cuda_graph_impl="transformer_engine",
                                       cuda_graph_scope="attn",
                                       overlap_moe_expert_parallel_comm=False)) == []


# --- the startup check's fixes where the command line's are a search ---

def test_without_the_fix_search_each_fix_names_what_to_change_and_the_command():
    """The runtime's startup check has no fixer (it never loads the layout search): the layer
    split, the world size and the microbatches each get the fix a rule can give alone (the node
    count, a value) or the settings to change, what must hold, and the command that proposes a
    layout; the verdicts and their reasons are the command line's."""
    command = "`nemo-fp8-align check CONFIG.yaml` proposes"
    split, = find_violations(seed_config(num_layers=18))
    assert (split.key, split.found) == ("model.num_layers", "18")
    assert split.expected == only(find_violations(seed_config(num_layers=18),
                                                  fixer=FIX_SEARCH)).expected
    assert split.fix.startswith("PP, VP or the first/last stage's layer counts such that")
    assert command in split.fix
    cfg = seed_config()
    cfg.trainer.devices = 6
    world, = find_violations(cfg)
    assert (world.key, world.fix) == ("trainer.num_nodes", "trainer.num_nodes=2")
    assert "which keeps the layout" in world.expected and command in world.expected
    batch, = find_violations(seed_config(global_batch_size=12))
    assert (batch.key, batch.found) == ("model.global_batch_size", "12 (M = 12 / (1 * DP 2) = 6)")
    assert batch.fix.startswith("a group size N, PP, VP or a smaller micro batch with which M")
    assert command in batch.fix
