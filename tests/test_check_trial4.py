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
