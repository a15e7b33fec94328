"""The engine on megatron-core's real interleaved schedule, DDP and DistributedOptimizer (gloo).

Each run spawns PP x DP processes on the CPU. Runs are cached per shape/policy so several tests
can read the same run.
"""

import json

import pytest

pytest.importorskip("megatron.core")

from support.configs import has_group_size  # noqa: E402
from support.demo_runs import demo, demo_cli  # noqa: E402

from lab.demo.launch import alignment_problems, differences  # noqa: E402

pytestmark = pytest.mark.slow


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


def test_bit_identical_across_policies():
    """Evaluation off and DP=2: the next step's parameter bytes arrive only through the
    all-gather the plugin waits for (tests/test_faults.py shows this comparison failing when
    it does not wait)."""
    runs = {p: demo(2, 2, 2, 4, p) for p in ("aligned", "lazy", "off")}
    ref = runs["off"]
    assert ref.options.eval_after_each_step is False
    for policy, run in runs.items():
        assert differences(run, ref) == [], policy
        assert alignment_problems(run) == [], policy
    assert ref.records == []  # off: the plugin was not attached


@pytest.mark.parametrize("policy,forced_sync", [("aligned", False), ("lazy", False),
                                                ("aligned", True)])
def test_evaluation_inside_training_triggers_nothing_and_stays_aligned(policy, forced_sync):
    """Forward-only passes after every step, through DDP's pre-hooks or, as Megatron-LM's
    evaluate does, with the pre-hooks disabled and a forced synchronous all-gather: nothing is
    built, the next step is aligned and exactly-once, and its transposes match the weights byte
    for byte (the GEMMs' provenance check; bit-identity with the plugin off)."""
    run = demo(2, 2, 2, 4, policy, eval_after_each_step=True, eval_forced_sync=forced_sync)
    assert alignment_problems(run) == []
    assert all(rank["eval_builds"] == 0 for rank in run.ranks)
    assert differences(run, demo(2, 2, 2, 4, "off")) == []


def test_foreign_module_forwards_with_gradients_never_count():
    """A module that is not a model chunk (a probe, a reference model) runs forward and
    backward with gradients between the schedule's launches and the first forward, between a
    backward and the next forward, and between steps: the real engine stays aligned and
    exactly-once, and the run is bit-identical to the plugin off."""
    run = demo(2, 2, 2, 4, "aligned", foreign_forwards=True)
    assert alignment_problems(run) == []
    assert all(rank["unlaunched_forwards"] == 0 for rank in run.ranks)
    assert differences(run, demo(2, 2, 2, 4, "off")) == []


def test_independent_evidence_places_builds_at_the_aligned_slot():
    """From the demo's own hooks (not the aligner's records): on every rank chunk 1 is built
    after T_1 - r forwards (slot T_1 = 2), none running; under lazy inside forward T_1."""
    from lab.demo.evidence import evidence_problems

    for policy in ("aligned", "lazy"):
        run = demo(2, 2, 2, 4, policy)
        for rank in run.ranks:
            ev = rank["evidence"]
            assert evidence_problems(ev, pp_rank=rank["pp_rank"], policy=policy) == []
            other = "lazy" if policy == "aligned" else "aligned"
            if rank["pp_rank"] > 0:  # on rank 0 the two policies coincide
                assert evidence_problems(ev, pp_rank=rank["pp_rank"], policy=other)


def test_pp4_vp2_last_chunk_included():
    result = demo(4, 2, 1, 4, "aligned")
    assert alignment_problems(result) == []
    last = [r for r in result.records if r["chunk"] == 1]
    assert {r["pp_rank"] for r in last} == {0, 1, 2, 3}
    assert {r["slot"] for r in last} == {4}
    assert sorted(r["vmid"] for r in last if r["step"] == 0) == [1, 2, 3, 4]


def _vp3_shape():
    """PP 2, VP 3 (chunk 2's all-gather is launched in the loop, not before it): M=5 with N=3
    (a last group of 2 >= PP microbatches) where megatron-core has N (0.10 on); before, M=4
    in the legacy order (groups of PP, M a multiple of PP)."""
    from nemo_fp8_align.core.schedule import InterleavedSchedule

    if has_group_size():
        return dict(m=5, n=3), InterleavedSchedule(2, 3, 5, 3)
    return dict(m=4, n=None), InterleavedSchedule(2, 3, 4, legacy_order=True)


def test_vp3_group_size_and_remainder_group():
    shape, model = _vp3_shape()
    result = demo(2, 3, 1, shape["m"], "aligned", n=shape["n"])
    assert alignment_problems(result) == []
    want = {(0, 0), (1, 3), (2, 6)} if has_group_size() else {(0, 0), (1, 2), (2, 4)}
    assert {(c, model.aligned_slot(c)) for c in range(3)} == want
    assert {(r["chunk"], r["slot"]) for r in result.records} == want
    assert all(r["legacy_order"] == (not has_group_size()) for r in result.records)


def test_cli_demo_writes_telemetry_and_exits_zero(tmp_path):
    path = tmp_path / "t.jsonl"
    proc = demo_cli("--pp", "2", "--vp", "2", "--microbatches", "2", "--steps", "1",
                    "--telemetry", str(path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK:" in proc.stdout
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["policy"] == "aligned" for r in rows)


def test_cli_demo_bad_shape_exits_2():
    proc = demo_cli("--pp", "4", "--microbatches", "2", timeout=120)
    assert proc.returncode == 2
    assert "--microbatches 2" in proc.stderr and "--pp" in proc.stderr


def test_real_schedule_launches_where_the_model_says():
    """megatron-core's real interleaved function, observed: each chunk's all-gather launch
    (its call of param_sync_func, timestamped by the wrapper) comes after exactly as many of
    the rank's forwards as the schedule model's param_sync_launch_vmid says, and before the
    chunk's transposes."""
    from nemo_fp8_align.core.schedule import AT_START

    shape, model = _vp3_shape()
    result = demo(2, 3, 1, shape["m"], "aligned", n=shape["n"])
    for rank in result.ranks:
        for rec in (r for r in result.records if r["pp_rank"] == rank["pp_rank"]):
            starts = [f[2] for f in rank["evidence"]["forwards"] if f[0] == rec["step"]]
            launched_after = sum(t < rec["t_launch"] for t in starts)
            want = model.param_sync_launch_vmid(rec["pp_rank"], rec["chunk"])
            assert launched_after == (0 if want == AT_START else want), rec
            assert rec["t_launch"] <= rec["t_slot"]


def test_resume_from_checkpoint_is_bit_identical_and_the_unlaunched_step_is_reported():
    """Saved before step 2 (Megatron-LM style: pre-hooks off with a forced all-gather, model,
    optimizer and DistributedOptimizer parameter state) and resumed in a new model, optimizer
    and aligner whose first step runs with the pre-hooks off and param_sync_func=None: the
    losses, gradients and parameters equal the uninterrupted run's; the step without launches
    builds at first use and is counted, not judged; telemetry steps continue (no step 2)."""
    plain = demo(2, 2, 2, 4, "aligned", steps=4)
    resumed = demo(2, 2, 2, 4, "aligned", steps=4, resume_at=2)
    assert differences(resumed, plain) == []
    assert alignment_problems(resumed) == []
    assert sorted({r["step"] for r in resumed.records}) == [0, 1, 3]
    assert all(rank["unlaunched_steps"] == [2] and rank["unlaunched_forwards"] == 8
               for rank in resumed.ranks)
