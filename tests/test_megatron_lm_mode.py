"""The plugin attached for a loop that re-binds ``config.param_sync_func`` (Megatron-LM's
``train()``, Megatron-Bridge): hooks on the DDP chunks, bound by the loop after the attach, the
loop's first step run without launches. Real megatron-core DDP, schedule and optimizer on gloo
(2 x 2 processes); the real Megatron-LM loop is in test_megatron_lm_loop.py (megatron-core 0.19)."""

import pytest

pytest.importorskip("megatron.core")

from nemo_fp8_align.config import Policy  # noqa: E402
from lab.demo.launch import alignment_problems, differences, run_demo  # noqa: E402
from lab.demo.train import DemoOptions  # noqa: E402

pytestmark = pytest.mark.slow


def _run(policy, **kw):
    return run_demo(DemoOptions(pp=2, vp=2, dp=2, microbatches=4, steps=3,
                                policy=Policy(policy), rebinding_loop=True, **kw))


@pytest.fixture(scope="module")
def runs():
    return {p: _run(p) for p in ("aligned", "lazy", "off")}


@pytest.mark.parametrize("policy", ["aligned", "lazy"])
def test_attached_before_the_loop_binds_param_sync_func_stays_in_the_loop(runs, policy):
    result = runs[policy]
    assert alignment_problems(result) == []
    # step 0 ran as the loop's first iteration (no launches); steps 1 and 2 were aligned
    assert result.ranks[0]["unlaunched_steps"] == [0]
    assert sorted({r["step"] for r in result.records}) == [1, 2]
    assert len(result.records) == 2 * 4 * 2  # launched steps x ranks x chunks
    if policy == "aligned":
        for r in result.records:
            assert r["slot"] == r["aligned_slot"] and r["after_all_gather"]


def test_bit_identical_to_the_plugin_off(runs):
    assert differences(runs["aligned"], runs["off"]) == []
    assert differences(runs["lazy"], runs["off"]) == []
