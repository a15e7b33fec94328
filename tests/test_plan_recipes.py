"""``plan --recipe R --gpu G`` (issue 26 item 5): each recipe's post-all-gather work, the bytes it
moves per chunk, each GPU's rate (measured or said to be assumed) and the recipes a GPU cannot run;
and the recipe read from a config's fp8 / fp4 keys."""

import json

import pytest

from nemo_fp8_align.cli import main
from nemo_fp8_align.planner.costs import GPUS, MODELS, Layout, chunk_costs
from nemo_fp8_align.planner.post_processing import post_processing

LAYOUT = Layout(tp=8, pp=8, vp=2, dp=4, micro_batch=1, global_batch=64)
FP8_ALIGN = str(__import__("pathlib").Path(__file__).parent.parent / "conf"
                / "megatron_gpt_fp8_align.yaml")


def _json(capsys, *argv):
    assert main(["plan", "--model", "llama3-70b", "--format", "json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recipe,gpu,kind,per_weight,gathered", [
    ("delayed", "h200", "transpose", 2.0, 1.0),
    ("tensorwise", "h100", "transpose", 2.0, 1.0),
    ("blockwise", "h200", "columnwise", 2.0 + 8 / 16384, 1.0 + 4 / 16384),
    ("blockwise", "b200", "columnwise", 2.0 + 8 / 16384, 1.0 + 4 / 16384),
    ("mxfp8", "gb200", "requantize", 6.0 + 2 / 32, 2.0),  # read BF16, write both FP8 copies, zero
    ("nvfp4", "b200", "nvfp4-transpose", 1.0 + 2 / 16, 0.5 + 1 / 16),
])
def test_bytes_each_recipe_moves(recipe, gpu, kind, per_weight, gathered):
    work, reason = post_processing(recipe, gpu, GPUS[gpu].needs_transpose[0])
    assert reason == "" and work.kind == kind
    costs, info = chunk_costs(MODELS["llama3-70b"], LAYOUT, GPUS[gpu], work=work)
    tbps = GPUS[gpu].rate(kind)[0]
    assert costs.transpose == pytest.approx(per_weight * info["weight_bytes"] / (tbps * 1e12))
    assert costs.allgather == pytest.approx(gathered * info["weight_bytes"] * 3 / 4 / 40e9)


def test_rates_say_measured_or_assumed(capsys):
    h200 = _json(capsys, "--recipe", "blockwise")
    # docs/design.md, section 5c: 303 MB of blockwise weights' columnwise copies in 0.190 ms on the H200
    assert h200["post_processing"]["tbps"] == pytest.approx(2 * 303e6 / 0.190e-3 / 1e12, rel=1e-3)
    assert h200["post_processing"]["rate_source"].startswith("measured on one H200")
    b200 = _json(capsys, "--recipe", "blockwise", "--gpu", "b200")
    assert b200["post_processing"]["rate_source"].startswith("assumed")
    assert b200["post_processing"]["tbps"] == pytest.approx(h200["post_processing"]["tbps"] * 8 / 4.8)
    assert b200["saving_ms"] > 0 and b200["step_ms"]["lazy"] > b200["step_ms"]["aligned"]
    assert main(["plan", "--model", "llama3-70b", "--recipe", "nvfp4", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4-transpose" in out and "assumed" in out and "pass --tflops" in out


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_blackwell_recipes_on_hopper_are_an_error(recipe, gpu, capsys):
    assert main(["plan", "--model", "llama3-70b", "--recipe", recipe, "--gpu", gpu]) == 2
    err = capsys.readouterr().err
    assert f"--recipe {recipe} --gpu {gpu}" in err and "Blackwell" in err and "--gpu b200" in err


@pytest.mark.parametrize("gpu", ["b200", "gb200"])
def test_per_tensor_on_datacenter_blackwell_has_nothing_to_align(gpu, capsys):
    out = _json(capsys, "--gpu", gpu)
    assert out["saving_ms"] == 0.0 and out["step_ms"] is None
    assert "non-TN" in out["nothing_to_align"]
    assert _json(capsys, "--gpu", gpu, "--recipe", "blockwise")["nothing_to_align"] is None


def test_mxfp8_without_grad_buffer_reuse_has_nothing_to_align(capsys):
    assert _json(capsys, "--gpu", "b200", "--recipe", "mxfp8")["nothing_to_align"] is None
    off = _json(capsys, "--gpu", "b200", "--recipe", "mxfp8",
                "--no-reuse-grad-buf-for-mxfp8-param-ag")
    assert "reuse_grad_buf_for_mxfp8_param_ag" in off["nothing_to_align"]


@pytest.mark.parametrize("overrides,recipe", [
    (["model.fp8_recipe=blockwise"], "blockwise"),
    (["model.fp8_recipe=mxfp8"], "mxfp8"),
    (["+model.fp4=e2m1"], "nvfp4"),  # megatron-core's fp4 format key; fp4_recipe defaults nvfp4
    (["+model.fp4=e2m1", "+model.fp4_recipe=nvfp4"], "nvfp4"),
])
def test_the_config_names_the_recipe(capsys, overrides, recipe):
    pytest.importorskip("hydra")
    assert main(["plan", FP8_ALIGN, *overrides, "--gpu", "b200", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"] == recipe and out["nothing_to_align"] is None


def test_the_configs_grad_buffer_reuse_is_read(capsys):
    pytest.importorskip("hydra")
    assert main(["plan", FP8_ALIGN, "model.fp8_recipe=mxfp8",
                 "+model.reuse_grad_buf_for_mxfp8_param_ag=false", "--gpu", "b200",
                 "--format", "json"]) == 0
    assert "reuse_grad_buf" in json.loads(capsys.readouterr().out)["nothing_to_align"]
    assert main(["plan", FP8_ALIGN, "+model.fp4=e2m1", "+model.fp4_recipe=mxfp4"]) == 2
    assert "model.fp4_recipe='mxfp4'" in capsys.readouterr().err
