"""The fourth fresh trial of issue 25 ("Done when"), kept: upstream configs, Megatron-LM CI
argument lists and Megatron-Bridge recipes (as flags) that no other test contained, checked as a
new user would, each printed fix line pasted and checked again (docs/check-trial.md, "Fourth
trial"; sources in tests/data/upstream/README.md). The first tests are the three wrong answers it
found (each seen failing before its fix); the rows after them hold every case's verdict and line."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import List, Tuple

import pytest

from nemo_fp8_align.cli.check import add_check_parser

UP = Path(__file__).parent / "data" / "upstream"
pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")
ON = ["+model.fp8_transpose_align.policy=aligned"]
FP8 = ON + ["model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True",
            "+model.optim.align_param_gather=True"]
#: Megatron-LM "+FP8": the plugin's FP8 and optimizer settings
PLUGIN = ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
          "--overlap-param-gather", "--overlap-grad-reduce"]


def run(argv: List[str]) -> Tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="nemo-fp8-align")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    if "--" in argv:
        at = argv.index("--")
        argv = argv[:at] + ["--format", "json"] + argv[at:]
    else:
        argv = argv + ["--format", "json"]
    args = parser.parse_args(["check", *argv])
    out = io.StringIO()
    status = args.func(args, out=out, err=io.StringIO())
    return status, json.loads(out.getvalue().strip().splitlines()[-1])


def args_of(name: str) -> List[str]:
    return [a for a in (UP / "megatron_lm" / f"{name}.args").read_text().split("\n") if a]


def megatron_lm(world: int, argv: List[str]) -> Tuple[int, dict]:
    return run(["--megatron-lm", "--world-size", str(world), "--", *argv])


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
