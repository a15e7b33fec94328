"""The startup check knows the quantized-weight recipes (issue 26 item 5, issue 25 item 3): valid
blockwise, MXFP8 (with and without grad-buffer reuse) and NVFP4 argument lists pass Megatron-LM
mode (megatron-core 0.19.2 post-processes them in ``_post_param_sync``); what megatron-core
rejects is named with the flag (NeMo mode: the key) and a fix that never changes the recipe; a
recipe the plugin does not align is "not supported by this plugin" with the off switch. One
table (config_check/recipes.py) for both modes. In-process calls, a few milliseconds each;
tests/test_megatron_lm_parser_019.py builds megatron-core 0.19.2's own config classes for the
same combinations."""

from __future__ import annotations

import argparse
import io
import json
from typing import List, Tuple

import pytest
from omegaconf import OmegaConf

from nemo_fp8_align.cli.check import add_check_parser
from nemo_fp8_align.config_check.check import find_violations
from nemo_fp8_align.config_check.megatron_lm_edits import MEGATRON_LM
from nemo_fp8_align.config_check.recipes import RECIPES, SETTINGS

GOOD = ("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer "
        "--overlap-param-gather --overlap-grad-reduce --micro-batch-size 1 "
        "--global-batch-size 16 --bf16 --seq-length 128 --lr 1e-4").split()
NO_FP8 = [a for a in GOOD if a not in ("--fp8-format", "hybrid", "--fp8-param-gather")]
NVFP4 = NO_FP8 + "--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-param-gather".split()
#: The flags that choose the numerics: a fix never sets them.
RECIPE_FLAGS = ("--fp8-recipe", "--fp4-recipe", "--fp8-format", "--fp4-format")


def sets_a_recipe(fix: str) -> bool:
    """Whether ``fix`` is edits (not a sentence) and one of them sets a recipe flag."""
    edits = MEGATRON_LM.split(fix)
    return edits is not None and any(e.split()[0] in RECIPE_FLAGS for e in edits)


def check(argv: List[str], world: int = 4) -> Tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    # the recipe verdict is the version's the check runs against: these are 0.19.2's lists
    args = parser.parse_args(["check", "--megatron-lm", "--world-size", str(world),
                              "--format", "json", "--megatron-core", "0.19.2", "--", *argv])
    out = io.StringIO()
    status = args.func(args, out=out, err=io.StringIO())
    return status, json.loads(out.getvalue())


@pytest.mark.parametrize("argv", [
    GOOD + ["--fp8-recipe", "blockwise"],
    GOOD + ["--fp8-recipe", "mxfp8", "--reuse-grad-buf-for-mxfp8-param-ag"],
    GOOD + ["--fp8-recipe", "mxfp8"],  # no post-processing then: nothing to align, no error
    GOOD + ["--fp8-recipe", "tensorwise", "--first-last-layers-bf16"],
    NVFP4,
], ids=["blockwise", "mxfp8-reuse", "mxfp8", "tensorwise-bf16-edges", "nvfp4"])
def test_valid_recipe_argument_lists_pass(argv):
    status, payload = check(argv)
    assert status == 0 and payload["violations"] == [], payload


#: (extra flags, flags removed, the flag named, its fix): what megatron-core 0.19.2 rejects
#: (and what the plugin needs of FP4).
REJECTED = [
    (["--fp8-recipe", "mxfp8", "--reuse-grad-buf-for-mxfp8-param-ag"], ["--fp8-param-gather"],
     "--reuse-grad-buf-for-mxfp8-param-ag", "--fp8-param-gather"),
    (["--fp8-recipe", "mxfp8", "--reuse-grad-buf-for-mxfp8-param-ag",
      "--overlap-param-gather-with-optimizer-step"], [],
     "--overlap-param-gather-with-optimizer-step",
     "drop --overlap-param-gather-with-optimizer-step"),
    (["--fp4-format", "e2m1"], [], "--fp4-format",
     "none that keeps both: drop --fp4-format or --fp8-format yourself (a choice of the "
     "training numerics)"),
    (["--fp4-param-gather"], [], "--fp4-param-gather", "drop --fp4-param-gather"),
    (["--fp8-recipe", "blockwise", "--fp8-output-proj"], [], "--fp8-output-proj",
     "drop --fp8-output-proj"),
    (["--fp8-recipe", "tensorwise", "--optimizer-cpu-offload"], [], "--optimizer-cpu-offload",
     "drop --optimizer-cpu-offload"),
    (["--fp4-format", "e2m1"], ["--fp8-format", "hybrid", "--fp8-param-gather"],
     "--fp4-param-gather", "--fp4-param-gather"),
    (["--fp8-recipe", "custom"], [], "--fp8-recipe",
     "none that keeps --fp8-recipe custom: train without the plugin (do not attach it)"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "custom", "--fp4-param-gather"],
     ["--fp8-format", "hybrid", "--fp8-param-gather"], "--fp4-recipe",
     "none that keeps --fp4-recipe custom: train without the plugin (do not attach it)"),
]


@pytest.mark.parametrize("extra,drop,flag,fix", REJECTED, ids=[r[2] + "-" + str(i) for i, r in
                                                               enumerate(REJECTED)])
def test_what_megatron_core_rejects_is_named_and_the_recipe_is_never_the_fix(extra, drop, flag,
                                                                              fix):
    argv = [a for a in GOOD if a not in drop] + extra
    status, payload = check(argv)
    named = {v["key"]: v for v in payload["violations"]}
    assert status == 2 and flag in named, payload["violations"]
    assert named[flag]["fix"] == fix
    for v in payload["violations"]:
        assert not sets_a_recipe(v["fix"]), v
    assert not set(RECIPE_FLAGS) & set(payload["fix_overrides"]), payload["fix_text"]
    if payload["fix_passes"]:
        assert check(payload["fixed_argv"])[0] == 0


def test_the_recipe_table_names_every_recipe_in_both_spellings():
    assert [r.name for r in RECIPES] == ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"]
    for recipe in RECIPES:
        flags = recipe.megatron_lm.replace("(the default)", "").split()
        status, _ = check([a for a in NO_FP8] + (["--fp8-format", "hybrid"]
                                                  if "--fp4-format" not in flags else []) + flags)
        assert status == 0, recipe.name  # the flags the table gives are a valid list
    assert SETTINGS["reuse"] == ("reuse_grad_buf_for_mxfp8_param_ag",
                                 "--reuse-grad-buf-for-mxfp8-param-ag")
    assert SETTINGS["fp4_param"].flag == "--fp4-param-gather"


def _nemo(**model):
    base = {"mcore_gpt": True, "transformer_engine": True, "fp8": True, "fp8_hybrid": True,
            "fp8_params": True, "megatron_amp_O2": True, "num_layers": 8,
            "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
            "micro_batch_size": 1, "global_batch_size": 16,
            "optim": {"name": "distributed_fused_adam", "overlap_param_sync": True,
                      "overlap_grad_sync": True},
            "fp8_transpose_align": {"enabled": True}}
    base.update(model)
    return OmegaConf.create({"trainer": {"devices": 4, "num_nodes": 1, "precision": "bf16"},
                             "model": base})


@pytest.mark.parametrize("model,key,why", [
    ({"fp8_recipe": "blockwise"}, "model.fp8_recipe", "has no blockwise recipe"),
    ({"fp8_recipe": "mxfp8"}, "model.fp8_recipe", "MXFP8 currently does not support"),
    ({"fp4": "e2m1", "fp4_param": True, "fp8": False}, "model.fp4", "has no FP4"),
])
def test_nemo_mode_says_not_supported_on_megatron_core_0_12_with_the_off_switch(model, key, why):
    from nemo_fp8_align.mcore_versions import rules_for

    found = [v for v in find_violations(_nemo(**model), mcore=rules_for("0.12.3"))
             if v.key == key]
    assert len(found) == 1 and why in found[0].expected, find_violations(_nemo(**model))
    assert "on megatron-core 0.12" in found[0].expected
    assert "not supported by this plugin" in found[0].expected
    assert found[0].fix.endswith("turn the plugin off")


@pytest.mark.parametrize("model,key,fix", [
    ({"fp8_params": False, "reuse_grad_buf_for_mxfp8_param_ag": True},
     "model.reuse_grad_buf_for_mxfp8_param_ag", "model.fp8_params=True"),
    ({"fp4": "e2m1"}, "model.fp4", "none that keeps both: drop fp4 or fp8 yourself (a choice "
     "of the training numerics)"),
    ({"fp4_param": True}, "model.fp4_param", "model.fp4_param=False"),
])
def test_nemo_mode_runs_the_same_rejections_on_its_keys(model, key, fix):
    found = [v for v in find_violations(_nemo(**model)) if v.key == key]
    assert [v.fix for v in found] == [fix], find_violations(_nemo(**model))


def test_a_recipe_row_in_the_refusal_table_is_reported_once(monkeypatch):
    """support.py may grow recipe rows (the runtime refusal at attach); the check
    reports a setting the recipe table already named once, not twice with two fixes."""
    from nemo_fp8_align.config_check.rules import refused
    from nemo_fp8_align.support import REFUSALS, Refusal

    row = Refusal("custom_recipe", "TransformerConfig.fp8_recipe", "every version",
                  lambda s: getattr(s.config, "fp8_recipe", None) == "custom" or None,
                  "a quantizer factory's post-processing is unknown", "do not attach the "
                  "plugin", "delayed")
    monkeypatch.setattr(refused, "REFUSALS", REFUSALS + (row,))
    found = [v for v in find_violations(_nemo(fp8_recipe="custom")) if v.key == "model.fp8_recipe"]
    assert len(found) == 1 and found[0].fix.endswith("turn the plugin off"), found


#: Each block-scaled recipe as the check's settings (SETTINGS names), with the work it leaves.
_BLOCK_SCALED = {
    "blockwise": {"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param": True},
    "nvfp4": {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param": True},
    "mxfp8": {"fp8": "hybrid", "fp8_recipe": "mxfp8", "fp8_param": True, "reuse": True},
}


@pytest.mark.parametrize("minor", range(12, 21))
@pytest.mark.parametrize("name", sorted(_BLOCK_SCALED))
def test_the_check_and_the_refusal_at_attach_agree_on_every_megatron_core(name, minor):
    """One "since" table: the check's verdict on a recipe at megatron-core 0.<minor> is the
    runtime's (support.py) on that version's features, as
    tests/test_recipe_support.py reads them from megatron-core 0.12.3 - 0.19.2 themselves
    (post-processing from 0.16, fp4_param_gather from 0.17, _post_param_sync from 0.18)."""
    from nemo_fp8_align.support import RECIPE_KIND
    from nemo_fp8_align.config_check.recipes import findings
    from nemo_fp8_align.support import McoreFeatures, recipe_refusals

    features = McoreFeatures(post_processes=minor >= 16, post_param_sync=minor >= 18,
                             version=f"0.{minor}", fp4_param_gather=minor >= 17)
    refused_at_attach = recipe_refusals([RECIPE_KIND[name]], features)
    refused_by_check = [f for f in findings(_BLOCK_SCALED[name], (0, minor), megatron_lm=True)
                        if f.fix == ("off",)]
    assert bool(refused_by_check) == bool(refused_at_attach), (refused_by_check,
                                                               refused_at_attach)
    for f in refused_by_check:  # the version the message names is the runtime's
        assert "not supported by this plugin" in f.why
        since = refused_at_attach[0].split("Fix: megatron-core >= ")[1].split(",")[0]
        assert f"from megatron-core {since} on" in f.why
