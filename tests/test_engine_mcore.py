"""The engine on megatron-core's real interleaved schedule, DDP and DistributedOptimizer (gloo).

Each run spawns PP x DP processes on the CPU. Runs are cached per shape/policy so several tests
can read the same run.
"""

import functools
import json
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from nemo_fp8_align.config import Policy  # noqa: E402
from nemo_fp8_align.demo.launch import alignment_problems, run_demo  # noqa: E402
from nemo_fp8_align.demo.train import DemoOptions  # noqa: E402

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def demo(pp, vp, dp, m, policy, steps=2, n=None):
    return run_demo(DemoOptions(pp=pp, vp=vp, dp=dp, microbatches=m, group_size=n, steps=steps,
                                policy=Policy(policy)))


@pytest.mark.parametrize("policy", ["aligned", "lazy"])
def test_slots_exactly_once_after_all_gather_pp2_vp2_dp2(policy):
    result = demo(2, 2, 2, 4, policy)
    assert alignment_problems(result) == []
    recs = result.records
    assert len(recs) == 2 * 4 * 2  # steps x ranks x chunks
    for step in range(2):
        for chunk in range(2):
            slots = {r["pp_rank"]: r["slot"] for r in recs if r["step"] == step and r["chunk"] == chunk}
            if policy == "aligned":  # the same slot on every pipeline rank: the chunk's first forward
                assert set(slots.values()) == {2 * chunk}
            else:  # lazy: each rank at its own first use, delayed by its pipeline rank
                assert slots == {pp: 2 * chunk + pp for pp in range(2)}
    assert all(r["after_all_gather"] and r["transposed"] == r["weights"] for r in recs)
    for rank in result.ranks:  # every FP8 weight transposed exactly once per step
        assert all(b == 1 for step in rank["builds_per_step"] for b in step)
        assert rank["eval_builds"] == 0  # forward-only evaluation after each step did nothing


def test_bit_identical_across_policies():
    runs = {p: demo(2, 2, 2, 4, p) for p in ("aligned", "lazy", "off")}
    ref = runs["off"]
    for policy, run in runs.items():
        assert run.losses() == ref.losses(), policy
        for mine, theirs in zip(run.ranks, ref.ranks):
            assert mine["grads"] == theirs["grads"], (policy, mine["rank"])
            assert mine["params"] == theirs["params"], (policy, mine["rank"])
    assert ref.records == []  # off: the plugin was not attached


def test_pp4_vp2_last_chunk_included():
    result = demo(4, 2, 1, 4, "aligned")
    assert alignment_problems(result) == []
    last = [r for r in result.records if r["chunk"] == 1]
    assert {r["pp_rank"] for r in last} == {0, 1, 2, 3}
    assert {r["slot"] for r in last} == {4}
    assert sorted(r["vmid"] for r in last if r["step"] == 0) == [1, 2, 3, 4]


def test_vp3_group_size_and_remainder_group():
    # M=5, N=3: a last group of 2 (>= PP) microbatches; chunk 2's all-gather is launched in
    # the loop, not before it.
    result = demo(2, 3, 1, 5, "aligned", n=3)
    assert alignment_problems(result) == []
    assert {(r["chunk"], r["slot"]) for r in result.records} == {(0, 0), (1, 3), (2, 6)}


def test_cli_demo_writes_telemetry_and_exits_zero(tmp_path):
    path = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "nemo_fp8_align", "demo", "--pp", "2", "--vp", "2",
                           "--microbatches", "2", "--steps", "1", "--telemetry", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK:" in proc.stdout
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["policy"] == "aligned" for r in rows)


def test_cli_demo_bad_shape_exits_2():
    proc = subprocess.run([sys.executable, "-m", "nemo_fp8_align", "demo", "--pp", "4",
                           "--microbatches", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "num_microbatches=2 < pipeline_model_parallel_size=4" in proc.stderr
