"""nemo_fp8_align.core.metrics: what lands in the experiment logger per step (pure functions)."""

from nemo_fp8_align.core.telemetry import TransposeRecord
from nemo_fp8_align.core.metrics import gather_step_metrics, last_step_records, step_metrics


def row(pp_rank, chunk, slot, *, launch, t_slot, gathered=None, done, transposed=4):
    return {"chunk": chunk, "pp_rank": pp_rank, "slot": slot, "transposed": transposed,
            "valid": 4, "seconds": None, "t_launch": launch if chunk == 0 else None,
            "t_slot": t_slot, "t_gathered": gathered, "t_done": done}


def test_aligned_ranks_have_no_slot_skew_and_report_wait_and_build():
    # PP=2: each rank measured from its own step start (its chunk-0 launch), clocks 100 s apart.
    rows = [row(0, 0, 0, launch=0.0, t_slot=0.001, gathered=0.003, done=0.004),
            row(1, 0, 0, launch=100.0, t_slot=100.001, gathered=100.002, done=100.005),
            row(0, 1, 2, launch=None, t_slot=0.020, gathered=0.021, done=0.022),
            row(1, 1, 2, launch=None, t_slot=100.021, gathered=100.021, done=100.023)]
    m = step_metrics(rows)
    assert m["fp8_align/chunk0/slot_skew"] == 0.0 and m["fp8_align/chunk1/slot_skew"] == 0.0
    assert abs(m["fp8_align/chunk1/time_skew_ms"] - 1.0) < 1e-6
    assert abs(m["fp8_align/chunk0/wait_ms"] - 2.0) < 1e-6  # the longer of 2 ms and 1 ms
    assert abs(m["fp8_align/chunk0/transpose_ms"] - 3.0) < 1e-6
    assert m["fp8_align/transposes_built"] == 16.0 and m["fp8_align/records"] == 4.0


def test_lazy_ranks_show_their_one_slot_skew_and_no_wait():
    rows = [row(0, 1, 2, launch=None, t_slot=0.020, done=0.030),
            row(1, 1, 3, launch=None, t_slot=0.040, done=0.050)]
    m = step_metrics(rows)
    assert m["fp8_align/chunk1/slot_skew"] == 1.0
    assert "fp8_align/chunk1/wait_ms" not in m and "fp8_align/chunk1/transpose_ms" not in m
    assert abs(m["fp8_align/chunk1/slot_to_valid_ms"] - 10.0) < 1e-6
    assert step_metrics([]) == {}  # nothing to log


def test_last_step_records_and_the_local_gather():
    recs = [TransposeRecord(step=s, pp_rank=0, dp_rank=0, chunk=c, policy="aligned",
                            backend="reference", vmid=-1 if c == 0 else 1, slot=2 * c,
                            aligned_slot=2 * c, transposed=1, weights=1, after_all_gather=True,
                            seconds=0.1, valid=1)
            for s in (4, 5) for c in (0, 1)]
    last = last_step_records(recs)
    assert [r.step for r in last] == [5, 5] and last_step_records([]) == []
    assert gather_step_metrics(last)["fp8_align/records"] == 2.0  # no process group: this rank
