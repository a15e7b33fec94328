"""The aligner's hooks on one simulated rank: slots, exactly-once, handles, forward-only."""

import json
import logging
from dataclasses import asdict

import pytest
import torch
from support.aligner_rank import FakeBackend, end_step, make_rank, run_training_step

from nemo_fp8_align.config import AlignConfig, Policy
from nemo_fp8_align.core.aligner import StepMismatchError, TransposeAligner
from nemo_fp8_align.core.schedule import AT_START, InterleavedSchedule
from nemo_fp8_align.core.telemetry import TelemetryWriter, read_records
from nemo_fp8_align.adapters.mcore_ddp import McoreDDPAdapter


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_aligned_every_chunk_at_its_slot_once(rank):
    r = make_rank(rank=rank)
    assert r.aligner.attach()
    for _ in range(3):
        run_training_step(r)
    recs = r.aligner.records
    assert len(recs) == 3 * r.schedule.vp
    for rec in recs:
        assert rec.slot == r.schedule.aligned_slot(rec.chunk)
        assert rec.vmid == r.schedule.trigger_vmid(rank, rec.chunk)
        assert rec.transposed == rec.weights == 2 and rec.after_all_gather
    assert {rec.chunk for rec in recs if rec.step == 2} == {0, 1, 2}  # the last chunk too
    assert all(w.builds == 3 for ws in r.weights for w in ws)  # exactly once per step


def test_chunk0_is_finished_after_both_preloop_launches():
    r = make_rank(rank=2)
    r.aligner.attach()
    run_training_step(r)
    assert r.sync.log[:3] == [("launch", 0), ("launch", 1), ("finish", 0)]
    assert r.aligner.records[0].vmid == AT_START and r.aligner.records[0].slot == 0


@pytest.mark.parametrize("rank", [0, 3])
def test_lazy_only_observes_first_use(rank):
    r = make_rank(rank=rank, policy=Policy.LAZY)
    r.aligner.attach()
    run_training_step(r)
    assert not [e for e in r.sync.log if e[0] == "finish"]  # lazy never finishes anything
    for rec in r.aligner.records:
        assert rec.vmid == r.schedule.first_vmid(rec.chunk)
        assert rec.slot == r.schedule.aligned_slot(rec.chunk) + rank
        assert rec.transposed == 2 and rec.seconds is None


def test_attach_detach_idempotent_and_leak_free():
    r = make_rank()
    original = r.config.param_sync_func
    assert r.aligner.attach() and r.aligner.attach()
    assert [len(c._forward_pre_hooks) for c in r.chunks] == [1, 1, 1]
    r.aligner.detach()
    r.aligner.detach()
    assert all(not c._forward_pre_hooks and not c._forward_hooks for c in r.chunks)
    assert r.config.param_sync_func is original
    run_training_step(r)  # detached: nothing recorded, weights built lazily by the chunks
    assert r.aligner.records == []
    assert r.aligner.attach()  # re-attach works after detach
    run_training_step(r)
    assert len(r.aligner.records) == 3


def test_forward_only_passes_do_nothing():
    r = make_rank()
    r.aligner.attach()
    with torch.no_grad():  # forward-only: the schedule calls no param_sync_func
        for v in range(r.schedule.total):
            r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    assert r.aligner.records == [] and r.sync.log == []
    run_training_step(r)
    n = len(r.aligner.records)
    with torch.no_grad():  # evaluation after a training step
        for v in range(r.schedule.total):
            r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    assert len(r.aligner.records) == n


def test_schedule_mismatch_is_an_error():
    r = make_rank(m=8)
    r.aligner.attach()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    r.chunks[1](torch.ones(1))  # held: raised inside the schedule it would hang the peers
    with pytest.raises(RuntimeError, match="runs chunk 0 there"):
        end_step(r)


def test_inactive_where_no_transpose_is_needed(caplog):
    r = make_rank(needed=False)
    with caplog.at_level(logging.INFO):
        assert not r.aligner.attach()
    assert "fake backend says so" in caplog.text
    assert all(not c._forward_pre_hooks for c in r.chunks)


def test_policy_off_attaches_nothing():
    r = make_rank(policy=Policy.OFF)
    assert not r.aligner.attach()
    assert not r.aligner.attached


def test_chunks_without_start_param_sync_name_the_fix():
    r = make_rank()
    with pytest.raises(TypeError, match="overlap_param_gather=True"):
        McoreDDPAdapter([torch.nn.Linear(1, 1)], r.config)


def test_wrong_chunk_count_is_rejected():
    r = make_rank()
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=3"):
        TransposeAligner(r.chunks[:2], schedule=r.schedule, pp_rank=0, dp_rank=0,
                         adapter=r.new_adapter(), weights=r.weights, backend=FakeBackend(),
                         config=AlignConfig())


def test_telemetry_lines(tmp_path):
    r = make_rank(rank=3)
    path = tmp_path / "t.jsonl"
    r.aligner.telemetry = TelemetryWriter(str(path))
    r.aligner.attach()
    run_training_step(r)
    r.aligner.detach()
    rows = read_records([str(path)])
    assert len(rows) == 3
    for row in rows:
        assert {"step", "pp_rank", "dp_rank", "chunk", "policy", "vmid", "slot", "transposed",
                "after_all_gather"} <= set(row)
        assert row["pp_rank"] == 3 and row["policy"] == "aligned"
        assert row["slot"] == (0 if row["vmid"] == -1 else row["vmid"] + 3)
    json.dumps(rows)


def test_unfinished_all_gather_builds_nothing_early():
    r = make_rank()
    r.sync.report_finished = False
    r.aligner.attach()
    run_training_step(r)
    assert r.aligner.records and not any(rec.after_all_gather for rec in r.aligner.records)
    assert all(rec.transposed == 0 for rec in r.aligner.records)  # no transpose of stale bytes
    assert all(w.builds == 1 for ws in r.weights for w in ws)  # built later, at first use


def test_record_problems_judges_slots_per_policy_and_duplicates():
    from dataclasses import asdict

    from nemo_fp8_align.core.telemetry import record_problems

    r = make_rank(rank=2)
    r.aligner.attach()
    run_training_step(r)
    rows = [asdict(rec) for rec in r.aligner.records]
    assert record_problems(rows) == []
    assert any("lazy slot is" in p for p in record_problems(rows, policy="lazy"))
    assert any("expected exactly 1" in p for p in record_problems(rows + rows[:1]))
    bad = [dict(rows[0], after_all_gather=False, transposed=0, valid=0)] + rows[1:]
    problems = record_problems(bad)
    assert any("before the chunk's all-gather" in p for p in problems)
    assert any("0 of 2 transposes valid" in p for p in problems)
    # megatron-core >= 0.16 builds them inside finish_param_sync: valid, none built by us.
    assert record_problems([dict(rows[0], transposed=0)] + rows[1:]) == []
    twice = [dict(rows[0], transposed=3)] + rows[1:]
    assert any("3 built" in p for p in record_problems(twice))
    late = [dict(rows[0], t_first_use=rows[0]["t_done"] - 1e-3)] + rows[1:]
    assert any("t_done" in p and "t_first_use" in p for p in record_problems(late))
    early = [dict(rows[1], t_slot=rows[1]["t_launch"] - 1e-3)] + rows[:1] + rows[2:]
    assert any("t_launch" in p and "t_slot" in p for p in record_problems(early))


def test_timestamps_follow_launch_gather_build_first_use():
    r = make_rank(rank=1)
    r.aligner.attach()
    run_training_step(r)
    for rec in r.aligner.records:
        assert rec.t_launch <= rec.t_slot <= rec.t_gathered <= rec.t_done <= rec.t_first_use
        assert rec.valid == rec.weights == 2


def test_lazy_records_time_and_validity_at_first_use():
    r = make_rank(rank=2, policy=Policy.LAZY)
    r.aligner.attach()
    run_training_step(r)
    for rec in r.aligner.records:
        assert rec.t_launch <= rec.t_slot == rec.t_first_use <= rec.t_done
        assert rec.valid == 2 and rec.t_gathered is None


def drive_forwards(r, count, launch=True):
    """The first ``count`` forwards of a step (a step with fewer microbatches than planned)."""
    if launch:
        r.config.param_sync_func[0]()
        r.config.param_sync_func[1]()
    for v in range(count):
        r.chunks[r.schedule.chunk_of(v)](torch.ones(1))


def test_shorter_step_is_an_error_at_the_next_step_and_eval_never_raises():
    from nemo_fp8_align.core.aligner import StepMismatchError

    r = make_rank(pp=2, vp=2, m=4)
    r.aligner.attach()
    drive_forwards(r, 4)  # M=2 ran, M=4 planned
    with torch.no_grad():  # a forward-only pass after it does not trip over the open step
        drive_forwards(r, 8, launch=False)
    # The step end was never heard: the next step's first launch ends it, on every rank.
    with pytest.raises(StepMismatchError, match="ran 4 forwards.*M=4"):
        r.config.param_sync_func[0]()


def test_longer_step_is_an_error_at_the_first_extra_forward():
    from nemo_fp8_align.core.aligner import StepMismatchError

    r = make_rank(pp=2, vp=2, m=2)
    r.aligner.attach()
    drive_forwards(r, 4)
    r.chunks[1](torch.ones(1))
    with pytest.raises(StepMismatchError, match="beyond its 4th"):
        end_step(r)


def test_step_end_check_runs_before_the_grad_sync():
    from nemo_fp8_align.core.aligner import StepMismatchError

    r = make_rank(pp=2, vp=2, m=4)
    r.aligner.attach()
    drive_forwards(r, 8)
    end_step(r)  # complete step: passes through
    assert r.chunks[0].grad_syncs == 1
    drive_forwards(r, 6)
    with pytest.raises(StepMismatchError, match="ran 6 forwards"):
        end_step(r)
    # Judged before the gradient collectives; on the error they are waited for (every rank
    # raises at this same point), then it is raised.
    assert [c.grad_syncs for c in r.chunks] == [2, 1]
    r.aligner.detach()
    assert "finish_grad_sync" not in vars(r.chunks[0])


def test_changing_m_is_replanned_per_step():
    m = {"value": 4}
    r = make_rank(pp=2, vp=2, m=4, rank=1)
    r.aligner = TransposeAligner(r.chunks, schedule=r.schedule, pp_rank=1, dp_rank=0,
                                 adapter=r.new_adapter(), weights=r.weights, backend=FakeBackend(),
                                 config=AlignConfig(), num_microbatches=lambda: m["value"])
    r.aligner.attach()
    run_training_step(r)
    m["value"] = 6
    r.schedule = InterleavedSchedule(2, 2, 6)
    run_training_step(r)
    by_step = {(rec.step, rec.chunk): rec for rec in r.aligner.records}
    assert by_step[(0, 1)].slot == 2 and by_step[(1, 1)].slot == 2  # N = PP = 2 either way
    assert r.aligner.schedule.microbatches == 6
    from dataclasses import asdict

    from nemo_fp8_align.core.telemetry import record_problems
    assert record_problems([asdict(x) for x in r.aligner.records]) == []


def test_inside_cuda_graph_capture_counts_but_refuses_work(monkeypatch):
    import nemo_fp8_align.core.aligner as aligner_mod

    r = make_rank(pp=2, vp=2, m=2, rank=0)
    r.aligner.attach()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    monkeypatch.setattr(aligner_mod, "_capturing_cuda_graph", lambda: True)
    r.chunks[0](torch.ones(1))  # forward 0: nothing due (chunk 0 was done at the start)
    r.chunks[0](torch.ones(1))  # forward 1
    assert r.aligner._vmid == 2  # counted, nothing done
    r.chunks[1](torch.ones(1))  # forward 2: chunk 1's slot
    assert 1 not in r.sync.done  # the plugin did nothing inside the capture (the layer may)
    monkeypatch.setattr(aligner_mod, "_capturing_cuda_graph", lambda: False)
    r.chunks[1](torch.ones(1))
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        end_step(r)  # the step is over: the next one starts clean
    assert r.aligner._vmid is None
    r.sync.new_step()
    run_training_step(r)
    assert [(x.step, x.chunk) for x in r.aligner.records] == [(1, 0), (1, 1)]  # step 0: none


def test_a_whole_step_inside_a_capture_refuses_at_its_start(monkeypatch):
    # megatron-core's full-iteration graphs capture the schedule's pre-loop launches too.
    import nemo_fp8_align.core.aligner as aligner_mod

    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    monkeypatch.setattr(aligner_mod, "_capturing_cuda_graph", lambda: True)
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    assert r.sync.done == set() and not any(w.builds for w in r.weights[0])  # nothing ran
    with pytest.raises(RuntimeError, match=r"chunks \[0\] are due at the start of step 0"):
        end_step(r)


class VerifyingBackend(FakeBackend):
    def transpose_mismatch(self, w):
        return None if w.valid and not getattr(w, "corrupt", False) else "bytes differ"


@pytest.mark.parametrize("policy", [Policy.ALIGNED, Policy.LAZY])
def test_verify_mode_names_step_chunk_and_weight(policy):
    from nemo_fp8_align.core.aligner import TransposeVerifyError

    r = make_rank(pp=2, vp=2, m=2, rank=1, policy=policy)
    r.aligner = TransposeAligner(r.chunks, schedule=r.schedule, pp_rank=1, dp_rank=0,
                                 adapter=r.new_adapter(), weights=r.weights, backend=VerifyingBackend(),
                                 config=AlignConfig(policy=policy, verify_every_n_steps=2))
    for chunk in r.chunks:
        chunk.backend = r.aligner.backend
    r.aligner.attach()
    run_training_step(r)  # step 0 verified, all good
    r.weights[1][1].corrupt = True
    run_training_step(r)  # step 1 is not a verify step
    with pytest.raises(TransposeVerifyError, match="step 2, pipeline rank 1, model chunk 1, "
                                                   "FP8 weight #1: bytes differ"):
        run_training_step(r)  # raised at the step end


def test_verify_every_n_steps_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="verify_every_n_steps=-1"):
        AlignConfig(verify_every_n_steps=-1)


def test_step_without_launches_is_counted_not_misjudged(caplog):
    """Megatron-LM's first iteration after a checkpoint load: param_sync_func=None, forwards
    with gradients. Nothing is built early, nothing recorded, the forwards are counted; the
    next launched step is aligned as usual."""
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    wrapped, r.config.param_sync_func = r.config.param_sync_func, None
    with caplog.at_level(logging.WARNING):
        for v in range(r.schedule.total):
            r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
    assert r.aligner.unlaunched_forwards == 4 and r.aligner.records == []
    assert "first iteration after a load" in caplog.text
    assert all(w.builds == 1 for ws in r.weights for w in ws)  # built at first use
    for ws in r.weights:
        for w in ws:
            w.valid = False
    r.config.param_sync_func = wrapped
    run_training_step(r)
    assert [rec.slot for rec in r.aligner.records] == [0, 2]


def test_foreign_module_forwards_are_not_chunk_forwards():
    """A module that is not a model chunk (a reference model, a probe) runs between steps and
    between the step's launches and its first forward: the count is untouched."""
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    foreign = torch.nn.Linear(1, 1)
    r.aligner.attach()
    foreign(torch.ones(1))
    run_training_step(r)
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    foreign(torch.ones(1))  # e.g. a reference model's forward inside the step
    for v in range(r.schedule.total):
        r.chunks[r.schedule.chunk_of(v)](torch.ones(1))
        foreign(torch.ones(1))
    assert [rec.slot for rec in r.aligner.records] == [0, 2, 0, 2]


def test_a_second_aligner_on_the_same_chunks_is_refused_until_the_first_detaches():
    r = make_rank(pp=2, vp=2, m=2)
    assert r.aligner.attach()
    original = r.config.param_sync_func
    second = TransposeAligner(r.chunks, schedule=r.schedule, pp_rank=r.rank, dp_rank=0,
                              adapter=r.new_adapter(), weights=r.weights, backend=FakeBackend(),
                              config=AlignConfig())
    with pytest.raises(RuntimeError, match="already has an aligned FP8-transpose engine"):
        second.attach()
    assert r.config.param_sync_func is original  # nothing half-done
    assert [len(c._forward_pre_hooks) for c in r.chunks] == [1, 1]
    r.aligner.detach()
    assert second.attach()  # free after the first detached
    run_training_step(r)
    assert len(second.records) == 2 and r.aligner.records == []
    second.detach()


def test_attach_after_an_error_in_the_hold_leaves_the_chunks_free(monkeypatch):
    r = make_rank(pp=2, vp=2, m=2)
    monkeypatch.setattr(McoreDDPAdapter, "_rebind_bound_list",
                        lambda self: (_ for _ in ()).throw(OSError("injected")))
    with pytest.raises(OSError, match="injected"):
        r.aligner.attach()
    assert not vars(r.chunks[0]).get("start_param_sync")
    monkeypatch.undo()
    assert r.aligner.attach()


def test_telemetry_is_flushed_once_per_step(tmp_path):
    path = tmp_path / "t.jsonl"
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.telemetry = TelemetryWriter(str(path))
    r.aligner.attach()
    run_training_step(r)
    r.config.param_sync_func[0]()  # the next step starts: the last one's lines are on disk
    assert len(read_records([str(path)])) == 2
    r.aligner.detach()


def test_functions_replaced_after_attach_raise_instead_of_leaving_the_aligner_blind():
    """A loop binding launch functions that are not the chunks' start_param_sync would leave
    the aligner blind: refused (at that step's end, on every rank)."""
    from nemo_fp8_align.errors import ScheduleRebindError

    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    run_training_step(r)
    theirs = r.config.param_sync_func = [r.sync.launcher(c) for c in range(2)]  # not ours
    r.chunks[0](torch.ones(1))  # launched yet no step opened: the foreign functions are seen
    with pytest.raises(ScheduleRebindError, match="not the model chunks' start_param_sync"):
        end_step(r)
    assert r.aligner.unlaunched_forwards == 0
    r.aligner.detach()  # restores what is still ours, keeps what replaced ours
    assert r.config.param_sync_func is theirs


def test_a_forward_only_pass_setting_param_sync_func_to_none_is_not_a_rebind():
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    run_training_step(r)
    ours, r.config.param_sync_func = r.config.param_sync_func, None  # megatron-core, eval
    with torch.no_grad():
        r.chunks[0](torch.ones(1))
    r.config.param_sync_func = ours
    run_training_step(r)
    assert len(r.aligner.records) == 4


def test_an_unlaunched_step_is_verified_at_every_forward():
    """After a load (param_sync_func None) no slot runs; verify mode checks every forward's
    transposes after TE / the layer built (or kept) them: a stale 'valid' flag is caught."""
    from nemo_fp8_align.core.aligner import TransposeVerifyError

    r = make_rank(pp=2, vp=2, m=2, rank=1)
    backend = VerifyingBackend()
    r.aligner = TransposeAligner(r.chunks, schedule=r.schedule, pp_rank=1, dp_rank=0,
                                 adapter=r.new_adapter(), weights=r.weights, backend=backend,
                                 config=AlignConfig(verify_every_n_steps=5))
    for chunk in r.chunks:
        chunk.backend = backend
    r.aligner.attach()
    run_training_step(r)
    r.config.param_sync_func, wrapped = None, r.config.param_sync_func
    r.chunks[0](torch.ones(1))  # all valid and right: passes
    r.weights[0][1].valid, r.weights[0][1].corrupt = True, True  # flagged valid, bytes stale
    r.chunks[0](torch.ones(1))
    with pytest.raises(TransposeVerifyError, match="model chunk 0, FP8 weight #1"):
        end_step(r)
    r.config.param_sync_func = wrapped


def test_an_error_inside_a_step_does_not_blame_the_next_step():
    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    r.config.param_sync_func[0]()
    r.config.param_sync_func[1]()
    r.chunks[1](torch.ones(1))  # forward 0 is chunk 0's
    with pytest.raises(StepMismatchError, match="ran model chunk 1"):
        end_step(r)
    r.sync.new_step()
    run_training_step(r)  # opens cleanly: no "ended after 0 forwards"
    assert [(x.step, x.chunk) for x in r.aligner.records] == [(1, 0), (1, 1)]


def test_records_of_tensor_parallel_peers_and_of_a_resumed_run_are_not_duplicates():
    from nemo_fp8_align.core.telemetry import record_problems

    r = make_rank(pp=2, vp=2, m=2, rank=1)
    r.aligner.attach()
    run_training_step(r)
    mine = [asdict(x) for x in r.aligner.records]
    assert {x["run"] for x in mine} == {r.aligner.run_id} and mine[0]["rank"] == -1
    tp_peer = [dict(x, rank=7) for x in mine]
    resumed = [dict(x, run="second-try") for x in mine]
    assert record_problems(mine + tp_peer + resumed) == []
    assert any("2 records, expected exactly 1" in p for p in record_problems(mine + mine))


@pytest.mark.parametrize("detach", [False, True], ids=["never-detached", "detached"])
def test_a_dropped_model_is_collectable(detach):
    """The claim registry must not keep an attached model alive: a training script that drops
    its model (detached or not) gets its memory back from the garbage collector."""
    import gc
    import weakref

    r = make_rank()
    assert r.aligner.attach()
    run_training_step(r)
    if detach:
        r.aligner.detach()
    chunk_refs = [weakref.ref(c) for c in r.chunks]
    aligner_ref = weakref.ref(r.aligner)
    del r
    gc.collect()
    assert all(ref() is None for ref in chunk_refs), "a model chunk outlived its last reference"
    assert aligner_ref() is None
