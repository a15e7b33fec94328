"""``nemo-fp8-align check --megatron-core X.Y``: the version's own schedule rules and options,
in both modes, from the facts the demo uses (``mcore_versions.py``'s
``VersionRules``). Pure check runs (no megatron-core import); that each version's real code
agrees (its schedule's and ``initialize_model_parallel``'s own validation, its classes) is
tests/test_mcore_versions.py, which ``make test`` runs on 0.7.0 to 0.11.0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8_align.cli import check as check_command
from nemo_fp8_align.mcore_versions import rules_for
from support.check_json import check_cli

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf" / "megatron_gpt_fp8_align.yaml")
#: A Megatron-LM command line the check passes on 0.19 (4 processes: PP 2, DP 2, M 6).
GOOD_LM = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
           "--num-layers-per-virtual-pipeline-stage", "3", "--num-layers", "12",
           "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1",
           "--global-batch-size", "12", "--fp8-format", "hybrid", "--fp8-param-gather",
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--seq-length", "128"]


check = check_cli


def as_json(*argv: str):
    if "--" in argv:
        at = argv.index("--")
        argv = (*argv[:at], "--format", "json", *argv[at:])
    else:
        argv = (*argv, "--format", "json")
    status, out, _ = check(*argv)
    return status, json.loads(out.strip().splitlines()[-1])


def keys(payload):
    return [v["key"] for v in payload["violations"]]


@pytest.mark.parametrize("given", ["0.9.x", "abc", "0.9.0rc1", "v0.9", "0.6", "0.20", "1.0"])
def test_a_malformed_or_unknown_version_is_an_error_naming_the_flag(given):
    status, out, err = check(CONF, "--megatron-core", given)
    assert status == 2 and out == ""
    assert err.startswith(f"error: --megatron-core {given}") or \
        err.startswith(f"error: --megatron-core '{given}'"), err
    assert "0.7 to 0.19" in err


def test_without_megatron_core_the_newest_rules_apply_and_the_note_says_so(monkeypatch):
    monkeypatch.setattr(check_command, "importable_version", lambda: None)
    monkeypatch.setattr(check_command, "importable_rules", lambda: None)
    # N = 5 with M = 5: megatron-core >= 0.10's rule holds (PP <= N <= M, M mod N = 0)
    status, out, _ = check(CONF, "model.global_batch_size=20",
                           "+model.microbatch_group_size_per_vp_stage=5")
    assert status == 0, out
    assert "note: megatron-core is not installed: checked against the newest megatron-core's " \
           "rules; pass --megatron-core X.Y to check against another" in out


def test_an_installed_version_outside_the_known_ones_gets_the_newest_rules_said_so(monkeypatch):
    from nemo_fp8_align import mcore_versions as mcore_version

    monkeypatch.setattr(mcore_version, "importable_version", lambda: "0.20.1")
    monkeypatch.setattr(check_command, "importable_version", lambda: "0.20.1")
    monkeypatch.setattr(check_command, "importable_rules", mcore_version.importable_rules)
    status, out, _ = check(CONF)
    assert status == 0
    assert "note: megatron-core 0.20.1 is installed, outside the versions the check knows (0.7 " \
           "to 0.19): checked against the newest megatron-core's rules" in out


def test_the_version_is_read_from_the_tree_python_would_import_without_importing_it():
    tree = ROOT / ".mcore-wheels" / "0.8.0"
    if not (tree / "megatron" / "core").is_dir():
        pytest.skip("no megatron-core 0.8.0 tree (make test unpacks it into .mcore-wheels/)")
    code = ("import sys; from nemo_fp8_align.mcore_versions import "
            "importable_version as v; print(v(), 'megatron' in sys.modules, 'torch' in "
            "sys.modules)")
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["0.8.0", "False", "False"], done.stderr[-2000:]


def test_nemo_070_needs_pp_above_two_with_interleaving_and_gets_a_pp_that_keeps_the_model():
    status, payload = as_json(CONF, "--megatron-core", "0.7.0")
    assert status == 2 and keys(payload) == ["model.pipeline_model_parallel_size"], payload
    found = payload["violations"][0]
    assert ("megatron-core 0.7.0 refuses the interleaved schedule with PP 2 "
            "(\"pipeline-model-parallel size should be greater than 2") in found["expected"]
    # 12 layers on 8 GPUs: PP 4 (DP 2, M 8, a multiple of 4), VP 3; model and batch kept
    assert payload["fix_passes"] is True
    assert payload["fix_overrides"] == ["model.virtual_pipeline_model_parallel_size=3",
                                        "model.pipeline_model_parallel_size=4"]
    assert "checked against megatron-core 0.7.0 (--megatron-core)" in payload["notes"]
    assert as_json(CONF, "--megatron-core", "0.8.0")[0] == 0


def test_nemo_before_010_has_no_group_size_and_needs_m_a_multiple_of_pp():
    overrides = ("model.global_batch_size=20", "+model.microbatch_group_size_per_vp_stage=5")
    assert as_json(CONF, *overrides, "--megatron-core", "0.10")[0] == 0  # M 5, N 5
    status, payload = as_json(CONF, *overrides, "--megatron-core", "0.9.0")
    assert status == 2
    assert keys(payload) == ["model.microbatch_group_size_per_vp_stage",
                             "model.global_batch_size"], payload
    n, m = payload["violations"]
    assert "megatron-core 0.9.0 has no microbatch_group_size_per_vp_stage (0.10 on)" in \
        n["expected"]
    assert n["fix"] == "model.microbatch_group_size_per_vp_stage=null"
    assert m["expected"].startswith("megatron-core 0.9.0: num_microbatches=5 is not a "
                                    "multiple of pipeline_model_parallel_size=2")
    # the search said to have varied only what 0.9.0 has (NeMo's first/last keys are 0.11's)
    assert "the search (of PP and VP, the layout settings megatron-core 0.9.0 has" in \
        m["expected"]
    # no N offered as a fix; M = 24 / 4 = 6, a multiple of PP
    assert payload["fix_overrides"] == ["model.microbatch_group_size_per_vp_stage=null",
                                        "model.global_batch_size=24"]
    assert payload["fix_passes"] is True


def test_nemo_mcore_optimizer_before_09_is_refused_as_the_plugin_refuses_it():
    overrides = ("model.optim.name=mcore_distributed_optim", "+model.optim.align_param_gather=true")
    assert as_json(CONF, *overrides, "--megatron-core", "0.9.0")[0] == 0
    status, payload = as_json(CONF, *overrides, "--megatron-core", "0.8.0")
    assert status == 2 and keys(payload) == ["model.optim.name"], payload
    assert payload["violations"][0]["expected"].startswith(
        "megatron-core 0.8.0 with NeMo's mcore_distributed_optim: the parameter all-gather "
        "belongs to the DistributedOptimizer")
    assert payload["fix_overrides"] == ["model.optim.name=distributed_fused_adam"]


@pytest.mark.parametrize("version,named", [
    ("0.10.0", "first_pipeline_num_layers"), ("0.8.0", None)])
def test_nemo_stage_split_keys_a_version_lacks_are_reported_not_offered(version, named):
    """num_layers_in_first_pipeline_stage is 0.11's field name (NeMo passes fields by name)."""
    overrides = ("model.num_layers=16", "+model.num_layers_in_first_pipeline_stage=4")
    assert as_json(CONF, *overrides, "--megatron-core", "0.11.0")[0] == 0
    status, payload = as_json(CONF, *overrides, "--megatron-core", version)
    assert status == 2
    split = [v for v in payload["violations"]
             if v["key"] == "model.num_layers_in_first_pipeline_stage"]
    assert split and f"megatron-core {version} has no num_layers_in_first_pipeline_stage" in \
        split[0]["expected"]
    assert (f"calls it {named}" in split[0]["expected"]) == (named is not None)
    assert not any("num_layers_in_first_pipeline_stage=" in o and not o.endswith("=null")
                   for o in payload["fix_overrides"]), payload["fix_overrides"]


def test_nemo_recipe_and_optimizer_step_gather_a_version_lacks():
    status, payload = as_json(CONF, "model.fp8_recipe=tensorwise",
                              "+model.optim.overlap_param_gather_with_optimizer_step=true",
                              "--megatron-core", "0.8.0")
    assert status == 2
    by_key = {v["key"]: v for v in payload["violations"]}
    recipe = by_key["model.fp8_recipe"]
    assert "megatron-core 0.8.0 has no fp8_recipe (0.12 on), only delayed scaling" in \
        recipe["expected"]
    assert recipe["fix"].startswith("none on megatron-core 0.8.0 that keeps the tensorwise "
                                    "recipe: megatron-core >= 0.12.0")
    assert payload["fix_passes"] is False  # the recipe is the user's to decide
    step = by_key["model.optim.overlap_param_gather_with_optimizer_step"]
    assert "has no overlap_param_gather_with_optimizer_step (0.9 on" in step["expected"]
    assert step["fix"] == "model.optim.overlap_param_gather_with_optimizer_step=False"
    # 0.12 has the recipe (its other rules then speak: Apex with tensorwise)
    status, payload = as_json(CONF, "model.fp8_recipe=tensorwise", "--megatron-core", "0.12")
    assert "megatron-core 0.12 has no fp8_recipe" not in json.dumps(payload)


def test_megatron_lm_before_010_drops_the_group_size_flag():
    argv = [*GOOD_LM, "--microbatch-group-size-per-virtual-pipeline-stage", "3"]
    assert as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.10.0",
                   "--", *argv)[0] == 0
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.9.0",
                              "--", *argv)
    assert status == 2 and keys(payload) == [
        "--microbatch-group-size-per-virtual-pipeline-stage"], payload
    assert payload["fix_drop"] == ["--microbatch-group-size-per-virtual-pipeline-stage"]
    assert payload["fix_passes"] is True


def test_megatron_lm_070_gets_pp_4_and_no_fp8_parameters():
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.7.0",
                              "--", *GOOD_LM)
    assert status == 2
    assert keys(payload) == ["--pipeline-model-parallel-size", "--fp8-param-gather"], payload
    pp, fp8 = payload["violations"]
    assert pp["fix"] == ("--pipeline-model-parallel-size 4; "
                         "--num-layers-per-virtual-pipeline-stage 1")
    assert "Transformer Engine FP8 parameters, which megatron-core's DistributedDataParallel " \
           "before 0.9 copies into its buffer" in fp8["expected"]
    assert fp8["fix"] == "none on megatron-core 0.7.0: megatron-core >= 0.9.0 (with " \
                         "--fp8-param-gather)"
    # on 0.8 only the FP8 parameters remain (PP 2 is allowed there); without the flag the
    # flag is not offered as the fix (0.8's optimizer cannot gather TE FP8 parameters)
    for argv in (GOOD_LM, [a for a in GOOD_LM if a != "--fp8-param-gather"]):
        status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core",
                                  "0.8.0", "--", *argv)
        assert keys(payload) == ["--fp8-param-gather"], payload
        assert payload["fix_overrides"] == [] and payload["fix_passes"] is False, payload


def test_megatron_lm_layout_string_before_013_is_reported_not_offered():
    argv = [a for a in GOOD_LM] + ["--pipeline-model-parallel-layout", "Et*3|t*3|t*3|t*3L"]
    at = argv.index("--num-layers-per-virtual-pipeline-stage")
    del argv[at:at + 2]
    assert as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.13",
                   "--", *argv)[0] == 0
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.12.3",
                              "--", *argv)
    assert status == 2 and "--pipeline-model-parallel-layout" in keys(payload), payload
    assert not any("--pipeline-model-parallel-layout" in o for o in payload["fix_overrides"])


@pytest.mark.parametrize("version,expected", [
    ("0.7.0", dict(group_size=False, optimizer_owns_gather=True, min_interleaved_pp=3,
                   first_stage_field=None, fp8_param_gather=False)),
    ("0.8", dict(optimizer_owns_gather=True, min_interleaved_pp=2)),
    ("0.9.0", dict(group_size=False, optimizer_owns_gather=False,
                   first_stage_field="first_pipeline_num_layers", split_accounting=False)),
    ("0.11.0", dict(group_size=True, first_stage_field="num_layers_in_first_pipeline_stage",
                    split_accounting=True, fp8_recipe=False)),
    ("0.12.3", dict(fp8_recipe=True, layout_string=False)),
    ("0.13.0", dict(layout_string=True)),
])
def test_the_version_table_by_number(version, expected):
    """Where a tree is here, tests/test_mcore_versions.py pins these to its classes; 0.13.0
    (not a make-test line) was read from its wheel by hand (pipeline_model_parallel_layout)."""
    rules = rules_for(version)
    assert {k: getattr(rules, k) for k in expected} == expected


# --- the recipe verdict is the version's the note names (issue 38 item 4) --------------------


def _recipe_violation(payload, key):
    return [v for v in payload["violations"] if v["key"] == key]


def test_nemo_mode_judges_the_recipe_by_the_version_given():
    """``--megatron-core 0.19`` and the note said 0.19 while the recipe was judged by 0.12.3's
    rules ("not supported ... on NeMo 2.3.3's megatron-core 0.12.3"): blockwise is aligned from
    0.16 on, so 0.19 accepts it and 0.13 refuses it, naming 0.13."""
    status, payload = as_json(CONF, "model.fp8_recipe=blockwise", "--megatron-core", "0.19")
    assert "checked against megatron-core 0.19 (--megatron-core)" in payload["notes"]
    assert _recipe_violation(payload, "model.fp8_recipe") == [], payload["violations"]
    _, payload = as_json(CONF, "model.fp8_recipe=blockwise", "--megatron-core", "0.13")
    [v] = _recipe_violation(payload, "model.fp8_recipe")
    assert "not supported by this plugin on megatron-core 0.13" in v["expected"], v
    assert "0.12" not in v["expected"], v


def test_megatron_lm_mode_judges_the_recipe_by_the_version_given():
    """The reverse: ``--megatron-core 0.12`` said 0.12 and passed blockwise by 0.19's rules."""
    argv = GOOD_LM + ["--fp8-recipe", "blockwise"]
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.12",
                              "--", *argv)
    assert "checked against megatron-core 0.12 (--megatron-core)" in payload["notes"]
    [v] = _recipe_violation(payload, "--fp8-recipe")
    assert "not supported by this plugin on megatron-core 0.12" in v["expected"], v
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--megatron-core", "0.19",
                              "--", *argv)
    assert status == 0, payload


def test_without_a_version_given_the_recipe_is_judged_by_the_installed_one():
    """The note names the installed megatron-core; its rules judge the recipe too."""
    from nemo_fp8_align.mcore_versions import importable_version, parse_version

    installed = importable_version()
    if installed is None or parse_version(installed) is None:
        pytest.skip("no megatron-core the check knows is installed")
    since_blockwise = parse_version(installed)[:2] >= (0, 16)
    status, payload = as_json("--megatron-lm", "--world-size", "4", "--",
                              *GOOD_LM, "--fp8-recipe", "blockwise")
    assert any(n.startswith(f"checked against megatron-core {installed}")
               for n in payload["notes"]), payload["notes"]
    assert bool(_recipe_violation(payload, "--fp8-recipe")) != since_blockwise, payload
