"""``report`` judges what it cannot see as not seen (issue 40, item 3).

The telemetry of a real PP=2 VP=2 DP=2 run of 3 steps (4 ranks, 2 chunks: 24 records), tampered
copy by copy: each tampering must fail (exit 1) or be named "not observed", never pass under
"every record is there" or "observed builds where the policy puts them". The expectation comes
from the run's own records: steps contiguous from the first to the last, every rank agreeing on
M, PP, VP, DP and the world, ranks inside the world, one clock per rank. Records the schedule
model rejects are one exit-2 line, not a traceback.
"""

import json
from pathlib import Path

import pytest

from nemo_fp8_align.cli import main

DATA = Path(__file__).parent / "data"
OBSERVED = DATA / "telemetry_observed_pp2_vp2_dp2_aligned.jsonl"
SHIFTED = DATA / "telemetry_observed_pp2_vp2_dp2_slot_shift_unreported.jsonl"
OBS_FIELDS = ("obs_built", "obs_at", "obs_slot")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _report(tmp_path, capsys, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = main(["report", str(path)])
    out, err = capsys.readouterr()
    return status, out, err


def _never_claimed(out):
    assert "every record is there" not in out
    if "OK:" in out:  # a pass must say what it did not see
        assert "not observed" in out.lower(), out


def test_the_untampered_run_passes_and_names_what_it_cannot_see(tmp_path, capsys):
    status, out, _ = _report(tmp_path, capsys, _rows(OBSERVED))
    assert status == 0, out
    assert "every record of steps 0-2 is there" in out
    # what the records cannot show: steps after the last, and the microbatches themselves
    assert "Not observed: any step after step 2" in out
    assert "M=4 as the records state it" in out
    _never_claimed(out)


def test_a_middle_step_deleted_on_every_rank_fails(tmp_path, capsys):
    rows = [r for r in _rows(OBSERVED) if r["step"] != 1]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert "FAILED: step 1: no record on any rank (the records run from step 0 to step 2" in out
    _never_claimed(out)


def test_the_last_step_deleted_on_every_rank_is_named_not_observed(tmp_path, capsys):
    rows = [r for r in _rows(OBSERVED) if r["step"] != 2]
    status, out, _ = _report(tmp_path, capsys, rows)
    # nothing in steps 0-1 says a step 2 existed: the verdict must not claim the run is whole
    assert status == 0, out
    assert "every record of steps 0-1 is there" in out
    assert "Not observed: any step after step 1" in out
    _never_claimed(out)


@pytest.mark.parametrize("old,new", [(1, 5), (2, 3), (0, 3)],
                         ids=["middle-to-gap", "last-to-gap", "first-after-last"])
def test_a_whole_step_renumbered_fails(tmp_path, capsys, old, new):
    rows = [{**r, "step": new} if r["step"] == old else r for r in _rows(OBSERVED)]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    if (old, new) == (0, 3):  # steps 1-3 are contiguous: the ranks' own clocks give it away
        assert "step 3 ran before step 2 by the rank's own clock" in out, out
    else:
        assert f"FAILED: step {old}: no record on any rank" in out, out
    _never_claimed(out)


def test_microbatches_changed_on_one_rank_fails(tmp_path, capsys):
    rows = [{**r, "microbatches": 8} if r["rank"] == 3 else r for r in _rows(OBSERVED)]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert "records disagree on microbatches: 4 (ranks 0, 1, 2), 8 (rank 3)" in out
    _never_claimed(out)


def test_microbatches_changed_on_every_rank_is_named_not_observed(tmp_path, capsys):
    rows = [{**r, "microbatches": 8} for r in _rows(OBSERVED)]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status in (0, 1), out
    if status == 0:
        assert "M=8 as the records state it" in out and "Not observed:" in out
    _never_claimed(out)


def test_a_rank_outside_the_world_fails(tmp_path, capsys):
    rows = _rows(OBSERVED)
    rows += [{**r, "rank": 4} for r in rows if r["rank"] == 3]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert "FAILED: global rank 4: outside the world of 4 ranks (world_size 4, ranks 0-3)" in out
    _never_claimed(out)


def test_a_rank_at_two_positions_fails(tmp_path, capsys):
    # rank 3's records copied as rank 2's of another run: no duplicate key, but rank 2 then
    # sits at two pipeline/data-parallel positions
    rows = _rows(OBSERVED)
    rows += [{**r, "rank": 2, "run": "copied"} for r in rows if r["rank"] == 3]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert "global rank 2: at more than one pipeline/data-parallel position" in out
    _never_claimed(out)


@pytest.mark.parametrize("how", ["removed", "nulled"])
def test_observations_stripped_from_a_real_failure_are_named_not_observed(tmp_path, capsys, how):
    rows = _rows(SHIFTED)
    for r in rows:
        for key in OBS_FIELDS:
            if how == "removed":
                r.pop(key)
            else:
                r[key] = None
    status, out, _ = _report(tmp_path, capsys, rows)
    assert "observed builds where the policy puts them" not in out
    assert status == 1 or "where the transposes were built (records without obs_* fields" in out, out
    _never_claimed(out)


@pytest.mark.parametrize("how", ["removed", "nulled"])
def test_observations_stripped_from_the_failing_records_only_fail(tmp_path, capsys, how):
    # the other records still carry them: the run observed, so every record must have them
    rows = _rows(SHIFTED)
    for r in rows:
        if r["chunk"] == 1 and r["pp_rank"] == 1:
            for key in OBS_FIELDS:
                if how == "removed":
                    r.pop(key)
                else:
                    r[key] = None
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert ("6 of 24 records carry no observed builds (obs_built/obs_at/obs_slot missing or "
            "null) where the run's other records have them") in out, out
    assert "observed builds where the policy puts them" not in out


@pytest.mark.parametrize("change,needle", [
    ({"vp_size": 1}, "virtual_pipeline_model_parallel_size=1"),
    ({"microbatches": 3}, "num_microbatches=3 mod microbatch_group_size_per_vp_stage=2 = 1"),
    ({"microbatches": 10 ** 12}, "forwards per rank per step"),
], ids=["vp1", "m-rejected", "m-absurd"])
def test_records_the_schedule_rejects_are_one_usage_line(tmp_path, capsys, change, needle):
    rows = [{**r, **change} for r in _rows(OBSERVED)]
    status, out, err = _report(tmp_path, capsys, rows)
    assert status == 2, out + err
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("nemo-fp8-align report: error: ") and "t.jsonl:1: step 0 chunk 0" in err
    assert needle in err and "Traceback" not in err


def test_absurd_sizes_end_quickly_without_a_traceback(tmp_path, capsys):
    # a world of 10**15 ranks or a DP of 10**15: counted, not enumerated
    rows = [{**r, "world_size": 10 ** 15, "dp_size": 10 ** 15} for r in _rows(OBSERVED)]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 1, out
    assert "global ranks wrote no records" in out and "more missing records" in out
    assert len(out.splitlines()) < 200  # MAX_LISTED of each kind, then counted


def test_a_step_between_two_runs_is_named_not_observed(tmp_path, capsys):
    # A job resumed from a checkpoint: each rank's new process (a new run id) starts after the
    # step that reloads, which runs without launches, so no rank records it. Not a deletion.
    rows = [{**r, "run": r["run"] + "-resumed"} if r["step"] == 2 else r
            for r in _rows(OBSERVED) if r["step"] != 1]
    status, out, _ = _report(tmp_path, capsys, rows)
    assert status == 0, out
    assert "every record of steps 0, 2 is there" in out
    assert ("step 1 (no record on any rank, between one process's steps and the next's: a step "
            "after a checkpoint load runs without launches)") in out
    _never_claimed(out)
