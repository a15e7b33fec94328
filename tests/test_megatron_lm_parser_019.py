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
from nemo_fp8_align.config_check.megatron_lm_parser import (flag_spec,  # noqa: E402
                                                            spec_from_parser)
from nemo_fp8_align.config_check.megatron_lm_rules import layout_stages  # noqa: E402


def test_the_flag_table_is_megatron_lms_parser():
    live = spec_from_parser(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)),
                            READ_DESTS)
    table = flag_spec()
    assert sorted(set(live) ^ set(table)) == []
    assert {o: r for o, r in live.items() if r != table[o]} == {}


@pytest.mark.parametrize("layout", ["Et|tt|tt|ttL", "Ettt|(tt|)*29,m|L", "E|t*3|(t|)*2,L"])
def test_layout_stages_and_layers_as_megatron_core_reads_them(layout):
    stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    decoder = sum(str(layer).endswith("decoder") for stage in stages for layer in stage)
    assert layout_stages(layout) == (len(stages), decoder)
