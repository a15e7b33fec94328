"""Several distributed-optimizer instances (megatron-core >= 0.10's
``num_distributed_optimizer_instances``, Megatron-LM's ``--num-distributed-optimizer-instances``,
which upstream CI trains with): the data-parallel ranks split into instances, each all-gathering
its parameters over its own ranks, the gradients all-reduced across instances. The plugin finishes
each instance's all-gathers as it does the single one's. PP=2 VP=2 DP=4 in 2 instances: 8 gloo
ranks per run, in the demo's own loop and in Megatron-LM's ``train()`` (0.19)."""

import importlib.util

import pytest

pytest.importorskip("megatron.core")

from support.demo_runs import demo, demo_cli  # noqa: E402

from lab.demo.launch import DemoRankError, alignment_problems, differences  # noqa: E402
from nemo_fp8_align import mcore_versions as mcore_version  # noqa: E402

pytestmark = pytest.mark.slow
HAS = mcore_version.has_optimizer_instances()
VERSION = mcore_version.installed_version()
needs_instances = pytest.mark.skipif(not HAS, reason=f"megatron-core {VERSION} has one "
                                     "optimizer instance only")

SHAPE = (2, 2, 4, 4)  # PP, VP, DP, M
#: Each chunk's DDP config asks for 2 instances, and each all-gathers over DP / 2 ranks.
INSTANCES = 2
LAYOUT = [{"instances": INSTANCES, "gather_group": [2]}] * 2


def run(policy, fault=None):
    return demo(*SHAPE, policy, fault=fault, dist_opt_instances=INSTANCES)


@needs_instances
def test_the_all_gathers_run_within_each_instance():
    for r in run("aligned").ranks:
        assert r["optimizer_instances"] == LAYOUT, r["optimizer_instances"]


@needs_instances
@pytest.mark.parametrize("policy", ["aligned", "lazy"])
def test_slots_and_counts_pass_the_verdict(policy):
    result = run(policy)
    assert alignment_problems(result) == []
    slots = {(r["chunk"], r["slot"] == r["aligned_slot"]) for r in result.records}
    assert slots == {(0, True), (1, True)} if policy == "aligned" else {(0, True), (1, True),
                                                                           (0, False), (1, False)}


@needs_instances
def test_bit_identical_across_policies():
    assert differences(run("lazy"), run("aligned")) == []


@needs_instances
def test_a_transpose_before_the_instance_all_gather_is_caught():
    with pytest.raises(DemoRankError, match="StaleFP8Error"):
        run("aligned", fault="no_wait")


def _has_megatron_lm():
    try:
        return all(importlib.util.find_spec(m) for m in ("megatron.training.models", "omegaconf"))
    except ModuleNotFoundError:  # no megatron.training package at all (before 0.19)
        return False


@needs_instances
@pytest.mark.skipif(not _has_megatron_lm(),
                    reason="Megatron-LM's loop ships in megatron-core >= 0.19 (.venv-mcore019)")
def test_megatron_lm_loop_with_two_instances():
    """Megatron-LM's own argument list with --num-distributed-optimizer-instances 2, its groups
    and train(), the plugin attached by the post-wrap hook: iterations 1 and 2 aligned."""
    from nemo_fp8_align.config import Policy
    from lab.demo.launch_megatron_lm import run_megatron_lm_demo
    from lab.demo.train import DemoOptions

    result = run_megatron_lm_demo(DemoOptions(pp=2, vp=2, dp=4, microbatches=4, steps=3,
                                              policy=Policy.ALIGNED, dist_opt_instances=INSTANCES))
    assert alignment_problems(result) == []
    assert all(r["optimizer_instances"] == LAYOUT for r in result.ranks)
    assert sorted({r["step"] for r in result.records}) == [1, 2]
    assert all(r["slot"] == r["aligned_slot"] for r in result.records)


def test_instances_that_do_not_divide_dp_are_refused():
    out = demo_cli("--dp", "3", "--dist-opt-instances", "2")
    assert out.returncode == 2
    assert ("--dist-opt-instances 2: megatron-core splits the --dp 3 data-parallel ranks evenly "
            "into the instances, and 2 does not divide 3; pass --dp 4, or --dist-opt-instances 1"
            ) in out.stderr


@pytest.mark.skipif(HAS, reason=f"megatron-core {VERSION} has optimizer instances")
def test_before_0_10_the_flag_is_refused_with_the_version():
    # PP 4: 0.7.0 refuses interleaving at PP 2 before it reads this flag
    out = demo_cli("--pp", "4", "--dp", "2", "--dist-opt-instances", "2")
    assert out.returncode == 2
    assert (f"--dist-opt-instances 2: megatron-core {VERSION} (before 0.10) has one distributed-"
            "optimizer instance only") in out.stderr
