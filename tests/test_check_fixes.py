"""Issue 17's ``check`` cases on real upstream configs: fixes that change the layout, never the
model, the batch or the cluster; one override line the tool re-checked; ``+``/plain forms that
compose; the launcher's ``training.`` prefix; ``--format json``; the misses (mcore_gpt, the
shared-embedding bucket, CUDA graphs, heads vs TP, files that are not training configs).

Every case re-checks its fix here too: the printed line is appended to the same command line
and the check must then pass (exit 0), as a user pasting it would see.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import List, Tuple

import pytest
from support.nemo_config import only, seed_config
from support.overrides import applied
from support.check_json import check_cli

from nemo_fp8_align.config_check.check import find_violations
from nemo_fp8_align.config_check.fix_search import FIX_SEARCH

ROOT = Path(__file__).resolve().parents[1]
UP = ROOT / "tests" / "data" / "upstream"
L = UP / "launcher"
MAIN = UP / "launcher_conf" / "config.yaml"
pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")
ENABLE = ["model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True",
          "+model.optim.align_param_gather=True", "+model.fp8_transpose_align.policy=aligned"]


check = check_cli


def as_json(*argv: str) -> Tuple[int, dict]:
    status, out, _ = check(*argv, "--format", "json")
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one JSON object
    return status, json.loads(lines[0])


def fix_line_of(*argv: str) -> List[str]:
    """The override line the check printed, after verifying it passes when pasted."""
    status, payload = as_json(*argv)
    assert status == 2 and payload["ok"] is False
    assert payload["fix_passes"] is True, payload
    line = payload["fix_overrides"]
    assert check(*argv, *line)[0] == 0, f"the printed line does not pass: {line}"
    return line


def test_llama3_70b_pp6_fix_is_a_pipeline_size_not_the_model_or_the_cluster():
    line = fix_line_of(str(L / "llama_llama3_70b.yaml"), *ENABLE,
                       "model.pipeline_model_parallel_size=6")
    assert line == ["model.pipeline_model_parallel_size=4"]  # the file's own PP fits 1024 GPUs
    joined = " ".join(line)
    assert "num_layers=" not in joined and "num_nodes" not in joined


def test_llama3_1_405b_first_last_13_gets_first_last_14_alone():
    line = fix_line_of(str(L / "llama_llama3_1_405b.yaml"), *ENABLE,
                       "+model.num_layers_in_first_pipeline_stage=13",
                       "+model.num_layers_in_last_pipeline_stage=13")
    assert line == ["model.num_layers_in_first_pipeline_stage=14",
                    "model.num_layers_in_last_pipeline_stage=14"]


def test_layer_split_message_names_every_setting_involved():
    _, payload = as_json(str(L / "llama_llama3_1_405b.yaml"), *ENABLE,
                         "model.virtual_pipeline_model_parallel_size=4")
    split = [v for v in payload["violations"]
             if v["key"] == "model.virtual_pipeline_model_parallel_size"]
    assert split and "num_layers" in split[0]["expected"]
    assert "pipeline_model_parallel_size" in split[0]["expected"]


def test_mixtral_8x22b_global_batch_shows_with_the_vp_violation_and_names_the_trade_off():
    _, payload = as_json(str(L / "mixtral_mixtral_8x22b.yaml"), *ENABLE)
    keys = [v["key"] for v in payload["violations"]]
    assert "model.virtual_pipeline_model_parallel_size" in keys
    assert "model.global_batch_size" in keys  # at once, not only after VP is fixed
    batch = next(v for v in payload["violations"] if v["key"] == "model.global_batch_size")
    assert "found no layout that fits" in batch["expected"]
    assert "changes the training recipe" in batch["expected"]
    fix_line_of(str(L / "mixtral_mixtral_8x22b.yaml"), *ENABLE)


def test_plugin_off_is_pasteable_on_a_config_without_the_block():
    status, out, _ = check(str(L / "gpt3_175b_mlperf.yaml"))
    assert status == 2
    assert "Or turn the plugin off: +model.fp8_transpose_align.enabled=False" in out
    assert check(str(L / "gpt3_175b_mlperf.yaml"),
                 "+model.fp8_transpose_align.enabled=False")[0] == 0


def test_absent_plugin_block_is_reported_not_ok():
    argv = [str(L / "gpt3_175b_mlperf.yaml"), "+model.optim.align_param_gather=True"]
    status, payload = as_json(*argv)
    assert status == 2
    assert [v["key"] for v in payload["violations"]] == ["model.fp8_transpose_align"]
    assert payload["violations"][0]["fix"] == "+model.fp8_transpose_align.policy=aligned"
    assert "entry-point callback stays inert" in payload["violations"][0]["expected"]
    assert check(*argv, "--mixin")[0] == 0  # a model with the mixin runs without the block


def test_training_prefix_on_a_launcher_training_yaml_is_honoured():
    status, out, err = check(str(L / "gpt3_175b_mlperf.yaml"),
                             "+training.model.fp8_transpose_align.policy=lazy",
                             "+model.optim.align_param_gather=True",
                             "training.trainer.num_nodes=64")
    assert status == 0, err
    assert "OK (policy=lazy)" in out  # the prefixed override was read, not dropped


def test_training_prefix_on_a_nemo_config_is_refused():
    status, _, err = check(str(UP / "nemo_v2.3.2" / "megatron_gpt_config.yaml"),
                           "+training.model.fp8=True")
    assert status == 2 and "NeMo reads no training: node" in err
    assert "write +model.fp8=True" in err


def test_launcher_main_config_fixes_carry_the_training_prefix_and_pass():
    argv = [str(MAIN), "training=llama/llama3_70b"]
    line = fix_line_of(*argv)
    assert line and all(o.lstrip("+").startswith("training.model.") for o in line), line
    status, out, err = check(*argv, *line)
    assert status == 0 and "OK (policy=aligned)" in out, err


def test_launcher_main_config_refuses_an_unprefixed_model_override():
    status, _, err = check(str(MAIN), "training=llama/llama3_70b", "+model.fp8=True")
    assert status == 2
    assert "would not read model.fp8" in err and "++training.model.fp8=True" in err
    assert len(err.strip().splitlines()) == 1


def test_launcher_main_config_unknown_training_choice():
    status, _, err = check(str(MAIN), "training=llama/nope")
    assert status == 2 and "training=llama/nope: no such file" in err


def test_json_valid_config():
    status, payload = as_json(str(ROOT / "conf" / "launcher" / "gpt3_175b_fp8_align.yaml"))
    assert status == 0
    assert payload["ok"] is True and payload["violations"] == []
    assert payload["fix_overrides"] == []


def test_json_load_error_is_one_object_exit_2(tmp_path):
    status, payload = as_json(str(tmp_path / "nope.yaml"))
    assert status == 2 and payload["ok"] is False and "no such file" in payload["error"]


def test_json_violation_fields():
    status, payload = as_json(str(L / "gpt3_175b_mlperf.yaml"))
    assert status == 2
    for v in payload["violations"]:
        assert set(v) == {"key", "found", "expected", "fix"}


@pytest.mark.parametrize("path,fragment", [
    (".", "is a directory"), ("/dev/null", "is a character device")])
def test_directory_and_dev_null_say_what_they_are(path, fragment):
    if path == "/dev/null" and not Path(path).is_char_device():
        pytest.skip("/dev/null is not a character device on this machine")
    status, _, err = check(path)
    assert status == 2 and fragment in err and "no such file" not in err


def test_yaml_without_model_is_not_a_training_config(tmp_path):
    path = tmp_path / "bcm.yaml"
    path.write_text("partition: batch\naccount: null\nexclusive: true\n")
    status, out, err = check(str(path))
    assert status == 2 and "not a NeMo training config" in out
    assert "+model." not in out + err


def test_mcore_gpt_false_is_a_violation():
    status, payload = as_json(str(L / "gpt3_175b_mlperf.yaml"), "model.mcore_gpt=False",
                              "+model.fp8_transpose_align.policy=aligned",
                              "+model.optim.align_param_gather=True")
    assert status == 2
    assert [(v["key"], v["fix"]) for v in payload["violations"]] == [
        ("model.mcore_gpt", "model.mcore_gpt=True")]


def test_hidden_1000_tied_embeddings_pp_dp_is_the_bucket_bug():
    base = [str(L / "gpt3_175b_mlperf.yaml"), "+model.fp8_transpose_align.policy=aligned",
            "+model.optim.align_param_gather=True", "model.hidden_size=1000",
            "model.ffn_hidden_size=4000", "+model.share_embeddings_and_output_weights=True"]
    status, payload = as_json(*base)
    assert status == 2
    bucket = [v for v in payload["violations"] if "SharedEmbeddingBucketError" in v["expected"]]
    assert len(bucket) == 1 and "hidden_size = 1000" in bucket[0]["expected"]
    fix_line_of(*base)
    # multiples of 128 are fine
    assert check(*base[:3], "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                 "+model.share_embeddings_and_output_weights=True")[0] == 0


def test_enable_cuda_graph_needs_the_te_rng_tracker_and_is_noted():
    base = [str(L / "gpt3_175b_mlperf.yaml"), "+model.fp8_transpose_align.policy=aligned",
            "+model.optim.align_param_gather=True", "+model.enable_cuda_graph=True"]
    status, payload = as_json(*base)
    assert status == 2
    assert ("model.use_te_rng_tracker", "+model.use_te_rng_tracker=True") in [
        (v["key"], v["fix"]) for v in payload["violations"]]
    status, out, _ = check(*base, "+model.use_te_rng_tracker=True")
    assert status == 0 and "note: model.enable_cuda_graph=True" in out


def test_attention_heads_and_query_groups_against_tp():
    base = [str(L / "llama_llama3_70b.yaml"), *ENABLE]
    status, payload = as_json(*base, "model.num_query_groups=6")
    assert status == 2
    heads = [v for v in payload["violations"] if v["key"] == "model.tensor_model_parallel_size"]
    assert heads and "num_query_groups = 6" in heads[0]["expected"]
    assert heads[0]["fix"] == "model.tensor_model_parallel_size=2"
    fix_line_of(*base, "model.num_query_groups=6")


def test_typo_fix_in_a_block_without_the_key_composes(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text((L / "gpt3_175b_mlperf.yaml").read_text())
    argv = [str(path), "+model.fp8_transpose_align.polcy=lazy",
            "+model.optim.align_param_gather=True"]
    _, payload = as_json(*argv)
    typo = [v for v in payload["violations"] if v["key"].endswith(".polcy")]
    assert [v["fix"] for v in typo] == [
        "~model.fp8_transpose_align.polcy +model.fp8_transpose_align.policy=lazy"]
    line = fix_line_of(*argv)
    assert "+model.fp8_transpose_align.policy=lazy" in line
    assert shlex.join(line)  # printable as one shell line


def test_trainer_world_size_not_divisible_by_model_parallel_size():
    cfg = seed_config()
    # 6 GPUs per node, TP*PP = 4. No layout fits 6 GPUs (PP 2: DP 3 does not divide the batch
    # of 16; PP 3 or 6: NeMo's (num_layers // PP) % VP), so the node count is what to change,
    # and the message says that it is a trade-off.
    cfg.trainer.devices = 6
    v = only(find_violations(cfg, fixer=FIX_SEARCH))
    assert (v.key, v.found, v.fix) == ("trainer.num_nodes", "1", "trainer.num_nodes=2")
    assert "6 * 1 = 6 GPUs" in v.expected and "multiple of 2" in v.expected
    assert "found no layout that fits" in v.expected
    # Re-checked: 12 GPUs give DP 3, which no node count divides into the batch of 16, so the
    # next round asks for the global batch too (the command line's fix line holds both): the
    # nearest that fits, 12 (M = 4; was 24, M = 8).
    again = find_violations(applied(cfg, v.fix), fixer=FIX_SEARCH)
    assert [(w.key, w.fix) for w in again] == [("model.global_batch_size",
                                                "model.global_batch_size=12")]
    assert "changes the training recipe" in again[0].expected
    assert find_violations(applied(cfg, v.fix + " " + again[0].fix), fixer=FIX_SEARCH) == []


def test_library_error_names_plugin_off_in_the_form_the_config_needs():
    from nemo_fp8_align.config_check.check import FP8AlignConfigError, check_config

    with pytest.raises(FP8AlignConfigError) as info:
        check_config(seed_config(fp8=False))  # no plugin block
    assert "turn the plugin off with +model.fp8_transpose_align.enabled=False." in str(info.value)
    with pytest.raises(FP8AlignConfigError) as info:
        check_config(seed_config(fp8=False, fp8_transpose_align={"enabled": True}))
    assert "turn the plugin off with model.fp8_transpose_align.enabled=False." in str(info.value)


def test_each_violation_fix_agrees_with_the_line():
    """Per-violation fixes are parts of the re-checked line (issue 25 item 2): was
    virtual_pipeline_model_parallel_size=2 for VP >= 2 and =3 (with PP 4) for the split."""
    from nemo_fp8_align.config_check.fixes import override_key, pasteable

    argv = [str(L / "gpt3_175b_mlperf.yaml"), "+model.fp8_transpose_align.policy=aligned",
            "+model.optim.align_param_gather=True",
            "model.virtual_pipeline_model_parallel_size=null", "model.num_layers=12",
            "model.pipeline_model_parallel_size=8", "trainer.num_nodes=8"]
    line = fix_line_of(*argv)
    chosen = {override_key(o): o for o in line}
    _, payload = as_json(*argv)
    assert len(payload["violations"]) == 2, payload
    for v in payload["violations"]:
        for override in pasteable(v["fix"]) or []:
            assert chosen[override_key(override)] == override, (v["fix"], line)


def test_cpu_offloading_with_pipeline_parallelism_is_a_violation():
    """megatron-core's TransformerConfig raises 'Currently there is no support for Pipeline
    parallelism with CPU offloading' (0.12.3 and 0.19.2); the plugin needs PP >= 2, so the fix is
    turning CPU offloading off (issue 25 item 3)."""
    v = only(find_violations(seed_config(cpu_offloading=True)))
    assert (v.key, v.found, v.fix) == ("model.cpu_offloading", "True",
                                       "model.cpu_offloading=False")
    assert "pipeline_model_parallel_size = 4" in v.expected
    assert "no support for Pipeline parallelism with CPU offloading" in v.expected
    assert find_violations(seed_config(cpu_offloading=False)) == []


def test_fixes_on_a_launcher_training_yaml_keep_the_users_training_prefix():
    """The user wrote training.-prefixed overrides: the fixes and the plugin-off line come in the
    same form (was: model.* on the same command line) and pass when pasted (issue 25 item 3)."""
    argv = [str(L / "gpt3_175b_mlperf.yaml"), "+training.model.fp8_transpose_align.policy=aligned",
            "+training.model.optim.align_param_gather=True",
            "training.model.pipeline_model_parallel_size=6"]
    line = fix_line_of(*argv)
    assert line and all(o.lstrip("+~").startswith("training.model.") for o in line), line
    _, payload = as_json(*argv)
    assert all(v["key"].startswith("training.") for v in payload["violations"]), payload
    assert all(v["fix"].lstrip("+~").startswith("training.") for v in payload["violations"])
    assert payload["plugin_off"].lstrip("+~").startswith("training.model."), payload
    # unprefixed overrides keep unprefixed fixes
    plain = fix_line_of(str(L / "gpt3_175b_mlperf.yaml"),
                        "+model.fp8_transpose_align.policy=aligned",
                        "+model.optim.align_param_gather=True",
                        "model.pipeline_model_parallel_size=6")
    assert all(o.lstrip("+~").startswith("model.") for o in plain), plain


NEMO_GPT = UP / "nemo_v2.3.2" / "megatron_gpt_config.yaml"


def test_a_smaller_micro_batch_keeps_the_global_batch():
    """NeMo's GPT config (micro batch 4, global 8) on 8 GPUs at PP 2 VP 2: no layout fits, and
    micro_batch_size=1 gives M = 8 / (1 * DP 4) = 2, which keeps the recipe; was
    global_batch_size=32 (issue 25 item 3)."""
    argv = [str(NEMO_GPT), "model.fp8=True", "+model.fp8_params=True", "model.fp8_hybrid=True",
            "model.transformer_engine=True", "model.optim.name=mcore_distributed_optim",
            "+model.optim.align_param_gather=True", "+model.optim.overlap_param_sync=True",
            "+model.optim.overlap_grad_sync=True", "+model.fp8_transpose_align.policy=aligned",
            "model.pipeline_model_parallel_size=2",
            "model.virtual_pipeline_model_parallel_size=2", "trainer.devices=8"]
    assert fix_line_of(*argv) == ["model.micro_batch_size=1"]
    _, payload = as_json(*argv)
    (v,) = payload["violations"]
    assert v["key"] == "model.micro_batch_size" and v["found"] == "4"
    assert "keeps the global batch" in v["expected"]


def test_a_global_batch_fix_goes_to_the_nearest_batch_that_fits_and_names_it():
    """16 GPUs, micro batch 1, global batch 2001 (odd): every layout has an even DP, so the batch
    changes; 2000 (M = 500 at DP 4) is nearer than 2016, where the fix went before."""
    cfg = seed_config(global_batch_size=2001)
    cfg.trainer.num_nodes = 2
    v = only(find_violations(cfg, fixer=FIX_SEARCH))
    assert (v.key, v.fix) == ("model.global_batch_size", "model.global_batch_size=2000")
    assert "from 2001 to 2000" in v.expected and "changes the training recipe" in v.expected
    assert find_violations(applied(cfg, v.fix), fixer=FIX_SEARCH) == []


def test_the_layout_search_reaches_a_vp_above_32_that_divides_the_layers():
    """Llama 3 70B (80 layers) with both accounting flags: 82 layers to split; PP 2 VP 41 fits
    (1024 GPUs, TP4 CP2), and the search stopped at VP 32, so the fix changed num_layers (issue
    25 item 3)."""
    line = fix_line_of(str(L / "llama_llama3_70b.yaml"), *ENABLE,
                       "+model.account_for_embedding_in_pipeline_split=True",
                       "+model.account_for_loss_in_pipeline_split=True")
    assert sorted(line) == ["model.pipeline_model_parallel_size=2",
                            "model.virtual_pipeline_model_parallel_size=41"], line


def test_a_context_parallel_size_that_no_pipeline_size_fits_is_the_fix():
    """Llama 3 70B with CP 3 on 1024 GPUs: TP4 * CP3 divides no world of 1024, so no PP or VP
    can fit; CP 2 (the file's own) does. Was trainer.num_nodes=132 and a global batch of 2024
    (issue 25 item 3: the search covers CP where it is the cause)."""
    argv = [str(L / "llama_llama3_70b.yaml"), *ENABLE, "model.context_parallel_size=3"]
    assert fix_line_of(*argv) == ["model.context_parallel_size=2"]
    _, payload = as_json(*argv)
    (v,) = payload["violations"]
    assert v["key"] == "model.context_parallel_size" and "4 * 4 * 3 = 48" in v["expected"]


def test_what_the_re_check_adds_to_the_line_is_listed_with_its_reason(tmp_path):
    """6 GPUs per node: the node count (2) is the first fix; 12 GPUs then give DP 3, and the
    re-check adds the global batch, which had no entry of its own (only the line named it)."""
    from omegaconf import OmegaConf

    path = tmp_path / "six.yaml"
    OmegaConf.save(seed_config(), path)
    argv = [str(path), "trainer.devices=6", "+model.fp8_transpose_align.policy=aligned"]
    assert fix_line_of(*argv) == ["trainer.num_nodes=2", "model.global_batch_size=12"]
    _, payload = as_json(*argv)
    assert [v["key"] for v in payload["violations"]] == ["trainer.num_nodes"]
    assert [(v["key"], v["fix"]) for v in payload["found_on_recheck"]] == [
        ("model.global_batch_size", "model.global_batch_size=12")]
    _, out, _ = check(*argv)
    assert "The re-check with the fixes above found more (in the line too):\n" \
           "  - model.global_batch_size: found 16" in out, out


def test_a_layer_count_fix_goes_to_the_nearest_count_either_way():
    """Both account_for_* flags and 17 layers: 19 to split, a prime, so no PP on 8 GPUs fits and
    the model must change; 14 layers (16 = PP 4 * VP 2 * 2) is nearer than 22, where the fix
    went before (it only counted up; issue 25 item 3)."""
    cfg = seed_config(num_layers=17, account_for_embedding_in_pipeline_split=True,
                      account_for_loss_in_pipeline_split=True)
    v = only(find_violations(cfg, fixer=FIX_SEARCH))
    assert (v.key, v.fix) == ("model.num_layers", "model.num_layers=14"), v
    assert "changes the model" in v.expected
    assert find_violations(applied(cfg, v.fix), fixer=FIX_SEARCH) == []


def test_a_tensor_parallel_size_that_divides_no_world_of_this_size_is_the_fix():
    """TP 4 on 6 GPUs: no PP can fit (TP divides no world of 6), so the node count changed (to
    8 nodes). TP 2 with PP 3 fits the 6 GPUs, the 24 layers and the heads; TP 3 is nearer but
    does not divide 32 heads (issue 25 item 3: TP where it is the cause)."""
    cfg = seed_config(tensor_model_parallel_size=4, num_attention_heads=32, hidden_size=4096,
                      num_layers=24, global_batch_size=18)
    cfg.trainer.devices = 6
    v = only(find_violations(cfg, fixer=FIX_SEARCH))
    assert (v.key, v.fix) == ("model.tensor_model_parallel_size",
                              "model.tensor_model_parallel_size=2 "
                              "model.pipeline_model_parallel_size=3"), v
    assert "changes TP" in v.expected
    assert find_violations(applied(cfg, v.fix), fixer=FIX_SEARCH) == []


def test_a_batch_fix_beside_the_pipeline_fixes_is_judged_at_the_layout_they_make():
    """GPT-3 126M on 16 nodes: PP 1 and no VP; at PP 1 (DP 128) the batch of 256 is no multiple
    of 4 * 128, and the fix said global_batch_size=512. The plugin's own fixes make PP 2 VP 2
    (DP 64), where micro_batch_size=2 keeps the batch (M = 2)."""
    line = fix_line_of(str(L / "gpt3_126m.yaml"), *ENABLE, "trainer.num_nodes=16")
    assert line == ["model.pipeline_model_parallel_size=2",
                    "model.virtual_pipeline_model_parallel_size=2", "model.micro_batch_size=2"]


def test_a_smaller_micro_batch_with_another_layout_before_another_global_batch():
    """GPT-3 126M on 24 nodes (192 GPUs, micro batch 4, global 256): no layout fits with micro
    batch 4 and no smaller one fits at PP 2 (DP 96), so the batch became 768; at PP 3 (DP 64)
    micro batch 1 gives M = 4 with N = 4, and the batch stays 256."""
    line = fix_line_of(str(L / "gpt3_126m.yaml"), *ENABLE, "trainer.num_nodes=24")
    assert "model.micro_batch_size=1" in line, line
    assert not any(o.startswith("model.global_batch_size") for o in line), line


def test_where_the_global_batch_must_change_the_nearest_over_smaller_micro_batches():
    """GPT-3 126M on 100 nodes (800 GPUs, micro batch 4, global 256): no layout and no micro
    batch keeps 256; with micro batch 1 the nearest batch that fits is 800 (M = 2 at DP 400),
    nearer than 3200 with micro batch 4, where the fix went."""
    line = fix_line_of(str(L / "gpt3_126m.yaml"), *ENABLE, "trainer.num_nodes=100")
    assert "model.micro_batch_size=1" in line and "model.global_batch_size=800" in line, line


def test_a_node_count_fix_keeps_the_layers_where_a_layout_fits_at_the_new_world_size():
    """6 layers at PP 4 on 5 GPUs: no layout fits 5 GPUs, so the node count changes (to 4: 20
    GPUs). The split rule, judging the 5 GPUs as given, also changed the model
    (model.num_layers=8), though on 20 GPUs PP 2 with VP 3 keeps all 6 layers."""
    line = fix_line_of(str(ROOT / "conf" / "megatron_gpt_fp8_align.yaml"), "trainer.devices=5",
                       "model.num_layers=6", "model.pipeline_model_parallel_size=4",
                       "model.global_batch_size=360")
    assert "trainer.num_nodes=4" in line, line
    assert not any("num_layers=" in o for o in line), line


def test_the_nearest_global_batch_is_exact_above_2_to_the_53():
    """Issue 40: a huge global batch's "nearest that fits" was off by float rounding (the
    division gbs / per lost the units above 2**53). Checked against a search in integers."""
    from nemo_fp8_align.config_check.batch_fix import nearest_batch
    from nemo_fp8_align.config_check.rules.batch import schedule_fits

    gbs = 3 * 10**18 + 22
    near = [k for k in range(gbs // 3 - 10, gbs // 3 + 10) if schedule_fits(2, 2, k, None)]
    best = min(near, key=lambda k: (abs(3 * k - gbs), -k))
    assert nearest_batch(2, 2, 3, 1, gbs, None) == (1, 3 * best)

