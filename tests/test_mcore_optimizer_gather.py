"""megatron-core 0.7.0 and 0.8.0, whose DistributedOptimizer owns the parameter all-gather (one
chain per optimizer from ``zero_grad``, no per-chunk ``start_param_sync``): the engine through
:class:`~nemo_fp8_align.sync.mcore_optimizer_hold.McoreOptimizerHold`, on the real schedule,
DDP and DistributedOptimizer of the installed version (make test puts each first on
PYTHONPATH). One shared multi-rank run per policy: aligned, lazy (megatron-core alone), off.

0.7.0 refuses interleaving with PP = 2 (its own check), so it runs PP = 4; 0.8.0 runs PP = 2
with three chunks (chunk 2's all-gather is chained from chunk 1's, inside the loop). DP = 2:
the next step's bytes of the other rank's shard arrive only through the all-gather that the
aligned finish waits for.
"""

import pytest

pytest.importorskip("megatron.core")

from nemo_fp8_align.integrations import mcore_version  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not mcore_version.optimizer_owns_gather(),
    reason="megatron-core >= 0.9: the DDP chunks own the all-gather (test_engine_mcore)")]

from nemo_fp8_align.core.schedule import InterleavedSchedule  # noqa: E402
from nemo_fp8_align.demo.launch import alignment_problems, differences  # noqa: E402
from support.demo_runs import demo  # noqa: E402


def _shape():
    """(pp, vp, dp, m): PP 4 on 0.7 (it refuses PP 2 with interleaving), else PP 2 and VP 3."""
    if mcore_version.installed_version().startswith("0.7."):
        return 4, 2, 2, 4
    return 2, 3, 2, 4


def _run(policy):
    return demo(*_shape(), policy, steps=3)


def _slots(result, step, chunk):
    return {r["pp_rank"]: r["slot"] for r in result.records
            if r["step"] == step and r["chunk"] == chunk and r["dp_rank"] == 0}


def test_aligned_same_slot_on_every_rank_once_per_step_after_the_gather():
    pp, vp, _, m = _shape()
    model = InterleavedSchedule(pp, vp, m, legacy_order=True)
    run = _run("aligned")
    assert alignment_problems(run) == []
    for step in range(3):
        for chunk in range(vp):
            assert set(_slots(run, step, chunk).values()) == {model.aligned_slot(chunk)}, \
                (step, chunk, _slots(run, step, chunk))
    assert all(r["after_all_gather"] and r["transposed"] == r["weights"] for r in run.records)
    assert all(r["legacy_order"] for r in run.records)  # before 0.10: groups of PP
    for rank in run.ranks:
        assert all(b == 1 for step in rank["builds_per_step"] for b in step)


def test_lazy_is_megatron_core_alone_each_rank_at_its_first_use():
    pp, vp, _, m = _shape()
    model = InterleavedSchedule(pp, vp, m, legacy_order=True)
    run = _run("lazy")
    assert alignment_problems(run) == []
    for chunk in range(vp):
        assert _slots(run, 2, chunk) == {r: model.aligned_slot(chunk) + r for r in range(pp)}


def test_bit_identical_to_the_plugin_off():
    off = _run("off")
    assert off.records == []  # off: never attached
    for policy in ("aligned", "lazy"):
        assert differences(_run(policy), off) == [], policy


def test_without_the_optimizer_align_fp8_transposes_says_how():
    from nemo_fp8_align.errors import UnsupportedSetupError
    from nemo_fp8_align.integrations.megatron_core import _optimizer_owned

    with pytest.raises(UnsupportedSetupError, match=r"megatron-core 0\.[78]\.0: the parameter "
                       r"all-gather belongs to the DistributedOptimizer.*optimizer=<what "
                       "get_megatron_optimizer returned>"):
        _optimizer_owned(None)
