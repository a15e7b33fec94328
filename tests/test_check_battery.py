"""The startup check on a battery of configurations: each row is a config (built from a seed, or a
real NeMo / NeMo-Framework-Launcher YAML from tests/data/upstream composed by Hydra as the CLI
does) and the exact list of (key, fix) the check must report, in order. Every row also checks
that no rule failed inside the check and that nothing raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import pytest
from omegaconf import OmegaConf

from nemo_fp8_align.config_check.check import find_violations
from nemo_fp8_align.config_check.fix_search import FIX_SEARCH
from nemo_fp8_align.config_check.fixes import fix_line, pasteable
from support.overrides import applied, present
from nemo_fp8_align.cli.check import load_config

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "data" / "upstream"
pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")

Expected = List[Tuple[str, str]]


def seed(**model: Any) -> Callable[[], Any]:
    """PP=4, VP=2, 16 layers, 8 GPUs (DP=2), M = 16 / 2 = 8, Apex distributed Adam, bf16;
    ``model`` (dotted keys) and ``trainer__*`` entries edit it; the value DROP removes a key."""
    def build() -> Any:
        cfg = OmegaConf.create({
            "trainer": {"devices": 8, "num_nodes": 1, "precision": "bf16"},
            "model": {
                "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4,
                "virtual_pipeline_model_parallel_size": 2, "num_layers": 16,
                "micro_batch_size": 1, "global_batch_size": 16, "megatron_amp_O2": True, "mcore_gpt": True,
                "transformer_engine": True, "fp8": True, "fp8_hybrid": True,
                "fp8_params": True,
                "optim": {"name": "distributed_fused_adam", "overlap_param_sync": True,
                          "overlap_grad_sync": True},
            },
        })
        for key, value in model.items():
            full = key.replace("trainer__", "trainer.") if key.startswith("trainer__") \
                else "model." + key
            if value is DROP:
                parent, _, leaf = full.rpartition(".")
                del OmegaConf.select(cfg, parent)[leaf]
            else:
                OmegaConf.update(cfg, full, value, force_add=True)
        return cfg
    return build


DROP = object()
HUGE_N = 10**9 + 7
MCORE = {"optim.name": "mcore_distributed_optim", "optim.align_param_gather": True}


def replaced(cfg: Any, parent: Optional[str], key: str, value: Any) -> Any:
    """``cfg`` with ``parent.key`` replaced by a value of another type (a list for a mapping)."""
    tree = OmegaConf.to_container(cfg)
    (tree[parent] if parent else tree)[key] = value
    return OmegaConf.create(tree)


def literal(value: Any) -> Callable[[], Any]:
    return lambda: value


def upstream(name: str, *overrides: str) -> Callable[[], Any]:
    return lambda: load_config(UPSTREAM / name, overrides)


def shipped(name: str, *overrides: str) -> Callable[[], Any]:
    return lambda: load_config(ROOT / "conf" / name, overrides)


# Overrides that turn a launcher GPT config into one the plugin runs with.
ENABLE_MCORE = ("model.fp8=True", "+model.fp8_params=True", "+model.optim.align_param_gather=True")

# (id, config, data_parallel_size, expected [(key, fix)])
ROWS: List[Tuple[str, Callable[[], Any], Optional[Any], Expected]] = [
    # --- valid shapes under every pipeline-split option ---------------------------------------
    ("seed-valid", seed(), None, []),
    ("mcore-optimizer-valid", seed(**MCORE), None, []),
    ("both-account-flags-valid", seed(num_layers=14, account_for_embedding_in_pipeline_split=True,
                                      account_for_loss_in_pipeline_split=True), None, []),
    ("uneven-first-last-valid", seed(num_layers_in_first_pipeline_stage=4,
                                     num_layers_in_last_pipeline_stage=4), None, []),
    ("devices-auto-skips-microbatches", seed(trainer__devices="auto", global_batch_size=3), None,
     []),
    ("devices-as-id-list", seed(trainer__devices=list(range(8))), None, []),
    # --- layer splits ------------------------------------------------------------------------
    # A layout fix (an uneven first stage), never a model change (num_layers=24 before).
    ("layers-not-divisible-by-pp", seed(num_layers=18), None,
     [("model.num_layers", "+model.num_layers_in_first_pipeline_stage=6")]),
    ("layers-per-rank-not-divisible-by-vp", seed(num_layers=12), None,
     [("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=3")]),
    ("embedding-stage-nemo-chunk-assertion", seed(num_layers=15,
                                                  account_for_embedding_in_pipeline_split=True),
     None, [("model.account_for_embedding_in_pipeline_split",
             "model.account_for_embedding_in_pipeline_split=False")]),
    ("both-account-flags-not-divisible", seed(num_layers=15,
                                              account_for_embedding_in_pipeline_split=True,
                                              account_for_loss_in_pipeline_split=True), None,
     # 17 to split: 14 layers (16 = PP 4 * VP 2 * 2) are nearer than 22, the old count-up
     [("model.num_layers", "model.num_layers=14")]),
    ("uneven-first-not-multiple-of-vp", seed(num_layers_in_first_pipeline_stage=3), None,
     [("model.num_layers_in_first_pipeline_stage", "model.num_layers_in_first_pipeline_stage=4"),
      ("model.num_layers", "model.num_layers_in_first_pipeline_stage=4")]),
    ("uneven-no-middle-stage-pp2", seed(pipeline_model_parallel_size=2, num_layers=4,
                                        num_layers_in_first_pipeline_stage=2,
                                        num_layers_in_last_pipeline_stage=2), None,
     [("model.num_layers_in_last_pipeline_stage",
       "model.num_layers_in_first_pipeline_stage=null")]),
    ("uneven-with-account-flag", seed(num_layers_in_first_pipeline_stage=4,
                                      account_for_loss_in_pipeline_split=True), None,
     [("model.num_layers_in_first_pipeline_stage",
       "model.num_layers_in_first_pipeline_stage=null")]),
    ("first-stage-zero", seed(num_layers_in_first_pipeline_stage=0), None,
     [("model.num_layers_in_first_pipeline_stage",
       "model.num_layers_in_first_pipeline_stage=null")]),
    ("layout-not-in-nemo-2.3.3", seed(pipeline_model_parallel_layout="Et*2|t*2|t*2|t*2L"), None,
     [("model.pipeline_model_parallel_layout", "~model.pipeline_model_parallel_layout")]),
    ("num-layers-string", seed(num_layers="16"), None,
     [("model.num_layers", "model.num_layers=16")]),
    ("num-layers-huge-no-hang", seed(num_layers=10**9 + 7), None,
     [("model.num_layers", "model.num_layers=1000000008")]),
    # --- precision -----------------------------------------------------------------------------
    ("precision-32", seed(trainer__precision=32), None,
     [("trainer.precision", "trainer.precision=bf16-mixed")]),
    ("precision-unparseable", seed(trainer__precision="fp8"), None,
     [("trainer.precision", "trainer.precision=bf16-mixed")]),
    ("precision-missing", seed(trainer__precision=DROP), None,
     [("trainer.precision", "+trainer.precision=bf16-mixed")]),
    ("model-precision-32-wins", seed(precision="32-true"), None,
     [("model.precision", "model.precision=bf16-mixed")]),
    # --- expert parallelism -------------------------------------------------------------------
    ("experts-with-apex-optimizer", seed(expert_model_parallel_size=2), None,
     [("model.optim.name", "model.optim.name=mcore_distributed_optim"),
      ("model.expert_model_parallel_size", "model.expert_model_parallel_size=1")]),
    ("experts-tp-needs-sequence-parallel", seed(**MCORE, expert_model_parallel_size=2,
                                                num_moe_experts=8, tensor_model_parallel_size=2,
                                                trainer__devices=16), None,
     [("model.sequence_parallel", "+model.sequence_parallel=True")]),
    ("experts-not-divisible", seed(**MCORE, expert_model_parallel_size=2, num_moe_experts=3),
     None, [("model.expert_model_parallel_size", "model.expert_model_parallel_size=1")]),
    # expert TP 1 * EP 4 * PP 4 = 16 on 8 GPUs: PP 2 fits EP 4 (the layout, EP kept; fourth
    # trial: an EP worked out at the given PP changed EP beside a PP change that made it fit)
    ("experts-world-not-divisible", seed(**MCORE, expert_model_parallel_size=4,
                                         num_moe_experts=8), None,
     [("model.expert_model_parallel_size", "model.pipeline_model_parallel_size=2")]),
    # --- world size and data-parallel size ----------------------------------------------------
    ("devices-zero", seed(trainer__devices=0), None,
     [("trainer.devices", "trainer.devices=8")]),
    ("devices-negative", seed(trainer__devices=-2), None,
     [("trainer.devices", "trainer.devices=8")]),
    ("num-nodes-zero", seed(trainer__num_nodes=0), None,
     [("trainer.num_nodes", "trainer.num_nodes=1")]),
    ("num-nodes-string", seed(trainer__num_nodes="two"), None,
     [("trainer.num_nodes", "trainer.num_nodes=1")]),
    ("node-count-not-a-multiple", seed(tensor_model_parallel_size=4, trainer__num_nodes=3), None,
     [("trainer.num_nodes", "trainer.num_nodes=4")]),  # no near layout: said, see below
    ("dp-argument-zero", seed(), 0,
     [("data_parallel_size", "data_parallel_size 1, or leave it out to derive it from "
       "trainer.devices * trainer.num_nodes / (TP * PP * CP)")]),
    ("dp-argument-string", seed(), "2",
     [("data_parallel_size", "data_parallel_size 1, or leave it out to derive it from "
       "trainer.devices * trainer.num_nodes / (TP * PP * CP)")]),
    ("dp-argument-disagrees", seed(), 4,
     [("data_parallel_size", "trainer.num_nodes=2, or leave data_parallel_size out")]),
    # --- batch sizes ---------------------------------------------------------------------------
    ("global-batch-zero", seed(global_batch_size=0), None,
     [("model.global_batch_size", "model.global_batch_size=8")]),
    ("global-batch-negative", seed(global_batch_size=-16), None,
     [("model.global_batch_size", "model.global_batch_size=8")]),
    ("global-batch-float", seed(global_batch_size=16.0), None,
     [("model.global_batch_size", "model.global_batch_size=8")]),
    ("micro-batch-string", seed(micro_batch_size="1"), None,
     [("model.micro_batch_size", "model.micro_batch_size=1")]),
    ("microbatches-remainder-below-pp", seed(global_batch_size=12), None,
     [("model.microbatch_group_size_per_vp_stage",
       "+model.microbatch_group_size_per_vp_stage=6")]),
    ("group-size-below-pp", seed(microbatch_group_size_per_vp_stage=3), None,
     [("model.microbatch_group_size_per_vp_stage",
       "model.microbatch_group_size_per_vp_stage=null")]),
    # M = 1000 * N + 1: the remainder 1 is below PP; the next M that fits is M + 3.
    ("huge-batch-and-group-no-hang", seed(global_batch_size=2 * (1000 * HUGE_N + 1),
                                          microbatch_group_size_per_vp_stage=HUGE_N), None,
     [("model.microbatch_group_size_per_vp_stage",
       "model.microbatch_group_size_per_vp_stage=256")]),
    ("telemetry-path-without-rank", seed(fp8_transpose_align={"telemetry_path": "/x/t.jsonl"}),
     None, [("model.fp8_transpose_align.telemetry_path",
             """'model.fp8_transpose_align.telemetry_path="/x/t.rank{rank}.jsonl"'""")]),
    ("telemetry-path-with-rank", seed(fp8_transpose_align={"telemetry_path": "/x/t{rank}"}),
     None, []),
    # --- the plugin block: every AlignConfig field, wrong types and values AlignConfig rejects -
    *[(f"block-{key}-{name}", seed(fp8_transpose_align={key: value}), None,
       [(f"model.fp8_transpose_align.{key}", f"model.fp8_transpose_align.{key}={fix}")])
      for key, name, value, fix in [
          ("enabled", "string", "yes", True), ("enabled", "int", 1, True),
          ("enabled", "null", None, True),
          ("policy", "unknown", "eager", "aligned"), ("policy", "member-name", "ALIGNED",
                                                      "aligned"),
          ("policy", "int", 1, "aligned"), ("policy", "null", None, "aligned"),
          ("telemetry_path", "int", 3, "null"), ("telemetry_path", "list", ["/x"], "null"),
          ("use_triton_kernel", "string", "no", True), ("use_triton_kernel", "int", 0, True),
          ("te_kernel_writes_transpose", "string", "yes", False),
          ("te_kernel_writes_transpose", "int", 1, False),
          ("verify_every_n_steps", "negative", -1, 0),
          ("verify_every_n_steps", "very-negative", -(10**12), 0),
          ("verify_every_n_steps", "float", 2.5, 0), ("verify_every_n_steps", "bool", True, 0),
          ("verify_every_n_steps", "string", "10", 0), ("verify_every_n_steps", "null", None, 0),
      ]],
    ("block-verify-zero-valid", seed(fp8_transpose_align={"verify_every_n_steps": 0}), None, []),
    ("block-verify-100-valid", seed(fp8_transpose_align={"verify_every_n_steps": 100}), None, []),
    # A value AlignConfig rejects hides no other violation, and is reported with the plugin off.
    ("block-verify-negative-and-a-bad-split", seed(num_layers=18, fp8_transpose_align={
        "verify_every_n_steps": -1}), None,
     [("model.fp8_transpose_align.verify_every_n_steps",
       "model.fp8_transpose_align.verify_every_n_steps=0"),
      ("model.num_layers", "+model.num_layers_in_first_pipeline_stage=6")]),
    ("block-verify-negative-plugin-off", seed(fp8=False, fp8_transpose_align={
        "enabled": False, "verify_every_n_steps": -3}), None,
     [("model.fp8_transpose_align.verify_every_n_steps",
       "model.fp8_transpose_align.verify_every_n_steps=0")]),
    ("rampup", seed(rampup_batch_size=[4, 4, 100]), None,
     [("model.rampup_batch_size", "model.rampup_batch_size=null")]),
    # --- shapes of the config itself ----------------------------------------------------------
    ("empty-config", literal({}), None,
     [("config", "check the file: nothing was read from it")]),
    ("config-a-list", literal([1, 2]), None,
     [("config", "make config a YAML block of keys, as in NeMo's megatron_gpt_config.yaml")]),
    ("config-none", literal(None), None,
     [("config", "make config a YAML block of keys, as in NeMo's megatron_gpt_config.yaml")]),
    ("model-not-a-mapping", literal({"trainer": {"devices": 8}, "model": 3}), None,
     [("model", "make model a YAML block of keys, as in NeMo's megatron_gpt_config.yaml")]),
    ("model-a-list", literal({"model": [1, 2]}), None,
     [("model", "make model a YAML block of keys, as in NeMo's megatron_gpt_config.yaml")]),
    ("trainer-not-a-mapping", lambda: replaced(seed()(), None, "trainer", "gpu"), None,
     [("trainer", "make trainer a YAML block of keys, as in NeMo's megatron_gpt_config.yaml")]),
    ("optim-a-list", lambda: replaced(seed()(), "model", "optim", [1, 2]), None,
     [("model.optim", "model.optim={} and then set the keys it needs")]),
    ("optim-null", seed(optim=None), None,
     [("model.optim.name", "+model.optim.name=distributed_fused_adam"),
      ("model.optim.overlap_param_sync", "+model.optim.overlap_param_sync=True"),
      ("model.optim.overlap_grad_sync", "+model.optim.overlap_grad_sync=True")]),
    ("plugin-block-a-string", seed(fp8_transpose_align="aligned"), None,
     [("model.fp8_transpose_align", "~model.fp8_transpose_align")]),
    ("unresolvable-interpolation", seed(num_layers="${nowhere}"), None,
     [("model.num_layers", "model.num_layers=<a literal value>")]),
    ("typo-in-a-nemo-key", seed(fp8_params=DROP, fp8_parms=True), None,
     [("model.fp8_params", "~model.fp8_parms +model.fp8_params=True")]),
    # --- resolvers and interpolations as NeMo and the launcher write them ----------------------
    ("nemo-multiply-and-sum", seed(num_layers="${multiply:4, 4}",
                                   global_batch_size="${sum:${.num_layers}, 0}"), None, []),
    ("launcher-divide-ceil-floor", seed(global_batch_size="${divide_ceil:31, 2}",
                                        micro_batch_size="${divide_floor:3, 2}"), None, []),
    ("launcher-training-interpolation", seed(num_layers="${training.model.global_batch_size}"),
     None, []),
    ("resolver-dividing-by-zero", seed(num_layers="${divide_floor:16, 0}"), None,
     [("model.num_layers", "model.num_layers=<a literal value>")]),
    # --- everything wrong at once: none hides another ------------------------------------------
    ("everything-wrong-at-once", seed(pipeline_model_parallel_size=0,
                                      virtual_pipeline_model_parallel_size="2", num_layers=-1,
                                      fp8="yes", trainer__devices=0, trainer__precision=32,
                                      global_batch_size=0,
                                      **{"optim.overlap_grad_sync": False}), 0,
     [("model.pipeline_model_parallel_size", "model.pipeline_model_parallel_size=2"),
      ("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=2"),
      ("model.num_layers", "model.num_layers=<the model's layer count>"),
      ("model.fp8", "model.fp8=True"),
      ("model.optim.overlap_grad_sync", "model.optim.overlap_grad_sync=True"),
      ("trainer.precision", "trainer.precision=bf16-mixed"),
      ("trainer.devices", "trainer.devices=8"),
      ("data_parallel_size", "data_parallel_size 1, or leave it out to derive it from "
       "trainer.devices * trainer.num_nodes / (TP * PP * CP)"),
      ("model.global_batch_size", "model.global_batch_size=1")]),
    # --- real NeMo-Framework-Launcher configs (tests/data/upstream/README.md) ------------------
    ("launcher-gpt3-175b-as-is", upstream("launcher/gpt3_175b.yaml"), None,
     [("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.optim.align_param_gather", "+model.optim.align_param_gather=True")]),
    ("launcher-gpt3-175b-enabled", upstream("launcher/gpt3_175b.yaml", *ENABLE_MCORE), None, []),
    # The launcher's whole config, with the training YAML under training: (as it composes it).
    ("launcher-main-config-with-training", lambda: OmegaConf.create(
        {"base_results_dir": "/results", "training": upstream("launcher/gpt3_175b.yaml")()}),
     None, [("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
            ("model.optim.align_param_gather", "+model.optim.align_param_gather=True")]),
    ("expert-tp-size-zero", seed(expert_tensor_parallel_size=0), None,
     [("model.expert_tensor_parallel_size", "model.expert_tensor_parallel_size=null")]),
    ("launcher-gpt3-175b-127-nodes", upstream("launcher/gpt3_175b.yaml", *ENABLE_MCORE,
                                              "trainer.num_nodes=127"), None,
     [("trainer.num_nodes", "trainer.num_nodes=128")]),
    ("launcher-gpt3-175b-100-nodes", upstream("launcher/gpt3_175b.yaml", *ENABLE_MCORE,
                                              "trainer.num_nodes=100"), None,
     # DP 25: 2000 (M = 80) is the nearest batch that fits 2048 (was 2200, M = 88)
     [("model.global_batch_size", "model.global_batch_size=2000")]),
    ("launcher-gpt3-175b-dp-flag-disagrees", upstream("launcher/gpt3_175b.yaml", *ENABLE_MCORE),
     16, [("data_parallel_size", "trainer.num_nodes=64, or leave data_parallel_size out")]),
    ("launcher-gpt3-175b-vp-5", upstream("launcher/gpt3_175b.yaml", *ENABLE_MCORE,
                                         "model.virtual_pipeline_model_parallel_size=5"), None,
     [("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=4")]),
    ("launcher-gpt3-175b-fp8-2024", upstream("launcher/gpt3_175b_fp8.yaml"), None,
     [("model.transformer_engine", "model.transformer_engine=True"),
      ("model.fp8_params", "+model.fp8_params=True")]),
    ("launcher-gpt3-5b", upstream("launcher/gpt3_5b.yaml"), None,
     [("model.pipeline_model_parallel_size", "model.pipeline_model_parallel_size=2"),
      ("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=2"),
      ("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.optim.align_param_gather", "+model.optim.align_param_gather=True")]),
    ("launcher-gpt3-126m", upstream("launcher/gpt3_126m.yaml"), None,
     [("model.pipeline_model_parallel_size", "model.pipeline_model_parallel_size=2"),
      ("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=2"),
      ("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.optim.align_param_gather", "+model.optim.align_param_gather=True")]),
    ("launcher-llama3.1-405b", upstream("launcher/llama_llama3_1_405b.yaml"), None,
     [("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.fp8_hybrid", "model.fp8_hybrid=True"),
      ("model.optim.align_param_gather", "+model.optim.align_param_gather=True")]),
    ("launcher-llama3.1-405b-vp-4", upstream("launcher/llama_llama3_1_405b.yaml", *ENABLE_MCORE,
                                             "model.fp8_hybrid=True",
                                             "model.virtual_pipeline_model_parallel_size=4"),
     None, [("model.virtual_pipeline_model_parallel_size",
             "model.virtual_pipeline_model_parallel_size=2")]),
    ("launcher-llama2-70b", upstream("launcher/llama_llama2_70b.yaml", *ENABLE_MCORE,
                                     "model.fp8_hybrid=True"), None, []),
    ("launcher-mixtral-8x7b", upstream("launcher/mixtral_mixtral_8x7b.yaml", *ENABLE_MCORE),
     None, []),
    ("launcher-mixtral-8x7b-apex", upstream("launcher/mixtral_mixtral_8x7b.yaml",
                                            "model.fp8=True", "+model.fp8_params=True",
                                            "model.optim.name=distributed_fused_adam"), None,
     [("model.optim.name", "model.optim.name=mcore_distributed_optim")]),
    ("launcher-nemotron-340b", upstream("launcher/nemotron_nemotron_340b.yaml", *ENABLE_MCORE),
     None, []),
    # --- real NeMo example configs -------------------------------------------------------------
    ("nemo-gpt-config-as-is", upstream("nemo_v2.3.2/megatron_gpt_config.yaml"), None,
     [("model.pipeline_model_parallel_size", "model.pipeline_model_parallel_size=2"),
      ("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=2"),
      ("model.transformer_engine", "model.transformer_engine=True"),
      ("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.optim.name", "model.optim.name=distributed_fused_adam"),
      ("model.optim.overlap_param_sync", "+model.optim.overlap_param_sync=True"),
      ("model.optim.overlap_grad_sync", "+model.optim.overlap_grad_sync=True")]),
    ("nemo-gpt-config-enabled", upstream(
        "nemo_v2.3.2/megatron_gpt_config.yaml", "trainer.devices=2",
        "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
        "model.transformer_engine=True", "model.fp8=True", "+model.fp8_params=True",
        "model.optim.name=distributed_fused_adam", "+model.optim.overlap_param_sync=True",
        "+model.optim.overlap_grad_sync=True"), None, []),
    ("nemo-llama-config-as-is", upstream("nemo_v2.3.2/megatron_llama_config.yaml"), None,
     [("model.pipeline_model_parallel_size", "model.pipeline_model_parallel_size=2"),
      ("model.virtual_pipeline_model_parallel_size",
       "model.virtual_pipeline_model_parallel_size=2"),
      ("model.fp8", "model.fp8=True"), ("model.fp8_params", "+model.fp8_params=True"),
      ("model.megatron_amp_O2", "model.megatron_amp_O2=True"),
      ("model.optim.name", "model.optim.name=distributed_fused_adam"),
      ("model.optim.overlap_param_sync", "+model.optim.overlap_param_sync=True"),
      ("model.optim.overlap_grad_sync", "+model.optim.overlap_grad_sync=True"),
      ("trainer.precision", "trainer.precision=bf16-mixed")]),
    ("project-launcher-yaml", shipped("launcher/gpt3_175b_fp8_align.yaml"), None, []),
]


@pytest.mark.parametrize("build,dp,expected", [row[1:] for row in ROWS],
                         ids=[row[0] for row in ROWS])
def test_battery(build: Callable[[], Any], dp: Optional[Any], expected: Expected) -> None:
    cfg = build()
    # the command line's verdicts and fixes (its fixer searches the layout)
    violations = find_violations(cfg, data_parallel_size=dp, fixer=FIX_SEARCH)
    assert [(v.key, v.fix) for v in violations] == expected, "\n".join(map(str, violations))
    for v in violations:
        assert not v.key.startswith("<check rule"), str(v)  # no rule failed inside the check
        assert v.found and v.expected and v.fix
    # The re-check: where every fix is an override, the combined line makes the config pass.
    if violations and all(pasteable(v.fix) for v in violations):
        line = fix_line(violations, lambda extra: find_violations(
            applied(cfg, extra), data_parallel_size=dp, fixer=FIX_SEARCH),
            lambda key: present(cfg, key))
        assert line.passes, (line.overrides, [str(v) for v in line.left])
    # The startup check (no fixer) finds as many, each fix the same or one without the search
    runtime = find_violations(cfg, data_parallel_size=dp)
    assert len(runtime) == len(violations), "\n".join(map(str, runtime))
    for v in runtime:
        assert v in violations or pasteable(v.fix) or "nemo-fp8-align check" in v.fix + \
            v.expected or v.fix.startswith("<"), str(v)


def test_battery_has_at_least_40_rows_and_real_upstream_configs() -> None:
    assert len(ROWS) >= 40
    used = {p.relative_to(UPSTREAM).as_posix() for p in UPSTREAM.rglob("*.yaml")}
    assert len(used) >= 8
    readme = (UPSTREAM / "README.md").read_text()
    for path in used:
        assert path in readme, f"{path} is not described in tests/data/upstream/README.md"
