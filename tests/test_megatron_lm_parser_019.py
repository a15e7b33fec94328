"""The generated table of Megatron-LM's flags (config_check/megatron_lm_flags.txt) against
megatron-core 0.19.2's own parser, and the layout-string reading against its own layout class.
Needs megatron.training (the 0.19 wheel): .venv-mcore019."""

import argparse

import pytest

pytest.importorskip("megatron.training.arguments",
                    reason="needs megatron-core 0.19's megatron.training (.venv-mcore019)")

from megatron.core.transformer.pipeline_parallel_layer_layout import (  # noqa: E402
    PipelineParallelLayerLayout)
from megatron.training.arguments import add_megatron_arguments  # noqa: E402

from nemo_fp8_align.config_check.megatron_lm_args import READ_DESTS  # noqa: E402
from nemo_fp8_align.config_check.megatron_lm_parser import (spec_from_parser,  # noqa: E402
                                                            table_spec)
from nemo_fp8_align.config_check.megatron_lm_rules import layout_stages  # noqa: E402


def test_the_flag_table_is_megatron_lms_parser():
    live = spec_from_parser(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)),
                            READ_DESTS)
    table = table_spec()  # the copy (flag_spec() reads the live parser here)
    assert sorted(set(live) ^ set(table)) == []
    assert {o: r for o, r in live.items() if r != table[o]} == {}


@pytest.mark.parametrize("layout", ["Et|tt|tt|ttL", "Ettt|(tt|)*29,m|L", "E|t*3|(t|)*2,L"])
def test_layout_stages_and_layers_as_megatron_core_reads_them(layout):
    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    decoder = sum(str(layer).endswith("decoder") for stage in stages for layer in stage)
    assert layout_stages(layout) == (len(stages), decoder)


@pytest.mark.parametrize("layers,pp,vp,mtp", [(61, 2, 2, 1), (61, 4, 2, 0), (7, 2, 2, 0),
                                              (13, 3, 2, 2), (4, 2, 2, 0), (95, 8, 3, 1)])
def test_a_layout_string_fix_is_one_megatron_core_accepts(layers, pp, vp, mtp):
    """The check's layout-string fix (DeepSeek-V3's 61 layers, second trial): megatron-core's
    own class reads PP x VP stages with every layer, the MTP layers and the loss last, and
    stages that differ by at most one layer."""
    from nemo_fp8_align.config_check.megatron_lm_rules import layout_text

    layout = PipelineParallelLayerLayout(layout_text(layers, pp, vp, mtp), pp)
    assert layout.virtual_pipeline_model_parallel_size == vp
    layout.validate_layer_layout(layers, mtp or None)
    from megatron.core.transformer.enums import LayerType

    counts = [stage.count(LayerType.decoder) for rank in layout.layout for stage in rank]
    assert sum(counts) == layers and max(counts) - min(counts) <= 1, counts


@pytest.mark.parametrize("pattern,stages", [
    ("M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-", 4), ("M*M*M/MM/MM", 2),
    ("MEMEMEM*E|MEMEM*EMEME", 6), ("M*-", 3)])
def test_a_hybrid_pattern_cut_into_segments_is_read_by_megatron_core(pattern, stages):
    """The check's VP fix for a hybrid model (second trial): megatron-core 0.19.2's own pattern
    functions read the same layers and MTP part, in the stages asked for."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import (
        get_hybrid_total_layer_count, get_hybrid_total_pipeline_segment_count,
        parse_hybrid_pattern)

    from nemo_fp8_align.config_check.megatron_lm_hybrid import (hybrid_layers,
                                                                hybrid_segments, with_segments)

    cut = with_segments(pattern, stages)
    assert get_hybrid_total_pipeline_segment_count(cut) == stages == hybrid_segments(cut)
    assert get_hybrid_total_layer_count(cut) == get_hybrid_total_layer_count(pattern) \
        == hybrid_layers(cut)
    before, after = parse_hybrid_pattern(pattern), parse_hybrid_pattern(cut)
    assert (after.mtp_pattern, after.mtp_num_depths) == (before.mtp_pattern,
                                                         before.mtp_num_depths)
    assert after.main_pattern.replace("|", "") == before.main_pattern.replace("|", "")


def _recipe_config_error(q):
    """What megatron-core 0.19.2's own config classes say about the recipe settings ``q`` (the
    recipe table's names): the error message, or None when all of them accept it."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    try:
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2,
                          fp8=q.get("fp8"), fp8_recipe=q.get("fp8_recipe") or "delayed",
                          fp8_param=bool(q.get("fp8_param")), fp4=q.get("fp4"),
                          fp4_param=bool(q.get("fp4_param")),
                          fp8_output_proj=bool(q.get("fp8_output_proj")))
        DistributedDataParallelConfig(fp8_param_gather=bool(q.get("fp8_param")),
                                      reuse_grad_buf_for_mxfp8_param_ag=bool(q.get("reuse")))
        OptimizerConfig(fp8_recipe=q.get("fp8_recipe"), reuse_grad_buf_for_mxfp8_param_ag=bool(
            q.get("reuse")), overlap_param_gather_with_optimizer_step=bool(
                q.get("gather_with_step")))
    except (AssertionError, ValueError) as err:
        return str(err) or type(err).__name__
    return None


@pytest.mark.parametrize("q,rejected", [
    ({"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True}, False),
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True, "reuse": True}, False),
    ({"fp4": "e2m1", "fp4_param": True}, False),
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "reuse": True}, True),
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True, "reuse": True,
      "gather_with_step": True}, True),
    ({"fp8": "hybrid", "fp4": "e2m1"}, True),
    ({"fp8": "hybrid", "fp4_param": True}, True),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_output_proj": True}, True),
])
def test_the_recipe_rejections_are_megatron_cores(q, rejected):
    """The recipe table's rejections (config_check/recipes.py) against megatron-core 0.19.2's
    TransformerConfig, DistributedDataParallelConfig and OptimizerConfig: the check names a
    combination exactly where megatron-core raises."""
    from nemo_fp8_align.config_check.recipes import rejected as named_by_the_check

    named = named_by_the_check(q, megatron_lm=True)
    assert (_recipe_config_error(q) is not None) is rejected, _recipe_config_error(q)
    assert bool(named) is rejected, named


# --- check --megatron-lm reads the flags through this parser, and runs validate_args ----------

from nemo_fp8_align.config_check import megatron_lm_parser  # noqa: E402
from nemo_fp8_align.config_check.megatron_lm_args import megatron_lm_violations  # noqa: E402
from nemo_fp8_align.config_check.megatron_lm_parser import parse_megatron_lm_argv  # noqa: E402
from support.check_json import VALIDATED_ARGV as FULL  # noqa: E402
from support.check_json import check_cli, check_json  # noqa: E402


def _payload(world, argv):
    return check_json(["--megatron-lm", "--world-size", str(world), "--", *argv])


def test_megatron_lms_own_parser_reads_the_flags_and_says_so(monkeypatch):
    """The table is not read where the parser is: emptied, the flags are still known."""
    source = megatron_lm_parser.flag_source()
    assert source.kind == "parser" and source.version.startswith("0.19"), source
    status, payload = _payload(4, FULL)
    assert status == 0, payload
    assert payload["flags_read_by"] == "parser", payload
    assert any(n.startswith("flags read by Megatron-LM's own parser "
                            "(megatron.training.arguments") for n in payload["notes"])
    monkeypatch.setattr(megatron_lm_parser, "table_spec", lambda: {})
    assert megatron_lm_violations(parse_megatron_lm_argv(FULL), world_size=4) == []


def test_the_copy_is_the_fallback_where_the_parser_does_not_import(monkeypatch):
    """The same list read by the copy (megatron.training made unimportable): the same verdict,
    and the output says the copy read it."""
    import sys

    megatron_lm_parser.flag_source.cache_clear()
    megatron_lm_parser.flag_spec.cache_clear()
    megatron_lm_parser._parser.cache_clear()
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)  # ImportError
    try:
        status, payload = _payload(4, FULL)
        assert status == 0 and payload["flags_read_by"] == "table", payload
        assert payload["megatron_lm_validate_args"] is None
    finally:
        monkeypatch.undo()
        megatron_lm_parser.flag_source.cache_clear()
        megatron_lm_parser.flag_spec.cache_clear()
        megatron_lm_parser._parser.cache_clear()


def test_megatron_lms_validate_args_runs_on_the_cpu_and_its_verdict_is_reported():
    status, payload = _payload(4, FULL)
    assert payload["megatron_lm_validate_args"] == "OK", payload
    assert "Megatron-LM's validate_args: OK" in payload["notes"]
    # 9 layers over PP 2: its own assertion, beside the plugin's violations
    argv = [a if a != "8" else "9" for a in FULL]
    status, payload = _payload(4, argv)
    assert status == 2
    verdict = payload["megatron_lm_validate_args"]
    assert verdict.startswith("AssertionError: number of layers of the model must be "
                              "divisible pipeline model parallel size"), verdict
    status, out, _ = check_cli("--megatron-lm", "--world-size", "4", "--", *argv)
    assert "note: Megatron-LM's validate_args: AssertionError: number of layers" in out, out
    # 3 processes: TP * PP * CP = 2 does not divide them (its own world-size assertion)
    status, payload = _payload(3, FULL)
    assert payload["megatron_lm_validate_args"].startswith("AssertionError"), payload
