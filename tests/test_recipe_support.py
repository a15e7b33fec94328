"""Which recipe's post-all-gather work can be aligned on the installed megatron-core
(support.py), read from megatron-core's own module on every version in CI,
and the refusal at attach: each recipe that cannot be aligned is named with the reason and the
off switch, never a recipe change."""

import pytest

pytest.importorskip("megatron.core")

from packaging.version import Version  # noqa: E402

from nemo_fp8_align.support import (COLUMNWISE, NVFP4_TRANSPOSE, REQUANTIZE,  # noqa: E402
                                             TRANSPOSE, chunk_kind)
from nemo_fp8_align.errors import UnsupportedSetupError  # noqa: E402
from nemo_fp8_align.support import (mcore_features, recipe_refusals,  # noqa: E402
                                                        refuse_recipes, weights_with_work)

from nemo_fp8_align.mcore_versions import installed_version  # noqa: E402

# megatron-core 0.7.0 has no megatron.core.__version__ (its package_info has).
MCORE = Version(Version(installed_version()).base_version)


def test_features_are_read_from_megatron_core_itself():
    f = mcore_features()
    assert f.post_processes == (MCORE >= Version("0.16"))
    assert f.post_param_sync == (MCORE >= Version("0.18"))
    assert f.fp4_param_gather == (MCORE >= Version("0.17"))


@pytest.mark.parametrize("kind,since", [(TRANSPOSE, "0"), (COLUMNWISE, "0.16"),
                                        (NVFP4_TRANSPOSE, "0.17"), (REQUANTIZE, "0.18")])
def test_each_kind_is_aligned_exactly_where_megatron_core_post_processes_it(kind, since):
    refused = recipe_refusals([kind], mcore_features())
    assert bool(refused) == (MCORE < Version(since))
    for message in refused:
        assert "policy=off" in message and f">= {since}" in message
        assert "recipe" not in message.lower().split("fix:")[1]  # never "change the recipe"


@pytest.mark.parametrize("kind", [COLUMNWISE, NVFP4_TRANSPOSE, REQUANTIZE])
def test_block_scaled_kinds_are_refused_where_the_plugin_would_build_them_itself(kind):
    with pytest.raises(UnsupportedSetupError, match="never byte-transposes block-scaled data"):
        refuse_recipes([kind, TRANSPOSE], None, path="NeMo's Apex distributed_fused_adam")
    refuse_recipes([TRANSPOSE], None)  # per-tensor FP8 is the plugin's own work there


def test_mxfp8_without_grad_buffer_reuse_has_no_work_to_align():
    class Backend:
        def kind_of(self, w):
            return w

    weights = [TRANSPOSE, REQUANTIZE, COLUMNWISE]
    assert weights_with_work(weights, Backend(), requantized=False) == [TRANSPOSE, COLUMNWISE]
    assert weights_with_work(weights, Backend(), requantized=True) == weights


def test_chunk_kind_reads_old_records_as_transpose():
    assert chunk_kind([]) == TRANSPOSE
    assert chunk_kind([COLUMNWISE, COLUMNWISE]) == COLUMNWISE
    assert chunk_kind([TRANSPOSE, COLUMNWISE]) == "columnwise+transpose"
